"""The bandwidth limiter: parses link speeds, and reads through it take bytes / rate."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from flipsync.board.throttle import ThrottledStore, parse_bandwidth
from flipsync.errors import ConfigError
from flipsync.stores import Store, open_store


@pytest.mark.parametrize(
    ("text", "bytes_per_s"),
    [("100mbit", 12.5e6), ("1gbit", 125e6), ("10Gbps", 1.25e9), ("50MB/s", 50e6), ("2000", 2000.0), ("1.5kB", 1500)],
)
def test_parse_bandwidth(text: str, bytes_per_s: float) -> None:
    assert parse_bandwidth(text) == pytest.approx(bytes_per_s)


@pytest.mark.parametrize("text", ["fast", "-1mbit", "0", ""])
def test_bad_bandwidth_is_refused(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_bandwidth(text)


def test_reads_are_paced(tmp_path: Path) -> None:
    inner = open_store(tmp_path)
    inner.put("a/blob", b"x" * 400_000)
    store = ThrottledStore(inner, 2_000_000)  # 2 MB/s: 400 kB takes about 0.2 s
    assert isinstance(store, Store)
    t = time.monotonic()
    assert store.get("a/blob") == b"x" * 400_000
    assert store.get_range("a/blob", 0, 100_000) == b"x" * 100_000
    took = time.monotonic() - t
    assert took >= 0.2  # 500 kB at 2 MB/s, less the initial burst
    assert store.bytes_read == 500_000
    assert [o.path for o in store.list("a")] == ["a/blob"]
