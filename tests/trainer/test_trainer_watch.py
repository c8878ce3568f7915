"""The checkpoint watcher: complete and stable HF safetensors checkpoints become consecutive versions."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save
from trainer_helpers import Replica, adam, assert_bitwise, tiny_llama, train
from typer.testing import CliRunner

from flipsync.board import open_store
from flipsync.board.catalog import Catalog
from flipsync.checkpoint import INDEX_NAME
from flipsync.cli import trainer as cli
from flipsync.formats import served_view
from flipsync.trainer.watch import CheckpointScanner, checkpoint_files, safetensors_complete, watch


def checkpoints(n: int) -> list[dict[str, torch.Tensor]]:
    """State dicts of a tiny untied Llama after 0, 1, ... Adam steps (fp32 masters)."""
    model = tiny_llama(tie=False)
    opt = adam(model)
    out = []
    for _ in range(n):
        out.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        train(model, opt, 1)
    return out


def write_slowly(directory: Path, tensors: dict[str, torch.Tensor], *, shards: int = 2, pause: float = 0.03) -> None:
    """A careless writer: the index first, then each shard in pieces, straight to the final names."""
    directory.mkdir(parents=True)
    names = sorted(tensors)
    groups = [names[i::shards] for i in range(shards)]
    files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    index = {"metadata": {}, "weight_map": {n: files[i] for i, g in enumerate(groups) for n in g}}
    (directory / INDEX_NAME).write_text(json.dumps(index))
    for fname, group in zip(files, groups, strict=True):
        data = save({n: tensors[n].contiguous() for n in group})
        with (directory / fname).open("wb") as f:
            for i in range(0, len(data), len(data) // 3 + 1):
                f.write(data[i : i + len(data) // 3 + 1])
                f.flush()
                time.sleep(pause)


def test_a_file_is_complete_only_when_every_declared_byte_is_there(tmp_path: Path) -> None:
    data = save({"a": torch.ones(10), "b": torch.zeros(3, 3)})
    f = tmp_path / "x.safetensors"
    for cut, ok in ((0, False), (7, False), (20, False), (len(data) - 1, False), (len(data), True)):
        f.write_bytes(data[:cut])
        assert safetensors_complete(f) is ok, cut
    f.write_bytes(b"\x10" + b"\x00" * 7 + b"not json at all!")
    assert not safetensors_complete(f)


def test_a_sharded_checkpoint_is_complete_only_with_all_its_shards(tmp_path: Path) -> None:
    d = tmp_path / "c"
    write_slowly(d, {"a": torch.ones(4), "b": torch.ones(2)}, pause=0)
    assert checkpoint_files(d) is not None
    (d / "model-00002-of-00002.safetensors").unlink()
    assert checkpoint_files(d) is None
    (d / INDEX_NAME).unlink()  # no index: the -of-N names must all be there
    assert checkpoint_files(d) is None


def test_the_watcher_publishes_every_checkpoint_once_after_it_is_complete(tmp_path: Path) -> None:
    ckpt_dir, board = tmp_path / "ckpts", tmp_path / "board"
    ckpt_dir.mkdir()
    states = checkpoints(3)

    def trainer() -> None:
        for i, state in enumerate(states):
            write_slowly(ckpt_dir / f"checkpoint-{(i + 1) * 100}", state)
            time.sleep(0.05)

    writer = threading.Thread(target=trainer)
    writer.start()
    store = open_store(board)
    events: list[tuple[str, dict]] = []
    pub = watch(
        ckpt_dir,
        store,
        run="w",
        poll_s=0.02,
        settle_s=0.12,
        max_checkpoints=3,
        on_event=lambda kind, info: events.append((kind, dict(info))),
    )
    writer.join()
    assert pub.last is not None and pub.last.name == "checkpoint-300"
    cat = Catalog(store, "w")
    assert [cat.version(v).meta["source"] for v in (0, 1, 2)] == ["checkpoint-100", "checkpoint-200", "checkpoint-300"]
    assert [e[1]["checkpoint"] for e in events if e[0] == "published"] == [f"checkpoint-{i}00" for i in (1, 2, 3)]
    replica = Replica(store, "w")
    for v, state in enumerate(states):
        replica.sync(goal=v)
        assert_bitwise({k: t.contiguous() for k, t in served_view(state, "bf16").items()}, replica.tensors)


def test_a_checkpoint_overwritten_in_place_is_published_per_write(tmp_path: Path) -> None:
    states = checkpoints(3)
    store = open_store(tmp_path / "board")
    out = tmp_path / "out"
    out.mkdir()

    def trainer() -> None:  # saves into the same directory every time, atomically (write + rename)
        for state in states:
            tmp = out / ".model.safetensors.partial"
            tmp.write_bytes(save(state))
            tmp.replace(out / "model.safetensors")
            time.sleep(0.4)

    writer = threading.Thread(target=trainer)
    writer.start()
    watch(out, store, run="inplace", poll_s=0.02, settle_s=0.1, max_checkpoints=3)
    writer.join()
    replica = Replica(store, "inplace")
    replica.follow_each()
    assert [s.manifest.kind.value for s in replica.steps] == ["keyframe", "patch", "patch"]
    assert_bitwise({k: t.contiguous() for k, t in served_view(states[-1], "bf16").items()}, replica.tensors)


def test_a_restarted_watcher_resumes_after_the_checkpoint_head_came_from(tmp_path: Path) -> None:
    states = checkpoints(3)
    ckpts = tmp_path / "ckpts"
    board = open_store(tmp_path / "board")
    for i in (0, 1):
        write_slowly(ckpts / f"step_{i}", states[i], pause=0)
    watch(ckpts, board, run="again", poll_s=0.01, settle_s=0.05, once=True)
    write_slowly(ckpts / "step_2", states[2], pause=0)
    pub = watch(ckpts, board, run="again", resume=True, poll_s=0.01, settle_s=0.05, once=True)
    assert pub.publisher is not None and pub.publisher.started == "adopt"
    cat = Catalog(board, "again")
    assert [cat.version(v).meta["source"] for v in (0, 1, 2)] == ["step_0", "step_1", "step_2"]
    assert not cat.has_version(3)


def test_cli_publish_and_watch(tmp_path: Path) -> None:
    import typer

    app = typer.Typer()
    app.command("watch")(cli.watch)
    app.command("publish")(cli.publish)
    states = checkpoints(2)
    for i, state in enumerate(states):
        write_slowly(tmp_path / "ckpts" / f"checkpoint-{i}", state, pause=0)
    board = str(tmp_path / "board")
    runner = CliRunner()
    out = runner.invoke(
        app,
        ["publish", board, str(tmp_path / "ckpts/checkpoint-0"), str(tmp_path / "ckpts/checkpoint-1"), "--run", "p"],
    )
    assert out.exit_code == 0, out.output
    again = runner.invoke(app, ["publish", board, str(tmp_path / "ckpts/checkpoint-0"), "--run", "p"])
    assert again.exit_code == 1 and "already exists" in again.output
    (tmp_path / "ckpts/checkpoint-1/model-00002-of-00002.safetensors").write_bytes(b"\x00" * 3)
    bad = runner.invoke(app, ["publish", board, str(tmp_path / "ckpts/checkpoint-1"), "--run", "q"])
    assert bad.exit_code == 1 and "not a complete safetensors checkpoint" in bad.output
    w = runner.invoke(
        app, ["watch", str(tmp_path / "ckpts"), board, "--run", "w", "--once", "--settle", "0.05", "--poll", "0.01"]
    )
    assert w.exit_code == 0, w.output
    assert "checkpoint-0 -> run w v0" in w.output
    assert Catalog(open_store(board), "w").list_versions() == [0]  # checkpoint-1 is half-written now


def test_scanner_needs_the_files_unchanged_for_the_settle_time(tmp_path: Path) -> None:
    now = [0.0]
    d = tmp_path / "c"
    write_slowly(d, {"a": torch.ones(2)}, shards=1, pause=0)
    scanner = CheckpointScanner(tmp_path, settle_s=10.0, clock=lambda: now[0])
    assert scanner.ready() == []
    now[0] = 9.0
    assert scanner.ready() == []
    now[0] = 10.5
    assert [c.name for c in scanner.ready()] == ["c"]
    with pytest.raises(Exception, match="does not exist"):
        CheckpointScanner(tmp_path / "nope", 1.0)


def test_watch_once_gives_a_slow_first_scan_its_settle_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from flipsync.trainer import watch as watch_module

    write_slowly(tmp_path / "ckpts" / "checkpoint-0", checkpoints(1)[0], pause=0)
    slow = watch_module.CheckpointScanner.ready

    def ready(self: CheckpointScanner) -> list:  # type: ignore[type-arg]
        time.sleep(0.2)  # a loaded machine: the scan itself outlasts the settle time
        return slow(self)

    monkeypatch.setattr(watch_module.CheckpointScanner, "ready", ready)
    pub = watch(tmp_path / "ckpts", open_store(tmp_path / "board"), run="w", once=True, settle_s=0.05, poll_s=0.01)
    assert pub.last is not None and pub.last.name == "checkpoint-0"
