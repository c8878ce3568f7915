"""The GPU check (``scripts/gpu-check``): what only a machine with a CUDA device can confirm, in one short run.

1. **Bits.** Every served format computed on the device gives the CPU's bytes (``served_view`` of the same
   FP32 masters: edge values, fused groups, both recipe inputs), and the fused cast+diff pass (its torch path,
   which CUDA tensors take) finds the CPU kernel's changes.
2. **Speed against the device's copy bandwidth.** A device-to-device copy of a served view sets the scale;
   the codec's diff of two views, the fused cast+diff of FP32 masters and the scatter that applies a patch are
   timed at several changed fractions and reported as a share of that copy.
3. **The torch engine's commit pause on the device.** A model in BF16 on the device follows patches of a
   growing size; stage (off the pause), commit (the pause) and a full load are timed.

It needs only torch, numba and safetensors (the machine may lack the codec's zstandard and transformers: the
launcher then stands in for them, see ``scripts/gpu-check``). Without a CUDA device every part runs on the
CPU at a small size, to show the script works, and the report says that the GPU figures were not measured.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from flipsync.formats import FORMAT_NAMES, served_view
from flipsync.formats.cast_diff import CastDiffer

FRACTIONS = (1e-4, 1e-3, 1e-2)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], Any], device: torch.device, repeat: int) -> float:
    """Best of ``repeat`` runs, in seconds (the device synchronized around each)."""
    best = float("inf")
    for _ in range(repeat):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def _bits(t: torch.Tensor) -> np.ndarray:
    t = t.detach().contiguous().cpu()
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.reshape(-1).view(width).numpy()


# ------------------------------------------------------------------------------------------------ bits
def edge_masters(seed: int = 0) -> dict[str, torch.Tensor]:
    """FP32 masters with the values recipes round differently if anything is off: signed zeros, FP32 and BF16
    subnormals, ties of BF16 / FP16 / e4m3 / e2m1 / int8 steps, large and tiny rows, a fused q/k/v group."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(96, 256, generator=g) * 0.02
    edges = torch.tensor(
        [0.0, -0.0, 2.0**-149, -(2.0**-130), 2.0**-126, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 1.0 + 2.0**-11,
         448.0, 464.0, -448.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 127.5, -127.5, 0.5, 1.5, 65504.0, 1e-8],
    )  # fmt: skip
    base[0, : edges.numel()] = edges
    base[1] = 0.0  # an all-zero row
    base[2] *= 2.0**-100  # a tiny row
    base[3] *= 2.0**20  # a large row
    masters = {
        "model.embed_tokens.weight": torch.randn(64, 256, generator=g),
        "model.layers.0.input_layernorm.weight": torch.randn(256, generator=g),
        "model.layers.0.mlp.down_proj.weight": base,
        "model.layers.0.mlp.up_proj.weight": torch.randn(96, 256, generator=g) * 0.05,
        "model.layers.0.mlp.gate_proj.weight": torch.randn(96, 256, generator=g) * 0.05,
        "lm_head.weight": torch.randn(64, 256, generator=g),
    }
    for p, rows in (("q", 128), ("k", 64), ("v", 64)):
        masters[f"model.layers.0.self_attn.{p}_proj.weight"] = torch.randn(rows, 256, generator=g) * 0.03
    return masters


def check_bits(device: torch.device) -> dict[str, Any]:
    """Every format's served view on ``device`` against the CPU's, bitwise, and the one-pass cast's changes."""
    masters = edge_masters()
    out: dict[str, Any] = {"formats": {}, "fused_cast_diff": {}}
    for fmt in FORMAT_NAMES:
        for from_fp32 in (False, True):
            cpu = served_view(masters, fmt, from_fp32=from_fp32)
            dev = served_view({k: v.to(device) for k, v in masters.items()}, fmt, from_fp32=from_fp32)
            bad = [k for k in cpu if dev[k].dtype != cpu[k].dtype or not np.array_equal(_bits(dev[k]), _bits(cpu[k]))]
            out["formats"][f"{fmt}{' from fp32' if from_fp32 else ''}"] = {"equal": not bad, "differ": bad}
    with CastDiffer(1) as caster:
        for dtype in (torch.bfloat16, torch.float16):
            x = masters["model.layers.0.mlp.up_proj.weight"]
            prev = x.to(dtype)
            prev.view(torch.int16).view(-1)[::7] ^= 1
            _, cpu_ch = caster.cast_diff("w", x, dtype, prev)
            _, dev_ch = caster.cast_diff("w", x.to(device), dtype, prev.to(device))
            same = all(np.array_equal(getattr(cpu_ch, f), getattr(dev_ch, f)) for f in ("positions", "old", "new"))
            out["fused_cast_diff"][str(dtype).removeprefix("torch.")] = {"equal": same, "changes": cpu_ch.size}
    out["equal"] = all(v["equal"] for v in out["formats"].values()) and all(
        v["equal"] for v in out["fused_cast_diff"].values()
    )
    return out


