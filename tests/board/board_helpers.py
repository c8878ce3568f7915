"""Helpers for the board tests: loopback servers, stores with explicit fake credentials, payloads."""

from __future__ import annotations

import base64
import email.utils
import hashlib
import hmac
import socket
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace

import pytest
import torch

from flipsync.board.reader import Step
from flipsync.board.writer import BoardWriter
from flipsync.stores import ObstoreStore, StoreOptions, open_store

AZURITE_ACCOUNT = "devstoreaccount1"
# The well-known Azurite development key (public, documented by Microsoft).
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
S3_CREDS = {"access_key_id": "testing", "secret_access_key": "testing", "region": "us-east-1"}
BACKENDS = ["file", "memory", "s3", "azure"]

SilentS3 = Callable[..., ObstoreStore]  # the ``silent_s3`` fixture (conftest)


def wait_for_port(port: int, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before listening on {port}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


def fast_options(**config: str) -> StoreOptions:
    """Short timeouts and few retries, so a failing test fails fast."""
    return StoreOptions(
        config=config,
        connect_timeout_s=2.0,
        request_timeout_s=15.0,
        max_retries=2,
        retry_timeout_s=5.0,
        init_backoff_s=0.05,
        max_backoff_s=0.5,
        multipart_chunk_bytes=5 << 20,
        range_chunk_bytes=4 << 20,
        allow_metadata_credentials=False,
    )


# -- moto (S3) --------------------------------------------------------------------------------------------


def make_s3_store(endpoint: str, options: StoreOptions | None = None) -> ObstoreStore:
    bucket = f"fs-{uuid.uuid4().hex[:12]}"
    # moto does not check signatures on bucket creation; a plain PUT creates the bucket.
    req = urllib.request.Request(f"{endpoint}/{bucket}", method="PUT", data=None)
    with urllib.request.urlopen(req, timeout=5) as resp:
        assert resp.status == 200
    opts = options or fast_options()
    cfg = {**S3_CREDS, "endpoint": endpoint, **opts.config}
    return open_store(f"s3://{bucket}/board", _with_config(opts, cfg))


def _with_config(opts: StoreOptions, config: dict[str, str]) -> StoreOptions:
    return replace(opts, config=config)


@dataclass(frozen=True)
class MotoIam:
    """The ``moto_iam`` fixture: an authenticating moto server and its users' keys (conftest)."""

    endpoint: str
    users: dict[str, dict[str, str]]
    bucket: str = "iam-board"


def moto_iam_store(
    endpoint: str, keys: dict[str, str], bucket: str = "iam-board", options: StoreOptions | None = None
) -> ObstoreStore:
    opts = options or fast_options()
    cfg = {"region": "us-east-1", "endpoint": endpoint, **keys, **opts.config}
    return open_store(f"s3://{bucket}/board", _with_config(opts, cfg))


# -- Azurite (Azure Blob) ---------------------------------------------------------------------------


def azurite_create_container(endpoint: str, name: str) -> None:
    """Create a container with a SharedKey-signed REST call (obstore cannot create containers)."""
    date = email.utils.formatdate(usegmt=True)
    version = "2021-08-06"
    to_sign = (
        "PUT" + "\n" * 12 + f"x-ms-date:{date}\nx-ms-version:{version}\n"
        f"/{AZURITE_ACCOUNT}/{AZURITE_ACCOUNT}/{name}\nrestype:container"
    )
    sig = base64.b64encode(hmac.new(base64.b64decode(AZURITE_KEY), to_sign.encode(), hashlib.sha256).digest()).decode()
    req = urllib.request.Request(
        f"{endpoint}/{name}?restype=container",
        method="PUT",
        headers={
            "x-ms-date": date,
            "x-ms-version": version,
            "Authorization": f"SharedKey {AZURITE_ACCOUNT}:{sig}",
            "Content-Length": "0",
        },
    )
    with urllib.request.urlopen(req, timeout=5) as resp:
        assert resp.status == 201


def make_azure_store(endpoint: str, options: StoreOptions | None = None) -> ObstoreStore:
    container = f"fs{uuid.uuid4().hex[:12]}"
    azurite_create_container(endpoint, container)
    opts = options or fast_options()
    cfg = {"account_name": AZURITE_ACCOUNT, "account_key": AZURITE_KEY, "endpoint": endpoint, **opts.config}
    return open_store(f"az://{container}/board", _with_config(opts, cfg))


# -- the parametrised store ----------------------------------------------------------------------------------


def backend_params(*names: str) -> list[object]:
    marks = {"s3": [pytest.mark.network_services], "azure": [pytest.mark.network_services]}
    return [pytest.param(n, marks=marks.get(n, []), id=n) for n in (names or BACKENDS)]


# -- payloads ------------------------------------------------------------------------------------------------


def fp(v: int, lineage: str = "a") -> str:
    """A made-up view fingerprint for version ``v`` of a lineage."""
    return hashlib.blake2b(f"{lineage}:{v}".encode(), digest_size=16).hexdigest()


def small_view(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.weight": torch.randn(32, 32, generator=g).to(torch.bfloat16),
        "model.layers.0.norm.weight": torch.ones(32, dtype=torch.bfloat16),
        "lm_head.scale": torch.randn(8, generator=g),
    }


def patch_bytes(v: int, size: int = 2000) -> bytes:
    """Deterministic stand-in for a codec patch file of version ``v`` (the board never decodes it)."""
    return hashlib.shake_256(f"patch:{v}".encode()).digest(size)


def build_run(
    store: ObstoreStore,
    n: int,
    *,
    run: str = "run",
    keyframes: tuple[int, ...] = (),
    spans: bool = False,
    patch_size: int = 2000,
    publisher_id: str = "trainer-0",
    **publisher_kw: object,
) -> BoardWriter:
    """Publish a snapshot v0 and patches v1..vn (two parts each), extra keyframes and, optionally, the
    power-of-two spans the cadence asks for. Views are ``fp(v)``; keyframe tensors ``small_view(v)``."""
    pub = BoardWriter(store, run, publisher_id=publisher_id, **publisher_kw)  # type: ignore[arg-type]
    pub.publish_snapshot(small_view(0), version=0, view_fp=fp(0), served_format="bf16")
    for v in range(1, n + 1):
        pub.publish_patch(
            [patch_bytes(v, patch_size), patch_bytes(-v, patch_size // 4)],
            base_version=v - 1,
            target_version=v,
            base_view_fp=fp(v - 1),
            target_view_fp=fp(v),
            served_format="bf16",
        )
        if spans:
            for a, b in pub.spans_due():
                pub.publish_span(
                    [span_bytes(a, b, patch_size)],
                    base_version=a,
                    target_version=b,
                    base_view_fp=fp(a),
                    target_view_fp=fp(b),
                    served_format="bf16",
                )
        if v in keyframes:
            pub.publish_keyframe(small_view(v), version=v, view_fp=fp(v), served_format="bf16")
    return pub


def span_bytes(a: int, b: int, patch_size: int = 2000) -> bytes:
    """A squashed span is bigger than one patch but smaller than the chain it replaces."""
    return hashlib.shake_256(f"span:{a}:{b}".encode()).digest(patch_size + (b - a) * patch_size // 8)


class Recorder:
    """A stand-in sidecar: records the verified steps it is handed."""

    def __init__(self) -> None:
        self.steps: list[Step] = []

    def __call__(self, step: Step) -> None:
        self.steps.append(step)

    @property
    def edges(self) -> list[tuple[str, int | None, int]]:
        return [s.manifest.edge for s in self.steps]
