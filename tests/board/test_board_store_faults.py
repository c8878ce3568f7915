"""Store failures on real store APIs: the ones that cannot heal fail at once with their cause, the ones that can
are retried within the bounds, and no failure is retried twice over.

- file://: a read-only board folder (mode 0555, a read-only mount or chattr +i, whichever works here), an
  immutable folder and file (chattr +i), a full filesystem (a small tmpfs; else the ENOSPC a write raises);
- moto S3: NoSuchBucket; an authenticating moto (IAM: AccessDenied, InvalidAccessKeyId, SignatureDoesNotMatch);
  503 SlowDown, 429 and a timed-out create injected by a proxy in front of moto;
- Azurite: 403 (a wrong account key), a missing container, 503 ServerBusy through the proxy.

Each asserts the time to the error (a refusal: under 5 s, a generous bound, not a performance figure) and
the message, and prints the time (``pytest -s``).
"""

from __future__ import annotations

import errno
import os
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import obstore
import pytest
from board_helpers import (
    AZURITE_ACCOUNT,
    AZURITE_KEY,
    S3_CREDS,
    MotoIam,
    Recorder,
    azurite_create_container,
    build_run,
    fast_options,
    fp,
    make_azure_store,
    make_s3_store,
    moto_iam_store,
    patch_bytes,
    small_view,
)
from fault_proxy import SERVER_BUSY, SLOW_DOWN, TOO_MANY, FaultProxy, Rule

from flipsync.board.follow import Follower
from flipsync.board.layout import RunLayout
from flipsync.board.reader import BoardReader
from flipsync.board.writer import BoardWriter
from flipsync.errors import NotFoundError, PermanentStoreError, TransientStoreError
from flipsync.stores import ObstoreStore, StoreOptions, open_store
from flipsync.stores.errors import describe_failure
from tests.store_faults import full_filesystem, immutable, read_only

L = RunLayout("run")
REFUSAL_BOUND_S = 5.0


def publish_next(store: ObstoreStore, v: int, size: int = 2000) -> None:
    """v{v} of ``run`` as the next patch, by a publisher that resumes the board."""
    w = BoardWriter(store, "run", publisher_id="trainer-0")
    w.resume()
    w.publish_patch(
        [patch_bytes(v, size)],
        base_version=v - 1,
        target_version=v,
        base_view_fp=fp(v - 1),
        target_view_fp=fp(v),
        served_format="bf16",
    )


def time_error(kind: type[Exception], label: str, call: Callable[[], object]) -> tuple[str, float]:
    """Run ``call``, which must raise ``kind``; its message and the seconds it took (printed)."""
    t0 = time.monotonic()
    with pytest.raises(kind) as err:
        call()
    elapsed = time.monotonic() - t0
    print(f"\n{label}: {type(err.value).__name__} after {elapsed:.3f} s: {err.value}")
    text = str(err.value)
    assert "\n" not in text  # one line
    return text, elapsed


def refused(label: str, call: Callable[[], object]) -> str:
    text, elapsed = time_error(PermanentStoreError, label, call)
    assert elapsed < REFUSAL_BOUND_S, text
    assert "was refused" in text
    return text


def follows_to(store: ObstoreStore, head: int) -> None:
    assert Follower(BoardReader(store, "run"), version=None).sync(Recorder()) == head


# -- file:// ------------------------------------------------------------------------------------------------


def test_a_read_only_board_folder_refuses_writes_at_once_and_still_serves_reads(tmp_path: Path) -> None:
    board = tmp_path / "board"
    store = open_store(board, fast_options())
    build_run(store, 2)
    with read_only(board) as how:
        text = refused(f"file:// read-only folder ({how}), publish", lambda: publish_next(store, 3))
        assert str(board) in text and "not writable by this process" in text
        assert any(c in text for c in ("Permission denied", "Read-only file system", "Operation not permitted"))
        follows_to(store, 2)  # readers are not affected
    publish_next(store, 3)  # writable again: the same store publishes


def test_an_immutable_board_folder_and_file_refuse_at_once(tmp_path: Path) -> None:
    board = tmp_path / "board"
    store = open_store(board, fast_options())
    build_run(store, 2)
    with immutable(board):
        text = refused("file:// immutable folder (chattr +i), publish", lambda: publish_next(store, 3))
        assert "Operation not permitted (os error 1)" in text and str(board) in text
    part = f"{L.version_dir(2)}/{BoardReader(store, 'run').catalog.version(2).parts[0].path}"
    with immutable(board / part):
        text = refused("file:// immutable file, overwrite", lambda: store.put(part, b"other bytes"))
        assert "Operation not permitted" in text
        with immutable(board / L.latest):  # the HEAD hint: a publisher warns and goes on
            publish_next(store, 3)
    follows_to(store, 3)