# ------------------------------------------------------------------------------------------- bandwidth
def _moved(t: torch.Tensor, fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A copy of ``t`` (BF16) with ``fraction`` of its elements one step up; the positions and new bits."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    n = t.numel()
    k = max(1, int(n * fraction))
    pos = torch.randperm(n, generator=g)[:k].sort().values.to(t.device)
    new = t.clone()
    flat = new.view(-1).view(torch.int16)
    flat[pos] += 1
    return new, pos, flat[pos].clone()


def bandwidth(device: torch.device, elements: int, repeat: int) -> dict[str, Any]:
    """Copy, diff, fused cast+diff and apply (scatter) on ``device``, against the copy's time."""
    from flipsync.codec import DiffEngine, scatter

    g = torch.Generator(device="cpu").manual_seed(1)
    master = (torch.randn(elements, generator=g) * 0.02).to(device)
    view = master.to(torch.bfloat16)
    scratch = torch.empty_like(view)
    copy_s = _timed(lambda: scratch.copy_(view), device, repeat)
    nbytes = view.numel() * view.element_size()
    out: dict[str, Any] = {
        "elements": elements,
        "view_bytes": nbytes,
        "copy_s": copy_s,
        "copy_gb_s": 2 * nbytes / copy_s / 1e9,  # read + write
        "rows": [],
    }
    engine = DiffEngine()
    caster = CastDiffer()
    try:
        for i, fraction in enumerate(FRACTIONS):
            new, pos, bits = _moved(view, fraction, 10 + i)
            diff_s = _timed(lambda new=new: engine.changes(view, new), device, repeat)
            moved_master = new.float()  # a master whose bf16 cast is `new`
            fused_s = _timed(lambda m=moved_master: caster.cast_diff("w", m, torch.bfloat16, view), device, repeat)
            target = view.clone()

            def apply(target: torch.Tensor = target, pos: torch.Tensor = pos, bits: torch.Tensor = bits) -> None:
                scatter(target, pos, bits)

            apply_s = _timed(apply, device, repeat)
            ok = torch.equal(target.view(torch.int16), new.view(torch.int16))
            out["rows"].append(
                {
                    "fraction": fraction,
                    "changed": int(pos.numel()),
                    "diff_s": diff_s,
                    "diff_vs_copy": diff_s / copy_s,
                    "fused_cast_diff_s": fused_s,
                    "fused_vs_copy": fused_s / copy_s,
                    "apply_s": apply_s,
                    "apply_vs_copy": apply_s / copy_s,
                    "apply_bitwise": ok,
                }
            )
    finally:
        engine.close()
        caster.close()
    return out


# ------------------------------------------------------------------------------------------ torch engine
class _PlainLM(torch.nn.Module):
    """A Llama-shaped stack of plain layers (names as Hugging Face's), for machines without transformers: the
    engine's commit path needs only the parameters."""

    def __init__(self, vocab: int, hidden: int, inter: int, layers: int) -> None:
        super().__init__()
        self.config = SimpleNamespace(vocab_size=vocab, max_position_embeddings=256)
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(vocab, hidden)
        self.model.layers = torch.nn.ModuleList()
        for _ in range(layers):
            layer = torch.nn.Module()
            layer.self_attn = torch.nn.Module()
            for p in ("q", "k", "v", "o"):
                setattr(layer.self_attn, f"{p}_proj", torch.nn.Linear(hidden, hidden, bias=False))
            layer.mlp = torch.nn.Module()
            layer.mlp.gate_proj = torch.nn.Linear(hidden, inter, bias=False)
            layer.mlp.up_proj = torch.nn.Linear(hidden, inter, bias=False)
            layer.mlp.down_proj = torch.nn.Linear(inter, hidden, bias=False)
            layer.input_layernorm = torch.nn.RMSNorm(hidden)
            layer.post_attention_layernorm = torch.nn.RMSNorm(hidden)
            self.model.layers.append(layer)
        self.model.norm = torch.nn.RMSNorm(hidden)
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, past_key_values: Any = None) -> Any:  # pragma: no cover
        raise NotImplementedError("the GPU check times commits only")


