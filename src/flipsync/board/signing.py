"""Ed25519 signatures over the canonical JSON (less the signature) of manifests and fleet member records; keys
are PEM files (SubjectPublicKeyInfo for the public one). See docs/board.md#signatures."""

from __future__ import annotations

import base64
import os
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import TypeVar

import blake3
from cryptography.exceptions import InternalError, InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from flipsync.domain.manifest import Manifest, Signature
from flipsync.errors import ConfigError, IntegrityError, SignatureError

ALG = "ed25519"
K = TypeVar("K", Ed25519PrivateKey, Ed25519PublicKey)


def key_id(public_key: Ed25519PublicKey) -> str:
    """A short, stable name for a public key: the first 16 hex digits of BLAKE3 of its raw bytes."""
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return blake3.blake3(raw).hexdigest()[:16]


class Signer:
    """Signs manifests with one private key."""

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._key = private_key
        self.key_id = key_id(private_key.public_key())

    @classmethod
    def from_pem(cls, pem: bytes | str | Path) -> Signer:
        load = partial(serialization.load_pem_private_key, password=None)
        cannot, wrong = "create one with `flipsync keygen KEY`", "create an Ed25519 pair with `flipsync keygen KEY`"
        return cls(_load_key(pem, "private key", load, Ed25519PrivateKey, cannot, wrong))

    def public_key(self) -> Ed25519PublicKey:
        return self._key.public_key()

    def sign(self, manifest: Manifest) -> Manifest:
        return manifest.with_signature(self.sign_payload(manifest.signing_payload()))

    def sign_payload(self, payload: bytes) -> Signature:
        """A detached signature of ``payload`` (a document's canonical JSON without its signature)."""
        sig = self._key.sign(payload)
        return Signature(alg=ALG, key_id=self.key_id, value=base64.b64encode(sig).decode("ascii"))


class Verifier:
    """Checks manifest signatures against a set of trusted public keys (several allow key rotation)."""

    def __init__(self, public_keys: Iterable[Ed25519PublicKey]) -> None:
        self._keys = {key_id(k): k for k in public_keys}
        if not self._keys:
            raise ConfigError("a Verifier needs at least one public key")
        self.key_ids = sorted(self._keys)

    @classmethod
    def from_pem(cls, *pems: bytes | str | Path) -> Verifier:
        cannot = "readers take the KEY.pub that `flipsync keygen` wrote"
        wrong = "pass the KEY.pub that `flipsync keygen` wrote beside the publisher's key"
        load = serialization.load_pem_public_key
        return cls(_load_key(pem, "public key", load, Ed25519PublicKey, cannot, wrong) for pem in pems)

    def verify(self, manifest: Manifest, where: str = "manifest") -> None:
        self.verify_payload(manifest.signature, manifest.signing_payload(), where, what="manifests")

    def verify_payload(self, sig: Signature | None, payload: bytes, where: str, *, what: str = "documents") -> None:
        """Check that ``sig`` signs ``payload`` with a trusted key; IntegrityError saying why not."""
        if sig is None:
            raise IntegrityError(f"{where} is not signed, and this reader only accepts signed {what}")
        key = self._keys.get(sig.key_id)
        if key is None:
            raise IntegrityError(
                f"{where} is signed by key {sig.key_id}, which is not trusted here (trusted: {self.key_ids})"
            )
        try:
            key.verify(base64.b64decode(sig.value, validate=True), payload)
        except (InvalidSignature, ValueError):
            raise SignatureError(f"{where} has a bad signature: it was modified after signing") from None


def generate_keypair() -> tuple[bytes, bytes]:
    """A new Ed25519 key pair as (private PEM, public PEM)."""
    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    return private, public


def write_keypair(out: Path, *, force: bool = False) -> tuple[Path, Path, str]:
    """Write a new key pair to ``out`` (private, mode 0600) and ``out.pub``; return the paths and key id."""
    pub_path = out.with_name(out.name + ".pub")
    if not force and (out.exists() or pub_path.exists()):
        raise ConfigError(f"{out} or {pub_path} already exists; pass force to replace it")
    private, public = generate_keypair()
    out.parent.mkdir(parents=True, exist_ok=True)
    # Create the private key file with restrictive permissions from the start.
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(private)
    os.chmod(out, 0o600)
    pub_path.write_bytes(public)
    return out, pub_path, Signer.from_pem(private).key_id


def _load_key(
    pem: bytes | str | Path, what: str, load: Callable[[bytes], object], cls: type[K], cannot: str, wrong: str
) -> K:
    data = _read(pem, what)
    try:
        key = load(data)
    # UnsupportedAlgorithm: a key type cryptography lacks; InternalError: OpenSSL refused the key bytes (its text
    # is a paragraph about its error stack; what the user needs is below).
    except (ValueError, TypeError, UnsupportedAlgorithm, InternalError) as e:
        reason = "its key bytes are corrupt" if isinstance(e, InternalError) else str(e)
        raise ConfigError(f"cannot load the Ed25519 {what}: {reason} ({cannot})") from None
    if not isinstance(key, cls):
        raise ConfigError(f"the {what} is {type(key).__name__}, not Ed25519: {wrong}")
    return key


def _read(source: bytes | str | Path, what: str) -> bytes:
    if isinstance(source, bytes):
        return source
    if isinstance(source, str) and source.lstrip().startswith("-----BEGIN"):
        return source.encode("ascii")
    path = Path(source)
    try:
        return path.read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read the {what} file {path}: {e.strerror}") from None
