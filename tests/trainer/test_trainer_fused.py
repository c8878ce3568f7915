"""The one-pass cast and diff changes nothing on the board: the same patches, byte for byte.

Two publishers train the same model the same way, one with the one-pass cast (``feed.fuse``) and one without;
every object they write (patches, spans, keyframes, manifests less their time, publisher and attempt folder) must be
equal. The fused run must really have used the fused changes (no second diff of the pieces it cast).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from trainer_helpers import Replica, adam, assert_bitwise, expected_view, tiny_llama, train

from flipsync.board import KeyframePolicy, open_store
from flipsync.codec import DiffEngine
from flipsync.formats.cast_diff import CastDiffer
from flipsync.trainer import Publisher, PublisherConfig
from flipsync.trainer.pieces import Fuse, Piece

EVERY_2 = KeyframePolicy(chain_fraction=1e9, max_interval=2)


def board_objects(root: Path) -> dict[str, bytes]:
    """Every object of run ``r``, keyed without its attempt folder; manifests without time and writer."""
    out: dict[str, bytes] = {}
    for p in sorted((root / "runs" / "r").rglob("*")):
        if not p.is_file() or p.name == "latest.json":
            continue
        rel = p.relative_to(root / "runs" / "r").parts
        if p.name == "manifest.json":
            m = json.loads(p.read_bytes())
            m.pop("created"), m.pop("publisher")
            for part in m["parts"]:
                part["path"] = part["path"].split("/")[-1]
            out["/".join(rel)] = json.dumps(m, sort_keys=True).encode()
        else:
            out["/".join((*rel[:-2], rel[-1]))] = p.read_bytes()
    return out


def publish(
    root: Path, fmt: str, fused: bool, steps: int, lr: float = 1e-6
) -> tuple[dict[str, bytes], dict[str, torch.Tensor]]:
    model = tiny_llama(seed=3, hidden=64, vocab=96)
    opt = adam(model, lr=lr)  # an RL rate: sparse changes (dense ones are diffed later, see below)
    store = open_store(root)
    cfg = PublisherConfig(background=False, keyframe_policy=EVERY_2)
    with Publisher(model, store, run="r", format=fmt, optimizer=opt, config=cfg) as pub:
        pub.feed.fuse = fused
        train(model, opt, steps, vocab=96)
        pub.flush()
    replica = Replica(store, "r")
    replica.follow_each()
    assert_bitwise(expected_view(model, fmt), replica.tensors)
    return board_objects(root), replica.tensors


@pytest.mark.parametrize("fmt", ["bf16", "fp16", "fp8-tensor", "fp8-channel", "fp8-block", "mxfp8", "mxfp4", "nvfp4"])
def test_fused_and_separate_passes_publish_the_same_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    diffed: list[int] = []
    kernel: list[int] = []
    real_changes, real_kernel = DiffEngine.changes, CastDiffer._kernel

    def changes(self: DiffEngine, old: torch.Tensor, new: torch.Tensor):  # type: ignore[no-untyped-def]
        diffed.append(new.numel())
        return real_changes(self, old, new)

    def counted(self: CastDiffer, *args):  # type: ignore[no-untyped-def]
        kernel.append(args[0].numel())
        return real_kernel(self, *args)

    quantized: list[str] = []
    real_quantize = CastDiffer.quantize_diff

    def quantize_diff(self: CastDiffer, fmt: str, name: str, *args, **kwargs):  # type: ignore[no-untyped-def]
        got = real_quantize(self, fmt, name, *args, **kwargs)
        if got is not None:
            quantized.append(name)
        return got

    monkeypatch.setattr(DiffEngine, "changes", changes)
    monkeypatch.setattr(CastDiffer, "_kernel", counted)
    monkeypatch.setattr(CastDiffer, "quantize_diff", quantize_diff)
    steps = 4
    plain, _ = publish(tmp_path / "plain", fmt, False, steps)
    assert not kernel
    separate = len(diffed)
    diffed.clear()
    fused, _ = publish(tmp_path / "fused", fmt, True, steps)
    assert plain.keys() == fused.keys()
    assert [k for k in plain if plain[k] != fused[k]] == []
    assert any("patch-" in k for k in plain)
    assert kernel  # the one-pass cast ran on the masters it covers ...
    if fmt == "bf16":  # ... and every plain cast's changes came from it, never from a second diff
        assert diffed == [] and separate > 0
    elif fmt == "fp16":  # fp16 keeps 3 more bits: at Adam's first steps some pieces are dense, diffed later
        assert len(diffed) < separate
    else:  # scales, and quantized tensors without a one-pass cast, are still diffed after they are computed
        assert 0 < len(diffed) < separate
    # quantized payloads (fused groups included) are quantized and diffed in one pass
    assert bool(quantized) == (fmt not in ("bf16", "fp16"))
    if fmt in ("fp8-tensor", "nvfp4"):  # shared scales: q_proj is prepared with its group
        assert any(n.endswith("q_proj.weight") for n in quantized)


def test_a_row_piece_diffs_against_the_piece_at_its_offset() -> None:
    g = torch.Generator().manual_seed(0)
    master = torch.randn(6, 40, generator=g)
    prev_rows = (master[3:] + 1e-3 * torch.randn(3, 40, generator=g)).bfloat16()
    with CastDiffer(1) as caster:
        fuse = Fuse(caster, {"w": Piece(prev_rows, 120, (6, 40))})
        new = fuse.hook(120)("w", master[3:], torch.bfloat16, None)
        assert torch.equal(new.view(torch.int16), master[3:].bfloat16().view(torch.int16))
        with DiffEngine(1) as engine:
            want = engine.changes(prev_rows, new)
        got = fuse.found["w"]
        np.testing.assert_array_equal(got.positions, want.positions)  # piece-relative, like the engine's
        np.testing.assert_array_equal(got.old, want.old)
        np.testing.assert_array_equal(got.new, want.new)
        other = Fuse(caster, {"w": Piece(prev_rows, 0, (6, 40))})  # another rank's rows: not a base of these
        other.hook(120)("w", master[3:], torch.bfloat16, None)
        assert other.found == {}


def test_squashed_and_background_steps_stay_bitwise(tmp_path: Path) -> None:
    """Background publishing folds steps: changes against a view that never became the base are dropped."""
    store = open_store(tmp_path)
    model = tiny_llama(seed=1)
    opt = adam(model)
    with Publisher(model, store, run="r", optimizer=opt, config=PublisherConfig()) as pub:
        train(model, opt, 6)
        pub.flush()
        pub.step()  # by hand, after a flush: diffed against the base it is sure to have
        pub.flush()
    replica = Replica(store, "r")
    assert replica.follow_each() == pub.stats.head
    assert_bitwise(expected_view(model), replica.tensors)


def test_the_device_path_publishes_the_same_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA masters take the torch path (cast and compare where the tensors live): forced here on the CPU."""
    plain, _ = publish(tmp_path / "plain", "bf16", False, 3)
    diffed: list[int] = []
    real_changes = DiffEngine.changes

    def changes(self: DiffEngine, old: torch.Tensor, new: torch.Tensor):  # type: ignore[no-untyped-def]
        diffed.append(new.numel())
        return real_changes(self, old, new)

    monkeypatch.setattr(DiffEngine, "changes", changes)
    monkeypatch.setattr(CastDiffer, "kernel_covers", staticmethod(lambda *_args: False))
    device, _ = publish(tmp_path / "device", "bf16", True, 3)
    assert [k for k in plain if plain[k] != device.get(k)] == [] and plain.keys() == device.keys()
    assert diffed == []


def test_dense_changes_are_diffed_later_not_held(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """At a high learning rate most values change: the fused changes would outweigh the view they ride with,
    so they are dropped and the worker diffs; the board's bytes are the same."""
    diffed: list[int] = []
    real_changes = DiffEngine.changes

    def changes(self: DiffEngine, old: torch.Tensor, new: torch.Tensor):  # type: ignore[no-untyped-def]
        diffed.append(new.numel())
        return real_changes(self, old, new)

    plain, _ = publish(tmp_path / "plain", "bf16", False, 2, lr=3e-3)
    monkeypatch.setattr(DiffEngine, "changes", changes)
    dense, _ = publish(tmp_path / "dense", "bf16", True, 2, lr=3e-3)
    assert plain == dense
    assert diffed  # the worker diffed what the one-pass cast found too dense to keep