def _model(device: torch.device, quick: bool) -> tuple[torch.nn.Module, str]:
    hidden, inter, layers, vocab = (128, 256, 2, 512) if quick else (1024, 2816, 8, 32000)
    try:
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                          num_attention_heads=max(1, hidden // 64), tie_word_embeddings=False)  # fmt: skip
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model: torch.nn.Module = LlamaForCausalLM(cfg)
        kind = "transformers Llama"
    except Exception:  # no transformers here (or a stand-in): plain layers with the same names
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = _PlainLM(vocab, hidden, inter, layers)
        kind = "plain torch layers named like Llama (no transformers on this machine)"
    return model.to(torch.bfloat16).to(device).eval().requires_grad_(False), kind


def engine_pause(device: torch.device, quick: bool, repeat: int) -> dict[str, Any]:
    from flipsync.codec import diff_views
    from flipsync.codec.fingerprint import FingerprintTable
    from flipsync.engines.torch.engine import TorchEngine

    model, kind = _model(device, quick)
    engine = TorchEngine(model, served_format="bf16")
    base = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}  # bf16: the served view
    table = FingerprintTable.of(base)
    params = sum(t.numel() for t in base.values())
    out: dict[str, Any] = {"model": kind, "params": params, "rows": []}
    load_s = _timed(lambda: engine.load_view(base), device, max(1, repeat // 2))
    out["full_load_s"] = load_s
    for i, fraction in enumerate(FRACTIONS):
        new = {}
        changed = 0
        for j, (name, t) in enumerate(base.items()):
            moved, pos, _ = _moved(t, fraction, 100 * i + j)
            new[name] = moved
            changed += int(pos.numel())
        patch, target = diff_views(base, new, old_table=table, context=False)
        stages, commits = [], []
        for _ in range(repeat):
            t0 = time.perf_counter()
            staged = engine.stage(patch)
            stages.append(time.perf_counter() - t0)
            _sync(device)
            t0 = time.perf_counter()
            undo = engine.commit(staged)
            _sync(device)
            commits.append(time.perf_counter() - t0)
            ok = engine.table.view_fp() == target.view_fp()
            engine.rollback(undo)
        held = engine.recompute_table().view_fp() == table.view_fp()
        out["rows"].append(
            {
                "fraction": fraction,
                "changed": changed,
                "stage_s": statistics.median(stages),
                "commit_s": statistics.median(commits),
                "commit_vs_full_load": statistics.median(commits) / load_s,
                "target_reached": ok,
                "rolled_back": held,
            }
        )
    engine.close()
    return out


# -------------------------------------------------------------------------------------------------- run
def run(*, quick: bool = False, device: str | None = None, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every part on ``device`` (default: CUDA if present, else the CPU at a small size); the report."""
    cuda = torch.cuda.is_available()
    dev = torch.device(device or ("cuda" if cuda else "cpu"))
    small = quick or dev.type != "cuda"
    report: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "cuda": dev.type == "cuda",
        "note": None
        if dev.type == "cuda"
        else "no CUDA device: every part ran on the CPU at a small size; the GPU figures were not measured",
    }
    t0 = time.perf_counter()
    log(f"device: {report['device']} (torch {torch.__version__})")
    if dev.type == "cuda":
        report["bits"] = check_bits(dev)
        log(f"bits: every format on the device equals the CPU's: {report['bits']['equal']}")
    else:
        report["bits"] = {"skipped": "no CUDA device: the CPU has nothing to be compared with"}
        log("bits: skipped (no CUDA device)")
    report["bandwidth"] = bandwidth(dev, (1 << 20) if small else (1 << 28), 2 if small else 5)
    bw = report["bandwidth"]
    log(f"copy {bw['copy_gb_s']:.1f} GB/s over {bw['view_bytes'] / 1e6:.0f} MB")
    for r in bw["rows"]:
        log(
            f"  {r['fraction']:.0e} changed: diff {r['diff_vs_copy']:.2f}x the copy, fused cast+diff "
            f"{r['fused_vs_copy']:.2f}x, apply {r['apply_vs_copy']:.3f}x (bitwise {r['apply_bitwise']})"
        )
    report["engine"] = engine_pause(dev, small, 2 if small else 5)
    for r in report["engine"]["rows"]:
        log(
            f"  torch engine, {r['changed']:,} changed: stage {r['stage_s'] * 1e3:.1f} ms, commit "
            f"{r['commit_s'] * 1e3:.2f} ms ({r['commit_vs_full_load']:.3f} of a full load)"
        )
    from flipsync_apps.bench.gpu_graphs import cuda_graph_case

    report["cuda_graph"] = graph = cuda_graph_case(dev, small)
    log(f"cuda graph: patched in place, replay == eager == fresh load: {graph['ok']}" + (
        f" ({graph['skipped']})" if "skipped" in graph else ""))  # fmt: skip
    report["seconds"] = time.perf_counter() - t0
    checks = [report["bits"].get("equal", True), graph["ok"]]
    checks += [r["apply_bitwise"] for r in bw["rows"]]
    checks += [r["target_reached"] and r["rolled_back"] for r in report["engine"]["rows"]]
    report["ok"] = all(checks)
    return report


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="gpu-check", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    ap.add_argument("--device", default=None, help="torch device (default: cuda if present, else cpu)")
    ap.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    args = ap.parse_args(argv)
    report = run(quick=args.quick, device=args.device)
    text = json.dumps(report, indent=2)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(("ok" if report["ok"] else "FAILED") + f" in {report['seconds']:.0f} s")
    return 0 if report["ok"] else 1
