"""Shared test settings: a bounded hypothesis profile so the suite fits CI's 2 cores, and shared fixtures."""

from __future__ import annotations

import gc
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


def pytest_collection_finish(session: pytest.Session) -> None:
    """The heap that collection built (torch, transformers, every test module: most of what this process will ever
    hold) frozen out of later garbage collections: each full collection scanned it all again, 7.4 s of a 110 s
    run of the board, codec and trainer tests (3.4 s frozen)."""
    gc.collect()
    gc.freeze()


@pytest.fixture
def no_cloud_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No cloud credentials or endpoints from this machine's environment reach the store under test."""
    for var in list(os.environ):
        if var.startswith(("AWS_", "GOOGLE_", "AZURE_")):
            monkeypatch.delenv(var)
    yield


# -- engines' environments that .ci/run installs in the background -----------------------------------------------
# FLIPSYNC_PENDING_VENVS is "VAR=MARKER,...", in the order .ci/run installs them: VAR (FLIPSYNC_VLLM_PYTHON, ...)
# already names the Python of a venv still being installed, and MARKER gets "ok" or why the install failed. A test
# that needs VAR (it carries a skipif whose reason names VAR) waits for its marker first. The k-th environment's
# tests are placed k+1 parts of n+1 into the others, which run while the installs go on (with pip each install took
# about that long; with uv each is ready well before), so that no worker waits long and the engines' long tests do
# not all come at the end. (Placed at 40% and 55% instead, the vLLM tests ran on both workers at once and the two
# runs measured took 16 and 29 s longer: within this machine's noise, but no gain.)
VENV_WAIT_S = 1800.0


def _pending_venvs() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for entry in filter(None, os.environ.get("FLIPSYNC_PENDING_VENVS", "").split(",")):
        var, _, marker = entry.partition("=")
        out[var] = Path(marker)
    return out


def _venvs_named(item: pytest.Item, pending: dict[str, Path]) -> list[str]:
    """The pending environments ``item`` needs, from the reasons of its skip markers."""
    reasons = " ".join(str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif"))
    return [var for var in pending if var in reasons]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    pending = _pending_venvs()
    if not pending:
        return
    needs = {id(it): _venvs_named(it, pending) for it in items}
    others = [it for it in items if not needs[id(it)]]
    order: list[pytest.Item] = []
    at = 0
    for k, var in enumerate(pending):  # the order within each part stays
        cut = len(others) * (k + 1) // (len(pending) + 1)
        order += others[at:cut] + [it for it in items if needs[id(it)] and needs[id(it)][-1] == var]
        at = cut
    items[:] = order + others[at:]


def pytest_runtest_setup(item: pytest.Item) -> None:
    pending = _pending_venvs()
    if not pending:
        return
    for var in _venvs_named(item, pending):
        marker = pending[var]
        deadline = time.monotonic() + VENV_WAIT_S
        while not (marker.exists() and marker.read_text().strip()):  # written whole once the install ended
            if time.monotonic() > deadline:
                pytest.fail(f"{var}: the environment .ci/run installs was not ready after {VENV_WAIT_S:.0f} s")
            time.sleep(2.0)
        status = marker.read_text().strip()
        if status != "ok":
            pytest.skip(status)
