"""``HttpStore``: the board's Store port over a relay's HTTP API (read-only), picked by
``flipsync.stores.open_store`` for a relay URL. See docs/sidecar.md ("The island relay").
"""

from __future__ import annotations

import builtins
import contextlib
import email.utils
import logging
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any, TypeVar
from urllib.parse import quote, urlparse

import httpx

from flipsync.errors import ConfigError, NotFoundError, PermanentStoreError, StoreError, TransientStoreError
from flipsync.stores.base import ObjectInfo, Store

log = logging.getLogger(__name__)
T = TypeVar("T")

OBJECT_PREFIX = "/board/o/"
WAIT_PREFIX = "/board/wait/"
# Set by the relay on a failure of its board: "permanent" or "transient" (already retried by the relay).
STORE_ERROR_HEADER = "X-Flipsync-Store-Error"
STORE_ERROR_DETAIL_HEADER = "X-Flipsync-Store-Error-Detail"  # the board's message (a HEAD answer has no body)
_RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
# Cloud endpoints that open_store serves itself over https; any other http(s) URL is a relay.
_CLOUD_HOSTS = ("amazonaws.com", "r2.cloudflarestorage.com", ".blob.core.windows.net", ".dfs.core.windows.net")


def _parse_time(text: str | None) -> datetime:
    for parse in (email.utils.parsedate_to_datetime, datetime.fromisoformat):
        with contextlib.suppress(TypeError, ValueError):
            return parse(text or "")
    return datetime.fromtimestamp(0, UTC)


