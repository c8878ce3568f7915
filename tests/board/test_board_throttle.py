"""The bandwidth limiter: parses link speeds, and reads through it take bytes / rate."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from flipsync.board.throttle import ThrottledStore, TokenBucket, parse_bandwidth
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


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s


@pytest.mark.parametrize("n", [1, 49_999, 50_000, 1_000_000, 1_234_567])
def test_the_bucket_sleeps_a_burst_at_a_time(n: int) -> None:
    """A long read takes exactly (bytes - the first burst) / rate, in sleeps of a burst each: waiting for one
    byte at a time spun a core for the whole download (tens of thousands of wake-ups here)."""
    clock = FakeClock()
    bucket = TokenBucket(1_000_000, clock=lambda: clock.now, sleep=clock.sleep)  # bursts of 50 kB
    bucket.take(n)
    assert clock.now == pytest.approx(max(0, n - 50_000) / 1_000_000, abs=1e-9)
    assert len(clock.sleeps) <= -(-n // 50_000)
    t = clock.now
    bucket.take(50_000)  # a whole burst now waits for the bytes the first read took from it
    assert clock.now - t == pytest.approx(min(n, 50_000) / 1_000_000, abs=1e-9)


def test_reads_in_a_row_pay_the_rate_between_them() -> None:
    """The debt one read leaves is paid by the next: four reads of 250 kB take as long as one of 1 MB."""
    clock = FakeClock()
    bucket = TokenBucket(1_000_000, clock=lambda: clock.now, sleep=clock.sleep)
    for _ in range(4):
        bucket.take(250_000)
    assert clock.now == pytest.approx((1_000_000 - 50_000) / 1_000_000, abs=1e-9)
