"""Islands fork from multiprocessing's fork server (``island_context``), which keeps the environment and working
directory of its own start: each island runs in those its parent had when it started the island
(``in_parent_context``), as a spawned island did."""

from __future__ import annotations

import os
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

from flipsync_apps.demo.island import in_parent_context, island_context

VAR = "FLIPSYNC_TEST_ISLAND_SETTING"


def report(conn: Connection) -> None:
    conn.send((os.environ.get(VAR), os.getcwd()))
    conn.close()


def test_each_island_runs_in_its_parents_environment_and_folder_of_the_moment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ctx = island_context()
    for value in ("first", "second"):  # the second island starts after the fork server, which kept "first"
        folder = tmp_path / value
        folder.mkdir()
        monkeypatch.setenv(VAR, value)
        monkeypatch.chdir(folder)
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=in_parent_context, args=(dict(os.environ), os.getcwd(), report, theirs))
        proc.start()
        assert ours.poll(120), "the island did not report"
        assert ours.recv() == (value, str(folder))
        proc.join(30)
        assert proc.exitcode == 0
