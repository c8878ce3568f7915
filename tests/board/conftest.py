"""Fixtures for the board tests: real stores on loopback only.

- ``file``: obstore LocalStore in a temporary directory;
- ``memory``: obstore MemoryStore;
- ``s3``: moto's ThreadedMotoServer on 127.0.0.1 (a real S3 API server, honours If-None-Match);
- ``azure``: Azurite (npm ``azurite``) on 127.0.0.1, skipped when ``azurite-blob`` is not installed;
- ``moto_iam``: a second moto server that checks signatures and IAM policies (bad credentials, AccessDenied).

Every client gets explicit fake credentials and a 127.0.0.1 endpoint, and metadata-service credentials are
disabled, so nothing ever leaves the machine. Every wait is bounded.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import replace

import pytest
from board_helpers import (
    AZURITE_ACCOUNT,
    S3_CREDS,
    MotoIam,
    SilentS3,
    build_run,
    fast_options,
    make_azure_store,
    make_s3_store,
    moto_iam_store,
    wait_for_port,
)

from flipsync.serving import free_port
from flipsync.stores import ObstoreStore, open_store

StoreFactory = Callable[[], ObstoreStore]


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        wait_for_port(port, 15.0)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


@pytest.fixture(scope="session")
def azurite_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    exe = shutil.which("azurite-blob")
    if exe is None:
        pytest.skip("Azurite is not installed (npm install -g azurite@3 provides azurite-blob)")
    port = free_port()
    workdir = tmp_path_factory.mktemp("azurite")
    proc = subprocess.Popen(
        [
            exe,
            "--blobHost",
            "127.0.0.1",
            "--blobPort",
            str(port),
            "--location",
            str(workdir),
            "--loose",
            "--skipApiVersionCheck",
            "--silent",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_port(port, 30.0, proc)
        yield f"http://127.0.0.1:{port}/{AZURITE_ACCOUNT}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


@pytest.fixture
def store_factory(request: pytest.FixtureRequest, tmp_path: object) -> Iterator[StoreFactory]:
    """A factory of fresh, empty stores of the backend named by the test's ``backend`` parameter."""
    backend = request.param if hasattr(request, "param") else "file"
    made: list[ObstoreStore] = []
    counter = iter(range(1_000_000))

    def make() -> ObstoreStore:
        if backend == "file":
            s = open_store(os.path.join(str(tmp_path), f"board{next(counter)}"), fast_options())
        elif backend == "memory":
            s = open_store("memory://", fast_options())
        elif backend == "s3":
            s = make_s3_store(request.getfixturevalue("moto_endpoint"))
        elif backend == "azure":
            s = make_azure_store(request.getfixturevalue("azurite_endpoint"))
        else:
            raise ValueError(backend)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


@pytest.fixture
def store(store_factory: StoreFactory) -> ObstoreStore:
    return store_factory()


@pytest.fixture
def silent_s3() -> Iterator[SilentS3]:
    """``silent_s3(max_retries=n)``: an S3 store whose endpoint, on loopback, accepts connections and never
    answers (0.3 s request timeout, 1 s retry budget)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    conns: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        srv.settimeout(0.1)
        while not stop.is_set():
            try:
                conns.append(srv.accept()[0])
            except OSError:
                continue

    def make(*, max_retries: int) -> ObstoreStore:
        opts = fast_options(**S3_CREDS, endpoint=f"http://127.0.0.1:{srv.getsockname()[1]}")
        opts = replace(opts, request_timeout_s=0.3, max_retries=max_retries, retry_timeout_s=1.0)
        return open_store("s3://bucket/board", opts)

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield make
    stop.set()
    t.join(timeout=2)
    for c in conns:
        c.close()
    srv.close()


@pytest.fixture(scope="session")
def moto_iam(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoIam]:
    """A moto server of its own (a subprocess: moto's auth switch is process-wide) that checks signatures
    and IAM policies, with a bucket holding a board ("run": v0-v2) and two users: ``reader`` may do anything
    but s3:PutObject (an IAM policy denies it), ``writer`` anything."""
    import boto3

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_port(port, 30.0, proc)
        endpoint = f"http://127.0.0.1:{port}"
        kw = {"endpoint_url": endpoint, "region_name": "us-east-1"}
        creds = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}
        boto3.client("s3", **kw, **creds).create_bucket(Bucket="iam-board")
        iam = boto3.client("iam", **kw, **creds)
        users = {}
        for name, deny in (("reader", ["s3:PutObject"]), ("writer", [])):
            iam.create_user(UserName=name)
            key = iam.create_access_key(UserName=name)["AccessKey"]
            statements: list[dict[str, object]] = [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]
            if deny:
                statements.append({"Effect": "Deny", "Action": deny, "Resource": "*"})
            policy = json.dumps({"Version": "2012-10-17", "Statement": statements})
            iam.put_user_policy(UserName=name, PolicyName="board", PolicyDocument=policy)
            users[name] = {"access_key_id": key["AccessKeyId"], "secret_access_key": key["SecretAccessKey"]}
        build_run(moto_iam_store(endpoint, users["writer"]), 2)
        req = urllib.request.Request(
            f"{endpoint}/moto-api/reset-auth", data=b"0", method="POST", headers={"Content-Type": "text/plain"}
        )
        with urllib.request.urlopen(req, timeout=5) as resp:  # from now on every request is authenticated
            assert resp.status == 200
        yield MotoIam(endpoint, users)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
