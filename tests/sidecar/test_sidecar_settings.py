"""`SidecarSettings`: one object holds every knob of a sidecar; bad values are refused where it is made, and the
pieces' configs come from it unchanged."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import pytest

from flipsync.errors import ConfigError
from flipsync.sidecar.gate import CommitMode
from flipsync.sidecar.settings import SidecarSettings


def test_every_knob_has_a_line_of_doc() -> None:
    source = Path(SidecarSettings.__module__.replace(".", "/") + ".py")
    text = (Path(__file__).resolve().parents[2] / "src" / source).read_text()
    for f in dataclasses.fields(SidecarSettings):
        line = next(ln for ln in text.splitlines() if ln.strip().startswith(f"{f.name}:"))
        assert "#" in line, f"SidecarSettings.{f.name} has no comment saying what it is"


def test_the_pieces_configs_come_from_the_settings() -> None:
    s = SidecarSettings(
        board="./b",
        poll_s=0.1,
        max_backoff_s=2.0,
        drain_timeout_s=3.0,
        adopt_search=5,
        commit_mode=CommitMode.QUIESCE,
        public_url="http://10.0.0.1:8100",
        island="eu",
        model_name="policy",
        heartbeat_s=1.0,
        member_ttl_s=4.0,
    )
    r = s.replica_config()
    assert (r.commit_mode, r.poll_interval_s, r.max_backoff_s, r.drain_timeout_s, r.adopt_search) == (
        CommitMode.QUIESCE,
        0.1,
        2.0,
        3.0,
        5,
    )
    p = s.proxy_config("http://127.0.0.1:9")
    assert p.upstream_url == "http://127.0.0.1:9" and p.retry_after_s == 1 and p.api_keys is None
    m = s.membership()
    assert m is not None and (m.public_url, m.island, m.model, m.interval_s, m.ttl_s) == (
        "http://10.0.0.1:8100",
        "eu",
        "policy",
        1.0,
        4.0,
    )
    assert SidecarSettings(board="./b").membership() is None


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        ({"listen": "nowhere"}, "HOST:PORT"),
        ({"engine": "tensorrt"}, "unknown engine"),
        ({"engine": "vllm"}, "--upstream"),
        ({"wait_timeout_s": -1.0}, "--wait-timeout"),
        ({"fetch_ahead_s": math.nan}, "--fetch-ahead"),
        ({"mirror_wait_s": -0.5}, "--mirror-wait"),
        ({"exit_timeout_s": -3.0}, "--exit-timeout"),
        ({"model_name": "a@b"}, "model must be"),
        ({"public_url": "http://h:1", "heartbeat_s": 20.0, "member_ttl_s": 10.0}, "--heartbeat"),
        ({"replica_id": "r1"}, "--public-url"),
        ({"fleet_board": "./other"}, "--public-url"),
    ],
)
def test_a_bad_setting_is_refused_where_it_is_made(kw: dict[str, object], says: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(says)):
        SidecarSettings(board="./b", **kw)  # type: ignore[arg-type]
