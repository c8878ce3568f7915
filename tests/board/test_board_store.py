"""The Store port over obstore, against real backends on loopback: local files, memory, moto S3, Azurite.

GCS has no emulator that works with obstore, so gs:// is covered by configuration tests only.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import replace

import pytest
from board_helpers import S3_CREDS, SilentS3, backend_params, fast_options
from obstore.store import AzureStore, GCSStore, LocalStore, MemoryStore, S3Store

from flipsync.errors import (
    ConfigError,
    ConflictError,
    NotFoundError,
    PermanentStoreError,
    StoreError,
    TransientStoreError,
)
from flipsync.serving import free_port
from flipsync.stores import ObstoreStore, StoreOptions, open_store

MiB = 1 << 20


@pytest.mark.parametrize("store_factory", backend_params(), indirect=True)
def test_basic_operations(store: ObstoreStore) -> None:
    store.put("runs/r/versions/000000000001/manifest.json", b"{}", create_only=True)
    store.put("runs/r/versions/000000000001/abc/part-0", b"0123456789")
    store.put("runs/r/versions/000000000002/abc/part-0", b"x")
    with pytest.raises(ConflictError, match="already exists"):
        store.put("runs/r/versions/000000000001/manifest.json", b"{other}", create_only=True)
    assert store.get("runs/r/versions/000000000001/manifest.json") == b"{}"  # not overwritten
    assert store.get_range("runs/r/versions/000000000001/abc/part-0", 2, 5) == b"234"
    info = store.head("runs/r/versions/000000000001/abc/part-0")
    assert info.size == 10 and info.modified.tzinfo is not None
    assert store.exists("runs/r/versions/000000000002/abc/part-0")
    assert not store.exists("runs/r/versions/000000000003/manifest.json")
    assert store.list_dirs("runs/r/versions") == ["000000000001", "000000000002"]
    assert store.list_dirs("runs/r/nothing") == []
    paths = sorted(o.path for o in store.list("runs/r/versions"))
    assert paths == [
        "runs/r/versions/000000000001/abc/part-0",
        "runs/r/versions/000000000001/manifest.json",
        "runs/r/versions/000000000002/abc/part-0",
    ]
    with pytest.raises(NotFoundError, match="does not exist"):
        store.get("runs/r/nope")
    with pytest.raises(NotFoundError):
        store.head("runs/r/nope")
    store.delete(["runs/r/versions/000000000002/abc/part-0", "runs/r/never-existed"])
    assert not store.exists("runs/r/versions/000000000002/abc/part-0")
    store.make_durable(["runs/r/versions/000000000001/abc/part-0"])


@pytest.mark.parametrize("store_factory", backend_params("file", "s3", "azure"), indirect=True)
def test_large_objects_multipart_up_parallel_ranges_down(store: ObstoreStore) -> None:
    data = os.urandom(12 * MiB + 12345)
    store.put("big/object", data)  # 5 MiB multipart chunks -> 3 parts
    info = store.head("big/object")
    assert info.size == len(data)
    if isinstance(store.inner, S3Store):
        # An S3 multipart upload's ETag is "<md5 of part md5s>-<number of parts>".
        assert info.etag is not None and info.etag.strip('"').endswith("-3")
    assert store.get("big/object", size=len(data)) == data  # 4 MiB ranges, fetched in parallel
    assert store.get("big/object") == data


@pytest.mark.parametrize("store_factory", backend_params("file", "memory", "s3", "azure"), indirect=True)
def test_create_only_race_has_exactly_one_winner(store: ObstoreStore) -> None:
    winners: list[int] = []
    losers: list[int] = []
    barrier = threading.Barrier(8)

    def race(i: int) -> None:
        barrier.wait(timeout=10)
        try:
            store.put("race/manifest.json", f"writer {i}".encode(), create_only=True)
            winners.append(i)
        except ConflictError:
            losers.append(i)

    threads = [threading.Thread(target=race, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(winners) + len(losers) == 8  # each writer won or was told of the conflict
    assert store.get("race/manifest.json") in {f"writer {i}".encode() for i in winners}
    if not isinstance(store.inner, S3Store):
        assert len(winners) == 1
    # S3 itself makes If-None-Match writes atomic, but moto checks then writes without a lock, so on its
    # threaded server two racing writers now and then both win: there only one winner at least is checked.
    assert winners


# -- URL parsing and configuration ---------------------------------------------------------------------------


def test_local_urls(tmp_path: os.PathLike[str]) -> None:
    a = open_store(tmp_path)
    b = open_store(f"file://{tmp_path}/sub")
    assert isinstance(a.inner, LocalStore) and isinstance(b.inner, LocalStore)
    assert b.url.startswith("file://") and os.path.isdir(f"{tmp_path}/sub")
    b.put("x", b"1")
    assert a.get("sub/x") == b"1"
    assert isinstance(open_store("memory://").inner, MemoryStore)
    with pytest.raises(ConfigError, match="file URLs name a local path"):
        open_store("file://somehost/dir")
    with pytest.raises(ConfigError, match="unsupported board URL"):
        open_store("ftp://host/board")


def test_s3_and_r2_configuration(no_cloud_env: None) -> None:
    opts = fast_options(**S3_CREDS, endpoint="http://127.0.0.1:9")
    s = open_store("s3://bucket/some/prefix", opts)
    assert isinstance(s.inner, S3Store)
    assert s.inner.prefix == "some/prefix"
    assert s.inner.config["bucket"] == "bucket"
    assert s.inner.client_options is not None and s.inner.client_options.get("allow_http") in (True, "true")
    r2 = open_store("https://acct.r2.cloudflarestorage.com/bucket/pfx", fast_options(**S3_CREDS))
    assert isinstance(r2.inner, S3Store) and r2.inner.prefix == "pfx"
    with pytest.raises(ConfigError, match="no explicit credentials"):
        open_store("s3://bucket/x", fast_options(endpoint="http://127.0.0.1:9"))
    with pytest.raises(ConfigError, match=r"bad store configuration|cannot open"):
        open_store("s3://bucket/x", fast_options(**S3_CREDS, not_a_real_key="1"))


def test_s3_endpoint_from_environment(no_cloud_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    s = open_store("s3://bucket/p", fast_options())
    assert isinstance(s.inner, S3Store)
    assert s.inner.client_options is not None and s.inner.client_options.get("allow_http") in (True, "true")


def test_azure_configuration(no_cloud_env: None) -> None:
    s = open_store(
        "az://container/pre/fix",
        fast_options(account_name="acct", account_key="a2V5", endpoint="http://127.0.0.1:9/acct"),
    )
    assert isinstance(s.inner, AzureStore)
    assert s.inner.config["container_name"] == "container" and s.inner.prefix == "pre/fix"
    with pytest.raises(ConfigError, match="no explicit credentials"):
        open_store("az://container/x", fast_options(account_name="acct"))


def test_gcs_configuration_without_emulator(no_cloud_env: None) -> None:
    """No GCS emulator works with obstore: check the configuration, and that a request goes only to the
    configured loopback endpoint (nothing listens there) and fails fast and clearly."""
    port = free_port()
    key = json.dumps(
        {
            "gcs_base_url": f"http://127.0.0.1:{port}",
            "disable_oauth": True,
            "client_email": "",
            "private_key": "",
            "private_key_id": "",
        }
    )
    opts = replace(fast_options(service_account_key=key), allow_http=True, max_retries=1, retry_timeout_s=2)
    s = open_store("gs://bucket/board/pfx", opts)
    assert isinstance(s.inner, GCSStore)
    assert s.inner.config["bucket"] == "bucket" and s.inner.prefix == "board/pfx"
    t0 = time.monotonic()
    with pytest.raises(StoreError, match="failed"):
        s.get("runs/r/latest.json")
    assert time.monotonic() - t0 < 10
    # Without credentials a GCS client would ask the metadata server; that is refused up front.
    with pytest.raises(ConfigError, match="no explicit credentials"):
        open_store("gs://bucket/x", fast_options())


def test_options_are_validated() -> None:
    with pytest.raises(ConfigError, match="5 MiB"):
        StoreOptions(multipart_chunk_bytes=1 << 20)
    with pytest.raises(ConfigError):
        StoreOptions(max_parallel_reads=0)


# -- faults ---------------------------------------------------------------------------------------------


def test_store_that_times_out_gives_a_clear_bounded_error(silent_s3: SilentS3) -> None:
    s = silent_s3(max_retries=2)
    t0 = time.monotonic()
    with pytest.raises(TransientStoreError, match=r"failed after 3 tries over") as err:  # obstore's retries
        s.get("runs/r/latest.json")
    assert time.monotonic() - t0 < 8
    assert "check that the store is reachable" in str(err.value)
    t0 = time.monotonic()
    with pytest.raises(TransientStoreError, match=r"failed after \d tries"):  # a create is retried by flipsync
        s.put("runs/r/versions/000000000001/manifest.json", b"{}", create_only=True)
    with pytest.raises(TransientStoreError):
        s.put("runs/r/versions/000000000001/x/part", b"data")  # retried, within the bound
    assert time.monotonic() - t0 < 15


def test_missing_cloud_credentials_are_named_not_the_metadata_endpoint() -> None:
    # obstore falls back to the cloud metadata service when no credentials are configured; its failure text
    # (a link-local URL) must become what the user has to set
    store = ObstoreStore(MemoryStore(), "s3://bucket/board", cloud=("s3", False, None))

    def fail() -> None:
        raise OSError("Generic S3 error: Error performing PUT http://169.254.169.254/latest/api/token: 403")

    with pytest.raises(PermanentStoreError) as err:  # waiting would not make credentials appear
        store._call("list", "runs", fail)
    text = str(err.value)
    assert "no credentials for the s3 store" in text and "AWS_ACCESS_KEY_ID" in text and "AWS_ENDPOINT_URL" in text
    assert "169.254" not in text and "retried" not in text
    # with credentials given, the same failure is about reaching the store, and names the endpoint
    store = ObstoreStore(MemoryStore(), "s3://bucket/board", fast_options(), cloud=("s3", True, "http://127.0.0.1:9"))
    with pytest.raises(TransientStoreError, match=r"check that the store is reachable \(endpoint http://127.0.0.1:9\)"):
        store._call("list", "runs", fail)
