"""flipsync.codec.jit: processes compiling one kernel for different signatures at once share its disk cache
safely — a later process loads each signature's own machine code (numba's numbered files did not: numba#10128).
"""

from __future__ import annotations

import multiprocessing as mp
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

DTYPES = ["int8", "int16", "uint32", "float64"]

# These processes need the codec's jit module only: entering its package without running the package's
# __init__ (which imports the whole codec, torch among it) spares each of them 2 s of CPU.
KERNEL = """
import importlib.util, sys, types
if "flipsync.codec" not in sys.modules:
    package = types.ModuleType("flipsync.codec")
    package.__path__ = [importlib.util.find_spec("flipsync").submodule_search_locations[0] + "/codec"]
    sys.modules["flipsync.codec"] = package
import numba
from flipsync.codec.jit import kernel
if {stock}:
    kernel = numba.njit(nogil=True, cache=True)

@kernel
def weighted_sum(a):
    s = a[0] * 0
    for i in range(a.size):
        s += a[i] * (i + 1)
    return s
"""


def _compile_at_once(folder: str, dtype: str, order: int, barrier: mp.synchronize.Barrier) -> None:
    import time

    import numpy as np
    from numba.core import caching

    files, last = caching.IndexDataCacheFile, len(DTYPES)
    load_index, save_index, save_data = files._load_index, files._save_index, files._save_data
    # Hold the race open, in a fixed order: every process saves from the index it read before the others did,
    # the last to write the index is the first to write its data.
    files._load_index = lambda self: (load_index(self), time.sleep(1.0))[0]
    files._save_index = lambda self, index: (time.sleep(0.4 * order), save_index(self, index))[1]
    files._save_data = lambda self, name, data: (time.sleep(0.8 * (last - order)), save_data(self, name, data))[1]
    sys.path.insert(0, folder)
    import shared_kernel

    barrier.wait()
    shared_kernel.weighted_sum(np.arange(5, dtype=dtype))


def _race_then_load(tmp_path: Path, stock: bool) -> subprocess.CompletedProcess[str]:
    (tmp_path / "shared_kernel.py").write_text(KERNEL.format(stock=stock))
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(len(DTYPES))
    procs = [ctx.Process(target=_compile_at_once, args=(str(tmp_path), dt, i, barrier)) for i, dt in enumerate(DTYPES)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * len(DTYPES)
    check = textwrap.dedent(f"""
        import sys
        import numpy as np
        sys.path.insert(0, {str(tmp_path)!r})
        import shared_kernel
        for dt in {DTYPES!r}:
            got = shared_kernel.weighted_sum(np.arange(5, dtype=dt))
            assert got == 40, (dt, got)
        assert sum(shared_kernel.weighted_sum.stats.cache_hits.values()) >= 1  # the last index written is used
    """)
    return subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120)


def test_kernels_compiled_by_racing_processes_load_their_own_code(tmp_path: Path) -> None:
    done = _race_then_load(tmp_path, stock=False)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.slow
def test_the_race_breaks_numbas_own_cache(tmp_path: Path) -> None:
    # The same race on numba's cache=True: a signature loads another's code, so the check above can fail.
    done = _race_then_load(tmp_path, stock=True)
    assert done.returncode != 0


def test_each_numba_version_keeps_its_own_cache_files(tmp_path: Path) -> None:
    """vLLM's CPU build pins another numba than the library's, and both environments share the source tree's
    cache: numba drops an index another version wrote, so each environment recompiled after the other ran.
    Here a process under another numba version (faked) compiles between two under this one; the last still
    loads every kernel from the cache."""
    (tmp_path / "shared_kernel.py").write_text(KERNEL.format(stock=False))
    run = textwrap.dedent("""
        import sys
        import numba
        if sys.argv[1] != "-":
            numba.__version__ = sys.argv[1]
        import numpy as np
        sys.path.insert(0, sys.argv[2])
        import shared_kernel
        assert shared_kernel.weighted_sum(np.arange(5, dtype="int16")) == 40
        print(sum(shared_kernel.weighted_sum.stats.cache_hits.values()))
    """)

    def hits(version: str) -> int:
        done = subprocess.run(
            [sys.executable, "-c", run, version, str(tmp_path)], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return int(done.stdout.split()[-1])

    assert hits("-") == 0  # compiled and saved
    assert hits("0.0.1") == 0  # another numba: compiles its own
    assert hits("-") == 1  # this numba's files are still there
