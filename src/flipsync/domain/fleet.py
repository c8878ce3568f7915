"""Fleet membership: the `MemberRecord` a replica keeps on the board, and the routing rules read from it, so a
gateway and any client route alike. Pure, no I/O. See docs/fleet.md#readiness-rules."""

from __future__ import annotations

import random
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import urlsplit

from flipsync.domain.balance import EngineLoad, load_key
from flipsync.domain.manifest import Signature, SignedRecord, check_name, check_time, load_json, parse_time
from flipsync.errors import IntegrityError

MEMBER_SCHEMA = 1
# The replica's reconcile-loop states (flipsync.sidecar.records.State) and "draining" (leaving on SIGTERM).
MEMBER_STATES = ("idle", "fetching", "staging", "committing", "error", "draining")
MAX_TTL_S = 3600.0
MAX_URL = 512
MAX_RECORD_BYTES = 16 << 10
# An OpenAI model name: no spaces, no '@' (a gateway request may say ``NAME@FORMAT``).
_MODEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/+-]{0,255}")
_FORMAT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}")
_HEX = re.compile(r"[0-9a-f]{1,128}")
_TOKENIZER = re.compile(r"[A-Za-z0-9._:-]{1,80}")
# The JSON keys in the order ``to_dict`` writes them (``lag`` is derived: checked, not stored).
_FIELDS = (
    "schema",
    "replica",
    "run",
    "island",
    "url",
    "engine",
    "served_format",
    "model",
    "version",
    "view_fp",
    "head",
    "lag",
    "state",
    "serving",
    "in_flight",
    "heartbeat",
    "ttl_s",
    "started",
    "seq",
    "load",
    "tokenizer",
    "signature",
)


def _fail(msg: str) -> IntegrityError:
    return IntegrityError(f"invalid member record: {msg}")


