"""The obstore implementation of the Store port (`flipsync.stores.base`): one client for file, memory, S3, GCS
and Azure, with bounded retries and typed failures. See docs/board.md ("Stores").
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import unquote, urlparse

import obstore
import obstore.exceptions as obx
from obstore.store import LocalStore, MemoryStore

from flipsync.errors import (
    ConfigError,
    ConflictError,
    NotFoundError,
    PermanentStoreError,
    StoreError,
    TransientStoreError,
)
from flipsync.stores import errors as kinds
from flipsync.stores.base import ObjectInfo, Store, StoreOptions
from flipsync.stores.errors import StoreFailure, asks_metadata_service, describe_failure

if TYPE_CHECKING:
    from obstore.store import ObjectStore

log = logging.getLogger(__name__)

T = TypeVar("T")
_WRITES = frozenset({"put", "create", "delete", "fsync"})

# Configuration keys (or environment variables) that give a backend explicit credentials; without any of
# them obstore would ask a cloud metadata service, which StoreOptions can forbid.
_EXPLICIT_CREDENTIALS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "s3": (
        ("access_key_id", "aws_access_key_id", "skip_signature", "aws_skip_signature", "web_identity_token_file"),
        ("AWS_ACCESS_KEY_ID", "AWS_SKIP_SIGNATURE", "AWS_WEB_IDENTITY_TOKEN_FILE"),
    ),
    "gs": (
        ("service_account", "service_account_key", "application_credentials", "bearer_token", "skip_signature"),
        (
            "GOOGLE_SERVICE_ACCOUNT",
            "GOOGLE_SERVICE_ACCOUNT_PATH",
            "GOOGLE_SERVICE_ACCOUNT_KEY",
            "GOOGLE_APPLICATION_CREDENTIALS",
        ),
    ),
    "az": (
        (
            "account_key",
            "access_key",
            "sas_key",
            "sas_token",
            "token",
            "bearer_token",
            "client_secret",
            "federated_token_file",
            "use_emulator",
            "skip_signature",
            "use_azure_cli",
        ),
        (
            "AZURE_STORAGE_ACCOUNT_KEY",
            "AZURE_STORAGE_ACCESS_KEY",
            "AZURE_STORAGE_SAS_KEY",
            "AZURE_STORAGE_TOKEN",
            "AZURE_CLIENT_SECRET",
            "AZURE_FEDERATED_TOKEN_FILE",
            "AZURE_STORAGE_USE_EMULATOR",
        ),
    ),
}
_CREDENTIAL_HINTS = {
    "s3": "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or --store-option access_key_id=... "
    "secret_access_key=...), or AWS_SKIP_SIGNATURE=true for a public bucket; for an S3-compatible store (MinIO, "
    "R2) also set AWS_ENDPOINT_URL or --store-option endpoint=URL",
    "gs": "set GOOGLE_APPLICATION_CREDENTIALS (or GOOGLE_SERVICE_ACCOUNT_KEY, or --store-option service_account=PATH)",
    "az": "set AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY or AZURE_STORAGE_SAS_KEY (or --store-option "
    "account_key=...), or AZURE_STORAGE_USE_EMULATOR=true for Azurite",
}
_SCHEMES = {
    "gs": "gs",
    **dict.fromkeys(("s3", "s3a"), "s3"),
    **dict.fromkeys(("az", "azure", "abfs", "abfss", "adl"), "az"),
}


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _info(meta: Mapping[str, Any]) -> ObjectInfo:
    return ObjectInfo(meta["path"], meta["size"], meta["last_modified"], meta.get("e_tag"))


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:400] if text else type(e).__name__


class ObstoreStore(Store):
    """The Store port over an obstore ``ObjectStore``."""

    def __init__(
        self,
        inner: ObjectStore,
        url: str,
        options: StoreOptions | None = None,
        *,
        cloud: tuple[str, bool, str | None] | None = None,
    ) -> None:
        self.inner = inner
        self._cloud = cloud  # (kind, explicit credentials given, endpoint): for messages that say what is missing
        self.url = url.rstrip("/") or url
        self.options = options or StoreOptions()
        self._pool: ThreadPoolExecutor | None = None
        # a local store's root, for fsync (without a prefix, paths start at the filesystem root)
        self._local_root = Path(inner.prefix or "/") if isinstance(inner, LocalStore) else None

    def __repr__(self) -> str:
        return f"ObstoreStore({self.url!r})"

    def _where(self, path: str) -> str:
        return f"{self.url}/{path}"

    def _call(self, op: str, path: str, fn: Callable[[], T]) -> T:
        """Run one obstore call: a permanent failure raises PermanentStoreError at once; a transient one obstore did
        not retry itself is retried here within the same bounds, then raises TransientStoreError (docs/board.md)."""
        o = self.options
        start = time.monotonic()
        tries = 0
        delay = o.init_backoff_s
        while True:
            try:
                return fn()
            except (obx.AlreadyExistsError, obx.PreconditionError, FileExistsError):
                raise ConflictError(f"{self._where(path)} already exists; it was not overwritten") from None
            except obx.UnknownConfigurationKeyError as e:
                raise ConfigError(f"bad store configuration for {self.url}: {_first_line(e)}") from e
            except (obx.BaseError, OSError, TimeoutError, NotImplementedError) as e:
                failure = describe_failure(e, creates=op in ("put", "create"), local=self._local_root is not None)
                if failure.kind == kinds.MISSING and op not in ("put", "create"):
                    raise NotFoundError(f"{self._where(path)} does not exist") from None
                error: BaseException = e
            tries += 1 + failure.retried
            elapsed = time.monotonic() - start
            if failure.permanent or self._missing_credentials(error):
                raise PermanentStoreError(self._refused(op, path, failure, error)) from error
            if failure.retried or tries > o.max_retries or elapsed + delay > o.retry_timeout_s:
                raise TransientStoreError(self._gave_up(op, path, failure, tries, elapsed)) from error
            log.warning(
                "%s %s failed (%s); retrying in %.2f s (try %d of at most %d)",
                op,
                self._where(path),
                failure.cause,
                delay,
                tries + 1,
                o.max_retries + 1,
            )
            time.sleep(delay)
            delay = min(2 * delay, o.max_backoff_s)

    def _missing_credentials(self, e: BaseException) -> bool:
        """obstore found no credentials and asked a cloud metadata service, which did not answer."""
        return self._cloud is not None and not self._cloud[1] and asks_metadata_service(e)

    def _refused(self, op: str, path: str, f: StoreFailure, e: BaseException) -> str:
        """What to tell a user whose request the store refused for good: the cause and what to do."""
        where = self._where(path)
        if self._missing_credentials(e):
            # obstore's own text names the metadata endpoint it fell back to, which helps nobody
            assert self._cloud is not None
            kind = self._cloud[0]
            return (
                f"{op} {where}: no credentials for the {kind} store (none in the store options or the environment, "
                f"and no cloud metadata service answered); {_CREDENTIAL_HINTS[kind]}"
            )
        write = op in _WRITES
        local = self._local_root is not None
        kind = self._cloud[0] if self._cloud is not None else None
        container = "container" if kind == "az" else "bucket"
        advice = {
            kinds.PERMISSION: (
                f"{self._local_root} is not {'writable' if write else 'readable'} by this process (its permissions, "
                "an immutable file or folder, or a read-only mount): fix that, or use another board"
                if local
                else f"these credentials may not {'write' if write else 'read'} it (a bucket or IAM policy denies "
                f"it): grant them {'write' if write else 'read'} access to the board's {container} and prefix, or "
                "use other credentials"
            ),
            kinds.CREDENTIALS: "the store rejected the credentials: check them"
            + (f" ({_CREDENTIAL_HINTS[kind]})" if kind else ""),
            kinds.NO_BUCKET: f"the {container} of {self.url} does not exist: create it, or fix the board URL",
            kinds.BAD_REQUEST: "the store refused the request as malformed: check the board URL, its region and the "
            "endpoint in the store options",
            kinds.NO_SPACE: (
                f"the filesystem holding {self._local_root} is full or over its quota: free space (e.g. "
                "`flipsync board gc`), or use another board"
                if local
                else "the store's quota is used up: raise it or free space (e.g. `flipsync board gc`)"
            ),
            kinds.UNSUPPORTED: "this store cannot do that operation",
            kinds.BAD_PATH: "the object path cannot be used on this store: check the board URL and the run name",
            kinds.MISSING: "a folder of the board vanished while it was written: check that nothing removes "
            f"{self.url}",
        }.get(f.kind, "waiting will not help: fix the cause")
        return f"{op} {where} was refused: {f.cause}; {advice}"

    def _gave_up(self, op: str, path: str, f: StoreFailure, tries: int, elapsed: float) -> str:
        o = self.options
        if f.kind in (kinds.THROTTLED, kinds.SERVER):
            what = "the store is throttling requests" if f.kind == kinds.THROTTLED else "the store is failing"
            advice = f"{what}; try again later, or allow more retries (StoreOptions max_retries, retry_timeout_s)"
        elif f.kind == kinds.LOCAL_IO:
            advice = f"the filesystem holding {self._local_root} keeps failing: check it"
        elif self._cloud is not None:
            _, _, endpoint = self._cloud
            where = f"endpoint {endpoint}" if endpoint else f"the default {self._cloud[0]} endpoint"
            advice = f"check that the store is reachable ({where})"
        else:
            advice = "check that the store is reachable"
        return (
            f"{op} {self._where(path)} failed after {tries} {'try' if tries == 1 else 'tries'} over {elapsed:.1f} s "
            f"(retried with backoff, at most {o.max_retries} retries within {o.retry_timeout_s:g} s): {f.cause}; "
            f"{advice}"
        )

    # -- writes ---------------------------------------------------------------------------------------

    def put(self, path: str, data: bytes | bytearray | memoryview, *, create_only: bool = False) -> None:
        if create_only:
            # Conditional puts are single requests (If-None-Match: *); the store decides atomically. A retried
            # create whose earlier try had landed after all reports ConflictError: read the object to tell.
            self._call("create", path, lambda: obstore.put(self.inner, path, data, mode="create"))
            return
        o = self.options
        self._call(
            "put",
            path,
            lambda: obstore.put(
                self.inner,
                path,
                data,
                mode="overwrite",
                chunk_size=o.multipart_chunk_bytes,
                max_concurrency=o.multipart_concurrency,
            ),
        )

    def delete(self, paths: Sequence[str]) -> None:
        for path in paths:
            with contextlib.suppress(NotFoundError):
                self._call("delete", path, lambda p=path: obstore.delete(self.inner, p))  # type: ignore[misc]

    def make_durable(self, paths: Sequence[str]) -> None:
        if self._local_root is None:
            return  # remote stores acknowledge a PUT only once it is durable
        dirs: set[Path] = set()
        for path in paths:
            full = self._local_root / path
            self._call("fsync", path, lambda f=full: _fsync(f))  # type: ignore[misc]
            dirs.add(full.parent)
        for d in dirs:
            with contextlib.suppress(OSError):  # some filesystems cannot fsync a directory; the file itself is durable
                _fsync(d)

    # -- reads ----------------------------------------------------------------------------------------

    def get(self, path: str, *, size: int | None = None) -> bytes:
        chunk = self.options.range_chunk_bytes
        if size is None or size <= chunk or self.options.max_parallel_reads == 1:
            return bytes(self._call("get", path, lambda: obstore.get(self.inner, path).bytes()))
        out = bytearray(size)
        view = memoryview(out)
        ranges = [(s, min(s + chunk, size)) for s in range(0, size, chunk)]

        def fetch(r: tuple[int, int]) -> None:
            data = self.get_range(path, r[0], r[1])
            if len(data) != r[1] - r[0]:
                raise StoreError(
                    f"{self._where(path)} is shorter than expected: range {r[0]}-{r[1]} returned {len(data)} bytes"
                )
            view[r[0] : r[1]] = data

        list(self._executor().map(fetch, ranges))
        return bytes(out)

    def get_range(self, path: str, start: int, end: int) -> bytes:
        return bytes(self._call("get_range", path, lambda: obstore.get_range(self.inner, path, start=start, end=end)))

    def head(self, path: str) -> ObjectInfo:
        return _info(self._call("head", path, lambda: obstore.head(self.inner, path)))

    def list(self, prefix: str) -> list[ObjectInfo]:
        prefix = prefix.rstrip("/")

        def run() -> list[ObjectInfo]:
            batches = obstore.list(self.inner, prefix + "/" if prefix else None, chunk_size=1000)
            return [_info(m) for batch in batches for m in batch]

        return self._call("list", prefix, run)

    def list_dirs(self, prefix: str) -> builtins.list[str]:
        prefix = prefix.rstrip("/")
        res = self._call("list", prefix, lambda: obstore.list_with_delimiter(self.inner, prefix or None))
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in res["common_prefixes"])

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.options.max_parallel_reads, thread_name_prefix="flipsync-get")
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> ObstoreStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- URL parsing -------------------------------------------------------------------------------------------


def _endpoint(kind: str, config: Mapping[str, str]) -> str | None:
    for key in ("endpoint", "aws_endpoint", "aws_endpoint_url", "base_url", "azure_storage_endpoint"):
        if config.get(key):
            return config[key]
    if kind == "s3":
        return os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT")
    if kind == "az":
        return os.environ.get("AZURE_STORAGE_ENDPOINT")
    return None


def open_object_store(url: str | os.PathLike[str], options: StoreOptions | None = None) -> ObstoreStore:
    """Open a board store from a local path (created if missing), ``file://``, ``memory://`` (a fresh one each
    call), ``s3://``, ``gs://``, ``az://`` or a cloud https URL (docs/board.md, "Stores"); cloud stores are
    configured from ``options.config`` and the usual environment variables."""
    opts = options or StoreOptions()
    text = str(url)
    parsed = urlparse(text)
    scheme = parsed.scheme.lower()
    if scheme in ("", "file") or (len(scheme) == 1 and os.name == "nt"):
        path = Path(unquote(parsed.path) if scheme == "file" else text).expanduser().resolve()
        if scheme == "file" and parsed.netloc not in ("", "localhost"):
            raise ConfigError(f"file URLs name a local path (file:///abs/dir), got {text!r}")
        try:
            # automatic_cleanup removes folders emptied by retention, so listings stay short.
            inner: ObjectStore = LocalStore(prefix=path, mkdir=True, automatic_cleanup=True)
        except Exception as e:
            raise ConfigError(f"cannot use {path} as a board directory: {_first_line(e)}") from e
        return ObstoreStore(inner, path.as_uri(), opts)
    if scheme == "memory":
        return ObstoreStore(MemoryStore(), "memory://", opts)
    kind = _SCHEMES.get(scheme)
    if kind is None and scheme in ("http", "https"):
        host = parsed.netloc.lower()
        if "r2.cloudflarestorage.com" in host or "amazonaws.com" in host:
            kind = "s3"
        elif host.endswith((".blob.core.windows.net", ".dfs.core.windows.net")):
            kind = "az"
    if kind is None:
        raise ConfigError(
            f"unsupported board URL {text!r}: use a path, file://, memory://, s3://, gs:// or az:// "
            "(or an R2 / S3 / Azure https URL)"
        )
    config = dict(opts.config)
    keys, env = _EXPLICIT_CREDENTIALS[kind]
    explicit = any(k.lower() in keys for k in config) or any(os.environ.get(v) for v in env)
    endpoint = _endpoint(kind, config)
    if not opts.allow_metadata_credentials and not explicit:
        raise ConfigError(
            f"no explicit credentials for {text!r} and metadata-service credentials are disabled: "
            "set them in the store options or the environment "
            "(AWS_ACCESS_KEY_ID, GOOGLE_SERVICE_ACCOUNT_KEY, AZURE_STORAGE_ACCOUNT_KEY, ...)"
        )
    try:
        inner = obstore.store.from_url(
            text,
            config=config or None,  # type: ignore[arg-type]
            client_options=opts.client_options(endpoint),
            retry_config=opts.retry_config(),
        )
    except (obx.BaseError, ValueError, TypeError) as e:
        raise ConfigError(f"cannot open {text!r}: {_first_line(e)}") from e
    return ObstoreStore(inner, text, opts, cloud=(kind, explicit, endpoint))
