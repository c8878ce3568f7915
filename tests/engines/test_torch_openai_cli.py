"""``flipsync sidecar --engine torch --model-name NAME``: the torch engine answers as NAME (not only the member
record), and a name no record could carry is refused before anything heavy starts."""

from __future__ import annotations

from typing import Any

import pytest
from typer.testing import CliRunner

from flipsync.cli.sidecar import sidecar_app
from flipsync.engines.torch import openai_server
from flipsync.errors import ConfigError
from tests.sidecar.sidecar_helpers import Trainer


class _Started(ConfigError):
    pass


def _run_until_the_engine_starts(board_dir: str, monkeypatch: pytest.MonkeyPatch, *extra: str) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    def fake_start(model_spec: str, served_format: str, **kw: Any) -> Any:
        seen.update(kw, model_spec=model_spec)
        raise _Started("engine start reached")  # stop there: the rest of the sidecar is not under test

    monkeypatch.setattr(openai_server, "start_torch_engine", fake_start)
    r = CliRunner().invoke(sidecar_app, ["sidecar", "--board", board_dir, "--engine", "torch", *extra])
    assert r.exit_code == 2 and "engine start reached" in r.output, r.output
    return seen


def test_model_name_reaches_the_torch_engine(store: object, board_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    Trainer(store)  # type: ignore[arg-type]  # a first version, so the sidecar learns the served format
    seen = _run_until_the_engine_starts(board_dir, monkeypatch, "--model-name", "policy-7b")
    assert seen["model_name"] == "policy-7b"
    default = _run_until_the_engine_starts(board_dir, monkeypatch)
    assert default.get("model_name", "flipsync-torch") == "flipsync-torch"


def test_a_bad_model_name_is_refused_at_once(board_dir: str) -> None:
    args = ["sidecar", "--board", board_dir, "--engine", "torch", "--model-name", "a@b", "--wait-timeout", "0"]
    r = CliRunner().invoke(sidecar_app, args)
    assert r.exit_code == 2 and "model must be" in r.output, r.output
