"""Shared test settings: a bounded hypothesis profile so the suite fits CI's 2 cores, and shared fixtures."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

pytest_plugins = ["tests.sidecar.board_fixtures"]

# Local Ray clusters (the fleet's Ray tests) on loopback: Ray otherwise advertises this machine's interface
# address, and its nodes, actors and the replicas' public URLs then use it; tests talk to 127.0.0.1 only. Ray
# reads it once, when first imported, and every process a cluster starts inherits it.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

settings.register_profile(
    "ci",
    max_examples=40,
    deadline=None,
    # CI (CI=true) replays the same examples every run so that a landing never depends on luck;
    # developers' runs explore new ones (and HYPOTHESIS_PROFILE=thorough explores many more).
    derandomize=bool(os.environ.get("CI")),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("thorough", max_examples=500, deadline=None, suppress_health_check=list(HealthCheck))
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def no_cloud_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No cloud credentials or endpoints from this machine's environment reach the store under test."""
    for var in list(os.environ):
        if var.startswith(("AWS_", "GOOGLE_", "AZURE_")):
            monkeypatch.delenv(var)
    yield


# -- engines' environments that .ci/run installs in the background -----------------------------------------------
# FLIPSYNC_PENDING_VENVS is "VAR=MARKER,...": VAR (FLIPSYNC_VLLM_PYTHON, ...) already names the Python of a venv
# still being installed, and MARKER gets "ok" or why the install failed. The tests of a module that names VAR wait
# for its marker first; they are placed after the first third of the others, which run while the installs go on
# (the installs take about that long), so that the engines' long tests do not all come at the end.
VENV_WAIT_S = 1800.0


def _pending_venvs() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for entry in filter(None, os.environ.get("FLIPSYNC_PENDING_VENVS", "").split(",")):
        var, _, marker = entry.partition("=")
        out[var] = Path(marker)
    return out


def _venvs_named(item: pytest.Item, pending: dict[str, Path], cache: dict[str, set[str]]) -> set[str]:
    path = str(item.path)
    if path not in cache:
        try:
            text = item.path.read_text()
        except OSError:
            text = ""
        cache[path] = {var for var in pending if var in text}
    return cache[path]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    pending = _pending_venvs()
    if not pending:
        return
    cache: dict[str, set[str]] = {}
    waiting = [it for it in items if _venvs_named(it, pending, cache)]
    others = [it for it in items if not _venvs_named(it, pending, cache)]
    head = len(others) // 3
    items[:] = others[:head] + waiting + others[head:]  # the order within each part stays
    config.stash[_NAMED] = cache


_NAMED = pytest.StashKey[dict[str, set[str]]]()


def pytest_runtest_setup(item: pytest.Item) -> None:
    pending = _pending_venvs()
    if not pending:
        return
    cache = item.config.stash.get(_NAMED, {})
    for var in sorted(_venvs_named(item, pending, cache)):
        marker = pending[var]
        deadline = time.monotonic() + VENV_WAIT_S
        while not (marker.exists() and marker.read_text().strip()):  # written whole once the install ended
            if time.monotonic() > deadline:
                pytest.fail(f"{var}: the environment .ci/run installs was not ready after {VENV_WAIT_S:.0f} s")
            time.sleep(2.0)
        status = marker.read_text().strip()
        if status != "ok":
            pytest.skip(status)
