"""The Store port: the few object-store operations the board needs, and how to reach a store (`StoreOptions`)."""

from __future__ import annotations

import builtins
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from flipsync.errors import ConfigError, NotFoundError

if TYPE_CHECKING:
    from obstore.store import ClientConfig, RetryConfig

MiB = 1 << 20


@dataclass(frozen=True)
class StoreOptions:
    """How to reach a store and how hard to try. ``config`` goes to the backend (``endpoint``, ``region``, ...).
    ``request_timeout_s`` bounds one request (one multipart chunk or one range). See docs/board.md ("Failures")."""

    config: Mapping[str, str] = field(default_factory=dict)
    allow_http: bool | None = None  # None: allow when the endpoint is http://
    connect_timeout_s: float = 5.0
    request_timeout_s: float = 60.0
    max_retries: int = 10
    retry_timeout_s: float = 60.0
    init_backoff_s: float = 0.1
    max_backoff_s: float = 5.0
    multipart_chunk_bytes: int = 16 * MiB
    multipart_concurrency: int = 8
    range_chunk_bytes: int = 16 * MiB
    max_parallel_reads: int = 8
    # Cloud VMs usually get credentials from the instance metadata service; tests and air-gapped hosts
    # set this False so a missing credential is an error instead of a request to a link-local address.
    allow_metadata_credentials: bool = True

    def __post_init__(self) -> None:
        if self.multipart_chunk_bytes < 5 * MiB:
            raise ConfigError("multipart_chunk_bytes must be at least 5 MiB (the S3 minimum part size)")
        if self.range_chunk_bytes <= 0:
            raise ConfigError("range_chunk_bytes must be positive")
        if self.max_parallel_reads < 1 or self.multipart_concurrency < 1:
            raise ConfigError("max_parallel_reads and multipart_concurrency must be at least 1")
        if self.max_retries < 0 or self.retry_timeout_s <= 0 or self.request_timeout_s <= 0:
            raise ConfigError("max_retries must be >= 0 and the timeouts positive")

    def client_options(self, endpoint: str | None) -> ClientConfig:
        opts: dict[str, Any] = {
            "connect_timeout": timedelta(seconds=self.connect_timeout_s),
            "timeout": timedelta(seconds=self.request_timeout_s),
        }
        if self.allow_http or (self.allow_http is None and endpoint and endpoint.startswith("http://")):
            opts["allow_http"] = True
        return opts  # type: ignore[return-value]

    def retry_config(self) -> RetryConfig:
        return {
            "max_retries": self.max_retries,
            "retry_timeout": timedelta(seconds=self.retry_timeout_s),
            "backoff": {
                "init_backoff": timedelta(seconds=self.init_backoff_s),
                "max_backoff": timedelta(seconds=self.max_backoff_s),
                # obstore draws each wait at random between init_backoff and base x the last one
                # (decorrelated jitter): with base 4 the waits about double, as flipsync's own retries do.
                "base": 4,
            },
        }


@dataclass(frozen=True)
class ObjectInfo:
    path: str
    size: int
    modified: datetime
    etag: str | None = None


@runtime_checkable
class Store(Protocol):
    """What the board needs from an object store. Paths are relative, '/'-separated."""

    url: str

    def put(self, path: str, data: bytes | bytearray | memoryview, *, create_only: bool = False) -> None:
        """Write an object atomically. ``create_only`` fails with ConflictError if it exists."""
        ...

    def get(self, path: str, *, size: int | None = None) -> bytes:
        """Read a whole object (in parallel ranges when ``size`` is known and large)."""
        ...

    def get_range(self, path: str, start: int, end: int) -> bytes: ...

    def head(self, path: str) -> ObjectInfo:
        """Metadata of one object; NotFoundError if it does not exist."""
        ...

    def exists(self, path: str) -> bool:
        """Whether ``path`` is an object (by default: whether ``head`` finds it)."""
        try:
            self.head(path)
        except NotFoundError:
            return False
        return True

    def list(self, prefix: str) -> list[ObjectInfo]:
        """Every object under ``prefix`` (a folder), recursively."""
        ...

    def list_dirs(self, prefix: str) -> builtins.list[str]:
        """The names of the immediate sub-folders of ``prefix``."""
        ...

    def delete(self, paths: Sequence[str]) -> None:
        """Delete objects; missing ones are ignored."""
        ...

    def make_durable(self, paths: Sequence[str]) -> None:
        """Make written objects survive a crash of this host (a no-op where puts are already durable)."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class WaitingStore(Protocol):
    """A Store that can wait for an object to appear (a relay): readers then learn of a new version as soon
    as it lands, instead of polling for it."""

    def wait_exists(self, path: str, timeout_s: float) -> bool | None:
        """True once ``path`` exists, False when ``timeout_s`` passed first; None when this store cannot wait
        after all (an older relay), so that the caller falls back to polling."""
        ...


class StoreWrapper:
    """A Store that passes every call to ``inner``: subclass it to change a few calls (limits, faults)."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.url = inner.url

    def put(self, path: str, data: bytes | bytearray | memoryview, *, create_only: bool = False) -> None:
        self.inner.put(path, data, create_only=create_only)

    def get(self, path: str, *, size: int | None = None) -> bytes:
        return self.inner.get(path, size=size)

    def get_range(self, path: str, start: int, end: int) -> bytes:
        return self.inner.get_range(path, start, end)

    def head(self, path: str) -> ObjectInfo:
        return self.inner.head(path)

    def exists(self, path: str) -> bool:
        return self.inner.exists(path)

    def list(self, prefix: str) -> list[ObjectInfo]:
        return self.inner.list(prefix)

    def list_dirs(self, prefix: str) -> builtins.list[str]:
        return self.inner.list_dirs(prefix)

    def delete(self, paths: Sequence[str]) -> None:
        self.inner.delete(paths)

    def make_durable(self, paths: Sequence[str]) -> None:
        self.inner.make_durable(paths)

    def close(self) -> None:
        self.inner.close()