def test_a_full_filesystem_refuses_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        with full_filesystem(tmp_path / "fs", "512k") as fs:
            store = open_store(fs / "board", fast_options())
            build_run(store, 1)
            text = refused("file:// full filesystem (tmpfs 512k), publish", lambda: publish_next(store, 2, 1 << 20))
            store.close()
    except pytest.skip.Exception:
        # No tmpfs here: the same store, whose writes raise the ENOSPC a full disk gives a write.
        store = open_store(tmp_path / "board", fast_options())
        build_run(store, 1)

        def full(*args: object, **kwargs: object) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(obstore, "put", full)
        text = refused("file:// ENOSPC (injected: no tmpfs here), publish", lambda: publish_next(store, 2, 1 << 20))
    assert "No space left on device" in text and "full or over its quota" in text


# -- moto S3 ------------------------------------------------------------------------------------------------


@pytest.mark.network_services
def test_s3_no_such_bucket_fails_at_once_for_readers_and_writers(moto_endpoint: str) -> None:
    opts = fast_options(**S3_CREDS, endpoint=moto_endpoint)
    store = open_store(f"s3://never-created-{uuid.uuid4().hex[:8]}/board", opts)
    text = refused("s3 NoSuchBucket, reader", lambda: BoardReader(store, "run").head())
    assert "NoSuchBucket" in text and "does not exist: create it, or fix the board URL" in text
    text = refused(
        "s3 NoSuchBucket, writer",
        lambda: BoardWriter(store, "run").publish_snapshot(
            small_view(), version=0, view_fp=fp(0), served_format="bf16"
        ),
    )
    assert "bucket of s3://never-created-" in text


@pytest.mark.network_services
def test_s3_access_denied_by_policy_refuses_writes_at_once(moto_iam: MotoIam) -> None:
    reader = moto_iam_store(moto_iam.endpoint, moto_iam.users["reader"])
    follows_to(reader, 2)  # the policy lets these credentials read ...
    text = refused("s3 AccessDenied (IAM policy), publish", lambda: publish_next(reader, 3))  # ... not write
    assert "HTTP 403 AccessDenied" in text and "may not write it" in text and "s3://iam-board/board/" in text


@pytest.mark.network_services
@pytest.mark.parametrize("bad", ["key", "secret"])
def test_s3_bad_credentials_fail_at_once_and_are_not_retried(moto_iam: MotoIam, bad: str) -> None:
    keys = dict(moto_iam.users["writer"])
    if bad == "key":
        keys["access_key_id"] = "AKIAWRONGWRONGWRONG0"
    else:
        keys["secret_access_key"] = "not-the-secret"
    proxy = FaultProxy(moto_iam.endpoint)  # counts the requests; injects nothing
    try:
        store = moto_iam_store(proxy.url, keys)
        text = refused(f"s3 bad {bad}, reader", lambda: BoardReader(store, "run").head())
        code = "InvalidAccessKeyId" if bad == "key" else "SignatureDoesNotMatch"
        assert code in text and "rejected the credentials" in text and "AWS_ACCESS_KEY_ID" in text
        assert len(proxy.log) == 1  # one request: a refusal is never retried
    finally:
        proxy.close()


@pytest.fixture
def s3_proxy(moto_endpoint: str) -> Iterator[FaultProxy]:
    proxy = FaultProxy(moto_endpoint)
    yield proxy
    proxy.close()


def proxied_s3(proxy: FaultProxy, **changes: float) -> ObstoreStore:
    """A fresh board bucket on moto, reached through ``proxy``; ``changes``: StoreOptions fields."""
    store = make_s3_store(proxy.upstream_url, replace(fast_options(), **changes))  # type: ignore[arg-type]
    bucket = store.url.split("/")[2]
    opts = replace(fast_options(**S3_CREDS, endpoint=proxy.url), **changes)  # type: ignore[arg-type]
    return open_store(f"s3://{bucket}/board", opts)


def parts_of(v: int) -> Callable[[str, str], bool]:
    return lambda method, path: method == "PUT" and f"versions/{v:012d}/" in path and "manifest" not in path


