"""``flipsync board ls|show|gc`` and ``keygen``, through Typer's test runner."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from board_helpers import build_run
from typer.testing import CliRunner

from flipsync.cli.board import board_app, keygen
from flipsync.stores import open_store

runner = CliRunner(env={"COLUMNS": "220"})


def board(tmp_path: Path, runs: tuple[str, ...] = ("run",), n: int = 6) -> str:
    store = open_store(tmp_path / "board")
    for r in runs:
        build_run(store, n, run=r, keyframes=(4,), spans=True)
    return str(tmp_path / "board")


def test_ls_lists_runs_then_versions(tmp_path: Path) -> None:
    url = board(tmp_path, runs=("alpha", "beta"))
    res = runner.invoke(board_app, ["ls", url])
    assert res.exit_code == 0, res.output
    assert "alpha" in res.output and "beta" in res.output and "v6" in res.output
    res = runner.invoke(board_app, ["ls", url, "--run", "alpha"])
    assert res.exit_code == 0, res.output
    assert "HEAD v6" in res.output and "snapshot" not in res.output and "v5 -> v6" in res.output
    assert "keyframe" in res.output and "span" in res.output


def test_show_manifest(tmp_path: Path) -> None:
    url = board(tmp_path)
    res = runner.invoke(board_app, ["show", url])  # the only run, HEAD
    assert res.exit_code == 0, res.output
    assert "v5 -> v6" in res.output and "patch-00000.safetensors" in res.output
    res = runner.invoke(board_app, ["show", url, "3", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["version"] == 3
    res = runner.invoke(board_app, ["show", url, "4", "--keyframe"])
    assert res.exit_code == 0 and "model.safetensors.index.json" in res.output
    res = runner.invoke(board_app, ["show", url, "--span", "0-4"])
    assert res.exit_code == 0 and "v0 -> v4" in res.output
    res = runner.invoke(board_app, ["show", url, "42"])
    assert res.exit_code == 1 and "error:" in res.output and "has no v42 (HEAD v6)" in res.output
    assert "manifest.json" not in res.output  # the user asked for a version, not an internal path


def test_gc_dry_run_then_real(tmp_path: Path) -> None:
    url = board(tmp_path, n=8)
    res = runner.invoke(board_app, ["gc", url, "--keep", "2", "--dry-run"])
    assert res.exit_code == 0, res.output
    assert "dry run" in res.output and "oldest kept version" in res.output
    res = runner.invoke(board_app, ["gc", url, "--keep", "2"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(board_app, ["show", url, "1"])
    assert res.exit_code == 1  # deleted


def test_errors_are_readable(tmp_path: Path) -> None:
    res = runner.invoke(board_app, ["ls", "ftp://nowhere/board"])
    assert res.exit_code == 1 and "unsupported board URL" in res.output
    url = board(tmp_path, runs=("a", "b"), n=1)
    res = runner.invoke(board_app, ["show", url])
    assert res.exit_code == 1 and "choose one with --run" in res.output
    res = runner.invoke(board_app, ["ls", url, "-o", "novalue"])
    assert res.exit_code == 1 and "key=value" in res.output


def test_keygen_command(tmp_path: Path) -> None:
    app = typer.Typer()
    app.command()(keygen)
    out = tmp_path / "keys" / "board.key"
    res = runner.invoke(app, [str(out)])
    assert res.exit_code == 0, res.output
    assert out.exists() and Path(str(out) + ".pub").exists() and "key id" in res.output
    res = runner.invoke(app, [str(out)])
    assert res.exit_code == 1 and "already exists" in res.output
    assert runner.invoke(app, [str(out), "--force"]).exit_code == 0
    # -o/--output says the same (the README's form); no file, or two different ones, is a usage error.
    other = tmp_path / "keys" / "other.key"
    res = runner.invoke(app, ["-o", str(other)])
    assert res.exit_code == 0, res.output
    assert other.exists() and Path(str(other) + ".pub").exists()
    assert runner.invoke(app, ["--output", str(other), "--force"]).exit_code == 0
    res = runner.invoke(app, [])
    assert res.exit_code == 2 and "-o KEY" in res.output
    assert runner.invoke(app, [str(out), "-o", str(other)]).exit_code == 2
    # The public key verifies a signed board through `show --public-key`.
    from flipsync.board.signing import Signer

    store = open_store(tmp_path / "signed")
    build_run(store, 1, signer=Signer.from_pem(out))
    res = runner.invoke(board_app, ["show", str(tmp_path / "signed"), "--public-key", str(out) + ".pub"])
    assert res.exit_code == 0 and "verified" in res.output
