"""The processes that hold no tensors start without torch, numba or safetensors: the gateway, the module a Ray
replica actor unpickles, the relay and the board's membership records. With torch and the codec a gateway started
in 1.45 s of CPU and held 323 MB; without, 0.4 s and 69 MB. A heavy import added anywhere on their path fails here.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

import flipsync.board as board

HEAVY = ("torch", "numba", "safetensors", "transformers")


LIGHT = ["flipsync.fleet.gateway", "flipsync.fleet.ray_pool", "flipsync.relay.server", "flipsync.board.membership"]


@pytest.mark.parametrize("module", LIGHT)
def test_a_process_without_tensors_imports_no_tensor_library(module: str) -> None:
    code = f"import sys, {module}; print(' '.join(m for m in {HEAVY!r} if m in sys.modules) or '-')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["-"], f"importing {module} imported {done.stdout.strip()}"


def test_the_board_s_names_are_there_when_asked_for() -> None:
    from flipsync.board import BoardReader, BoardWriter, Verifier, open_store
    from flipsync.board.reader import BoardReader as reader_class
    from flipsync.board.signing import Verifier as verifier_class
    from flipsync.board.writer import BoardWriter as writer_class
    from flipsync.stores import open_store as opener

    assert (BoardReader, BoardWriter, Verifier, open_store) == (reader_class, writer_class, verifier_class, opener)
    assert all(getattr(board, name) is not None for name in board.__all__)
    assert set(board.__all__) <= set(dir(board))
    assert set(board.__all__) == set(vars(board)["_HOMES"])  # every public name has a home
    with pytest.raises(AttributeError, match=r"flipsync\.board.*no_such_name"):
        board.no_such_name  # noqa: B018
