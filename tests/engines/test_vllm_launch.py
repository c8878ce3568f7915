"""Where vLLM CPU servers sharing a host bind their workers (`spread_binding`), and the ranks of one (`cpu_env`)."""

from __future__ import annotations

import pytest

from flipsync.engines.vllm import launch
from flipsync.errors import ConfigError


def binds(monkeypatch: pytest.MonkeyPatch, cpus: list[int], *args: int, **kw: int) -> list[list[int]]:
    monkeypatch.setattr(launch.os, "sched_getaffinity", lambda _pid: set(cpus))
    value = launch.spread_binding(*args, **kw)["VLLM_CPU_OMP_THREADS_BIND"]
    return [[int(c) for c in rank.split(",")] for rank in value.split("|")]


def test_servers_get_cpus_of_their_own_while_there_are_enough(monkeypatch: pytest.MonkeyPatch) -> None:
    got = [binds(monkeypatch, list(range(8)), s, servers=4) for s in range(4)]
    assert got == [[[0, 1]], [[2, 3]], [[4, 5]], [[6, 7]]]
    # two ranks each: one CPU a rank, no CPU shared between servers
    got = [binds(monkeypatch, [4, 5, 6, 7], s, servers=2, tensor_parallel_size=2) for s in range(2)]
    assert got == [[[4], [5]], [[6], [7]]]


def test_more_servers_than_cpus_take_them_in_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    # the demo on two CPUs: islands, control and joiner spread over both instead of all on CPU 0
    got = [binds(monkeypatch, [0, 1], s, servers=4) for s in range(4)]
    assert got == [[[0]], [[1]], [[0]], [[1]]]
    # ranks of one server never share a CPU: where there are too few, the caller is told
    assert binds(monkeypatch, [0, 1], 1, servers=3, tensor_parallel_size=2) == [[0], [1]]
    with pytest.raises(ConfigError, match="fewer ranks"):
        binds(monkeypatch, [0, 1], 0, servers=1, tensor_parallel_size=3)


def test_cpu_env_splits_one_servers_cpus_between_its_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(launch.os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3})
    assert launch.cpu_env(2) == {"VLLM_CPU_OMP_THREADS_BIND": "0,1|2,3"}
    assert launch.cpu_env(1) == {}
    with pytest.raises(ConfigError, match="fewer ranks"):
        launch.cpu_env(5)
