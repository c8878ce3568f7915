"""``python -m flipsync.engines.vllm_serve ARGS...``: vLLM's OpenAI-compatible server (the arguments of ``python -m
vllm.entrypoints.openai.api_server``), with vLLM imported while Python's cyclic garbage collector is off.

Why: an import of vLLM makes some 700,000 objects that live as long as the process, and the collector scans them all
again each time they grow by a quarter (about 1.9 of the import's 7.5 s of CPU). The CPU build imports vLLM in three
processes of a server: its API server, and its engine core and worker, which start by *spawn* and so import this
module again as their ``__mp_main__``. What the import left behind is collected once, the rest frozen (out of every
later collection), and the collector runs as before from there. Measured on a 2-core machine, a tiny model, until
``/health`` answers: 23.1-24.3 s of CPU and 22 s of wall time with vLLM's module, 18.1-19.9 s and 17-19 s with this one.

A module beside the ``vllm`` package, not in it: that package imports the codec (numba), and vLLM's worker, as it
starts, scans every imported module's namespace for Triton kernels and fails on one of numba's objects.
"""

from __future__ import annotations

import gc
import importlib
from collections.abc import Callable
from typing import Any


def import_frozen(module: str, name: str) -> Any:
    """``module.name``, imported with the collector off; what the import left is collected, what lives on frozen.
    The collector is on afterwards if it was before, the import failed or not."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return getattr(importlib.import_module(module), name)
    finally:
        gc.collect()
        gc.freeze()
        if enabled:
            gc.enable()


if __name__ in ("__main__", "__mp_main__"):  # the server, or one of the processes it spawns
    main: Callable[[], None] = import_frozen("vllm.entrypoints.launchers.api_server.entry", "main")
    if __name__ == "__main__":
        main()
