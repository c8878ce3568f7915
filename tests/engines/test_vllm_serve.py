"""`flipsync.engines.vllm_serve`: vLLM's server imported with the collector off, in the server and in the processes
it spawns. The live server tests (test_vllm_real.py, the real clients, the demo's islands) start vLLM through it."""

from __future__ import annotations

import gc
import runpy
import sys
import types
from pathlib import Path

import pytest

from flipsync.engines.vllm_serve import import_frozen

MODULE = """
import gc, weakref

class Cycle:
    pass

enabled_while_importing = gc.isenabled()
garbage = Cycle()
garbage.me = garbage
garbage_ref = weakref.ref(garbage)
del garbage
"""


@pytest.fixture
def collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    gc.enable() if was else gc.disable()  # as it was, whatever the test left


def test_the_import_runs_without_collections_and_leaves_the_collector_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, collector_on: None
) -> None:
    (tmp_path / "heavy_for_vllm_serve.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    frozen = gc.get_freeze_count()
    ref = import_frozen("heavy_for_vllm_serve", "garbage_ref")
    module = sys.modules.pop("heavy_for_vllm_serve")
    assert module.enabled_while_importing is False
    assert gc.isenabled()
    assert ref() is None  # what the import left behind was collected, not frozen with the rest
    assert gc.get_freeze_count() > frozen  # what lives on is out of later collections


def test_a_failed_import_leaves_the_collector_as_it_was(collector_on: None) -> None:
    with pytest.raises(ModuleNotFoundError):
        import_frozen("no_such_module_for_vllm_serve", "main")
    assert gc.isenabled()
    gc.disable()
    with pytest.raises(ModuleNotFoundError):
        import_frozen("no_such_module_for_vllm_serve", "main")
    assert not gc.isenabled()


@pytest.mark.parametrize(("run_name", "serves"), [("__main__", True), ("__mp_main__", False)])
def test_the_server_serves_and_its_spawned_processes_only_import(
    run_name: str, serves: bool, monkeypatch: pytest.MonkeyPatch, collector_on: None
) -> None:
    calls: list[bool] = []
    entry = types.ModuleType("vllm.entrypoints.launchers.api_server.entry")
    entry.main = lambda: calls.append(gc.isenabled())  # type: ignore[attr-defined]
    for name in ("vllm", "vllm.entrypoints", "vllm.entrypoints.launchers", "vllm.entrypoints.launchers.api_server"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, entry.__name__, entry)
    monkeypatch.delitem(sys.modules, "flipsync.engines.vllm_serve")  # run afresh, as ``python -m`` and spawn do
    namespace = runpy.run_module("flipsync.engines.vllm_serve", run_name=run_name)
    assert namespace["main"] is entry.main
    assert calls == ([True] if serves else [])  # vLLM's main runs with the collector on, in the server only
