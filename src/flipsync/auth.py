"""Client API keys (``Authorization: Bearer KEY``) for a sidecar's proxy and for the gateway, from a file (one key
a line) or the ``FLIPSYNC_API_KEYS`` environment variable (comma-separated). A request without a known key is
refused with 401 in OpenAI's error shape. Health, status and metrics routes stay open (docs/fleet.md#api-keys)."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from starlette.responses import JSONResponse

from flipsync.errors import ConfigError

log = logging.getLogger(__name__)

ENV_KEYS = "FLIPSYNC_API_KEYS"
ENV_REPLICA_KEY = "FLIPSYNC_REPLICA_API_KEY"
# Routes any caller may reach with or without a key: probes and scrapers (and the fleet's own control routes).
OPEN_PATHS = frozenset({"/livez", "/readyz", "/metrics", "/health"})
OPEN_PREFIX = "/flipsync/"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def _check_key(key: str, where: str) -> str:
    if not key or any(c.isspace() for c in key) or not key.isprintable():
        raise ConfigError(f"an API key in {where} is empty or holds whitespace or control characters: one key a line")
    return key


@dataclass(frozen=True)
class ApiKeys:
    """The keys a server accepts, kept as SHA-256 digests (a key is looked up in constant time per request)."""

    digests: frozenset[bytes]

    @classmethod
    def of(cls, keys: list[str], where: str = "the keys given") -> ApiKeys:
        if not keys:
            raise ConfigError(f"{where} holds no API key: every request would be refused; add one key a line")
        return cls(frozenset(_digest(_check_key(k, where)) for k in keys))

    @classmethod
    def load(cls, path: Path | None = None, environ: Mapping[str, str] | None = None) -> ApiKeys | None:
        """The keys of ``path`` (one a line; blank lines and ``#`` comments skipped) and of ``FLIPSYNC_API_KEYS``
        together; None when neither is given (no authentication)."""
        env = os.environ if environ is None else environ
        keys: list[str] = []
        given = False
        if path is not None:
            given = True
            try:
                text = path.read_text(encoding="utf-8")
            except OSError as e:
                raise ConfigError(f"cannot read the API keys file {path}: {e}") from None
            keys += [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
        if env.get(ENV_KEYS, "").strip():
            given = True
            keys += [k.strip() for k in env[ENV_KEYS].split(",") if k.strip()]
        if not given:
            return None
        where = " and ".join(w for w, on in ((str(path), path is not None), (ENV_KEYS, ENV_KEYS in env)) if on)
        return cls.of(keys, where)

    def allows(self, authorization: str | bytes | None) -> bool:
        """Whether an ``Authorization`` header value carries one of the keys (``Bearer KEY``)."""
        if authorization is None:
            return False
        if isinstance(authorization, bytes):
            authorization = authorization.decode("latin-1")
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return False
        digest = _digest(key.strip())
        # Digests of equal length compared without an early exit: the time taken says nothing of a key.
        return any(hmac.compare_digest(digest, d) for d in self.digests)


def is_open(path: str) -> bool:
    """Routes left open whatever the keys: health, readiness, status and metrics (probes and scrapers)."""
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIX)


def unauthorized(has_header: bool) -> JSONResponse:
    """401 as OpenAI answers it; ``x-should-retry: false``, since the same key fails again."""
    message = (
        "Incorrect API key provided: the key in the Authorization header is not one this server accepts"
        if has_header
        else "You didn't provide an API key: send it as 'Authorization: Bearer KEY'"
    )
    return JSONResponse(
        {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}},
        status_code=401,
        headers={"x-should-retry": "false", "WWW-Authenticate": 'Bearer realm="flipsync"'},
    )


def replica_key(given: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """The key a gateway sends to sidecars that require one: ``--replica-api-key``, else the environment's."""
    env = os.environ if environ is None else environ
    key = given if given is not None else env.get(ENV_REPLICA_KEY) or None
    return None if key is None else _check_key(key.strip(), "--replica-api-key / " + ENV_REPLICA_KEY)
