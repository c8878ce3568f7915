"""``scripts/gpu-check`` on a machine without a GPU: every part runs on the CPU at a small size and says so,
also with nothing installed but what a GPU machine has (torch, numba, safetensors, xxhash, ...)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from flipsync_apps.bench import gpu

ROOT = Path(__file__).resolve().parents[3]

# Imports blocked in the subprocess: flipsync's other dependencies, absent from the GPU machine's image.
BLOCK = """
import sys
DENY = {"zstandard", "transformers", "constriction", "httpx", "fastapi", "uvicorn", "obstore", "blake3",
        "tokenizers", "ml_dtypes", "hypothesis", "pydantic", "starlette", "matplotlib"}
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in DENY:
            raise ModuleNotFoundError(f"No module named {name!r} (not on the GPU machine)")
        return None
sys.meta_path.insert(0, Block())
"""


def test_the_check_runs_on_the_cpu_and_says_the_gpu_parts_were_not_measured() -> None:
    report = gpu.run(quick=True, log=lambda _: None)
    assert report["ok"] and not report["cuda"] and "not measured" in report["note"]
    assert "skipped" in report["bits"]
    assert [r["fraction"] for r in report["bandwidth"]["rows"]] == list(gpu.FRACTIONS)
    assert all(r["apply_bitwise"] for r in report["bandwidth"]["rows"])
    assert all(r["target_reached"] and r["rolled_back"] for r in report["engine"]["rows"])
    graph = report["cuda_graph"]  # on the CPU: the same steps eagerly, the graph part said to be skipped
    assert graph["ok"] and not graph["captured"] and "CUDA-graph replay was not checked" in graph["skipped"]


def test_the_bit_comparison_runs_through_every_format() -> None:
    """On the CPU it compares the CPU with itself (what it proves needs a GPU): the code path is exercised."""
    out = gpu.check_bits(torch.device("cpu"))
    assert out["equal"] and len(out["formats"]) == 2 * len(gpu.FORMAT_NAMES)


def test_the_launcher_runs_with_only_what_a_gpu_machine_has(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(BLOCK)
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu-check"), "--quick", "--out", str(out)],
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "zstandard is not installed" in proc.stdout and "transformers is not installed" in proc.stdout
    report = json.loads(out.read_text())
    assert report["ok"] and report["engine"]["model"].startswith("plain torch layers")
