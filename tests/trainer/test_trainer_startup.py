"""How a publisher starts on a run (`decide_start`, pure) and what `PublisherConfig` refuses."""

from __future__ import annotations

import pytest
import torch

from flipsync.codec.fingerprint import FingerprintTable
from flipsync.errors import ConfigError
from flipsync.trainer import PublisherConfig
from flipsync.trainer.startup import decide_start, layout_fingerprint
from tests.strategies import patch_manifest

VIEW, LAYOUT = "1e" * 8, "ab" * 8


def decide(head_over: dict | None, **kw: object) -> tuple[str, int | None, str]:
    head = patch_manifest(**head_over) if head_over is not None else None
    args: dict = dict(
        run="run-1",
        board_url="file:///b",
        view_fp=VIEW,
        layout=LAYOUT,
        served_format="bf16",
        resume=False,
        new_weights=False,
    )
    args.update(kw)
    return tuple(decide_start(head, **args))  # type: ignore[return-value]


def test_an_empty_run_starts_new() -> None:
    assert decide(None) == ("new", None, "")
    assert decide(None, resume=True)[0] == "new"


def test_an_existing_run_is_refused_without_resume() -> None:
    kind, head, message = decide({"meta": {"layout": LAYOUT}})
    assert (kind, head) == ("refuse", 7)
    assert "already exists" in message and "resume=True" in message and "trainer-0" in message


def test_resume_adopts_head_when_it_holds_this_view() -> None:
    assert decide({"meta": {"layout": LAYOUT}}, resume=True) == ("adopt", 7, "")


def test_other_weights_of_this_model_are_taken_over() -> None:
    other = {"target_view_fp": "77" * 8, "meta": {"layout": LAYOUT}}
    assert decide(other, resume=True) == ("takeover", 7, "")
    assert decide({"target_view_fp": "77" * 8, "meta": {}}, resume=True)[0] == "takeover"  # no layout recorded


def test_another_model_or_format_needs_new_weights() -> None:
    other_model = {"target_view_fp": "77" * 8, "meta": {"layout": "cd" * 8}}
    kind, _, message = decide(other_model, resume=True)
    assert kind == "refuse_model" and "tensors" in message and "new_weights=True" in message
    assert decide(other_model, resume=True, new_weights=True)[0] == "takeover"
    kind, _, message = decide({"meta": {"layout": LAYOUT}}, resume=True, served_format="fp16")
    assert kind == "refuse_model" and "served format fp16, HEAD's is bf16" in message
    assert decide({"meta": {"layout": LAYOUT}}, resume=True, served_format="fp16", new_weights=True)[0] == "takeover"


def test_layout_fingerprint_sees_names_dtypes_and_shapes_not_values() -> None:
    a = {"w": torch.zeros(4, 3, dtype=torch.bfloat16)}
    same_layout = {"w": torch.ones(4, 3, dtype=torch.bfloat16)}
    fp = layout_fingerprint(FingerprintTable.of(a))
    assert fp == layout_fingerprint(FingerprintTable.of(same_layout))
    for other in (
        {"w": torch.zeros(3, 4, dtype=torch.bfloat16)},
        {"w": torch.zeros(4, 3, dtype=torch.float16)},
        {"v": torch.zeros(4, 3, dtype=torch.bfloat16)},
    ):
        assert layout_fingerprint(FingerprintTable.of(other)) != fp


def test_config_refuses_bad_knobs_when_made() -> None:
    with pytest.raises(ConfigError, match="max_store_failures"):
        PublisherConfig(max_store_failures=0)
    with pytest.raises(ConfigError, match="chunk_bytes"):
        PublisherConfig(chunk_bytes=100)
    assert PublisherConfig(threads=3).pool_threads == 3
    assert PublisherConfig().pool_threads >= 1
