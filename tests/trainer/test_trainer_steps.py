"""Explicit step numbers: a loop that counts its own steps (verl's global_steps) names each version's step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from trainer_helpers import adam, follow_and_check, tiny_llama, train

from flipsync.board import open_store
from flipsync.board.catalog import Catalog
from flipsync.errors import ConfigError
from flipsync.trainer import Publisher, PublisherConfig


@pytest.mark.parametrize("background", [True, False])
def test_explicit_steps_are_the_versions_steps(tmp_path: Path, background: bool) -> None:
    store = open_store(tmp_path)
    model = tiny_llama()
    opt = adam(model)
    with Publisher(model, store, run="s", first_step=5, config=PublisherConfig(background=background)) as pub:
        for step in (7, 8, 12):
            train(model, opt, 1, seed=step)
            pub.step(step=step, meta={"note": f"s{step}"})
            pub.flush()  # one version per step: nothing squashed
        assert pub.stats.steps == 3  # calls, not the last step number
    follow_and_check(store, "s", model)
    cat = Catalog(store, "s")
    assert [cat.version(v).meta["step"] for v in range(4)] == [5, 7, 8, 12]
    # meta.steps: how many trainer steps each version covers, from the explicit numbers
    assert [cat.version(v).meta["steps"] for v in (1, 2, 3)] == [2, 1, 4]
    assert cat.version(3).meta["note"] == "s12"


def test_default_steps_continue_from_an_explicit_one(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    model = tiny_llama()
    opt = adam(model)
    with Publisher(model, store, run="d", config=PublisherConfig(background=False)) as pub:
        pub.step(step=10)
        pub.step()
        train(model, opt, 1)  # not attached: nothing published by the optimizer
        pub.step()
    cat = Catalog(store, "d")
    assert [cat.version(v).meta["step"] for v in range(4)] == [0, 10, 11, 12]
    follow_and_check(store, "d", model)


@pytest.mark.parametrize("bad", [0, 3, -1, 2.5, True, "4"])
def test_a_step_that_does_not_move_forward_is_refused(tmp_path: Path, bad: object) -> None:
    model = tiny_llama()
    with Publisher(model, open_store(tmp_path), run="r", first_step=3, config=PublisherConfig(background=False)) as pub:
        with pytest.raises(ConfigError, match="greater than the last step"):
            pub.step(step=bad)  # type: ignore[arg-type]
        pub.step(step=4)  # the refused call changed nothing
        assert pub.flush() is not None and pub.flush().step == 4


@pytest.mark.parametrize("bad", [-1, 1.0, None, True])
def test_a_bad_first_step_is_refused_before_anything_starts(tmp_path: Path, bad: object) -> None:
    with pytest.raises(ConfigError, match="first_step"):
        Publisher(torch.nn.Linear(2, 2), open_store(tmp_path), run="f", first_step=bad)  # type: ignore[arg-type]
    assert not (tmp_path / "runs").exists()