@pytest.mark.network_services
@pytest.mark.parametrize(
    ("status", "body"), [(503, SLOW_DOWN), (429, TOO_MANY), (500, b"<Error><Code>InternalError</Code></Error>")]
)
def test_s3_throttling_and_5xx_heal_and_the_version_lands(s3_proxy: FaultProxy, status: int, body: bytes) -> None:
    store = proxied_s3(s3_proxy)
    build_run(store, 1)
    s3_proxy.add(Rule(parts_of(2), times=2, status=status, body=body))
    t0 = time.monotonic()
    publish_next(store, 2)
    print(f"\ns3 {status} twice on a part upload: healed, v2 landed in {time.monotonic() - t0:.3f} s")
    assert s3_proxy.injected() == 2
    follows_to(store, 2)


@pytest.mark.network_services
def test_s3_throttling_that_does_not_heal_is_tried_max_retries_times_once(s3_proxy: FaultProxy) -> None:
    store = proxied_s3(s3_proxy, max_retries=3, retry_timeout_s=10.0)
    build_run(store, 1)
    s3_proxy.add(Rule(parts_of(2), times=100, status=503, body=SLOW_DOWN))
    text, elapsed = time_error(TransientStoreError, "s3 503 SlowDown forever, publish", lambda: publish_next(store, 2))
    assert "failed after 4 tries over" in text and "at most 3 retries within 10 s" in text
    assert "HTTP 503 SlowDown" in text and "throttling" in text
    assert s3_proxy.injected() == 4  # obstore's retries, not retried again above it
    assert elapsed < 10


@pytest.mark.network_services
def test_s3_a_timed_out_create_is_tried_again_and_lands_once(s3_proxy: FaultProxy) -> None:
    """obstore does not retry a create-only PUT that timed out (it may have landed); the store does, and a
    create that finds its own earlier try there is the writer's success, not a conflict."""
    store = proxied_s3(s3_proxy, request_timeout_s=0.5)
    build_run(store, 1)
    manifest = L.version_manifest(2)
    s3_proxy.add(Rule(lambda m, p: m == "PUT" and p.endswith(manifest), times=1, delay_s=1.5))
    t0 = time.monotonic()
    publish_next(store, 2)
    print(f"\ns3 manifest create timed out once: v2 landed in {time.monotonic() - t0:.3f} s")
    follows_to(store, 2)
    time.sleep(1.5)  # the held first try reaches moto now, and finds the manifest there
    creates = [what for method, path, what in s3_proxy.log if method == "PUT" and path.endswith(manifest)]
    assert sorted(creates) == ["forwarded 200", "forwarded 412 late"]


@pytest.mark.network_services
def test_s3_a_refusal_behind_the_proxy_is_one_request(s3_proxy: FaultProxy) -> None:
    store = proxied_s3(s3_proxy)
    build_run(store, 1)
    denied = b"<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>"
    s3_proxy.add(Rule(parts_of(2), times=100, status=403, body=denied))
    refused("s3 403 AccessDenied (injected), publish", lambda: publish_next(store, 2))
    assert s3_proxy.injected() == 1


# -- Azurite ------------------------------------------------------------------------------------------------


@pytest.mark.network_services
def test_azure_wrong_key_and_missing_container_fail_at_once(azurite_endpoint: str) -> None:
    good = make_azure_store(azurite_endpoint)
    build_run(good, 1)
    container = good.url.split("/")[2]
    wrong = open_store(
        f"az://{container}/board",
        fast_options(account_name=AZURITE_ACCOUNT, account_key="d3Jvbmcta2V5" * 8, endpoint=azurite_endpoint),
    )
    text = refused("azure 403 (wrong account key), reader", lambda: BoardReader(wrong, "run").head())
    assert "HTTP 403" in text and "AuthorizationFailure" in text and "rejected the credentials" in text
    text = refused("azure 403 (wrong account key), publish", lambda: publish_next(wrong, 2))
    missing = open_store(
        f"az://absent{uuid.uuid4().hex[:8]}/board",
        fast_options(account_name=AZURITE_ACCOUNT, account_key=AZURITE_KEY, endpoint=azurite_endpoint),
    )
    text = refused("azure missing container, reader", lambda: BoardReader(missing, "run").head())
    assert "ContainerNotFound" in text and "container of az://absent" in text
    refused(
        "azure missing container, writer",
        lambda: BoardWriter(missing, "run").publish_snapshot(
            small_view(), version=0, view_fp=fp(0), served_format="bf16"
        ),
    )


