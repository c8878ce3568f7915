"""The examples of docs/integrations/{slime,openrlhf,prime-rl}.md, run as the pages write them.

verl.md's example needs verl: tests/integrations/test_verl.py runs it with the verl venv's Python.
"""

from __future__ import annotations

import importlib
import runpy
import sys
from argparse import Namespace
from pathlib import Path

import pytest

from flipsync.board import open_store
from flipsync.board.catalog import Catalog
from tests.integrations.doc_examples import examples
from tests.integrations.slime_layout import hf_checkpoint, slime_version_dir, weights_after
from tests.trainer.trainer_helpers import Replica, assert_bitwise, expected_view, tiny_llama


def write_examples(page: str, where: Path) -> dict[str, Path]:
    where.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, body in examples(page).items():
        (where / name).write_text(body)
        out[name] = where / name
    assert out, f"{page} has no '# example:' block"
    return out


@pytest.mark.parametrize(("page", "name", "run"), [("openrlhf.md", "openrlhf_actor.py", "openrlhf-0412"),
                                                    ("prime-rl.md", "prime_rl_train.py", "prime-rl-0412")])  # fmt: skip
def test_trainer_loop_examples_publish_every_step_bitwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, page: str, name: str, run: str
) -> None:
    board = tmp_path / "board"
    monkeypatch.setenv("FLIPSYNC_BOARD", str(board))
    path = write_examples(page, tmp_path / "ex")[name]
    ns = runpy.run_path(str(path), run_name="__main__")
    replica = Replica(open_store(board), run)
    head = replica.follow_each()
    # prime-rl's publisher runs in the background and may squash steps; every step is in one version
    last_step = Catalog(open_store(board), run).version(head).meta["step"]
    assert last_step == (3 if page == "prime-rl.md" else 2)
    assert_bitwise(expected_view(ns["model"]), replica.tensors)


def test_the_slime_hook_module_publishes_slime_syncs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    board = tmp_path / "board"
    monkeypatch.setenv("FLIPSYNC_BOARD", str(board))
    write_examples("slime.md", tmp_path / "ex")
    monkeypatch.syspath_prepend(str(tmp_path / "ex"))
    sys.modules.pop("my_hooks", None)
    hook = importlib.import_module("my_hooks").publish  # what --custom-update-weight-post-write-path names
    views = weights_after(tiny_llama(tie=False), 2)
    args = Namespace(hf_checkpoint=str(hf_checkpoint(tmp_path / "hf", views[0])))
    delta = tmp_path / "delta-updates"
    delta.mkdir()
    hook(args, str(delta), [])
    for v in (1, 2):
        hook(args, str(slime_version_dir(delta, v, views[v - 1], views[v])), [])
    hook.close()
    replica = Replica(open_store(board), "glm-rl-0412")
    assert replica.follow_each() == 2
    assert_bitwise(views[2], replica.tensors)
    assert Catalog(open_store(board), "glm-rl-0412").version(2).meta["slime_version"] == 2
