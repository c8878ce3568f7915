"""One trainer, several served formats: a run per format, the same version numbers, every version bitwise."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from trainer_helpers import Replica, SlowStore, adam, assert_bitwise, expected_view, tiny_llama, train

from flipsync.board import KeyframePolicy, open_store
from flipsync.errors import ConfigError
from flipsync.trainer import MultiFormatPublisher, Publisher, PublisherConfig
from flipsync.trainer.pieces import ViewPlan

NO_KEYFRAMES = KeyframePolicy(chain_fraction=1e9, max_interval=1 << 30)
FORMATS = ("bf16", "fp8-block", "nvfp4")


@pytest.mark.parametrize("background", [True, False])
def test_every_format_publishes_every_step_under_one_version_number(tmp_path: Path, background: bool) -> None:
    store = open_store(tmp_path)
    model = tiny_llama()
    opt = adam(model)
    views: list[dict[str, dict[str, torch.Tensor]]] = [{f: expected_view(model, f) for f in FORMATS}]

    def record(_opt: object, _args: object, _kwargs: object) -> None:
        views.append({f: expected_view(model, f) for f in FORMATS})

    slow = SlowStore(store, 0.2 if background else 0.0)
    config = PublisherConfig(background=background, keyframe_policy=NO_KEYFRAMES)
    with MultiFormatPublisher(model, slow, FORMATS, run="multi", optimizer=opt, config=config) as pub:
        opt.register_step_post_hook(record)  # after the publisher's hook: the masters of that step
        train(model, opt, 4)
        pub.flush()
    assert pub.runs == {f: f"multi-{f}" for f in FORMATS}
    for fmt, run in pub.runs.items():
        assert pub.stats[fmt].squashed_steps == 0 and pub.stats[fmt].head == 4
        replica = Replica(store, run)
        for v in range(5):
            assert replica.sync(goal=v) == v
            assert replica.steps[-1].manifest.meta["step"] == v  # version v is trainer step v in every run
            assert replica.steps[-1].manifest.served_format == fmt
            assert_bitwise(views[v][fmt], replica.tensors)


def test_one_gather_of_the_masters_serves_every_format(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = ViewPlan.gather

    def counting(self: ViewPlan, masters: Any) -> Any:
        calls.append(self.fmt)
        return real(self, masters)

    model = tiny_llama()
    with MultiFormatPublisher(model, tmp_path, ("bf16", "fp8-block"), config=PublisherConfig(background=False)) as pub:
        monkeypatch.setattr(ViewPlan, "gather", counting)
        pub.step()
        pub.step(step=5)
    assert calls == ["bf16", "bf16"]  # one per step, not one per format
    assert [p.stats.steps for p in pub.publishers.values()] == [2, 2]


def test_a_plain_publisher_still_squashes_and_a_multi_format_one_refuses_bad_formats(tmp_path: Path) -> None:
    model = tiny_llama()
    with pytest.raises(ConfigError, match="each served format once"):
        MultiFormatPublisher(model, tmp_path, ("bf16", "BF16"))
    with pytest.raises(ConfigError, match="at least one"):
        MultiFormatPublisher(model, tmp_path, ())
    with pytest.raises(ConfigError):
        MultiFormatPublisher(model, tmp_path, ("bf16", "fp7"))
    assert not any(tmp_path.rglob("*.json"))  # refused before any run started
    opt = adam(model)
    store = SlowStore(open_store(tmp_path), 0.3)
    with Publisher(model, store, run="plain", optimizer=opt, config=PublisherConfig(spans=False)) as plain:
        train(model, opt, 6)
    assert plain.stats.squashed_steps > 0  # the default keeps the training step from waiting