@pytest.mark.network_services
def test_azure_server_busy_heals_and_the_version_lands(azurite_endpoint: str) -> None:
    proxy = FaultProxy(azurite_endpoint)
    try:
        container = f"fs{uuid.uuid4().hex[:12]}"
        azurite_create_container(azurite_endpoint, container)
        opts = fast_options(account_name=AZURITE_ACCOUNT, account_key=AZURITE_KEY, endpoint=proxy.url)
        store = open_store(f"az://{container}/board", opts)
        build_run(store, 1)
        proxy.add(Rule(parts_of(2), times=2, status=503, body=SERVER_BUSY))
        t0 = time.monotonic()
        publish_next(store, 2)
        print(f"\nazure 503 ServerBusy twice: healed, v2 landed in {time.monotonic() - t0:.3f} s")
        assert proxy.injected() == 2
        follows_to(store, 2)
    finally:
        proxy.close()


# -- the classification itself -------------------------------------------------------------------------------


def test_a_local_transient_error_is_retried_within_the_bounds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """obstore retries nothing on a local store: an EIO (a network filesystem's hiccup) is tried again here,
    at most max_retries times, and then reported with how often and how long."""
    store = open_store(tmp_path / "board", replace(fast_options(), max_retries=3, init_backoff_s=0.01))
    real = obstore.put
    calls: list[str] = []
    failing = [2]

    def flaky(inner: object, path: str, *args: object, **kwargs: object) -> object:
        calls.append(path)
        if failing[0] > 0:
            failing[0] -= 1
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(inner, path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(obstore, "put", flaky)
    store.put("a/b", b"data")
    assert calls == ["a/b"] * 3 and store.get("a/b") == b"data"
    calls.clear()
    failing[0] = 100
    text, _ = time_error(TransientStoreError, "file:// EIO forever", lambda: store.put("a/c", b"x"))
    assert calls == ["a/c"] * 4 and "failed after 4 tries" in text and "keeps failing" in text


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        (
            "Generic S3 error: Error performing GET http://h/b/x in 3ms - Server returned non-2xx status code: 400 Bad "
            "Request: <Error><Code>RequestTimeout</Code></Error>",
            "timeout",
        ),
        ("Generic S3 error: ... 403 Forbidden: <Error><Code>RequestTimeTooSkewed</Code></Error>", "credentials"),
        (
            "Generic S3 error: Received redirect without LOCATION, this normally indicates an incorrectly configured "
            "region",
            "bad_request",
        ),
        ("Generic LocalFileSystem error: Unable to open file /b/x: Stale file handle (os error 116)", "local_io"),
        ("Generic LocalFileSystem error: Unable to copy data to file: Disk quota exceeded (os error 122)", "no_space"),
        (
            'Generic GCS error: ... status code: 429 Too Many Requests: {"error": {"code": 429, "reason": '
            '"rateLimitExceeded"}}',
            "throttled",
        ),
        (
            "Generic S3 error: Error performing PUT http://h/b/x in 1ms - HTTP error: error sending request\n\nDebug "
            "source:\n  HttpError {\n kind: Connect, source: Os { code: 111, kind: ConnectionRefused, } }",
            "connection",
        ),
    ],
)
def test_store_error_texts_obstore_gives_are_classified(text: str, kind: str) -> None:
    import obstore.exceptions as obx

    assert describe_failure(obx.GenericError(text), creates=False, local="LocalFileSystem" in text).kind == kind


def test_not_found_is_the_objects_unless_a_put_or_the_store_says_bucket(tmp_path: Path) -> None:
    store = open_store(tmp_path / "board", fast_options())
    with pytest.raises(NotFoundError):
        store.get("runs/run/latest.json")
    store.delete(["never/was"])  # a missing object is not an error for a delete


def test_board_md_states_the_bounds_the_code_uses() -> None:
    """docs/board.md's table of retry bounds: every row names a StoreOptions field and its default."""
    import re

    doc = (Path(__file__).resolve().parents[2] / "docs" / "board.md").read_text()
    rows = dict(re.findall(r"^\| [^|]+ \| `(\w+)` \| ([\d.]+)(?: s)? \|$", doc, flags=re.MULTILINE))
    defaults = StoreOptions()
    assert set(rows) == {
        "max_retries",
        "retry_timeout_s",
        "init_backoff_s",
        "max_backoff_s",
        "request_timeout_s",
        "connect_timeout_s",
    }
    for name, value in rows.items():
        assert float(value) == float(getattr(defaults, name)), name
    assert f"tried at most {defaults.max_retries + 1} times" in doc.replace("\n", " ")
