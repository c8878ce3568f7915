"""Measure ``vllm.benchmarks.serve`` through ``flipsync gateway``: a torch-only fleet (two torch-engine sidecars)
and a mixed one (the same two and a vLLM CPU replica), each with and without a SIGKILL of torch replica ``a``
mid-run, completions (``openai`` backend) and chat (``openai-chat``). Prints one row per run (successes,
failures, request throughput, mean and median TTFT) and the gateway's outcomes over it.

    FLIPSYNC_VLLM_PYTHON=.vllm-venv/bin/python .venv/bin/python -m tests.fleet.real_clients_measure \
        [--fleet torch --fleet mixed] [--num-prompts 40] [--request-rate 10] [--max-concurrency 6] [--out DIR]

The same pieces as tests/fleet/test_real_clients.py (``tests/fleet/real_clients_helpers.py``); the client is
the vLLM venv's (``tests/fleet/vllm_bench_serve.py``), the fleet runs in this interpreter's.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from tests.fleet.real_clients_helpers import VLLM_PYTHON_VAR, BenchSettings, RealFleet, run_bench


def measure(kind: str, root: Path, python: str, settings: BenchSettings) -> list[dict[str, Any]]:
    fleet = RealFleet(root, vllm_python=python)
    rows: list[dict[str, Any]] = []
    try:
        fleet.publish(versions=1)
        if kind == "mixed":
            fleet.start_vllm_server()
        fleet.start_gateway(hold_s=3.0)
        fleet.start_torch("a")
        fleet.start_torch("b")
        if kind == "mixed":
            fleet.wait_vllm_server()
            fleet.start_vllm_replica()
        fleet.wait_ready()
        for backend in ("openai", "openai-chat"):
            for kill in (None, "a"):
                if not fleet.replicas["a"].proc.alive:
                    fleet.start_torch("a")
                fleet.wait_ready()
                run = run_bench(fleet, backend, kill=kill, settings=settings)
                row = {"fleet": kind, "kill": kill or "-", **run.summary(), "gateway": run.gateway}
                row["served_by"] = run.served_by
                print(json.dumps(row), flush=True)
                rows.append(row)
    finally:
        fleet.close()
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    head = "| fleet | backend | kill | ok | failed | req/s | mean TTFT ms | median TTFT ms | gateway outcomes |"
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        lines.append(
            f"| {r['fleet']} | {r['backend']} | {r['kill']} | {r['completed']} | {r['failed']} | "
            f"{r['request_throughput']:.2f} | {r['mean_ttft_ms']:.1f} | {r['median_ttft_ms']:.1f} | "
            f"{', '.join(f'{k} {v:g}' for k, v in sorted(r['gateway'].items()))} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fleet", action="append", choices=("torch", "mixed"))
    parser.add_argument("--num-prompts", type=int, default=40)
    parser.add_argument(
        "--request-rate", type=float, default=10.0, help="Poisson arrivals per second (inf: all at once)"
    )
    parser.add_argument("--max-concurrency", type=int, default=6)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    python = os.environ.get(VLLM_PYTHON_VAR)
    if not python:
        raise SystemExit(f"set {VLLM_PYTHON_VAR} to the vLLM venv's Python (its vllm.benchmarks.serve is the client)")
    settings = BenchSettings(
        num_prompts=args.num_prompts, request_rate=args.request_rate, max_concurrency=args.max_concurrency
    )
    out = args.out or Path(tempfile.mkdtemp(prefix="real-clients-"))
    rows: list[dict[str, Any]] = []
    for kind in args.fleet or ["torch", "mixed"]:
        root = out / kind
        root.mkdir(parents=True, exist_ok=True)
        rows += measure(kind, root, python, settings)
    print(table(rows))
    print(f"logs and result JSON files: {out}")


if __name__ == "__main__":
    main()
