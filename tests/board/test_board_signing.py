"""Ed25519 signatures: signed boards verify; unsigned, foreign-key and tampered manifests or parts are refused."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from board_helpers import Recorder, backend_params, build_run, fp

from flipsync.board.follow import Follower
from flipsync.board.layout import RunLayout
from flipsync.board.reader import BoardReader
from flipsync.board.signing import Signer, Verifier, generate_keypair, write_keypair
from flipsync.errors import ConfigError, IntegrityError, SignatureError
from flipsync.stores import ObstoreStore

L = RunLayout("run")


@pytest.fixture
def keys(tmp_path: Path) -> tuple[Signer, Verifier]:
    private, public, kid = write_keypair(tmp_path / "board.key")
    assert public == private.with_name("board.key.pub") and len(kid) == 16
    assert stat.S_IMODE(os.stat(private).st_mode) == 0o600
    signer, verifier = Signer.from_pem(private), Verifier.from_pem(public)
    assert signer.key_id == kid and verifier.key_ids == [kid]
    return signer, verifier


def test_keygen_refuses_to_overwrite(tmp_path: Path) -> None:
    write_keypair(tmp_path / "k")
    with pytest.raises(ConfigError, match="already exists"):
        write_keypair(tmp_path / "k")
    write_keypair(tmp_path / "k", force=True)
    with pytest.raises(ConfigError, match="cannot read"):
        Signer.from_pem(tmp_path / "missing")
    with pytest.raises(ConfigError, match="cannot load"):
        Verifier.from_pem(b"-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n")


@pytest.mark.parametrize("store_factory", backend_params("file", "s3"), indirect=True)
def test_signed_board_verifies(store: ObstoreStore, keys: tuple[Signer, Verifier]) -> None:
    signer, verifier = keys
    build_run(store, 4, keyframes=(3,), spans=True, signer=signer)
    reader = BoardReader(store, "run", verifier=verifier)
    m = reader.catalog.version(4)
    assert m.signature is not None and m.signature.key_id == signer.key_id
    rec = Recorder()
    assert Follower(reader).sync(rec) == 4
    rec = Recorder()
    assert Follower(reader, version=0, view_fp=fp(0)).sync(rec) == 4


def test_unsigned_board_is_refused_by_a_verifying_reader(store: ObstoreStore, keys: tuple[Signer, Verifier]) -> None:
    build_run(store, 2)
    f = Follower(BoardReader(store, "run", verifier=keys[1]), version=1, view_fp=fp(1))
    with pytest.raises(IntegrityError, match="not signed"):
        f.sync(Recorder())
    assert f.version == 1


def test_foreign_key_is_refused(store: ObstoreStore, keys: tuple[Signer, Verifier]) -> None:
    other = Signer.from_pem(generate_keypair()[0])
    build_run(store, 2, signer=other)
    f = Follower(BoardReader(store, "run", verifier=keys[1]), version=1, view_fp=fp(1))
    with pytest.raises(IntegrityError, match="not trusted"):
        f.sync(Recorder())
    # Several trusted keys (rotation): the other key is accepted once trusted.
    both = Verifier([keys[0].public_key(), other.public_key()])
    assert Follower(BoardReader(store, "run", verifier=both), version=1, view_fp=fp(1)).sync(Recorder()) == 2


@pytest.mark.parametrize("field", ["target_view_fp", "part_hash", "part_size", "meta"])
def test_tampered_manifest_is_refused(store: ObstoreStore, keys: tuple[Signer, Verifier], field: str) -> None:
    signer, verifier = keys
    build_run(store, 3, signer=signer)
    path = L.version_manifest(3)
    d = json.loads(store.get(path))
    if field == "target_view_fp":
        d["target_view_fp"] = fp(3, "evil")
    elif field == "part_hash":
        d["parts"][0]["hash"] = "0" * 64
    elif field == "part_size":
        d["parts"][0]["size"] += 1
    else:
        d["meta"]["injected"] = "x"
    store.delete([path])
    store.put(path, json.dumps(d).encode(), create_only=True)
    f = Follower(BoardReader(store, "run", verifier=verifier), version=2, view_fp=fp(2))
    with pytest.raises(SignatureError, match="bad signature"):
        f.sync(Recorder())
    assert f.version == 2


def test_tampered_part_is_refused(store: ObstoreStore, keys: tuple[Signer, Verifier]) -> None:
    signer, verifier = keys
    build_run(store, 3, signer=signer)
    reader = BoardReader(store, "run", verifier=verifier)
    m = reader.catalog.version(3)
    path = f"{L.version_dir(3)}/{m.parts[0].path}"
    data = bytearray(store.get(path))
    data[10] ^= 1
    store.put(path, bytes(data))
    f = Follower(reader, version=2, view_fp=fp(2), max_replans=0)
    with pytest.raises(IntegrityError, match="corrupt"):
        f.sync(Recorder())
    assert f.version == 2


def test_tampered_keyframe_is_refused(store: ObstoreStore, keys: tuple[Signer, Verifier]) -> None:
    signer, verifier = keys
    build_run(store, 3, keyframes=(3,), signer=signer)
    reader = BoardReader(store, "run", verifier=verifier)
    m = reader.catalog.keyframe(3)
    path = f"{L.keyframe_dir(3)}/{m.parts[0].path}"
    data = bytearray(store.get(path))
    data[len(data) // 2] ^= 1
    store.put(path, bytes(data))
    f = Follower(reader, version=None, max_replans=0)
    with pytest.raises(IntegrityError, match="corrupt"):
        f.sync(Recorder())
    assert f.version is None  # nothing was loaded from the tampered keyframe


def test_replayed_older_manifest_cannot_move_a_replica(store: ObstoreStore, keys: tuple[Signer, Verifier]) -> None:
    # An attacker with write access copies the validly signed v2 manifest to where v4's would go.
    signer, verifier = keys
    build_run(store, 3, signer=signer)
    store.put(L.version_manifest(4), store.get(L.version_manifest(2)), create_only=True)
    f = Follower(BoardReader(store, "run", verifier=verifier), version=3, view_fp=fp(3))
    with pytest.raises(IntegrityError, match="its location says patch 3->4"):
        f.sync(Recorder())
    assert f.version == 3
