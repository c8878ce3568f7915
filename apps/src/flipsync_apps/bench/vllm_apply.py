"""Where one version's apply goes on vLLM's CPU build, at the demo's model size (docs/engines.md, "One version's
apply"): run with vLLM's interpreter, the applications on its path,

    PYTHONPATH=apps/src LD_PRELOAD=.vllm-venv/lib/libiomp5.so .vllm-venv/bin/python -m flipsync_apps.bench.vllm_apply \
        [--preset llama-20m] [--versions 4] [--changed 0.037] [--audit every,sample,off]

A model folder of the preset (``flipsync model``'s), served by an offline ``vllm.LLM`` (its engine core in this
process) with flipsync's worker extension; then, per audit mode, ``--versions`` patches that each change about
``--changed`` of the served values (the demo's average per version), each staged and committed through
`VllmEngine`. Per version: stage (decode, lookups, the gather RPC), commit (the apply RPC), and inside the apply
the worker's own seconds, its reload and repack of the touched layers and its audit; the layers reloaded. Prints a
table and one ``RESULT {json}`` line.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process: one vLLM import


def _step(masters: dict[str, Any], changed: float, seed: int) -> dict[str, Any]:
    """Masters moved so that about ``changed`` of the BF16 values change: a relative move on a random subset."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, m in masters.items():
        mask = torch.rand(m.shape, generator=g) < changed * 1.6  # about 60% of the moved values cross a BF16 step
        out[name] = torch.where(mask, m * (1 + torch.randn(m.shape, generator=g) * 2.0**-7), m)
    return out


def run(preset: str, versions: int, changed: float, audits: list[str], workdir: Path) -> dict[str, Any]:
    import torch
    from safetensors.torch import save_file

    from flipsync.codec import diff_views
    from flipsync.engines.torch.model_dir import demo_config, write_model_dir
    from flipsync.engines.torch.models import build_model
    from flipsync.engines.vllm.engine import VllmEngine
    from flipsync.engines.vllm.launch import offline_llm
    from flipsync.engines.vllm.rpc_transports import LLMTransport
    from flipsync.engines.vllm.tensor_specs import specs_from_checkpoint
    from flipsync.formats import served_view

    config = demo_config(preset)
    model = build_model(config, seed=0, dtype=torch.float32)
    masters = {n: p.detach().clone() for n, p in model.state_dict().items()}
    del model
    view = served_view(masters, "bf16")
    folder = write_model_dir(workdir / preset, config, view)
    llm = offline_llm(folder, dtype="bfloat16", enforce_eager=True, max_model_len=128, max_num_seqs=4, seed=0)
    out: dict[str, Any] = {"preset": preset, "params": sum(t.numel() for t in view.values()), "modes": {}}
    for i, audit in enumerate(audits):
        # each mode attaches to the version the previous one left: its source is a checkpoint of that view
        source = folder if i == 0 else workdir / f"held-{i}"
        if i:
            source.mkdir()
            save_file({n: t.contiguous() for n, t in view.items()}, str(source / "model.safetensors"))
        engine = VllmEngine(LLMTransport(llm), specs_from_checkpoint(folder), source=source, audit=audit)
        table = engine.table
        rows = []
        for k in range(versions):
            moved = _step(masters, changed, seed=1000 * len(out["modes"]) + k)
            new_view = served_view(moved, "bf16")
            patch, new_table = diff_views(view, new_view, old_table=table)
            n = sum(s.n for s in patch.sections)
            t0 = time.perf_counter()
            staged = engine.stage(patch)
            t1 = time.perf_counter()
            engine.commit(staged)
            t2 = time.perf_counter()
            a = engine.last_audit
            rows.append(
                {
                    "changed": n,
                    "changed_pct": 100.0 * n / out["params"],
                    "stage_s": t1 - t0,
                    "commit_s": t2 - t1,
                    "worker_apply_s": a["apply_s"],
                    "audit_s": a["seconds"],
                    "reload_and_rest_s": a["apply_s"] - a["seconds"],
                    "layers_reloaded": max((len(v) for v in a["reloaded"].values()), default=0),
                    "layers_audited": max((len(v) for v in a["layers"].values()), default=0),
                }
            )
            assert engine.table.view_fp() == new_table.view_fp()
            masters, view, table = moved, new_view, new_table
        out["modes"][audit] = rows
        engine.close()
        gc.collect()
    return out


def _median(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama-20m")
    p.add_argument("--versions", type=int, default=4)
    p.add_argument("--changed", type=float, default=0.037, help="share of served values a version changes")
    p.add_argument("--audit", default="every,sample,off", help="audit modes, comma-separated")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="flipsync-vllm-apply-") as tmp:
        result = run(args.preset, args.versions, args.changed, args.audit.split(","), Path(tmp))
    print(f"{result['preset']}: {result['params']:,} served values; medians over {args.versions} versions")
    print("audit    changed%  stage s  commit s  worker s  reload+ s  audit s  layers reloaded/audited")
    for mode, rows in result["modes"].items():
        print(
            f"{mode:8} {_median(rows, 'changed_pct'):8.2f} {_median(rows, 'stage_s'):8.3f} "
            f"{_median(rows, 'commit_s'):9.3f} {_median(rows, 'worker_apply_s'):9.3f} "
            f"{_median(rows, 'reload_and_rest_s'):10.3f} {_median(rows, 'audit_s'):8.3f} "
            f"{rows[-1]['layers_reloaded']}/{rows[-1]['layers_audited']}"
        )
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