class HttpStore(Store):
    """A read-only Store that reads a board through a ``flipsync relay``."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 60.0,
        connect_timeout_s: float = 5.0,
        max_retries: int = 4,
        retry_timeout_s: float = 30.0,
        init_backoff_s: float = 0.1,
        max_backoff_s: float = 2.0,
    ) -> None:
        parsed = urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ConfigError(f"a relay URL is http(s)://HOST:PORT, got {url!r}")
        self.url = url.rstrip("/")
        self.max_retries = max_retries
        self.retry_timeout_s = retry_timeout_s
        self.init_backoff_s = init_backoff_s
        self.max_backoff_s = max_backoff_s
        self._can_wait = True
        self._connect_s = connect_timeout_s
        self._client = httpx.Client(
            base_url=self.url,
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
            limits=httpx.Limits(max_connections=32, max_keepalive_connections=16),
        )

    def __repr__(self) -> str:
        return f"HttpStore({self.url!r})"

    # -- transport ------------------------------------------------------------------------------------

    def _request(
        self,
        method: str,
        target: str,
        what: str,
        *,
        params: dict[str, str] | None = None,
        headers: dict[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> httpx.Response:
        """One request, retried on transient failures of the relay itself within ``max_retries`` and
        ``retry_timeout_s`` (a failure of the relay's board was retried by the relay: raised at once)."""
        timeout = httpx.USE_CLIENT_DEFAULT if timeout_s is None else httpx.Timeout(timeout_s, connect=self._connect_s)
        start = time.monotonic()
        delay = self.init_backoff_s
        attempt = 0
        while True:
            problem: str
            try:
                r = self._client.request(method, target, params=params, headers=headers, timeout=timeout)
            except httpx.HTTPError as e:
                problem = f"{type(e).__name__}: {e}"
            else:
                if r.status_code == 404:
                    raise NotFoundError(f"{self.url}/{what} does not exist")
                if r.status_code < 400:
                    return r
                upstream = r.headers.get(STORE_ERROR_HEADER)
                if upstream == "permanent":
                    raise PermanentStoreError(
                        f"{method} {self.url}/{what}: the relay's board refused it: {_message(r)}"
                    )
                if upstream is not None:
                    raise TransientStoreError(
                        f"{method} {self.url}/{what}: the relay's board failed (the relay retried it): {_message(r)}"
                    )
                problem = f"HTTP {r.status_code}: {_message(r)}"
                if r.status_code not in _RETRY_STATUS:
                    raise PermanentStoreError(
                        f"{method} {self.url}/{what} was refused ({problem}); check the relay URL "
                        "(http(s)://HOST:PORT of a flipsync relay)"
                    )
            attempt += 1
            elapsed = time.monotonic() - start
            if attempt > self.max_retries or elapsed + delay > self.retry_timeout_s:
                raise TransientStoreError(
                    f"{method} {self.url}/{what} failed after {attempt} {'try' if attempt == 1 else 'tries'} over "
                    f"{elapsed:.1f} s (at most {self.max_retries} retries within {self.retry_timeout_s:g} s): "
                    f"{problem}; check that the relay is running and reachable"
                )
            log.debug("%s %s failed (%s); retrying in %.2f s", method, what, problem, delay)
            time.sleep(delay)
            delay = min(delay * 2, self.max_backoff_s)

    @staticmethod
    def _object(path: str) -> str:
        if not path or path.startswith("/"):
            raise PermanentStoreError(f"bad object path {path!r}")
        return OBJECT_PREFIX + quote(path, safe="/")

    # -- Store port -----------------------------------------------------------------------------------

    def get(self, path: str, *, size: int | None = None) -> bytes:
        return self._request("GET", self._object(path), path).content

    def get_range(self, path: str, start: int, end: int) -> bytes:
        if end <= start:
            return b""
        r = self._request("GET", self._object(path), path, headers={"Range": f"bytes={start}-{end - 1}"})
        return r.content[start:end] if r.status_code == 200 else r.content  # 200: the server ignored the range

    def head(self, path: str) -> ObjectInfo:
        r = self._request("HEAD", self._object(path), path)
        size = r.headers.get("content-length")
        if size is None or not (size.isascii() and size.isdigit()):
            raise PermanentStoreError(f"HEAD {self.url}/{path} gave no Content-Length: is {self.url} a flipsync relay?")
        return ObjectInfo(path, int(size), _parse_time(r.headers.get("last-modified")), r.headers.get("etag"))

    def wait_exists(self, path: str, timeout_s: float) -> bool | None:
        """Wait (a long poll at the relay) until ``path`` exists: True, or False after ``timeout_s``; None
        when the relay predates waiting (its answer is a 404 of the route), so the caller polls instead."""
        if not self._can_wait:
            return None
        target = WAIT_PREFIX + quote(path, safe="/")
        try:
            r = self._request(
                "GET",
                target,
                f"{path} (wait)",
                params={"timeout": f"{max(0.0, timeout_s):.3f}"},
                timeout_s=timeout_s + 10,
            )
        except NotFoundError:
            self._can_wait = False
            log.info("the relay at %s cannot wait for objects (an older version): polling instead", self.url)
            return None
        return self._parse(r, f"a wait for {path!r}", lambda doc: bool(doc["exists"]))

    def list(self, prefix: str) -> list[ObjectInfo]:
        r = self._request("GET", "/board/list", f"{prefix} (list)", params={"prefix": prefix.rstrip("/")})
        return self._parse(
            r,
            f"a listing of {prefix!r}",
            lambda doc: [
                ObjectInfo(o["path"], int(o["size"]), _parse_time(o.get("modified")), o.get("etag"))
                for o in doc["objects"]
            ],
        )

    def list_dirs(self, prefix: str) -> builtins.list[str]:
        r = self._request("GET", "/board/dirs", f"{prefix} (dirs)", params={"prefix": prefix.rstrip("/")})
        return self._parse(r, f"a listing of {prefix!r}", lambda doc: _names(doc["dirs"]))

    def _parse(self, r: httpx.Response, what: str, parse: Callable[[Any], T]) -> T:
        try:
            return parse(r.json())
        except (ValueError, KeyError, TypeError) as e:
            raise PermanentStoreError(f"the relay at {self.url} answered {what} with garbage: {e}") from None

    def _read_only(self, op: str) -> StoreError:
        return PermanentStoreError(f"{op} on {self.url}: a relay is read-only; publish to the board itself")

    def put(self, path: str, data: bytes | bytearray | memoryview, *, create_only: bool = False) -> None:
        raise self._read_only(f"put {path}")

    def delete(self, paths: Sequence[str]) -> None:
        raise self._read_only("delete")

    def make_durable(self, paths: Sequence[str]) -> None:
        raise self._read_only("make_durable")

    def close(self) -> None:
        self._client.close()


def _names(dirs: Any) -> builtins.list[str]:
    if not all(isinstance(d, str) for d in dirs):
        raise TypeError("names must be strings")
    return sorted(dirs)


def _message(r: httpx.Response) -> str:
    if not r.content:
        return r.headers.get(STORE_ERROR_DETAIL_HEADER, "")
    with contextlib.suppress(ValueError):
        doc = r.json()
        if isinstance(doc, dict) and isinstance(doc.get("detail"), str):
            return doc["detail"]
        if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
            return str(doc["error"].get("message", ""))
    return r.text[:200]


def is_relay_url(url: str) -> bool:
    """True for an http(s) URL that is not one of the cloud endpoints ``open_store`` handles itself."""
    parsed = urlparse(url)
    host = parsed.netloc.lower()
    return parsed.scheme in ("http", "https") and not any(h in host for h in _CLOUD_HOSTS)
