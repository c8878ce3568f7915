"""How the sidecar sends one JSON request to every vLLM worker (``collective_rpc``): over an offline ``vllm.LLM``
in this process, a ``vllm serve`` over HTTP, or worker cores in this process (tests).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import httpx

from flipsync.engines.vllm.wire import EXTENSION_CLS, RPC_METHOD
from flipsync.errors import ConfigError, EngineError, EngineUnavailableError

if TYPE_CHECKING:
    from flipsync.engines.vllm.worker import WorkerCore


class RpcTransport(Protocol):
    """Sends one JSON request to every worker; answers in rank order."""

    def call(self, request: Mapping[str, Any], timeout_s: float) -> list[dict[str, Any]]: ...

    def health(self) -> bool: ...

    def close(self) -> None: ...


def parse_answer(raw: Any) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    try:
        answer = json.loads(raw)
    except (TypeError, ValueError) as e:
        raise EngineError(f"a vLLM worker answered something that is not JSON ({e}): {str(raw)[:200]!r}") from None
    if not isinstance(answer, dict) or "ok" not in answer:
        raise EngineError(f"a vLLM worker answered an unexpected object: {str(raw)[:200]!r}")
    return answer


class _InProcess:
    """A transport whose workers live as long as this process: always healthy, nothing to close."""

    def health(self) -> bool:
        return True

    def close(self) -> None:
        pass


class LLMTransport(_InProcess):
    """An offline ``vllm.LLM`` in this process, built with ``worker_extension_cls=EXTENSION_CLS``."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def call(self, request: Mapping[str, Any], timeout_s: float) -> list[dict[str, Any]]:
        try:
            raw = self.llm.collective_rpc(RPC_METHOD, timeout=timeout_s, args=(json.dumps(request),))
        except TimeoutError:
            raise EngineUnavailableError(
                f"vLLM workers did not answer {request.get('op')!r} in {timeout_s:.0f}s"
            ) from None
        except Exception as e:
            if isinstance(e, AttributeError) or RPC_METHOD in str(e):
                raise ConfigError(
                    f"the vLLM workers lack the flipsync extension ({e}); build the LLM with "
                    f"worker_extension_cls={EXTENSION_CLS!r}"
                ) from None
            raise EngineUnavailableError(f"collective_rpc failed: {type(e).__name__}: {e}") from None
        return [parse_answer(r) for r in raw]


class HttpTransport:
    """A ``vllm serve`` started with ``VLLM_SERVER_DEV_MODE=1`` and the flipsync worker extension."""

    def __init__(self, base_url: str, *, connect_timeout_s: float = 5.0, client: httpx.Client | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self._own = client is None
        self._client = client or httpx.Client(timeout=httpx.Timeout(30.0, connect=connect_timeout_s))

    def call(self, request: Mapping[str, Any], timeout_s: float) -> list[dict[str, Any]]:
        body = {"method": RPC_METHOD, "args": [json.dumps(request)], "timeout": timeout_s}
        try:
            resp = self._client.post(f"{self.base_url}/collective_rpc", json=body, timeout=timeout_s + 10.0)
        except httpx.TimeoutException:
            raise EngineUnavailableError(
                f"vLLM at {self.base_url} did not answer {request.get('op')!r} within {timeout_s + 10:.0f}s"
            ) from None
        except httpx.HTTPError as e:
            raise EngineUnavailableError(f"vLLM at {self.base_url} is unreachable: {e}") from None
        if resp.status_code == 404:
            raise ConfigError(
                f"{self.base_url} has no /collective_rpc route; start vLLM with VLLM_SERVER_DEV_MODE=1 and "
                f"--worker-extension-cls {EXTENSION_CLS}"
            )
        if resp.status_code != 200:
            raise EngineError(f"vLLM /collective_rpc answered HTTP {resp.status_code}: {resp.text[:300]}")
        try:
            results = resp.json()["results"]
        except (ValueError, KeyError, TypeError):
            raise EngineError(f"vLLM /collective_rpc answered an unexpected body: {resp.text[:300]}") from None
        if not isinstance(results, list):
            raise EngineError("vLLM /collective_rpc answered no result list")
        return [parse_answer(r) for r in results]

    def health(self) -> bool:
        try:
            return self._client.get(f"{self.base_url}/health", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    def close(self) -> None:
        if self._own:
            self._client.close()


class LocalTransport(_InProcess):
    """Worker cores in this process; requests go through JSON exactly as they would over the wire."""

    def __init__(self, cores: Sequence[WorkerCore]) -> None:
        self.cores = list(cores)

    def call(self, request: Mapping[str, Any], timeout_s: float) -> list[dict[str, Any]]:
        wire = json.dumps(request)
        return [parse_answer(json.dumps(core.handle(json.loads(wire)))) for core in self.cores]
