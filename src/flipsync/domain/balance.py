"""How a fleet's load is spread: the load an engine reports (`EngineLoad`, on member records), the affinity key of
a request (a session, or a GRPO group's prompt), and rendezvous hashing with bounded load over the replicas that
may serve it. Pure, no I/O. See docs/fleet.md#affinity and docs/fleet.md#load-from-the-engines."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from flipsync.errors import IntegrityError

_LOAD_KEYS = ("waiting", "running", "kv_cache")
MAX_AFFINITY_KEY = 256  # characters of a client-given session id kept (longer ones are hashed whole)


@dataclass(frozen=True)
class EngineLoad:
    """What an engine says of its load: requests queued (``waiting``) and being generated (``running``), and the
    fraction of its KV cache in use (``kv_cache``, 0..1). Any may be None (the engine does not report it)."""

    waiting: int | None = None
    running: int | None = None
    kv_cache: float | None = None

    def __post_init__(self) -> None:
        for name in ("waiting", "running"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise IntegrityError(f"invalid member record: load.{name} must be a non-negative integer or null")
        kv = self.kv_cache
        if kv is not None and (isinstance(kv, bool) or not isinstance(kv, int | float) or not 0 <= kv <= 1):
            raise IntegrityError("invalid member record: load.kv_cache must be a number in [0, 1] or null")

    def to_dict(self) -> dict[str, Any]:
        return {"waiting": self.waiting, "running": self.running, "kv_cache": self.kv_cache}

    @classmethod
    def from_dict(cls, d: object) -> EngineLoad:
        if not isinstance(d, dict) or set(d) - set(_LOAD_KEYS):
            raise IntegrityError(f"invalid member record: load must be an object with keys {list(_LOAD_KEYS)}")
        return cls(**{k: d.get(k) for k in _LOAD_KEYS})

    @property
    def queued(self) -> int:
        """Requests the engine holds but has not started (0 when unknown)."""
        return self.waiting or 0


def load_key(mine: int, load: EngineLoad | None, record_in_flight: int) -> tuple[float, float, int]:
    """The sort key of a replica by load, least first: this caller's own requests there (exact, now) plus what
    the engine queues (everyone's, a heartbeat old), then its KV-cache use in tenths (a nearly full cache
    preempts), then the requests in flight its record counts."""
    queued = 0 if load is None else load.queued
    kv = 0.0 if load is None or load.kv_cache is None else math.floor(load.kv_cache * 10) / 10
    return (mine + queued, kv, record_in_flight)


def affinity_key(session: str | None, user: object, prompt: object) -> str | None:
    """What ties a request to a replica: the session header, else the OpenAI ``user`` field, else a digest of
    the prompt's opening (the same prompt sampled n times, a GRPO group, or a conversation's first turn); None
    when the request says none of these."""
    if session:
        return "s:" + (session if len(session) <= MAX_AFFINITY_KEY else _digest(session))
    if isinstance(user, str) and user:
        return "u:" + (user if len(user) <= MAX_AFFINITY_KEY else _digest(user))
    if prompt is None:
        return None
    return "p:" + _digest(repr(prompt))


def prompt_opening(doc: Mapping[str, Any], prefix_chars: int) -> object:
    """The part of a request's prompt that names its group: a chat's messages up to and including the first user
    message (later turns append to them), or a completion prompt's first ``prefix_chars`` characters."""
    messages = doc.get("messages")
    if isinstance(messages, list) and messages:
        opening = []
        for m in messages:
            opening.append(m.get("content") if isinstance(m, dict) else m)
            if isinstance(m, dict) and m.get("role") == "user":
                break
        return (doc.get("model"), opening)
    prompt = doc.get("prompt")
    if isinstance(prompt, str) and prompt:
        return (doc.get("model"), prompt[:prefix_chars])
    if isinstance(prompt, list) and prompt:  # token ids, or a batch of prompts
        return (doc.get("model"), prompt[:prefix_chars])
    return None


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def rendezvous_score(key: str, replica: str) -> int:
    """Highest-random-weight hashing: every caller that knows the same replicas ranks them alike for ``key``, and
    a replica leaving moves only the keys it held."""
    h = hashlib.blake2b(f"{key}\x00{replica}".encode("utf-8", "surrogatepass"), digest_size=8)
    return int.from_bytes(h.digest(), "big")


def rendezvous_order(key: str, replicas: Sequence[str]) -> list[str]:
    return sorted(replicas, key=lambda r: rendezvous_score(key, r), reverse=True)


def load_cap(loads: Sequence[int], factor: float, floor: int) -> int:
    """Bounded-load consistent hashing: the most requests in flight a replica may hold and still take a new
    affine one, ``factor`` times the mean with this one counted (and never below ``floor``, so that light traffic
    keeps its affinity)."""
    if not loads:
        return floor
    return max(floor, math.ceil(factor * (sum(loads) + 1) / len(loads)))