def _int(value: object, what: str, *, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:  # a JSON true is not a count
        raise _fail(f"{what} must be a non-negative integer{' or null' if optional else ''}, got {value!r}")
    return value


def check_url(value: object) -> str:
    """A replica's public URL: ``http(s)://host[:port][/path]``, no credentials, query or fragment."""
    if not isinstance(value, str) or not value or len(value) > MAX_URL or not value.isascii():
        raise _fail(f"url must be an ASCII http(s) URL of at most {MAX_URL} characters, got {value!r}")
    try:
        parts = urlsplit(value)
        port = parts.port  # raises ValueError when out of range
    except ValueError:
        raise _fail(f"url {value!r} is not a valid URL") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise _fail(f"url must be http:// or https:// with a host, got {value!r}")
    if parts.username is not None or parts.password is not None or parts.query or parts.fragment:
        raise _fail(f"url may not carry credentials, a query or a fragment, got {value!r}")
    if any(c.isspace() for c in value) or port == 0:
        raise _fail(f"url {value!r} is not a valid URL")
    return value


def check_model(value: object) -> str:
    if not isinstance(value, str) or not _MODEL.fullmatch(value):
        raise _fail(f"model must be 1-256 characters of [A-Za-z0-9._:/+-] (no '@'), got {value!r}")
    return value


@dataclass(frozen=True)
class MemberRecord(SignedRecord):
    """What one replica's sidecar says about it: ``version`` the verified version the engine holds, ``head`` the
    newest the sidecar saw; the record was written at ``heartbeat`` and stays valid ``ttl_s``; ``started`` is
    when this sidecar life began, ``seq`` the record's count in it."""

    replica: str
    run: str
    island: str
    url: str
    engine: str
    served_format: str
    model: str
    version: int | None
    view_fp: str | None
    head: int | None
    state: str
    serving: bool
    in_flight: int
    heartbeat: str
    ttl_s: float
    started: str
    seq: int = 0
    load: EngineLoad | None = None  # what the engine says of its load (optional: older records lack it)
    tokenizer: str | None = None  # a digest of how the engine tokenizes (optional: None where it cannot tell)
    signature: Signature | None = None
    schema: int = MEMBER_SCHEMA
    _json_keys = _FIELDS

    def __post_init__(self) -> None:
        if self.schema != MEMBER_SCHEMA or isinstance(self.schema, bool):
            raise _fail(f"schema {self.schema!r} is not supported (this flipsync reads {MEMBER_SCHEMA}); upgrade")
        check_name(self.replica, "replica", _fail)
        check_name(self.run, "run", _fail)
        check_name(self.island, "island", _fail)
        check_url(self.url)
        check_name(self.engine, "engine", _fail)
        if not isinstance(self.served_format, str) or not _FORMAT.fullmatch(self.served_format):
            raise _fail(f"served_format must be 1-64 characters of [A-Za-z0-9._+-], got {self.served_format!r}")
        check_model(self.model)
        _int(self.version, "version", optional=True)
        _int(self.head, "head", optional=True)
        if self.view_fp is not None and (not isinstance(self.view_fp, str) or not _HEX.fullmatch(self.view_fp)):
            raise _fail(f"view_fp must be 1-128 lowercase hex characters or null, got {self.view_fp!r}")
        if (self.version is None) != (self.view_fp is None):
            raise _fail("version and view_fp are both set (a verified version) or both null")
        if self.state not in MEMBER_STATES:
            raise _fail(f"state must be one of {list(MEMBER_STATES)}, got {self.state!r}")
        if not isinstance(self.serving, bool):
            raise _fail(f"serving must be true or false, got {self.serving!r}")
        if self.serving and self.version is None:
            raise _fail("a replica without a version cannot be serving")
        _int(self.in_flight, "in_flight")
        check_time(self.heartbeat, "heartbeat", _fail)
        check_time(self.started, "started", _fail)
        ttl = self.ttl_s
        if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not (0 < ttl <= MAX_TTL_S):
            raise _fail(f"ttl_s must be a number of seconds in (0, {MAX_TTL_S:g}], got {ttl!r}")
        _int(self.seq, "seq")
        if self.signature is not None and not isinstance(self.signature, Signature):
            raise _fail("signature must be a Signature or null")
        if self.load is not None and not isinstance(self.load, EngineLoad):
            raise _fail("load must be an EngineLoad or null")
        if self.tokenizer is not None and (
            not isinstance(self.tokenizer, str) or not _TOKENIZER.fullmatch(self.tokenizer)
        ):
            raise _fail(f"tokenizer must be 1-80 characters of [A-Za-z0-9._:-] or null, got {self.tokenizer!r}")

    # -- derived ------------------------------------------------------------------------------------

    @property
    def lag(self) -> int | None:
        """HEAD as the sidecar last saw it, minus the version it holds (None when either is unknown)."""
        return lag_behind(self, self.head)

    @property
    def heartbeat_at(self) -> datetime:
        return parse_time(self.heartbeat)

    @property
    def draining(self) -> bool:
        return self.state == "draining"

    # -- JSON -----------------------------------------------------------------------------------------

    def to_dict(self, *, with_signature: bool = True) -> dict[str, Any]:
        d = super().to_dict(with_signature=with_signature)
        # Left out when unknown, so a record without it reads as before (and older readers still parse it).
        load = d.pop("load")
        if load is not None:
            d["load"] = load.to_dict()
        if d.get("tokenizer", "") is None:  # likewise
            del d["tokenizer"]
        return d

    @classmethod
    def from_json(cls, text: str | bytes) -> MemberRecord:
        """Parse and validate; every problem raises IntegrityError naming the field."""
        if len(text) > MAX_RECORD_BYTES:
            raise _fail(f"{len(text)} bytes, at most {MAX_RECORD_BYTES} allowed")
        d = load_json(text, _fail, _FIELDS, optional=("signature", "load", "tokenizer"))
        if d.get("load") is not None:
            d["load"] = EngineLoad.from_dict(d["load"])
        lag, sig = d.pop("lag"), d.pop("signature", None)
        try:
            record = cls(**d, signature=None if sig is None else _signature(sig))
        except TypeError as e:  # an unhashable value where a name belongs, and the like
            raise _fail(str(e)) from None
        if lag != record.lag:
            raise _fail(f"lag {lag!r} is not head - version ({record.lag!r})")
        return record


def _signature(d: object) -> Signature:
    try:
        return Signature.from_dict(d)
    except IntegrityError as e:
        raise _fail(str(e).removeprefix("invalid manifest: ")) from None


# -- liveness and routing -------------------------------------------------------------------------------


def liveness(
    record: MemberRecord, now: datetime, *, max_skew_s: float = 5.0, max_ttl_s: float | None = None
) -> str | None:
    """Why ``record`` is not live at ``now`` (expired, or written in the future beyond the clock skew
    allowed), or None when it is. ``max_ttl_s`` caps the TTL a record may claim for itself."""
    age = (now - record.heartbeat_at).total_seconds()
    if age < -max_skew_s:
        return f"its heartbeat is {-age:.1f} s in the future (clocks more than {max_skew_s:g} s apart?)"
    ttl = record.ttl_s if max_ttl_s is None else min(record.ttl_s, max_ttl_s)
    if age > ttl:
        return f"expired: last heartbeat {age:.1f} s ago (TTL {ttl:g} s)"
    return None


def lag_behind(record: MemberRecord, head: int | None) -> int | None:
    """How many versions ``record``'s replica is behind ``head`` (the board's HEAD), None when unknown."""
    return None if head is None or record.version is None else max(0, head - record.version)


def is_ready(record: MemberRecord, head: int | None, max_lag: int) -> bool:
    """In rotation for unconstrained traffic: serving a verified version within ``max_lag`` of HEAD."""
    lag = lag_behind(record, head)
    return record.serving and not record.draining and lag is not None and lag <= max_lag


@dataclass(frozen=True)
class Want:
    """What one request asks of the replica that serves it."""

    min_version: int | None = None
    exact_version: int | None = None
    model: str | None = None
    served_format: str | None = None
    run: str | None = None

    @property
    def constrained(self) -> bool:
        return self.min_version is not None or self.exact_version is not None

    def describe(self) -> str:
        asks = (
            ("exactly v", self.exact_version),
            ("at least v", self.min_version),
            ("model ", self.model),
            ("format ", self.served_format),
            ("run ", self.run),
        )
        return ", ".join(f"{what}{value}" for what, value in asks if value is not None) or "any ready replica"


def serves(record: MemberRecord, want: Want) -> bool:
    """Whether the replica serves what the request names: its model, served format and run."""
    if want.model is not None and record.model != want.model:
        return False
    if want.served_format is not None and record.served_format.lower() != want.served_format.lower():
        return False
    return want.run is None or record.run == want.run


def satisfies(version: int | None, want: Want) -> bool:
    """Whether ``version`` meets the request's version constraint (the stricter of min and exact)."""
    if version is None:
        return False
    if want.exact_version is not None and version != want.exact_version:
        return False
    return want.min_version is None or version >= want.min_version


def admits(record: MemberRecord, want: Want, head: int | None, max_lag: int) -> bool:
    """Whether the request may be sent to ``record``'s replica: it serves the model, format and run asked
    for, is serving and not draining, and holds a version that meets the constraint, or (no constraint) is
    ready."""
    if not serves(record, want) or not record.serving or record.draining:
        return False
    return satisfies(record.version, want) if want.constrained else is_ready(record, head, max_lag)


def floor_version(want: Want, head: int | None, max_lag: int) -> int | None:
    """The ``min_version`` a gateway asks a replica to enforce for an unconstrained request (HEAD - max_lag),
    so that the replica, which knows the version it holds, refuses when its record was out of date."""
    return None if want.constrained or head is None else max(0, head - max_lag)


def rank(
    candidates: Iterable[MemberRecord], in_flight: Mapping[str, int] | None = None, rng: random.Random | None = None
) -> list[MemberRecord]:
    """Least loaded first (``balance.load_key``: the caller's own count, exact this instant, plus what the engine
    queues, then its KV-cache use, then the record's in-flight count, a heartbeat old); among equals the newer
    version, then at random with ``rng`` (so that sequential traffic spreads over equals) or by replica id (a
    stable order)."""
    mine = in_flight or {}
    items = list(candidates)
    ties = {r.replica: rng.random() for r in items} if rng is not None else {}
    return sorted(
        items,
        key=lambda r: (
            *load_key(mine.get(r.replica, 0), r.load, r.in_flight),
            -(r.version if r.version is not None else -1),
            ties.get(r.replica, 0.0),
            r.replica,
        ),
    )


def readiness(records: Sequence[MemberRecord], head: int | None) -> float | None:
    """The fraction of live replicas that serve HEAD (None without replicas or without a HEAD)."""
    if not records or head is None:
        return None
    return sum(1 for r in records if r.serving and not r.draining and r.version == head) / len(records)


def replica_id_for(url: str) -> str:
    """A replica id from its URL: ``host-port`` in the board's name characters (``10.0.0.5-8100``)."""
    parts = urlsplit(url)
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        port = 0
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", f"{parts.hostname or 'replica'}-{port}").strip("-._")
    return name[:128] or "replica"


def tokenizer_outliers(records: Iterable[MemberRecord]) -> dict[str, str]:
    """The replicas that tokenize differently from the others behind their model name, each with why: per model,
    the tokenizer digest most replicas report wins (a tie: the one whose replica has served longest, by
    ``started``), and a replica reporting another is an outlier. A replica that reports none is never one (it
    cannot be judged). One model name must answer one way: the same prompt as the same token ids."""
    by_model: dict[str, dict[str, list[MemberRecord]]] = {}
    for r in records:
        if r.tokenizer is not None:
            by_model.setdefault(r.model, {}).setdefault(r.tokenizer, []).append(r)
    out: dict[str, str] = {}
    for model, groups in by_model.items():
        if len(groups) < 2:
            continue
        winner = min(groups, key=lambda t: (-len(groups[t]), min(r.started for r in groups[t]), t))
        for digest, members in groups.items():
            if digest == winner:
                continue
            for r in members:
                out[r.replica] = (
                    f"replica {r.replica} serves model {model!r} with tokenizer {digest}, but {len(groups[winner])} "
                    f"replica(s) serve it with tokenizer {winner} (BOS rule, special tokens or chat template differ): "
                    f"one model name must tokenize one way; serve the same model folder or give it another "
                    f"--model-name"
                )
    return out
