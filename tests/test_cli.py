"""The command line on real safetensors checkpoints: view, diff, apply, squash, inspect, bench."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from flipsync.checkpoint import load_checkpoint, save_checkpoint
from flipsync.cli.main import app
from flipsync.codec import Patch
from tests.strategies import same_bits

runner = CliRunner(env={"COLUMNS": "160"})


def masters(seed: int, drift: float = 0.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(256, 128, generator=g) * 0.02,
        "model.layers.0.self_attn.k_proj.weight": torch.randn(64, 128, generator=g) * 0.02,
        "model.layers.0.self_attn.v_proj.weight": torch.randn(64, 128, generator=g) * 0.02,
        "model.layers.0.mlp.gate_proj.weight": torch.randn(128, 128, generator=g) * 0.02,
        "model.norm.weight": torch.ones(128),
    }
    if drift:
        g2 = torch.Generator().manual_seed(seed)
        base = {k: v + drift * torch.randn(v.shape, generator=g2) for k, v in base.items()}
    return base


@pytest.fixture
def ckpts(tmp_path: Path) -> dict[str, Path]:
    paths = {"m0": tmp_path / "m0.safetensors", "m1": tmp_path / "m1", "m2": tmp_path / "m2.safetensors"}
    save_checkpoint(masters(0), paths["m0"])
    save_checkpoint(masters(1, 1e-4), paths["m1"], max_shard_bytes=60_000)  # an HF dir with an index
    save_checkpoint(masters(2, 2e-4), paths["m2"])
    return paths


def run(*args: str) -> str:
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.parametrize("fmt", ["bf16", "fp8-block", "nvfp4"])
def test_view_diff_apply_round_trip(ckpts: dict[str, Path], tmp_path: Path, fmt: str) -> None:
    assert (ckpts["m1"] / "model.safetensors.index.json").exists()
    s0, s1, patch = tmp_path / "s0.safetensors", tmp_path / "s1", tmp_path / "p.safetensors"
    run("view", ckpts["m0"], "--format", fmt, "-o", s0)
    run("view", ckpts["m1"], "--format", fmt, "-o", s1)
    out = run("diff", ckpts["m0"], ckpts["m1"], "--format", fmt, "-o", patch)
    assert "bytes per changed value" in out
    # BASE given as masters (quantized with the patch's format) and as the served view: same result.
    run("apply", ckpts["m0"], patch, "-o", tmp_path / "a.safetensors")
    run("apply", s0, patch, "-o", tmp_path / "b")
    want = load_checkpoint(s1)
    for got in (load_file(tmp_path / "a.safetensors"), load_checkpoint(tmp_path / "b")):
        assert set(got) == set(want)
        assert all(same_bits(got[k], want[k]) for k in want)


def test_diff_of_served_views_equals_diff_of_masters(ckpts: dict[str, Path], tmp_path: Path) -> None:
    run("view", ckpts["m0"], "-f", "fp8-tensor", "-o", tmp_path / "s0.safetensors")
    run("view", ckpts["m1"], "-f", "fp8-tensor", "-o", tmp_path / "s1.safetensors")
    run("diff", tmp_path / "s0.safetensors", tmp_path / "s1.safetensors", "-o", tmp_path / "ps.safetensors")
    run("diff", ckpts["m0"], ckpts["m1"], "-f", "fp8-tensor", "-o", tmp_path / "pm.safetensors")
    run("apply", tmp_path / "s0.safetensors", tmp_path / "ps.safetensors", "-o", tmp_path / "o.safetensors")
    got, want = load_file(tmp_path / "o.safetensors"), load_file(tmp_path / "s1.safetensors")
    assert all(same_bits(got[k], want[k]) for k in want)


def test_squash_and_inspect(ckpts: dict[str, Path], tmp_path: Path) -> None:
    p01, p12, p02 = (tmp_path / f"{n}.safetensors" for n in ("p01", "p12", "p02"))
    run("diff", ckpts["m0"], ckpts["m1"], "-f", "bf16", "-o", p01)
    run("diff", ckpts["m1"], ckpts["m2"], "-f", "bf16", "-o", p12)
    refused = runner.invoke(app, ["squash", str(p01), str(p12), "-o", str(p02)])
    assert refused.exit_code == 1 and "--base" in refused.output  # ctx-coded positions need the first base
    run("squash", p01, p12, "-o", p02, "--base", ckpts["m0"])
    run("apply", ckpts["m0"], p02, "-o", tmp_path / "o.safetensors")
    run("view", ckpts["m2"], "-f", "bf16", "-o", tmp_path / "s2.safetensors")
    got, want = load_file(tmp_path / "o.safetensors"), load_file(tmp_path / "s2.safetensors")
    assert all(same_bits(got[k], want[k]) for k in want)
    table = run("inspect", p02)
    assert "q_proj" in table and "rice" in table
    lines = table.splitlines()
    header = next(ln for ln in lines if "tensor" in ln and "mode" in ln)
    row = next(ln for ln in lines if "q_proj" in ln)
    # one header per column: the box characters split header and rows into the same number of cells
    assert "pos codec" in header and "value codec" in header
    assert header.count("┃") == row.count("│")
    assert '"sections"' in run("inspect", p02, "--json")
    # a patch coded against its base says so (this one: the squash above refused it without --base)
    assert Patch.load(p01).needs_base and "coded against the values they change" in run("inspect", p01)
    assert Patch.load(p02).needs_base == ("coded against the values they change" in table)


def test_errors_are_one_actionable_line(ckpts: dict[str, Path], tmp_path: Path) -> None:
    patch = tmp_path / "p.safetensors"
    run("diff", ckpts["m0"], ckpts["m1"], "-f", "bf16", "-o", patch)
    wrong_base = runner.invoke(app, ["apply", str(ckpts["m2"]), str(patch), "-o", str(tmp_path / "x.safetensors")])
    assert wrong_base.exit_code == 1
    assert "Traceback" not in wrong_base.output
    text = " ".join(wrong_base.output.split())
    # said in the files the user passed, not in board versions
    assert "is not the base" in text and "version None" not in text and "flipsync diff OLD NEW" in text
    assert not (tmp_path / "x.safetensors").exists()
    missing = runner.invoke(app, ["diff", str(tmp_path / "nope"), str(ckpts["m1"]), "-o", str(patch)])
    assert missing.exit_code == 1 and "does not exist" in missing.output
    no_format = runner.invoke(app, ["diff", str(ckpts["m0"]), str(ckpts["m1"]), "-o", str(patch)])
    assert no_format.exit_code == 1 and "--format" in no_format.output
    # format names as `inspect` prints them are accepted
    run("view", ckpts["m0"], "-f", "BF16", "-o", tmp_path / "upper.safetensors")
    bad_format = runner.invoke(app, ["view", str(ckpts["m0"]), "-f", "fp7", "-o", str(patch)])
    assert bad_format.exit_code == 1 and "bf16" in bad_format.output
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ")
    bad_patch = runner.invoke(app, ["inspect", str(garbage)])
    assert bad_patch.exit_code == 1 and "error" in bad_patch.output


def test_a_server_command_starts_without_collections_and_serving_turns_them_back_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import gc

    import uvicorn

    from flipsync.cli.terminal import server_command
    from flipsync.serving import serve_until_signal

    seen: list[object] = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self: seen.append(("serving", gc.isenabled())))

    @server_command
    def serve(fail: bool) -> str:
        seen.append(("starting", gc.isenabled()))
        if fail:
            raise RuntimeError("the engine did not load")
        serve_until_signal(lambda scope, receive, send: None, "127.0.0.1", 0)  # type: ignore[arg-type, return-value]
        return "served"

    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    gc.collect()
    assert serve(False) == "served"
    assert seen == [("starting", False), ("serving", True)] and gc.isenabled()
    assert gc.get_freeze_count() > frozen  # the start's heap went out of later collections
    seen.clear()
    with pytest.raises(RuntimeError):
        serve(True)
    assert seen == [("starting", False)] and gc.isenabled()  # a start that failed leaves collection on
