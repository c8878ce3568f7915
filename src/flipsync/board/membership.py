"""Fleet membership on the board: `MemberWriter` keeps one replica's record, `MemberReader` lists the live ones
and says why it refuses the others. See docs/fleet.md#membership."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime

from flipsync.board.layout import RUNS, RunLayout
from flipsync.board.signing import Signer, Verifier
from flipsync.domain.fleet import MAX_RECORD_BYTES, MemberRecord, liveness
from flipsync.errors import FlipsyncError, IntegrityError, NotFoundError, SignatureError
from flipsync.stores import ObjectInfo, Store

log = logging.getLogger(__name__)

# Why a record is not routed to (the ``reason`` of `Rejected`, and a metric label).
REASONS = (
    "malformed",
    "misplaced",
    "unsigned",
    "untrusted_key",
    "bad_signature",
    "expired",
    "future",
    "unreadable",
    "tokenizer_mismatch",  # routed by no gateway: its model name is served with another tokenizer (fleet.pool)
)


class MemberWriter:
    """Writes (and deletes) one replica's record under its run; signs it when given a signer."""

    def __init__(self, store: Store, run: str, *, signer: Signer | None = None) -> None:
        self.store = store
        self.layout = RunLayout(run)
        self.signer = signer

    def put(self, record: MemberRecord) -> MemberRecord:
        """Write ``record`` (signed, with a signer) over the replica's previous one; returns what was written."""
        if record.run != self.layout.run:
            raise IntegrityError(f"a record of run {record.run!r} does not belong under run {self.layout.run!r}")
        if self.signer is not None:
            record = record.with_signature(self.signer.sign_payload(record.signing_payload()))
        self.store.put(self.layout.member_path(record.replica), record.to_json().encode("ascii"))
        return record

    def remove(self, replica: str) -> None:
        """Delete the replica's record (leaving the fleet); a record already gone is fine."""
        self.store.delete([self.layout.member_path(replica)])


@dataclass(frozen=True)
class Rejected:
    """A record that routes no traffic, and why (``reason`` is one of `REASONS`)."""

    path: str
    reason: str
    message: str


@dataclass(frozen=True)
class MemberScan:
    """One look at the board's membership: the live, trusted records, and those refused."""

    live: tuple[MemberRecord, ...]
    rejected: tuple[Rejected, ...]
    runs: tuple[str, ...]
    at: datetime


@dataclass
class _Seen:
    listing: tuple[int, str, str | None]  # size, modified, ETag of the object when it was read
    record: MemberRecord | None = None
    error: Rejected | None = None


@dataclass
class MemberReader:
    """Reads the member records of ``runs`` (None: every run on the board, listed at each scan), verifying
    signatures with ``verifier``; a heartbeat may be ``max_skew_s`` in the future, ``max_ttl_s`` caps TTLs."""

    store: Store
    runs: tuple[str, ...] | None = None
    verifier: Verifier | None = None
    max_skew_s: float = 5.0
    max_ttl_s: float | None = None
    max_parallel_reads: int = 32
    _seen: dict[str, _Seen] = field(default_factory=dict, repr=False)
    _pool: ThreadPoolExecutor | None = field(default=None, repr=False)

    def scan(self, now: datetime | None = None) -> MemberScan:
        """Every run's records, split into live (and trusted) and rejected. Store failures propagate."""
        now = now or datetime.now(UTC)
        runs = self.runs if self.runs is not None else tuple(self.store.list_dirs(RUNS))
        live: list[MemberRecord] = []
        rejected: list[Rejected] = []
        objects = [
            (obj, run)
            for run in runs
            for obj in self.store.list(RunLayout(run).members_dir)
            if obj.path.endswith(".json")
        ]
        listed = {obj.path for obj, _ in objects}
        changed = [(o, run) for o, run in objects if getattr(self._seen.get(o.path), "listing", None) != _listing(o)]
        if len(changed) > 1:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.max_parallel_reads, thread_name_prefix="flipsync-members")
            list(self._pool.map(lambda item: self._read(*item), changed))
        for obj, run in objects:
            record, error = self._read(obj, run)
            if error is None and record is not None:
                why = liveness(record, now, max_skew_s=self.max_skew_s, max_ttl_s=self.max_ttl_s)
                if why is not None:
                    error = Rejected(obj.path, "future" if "future" in why else "expired", why)
            if error is not None:
                rejected.append(error)
            elif record is not None:
                live.append(record)
        for gone in set(self._seen) - listed:  # deleted records: forget them
            del self._seen[gone]
        return MemberScan(tuple(live), tuple(rejected), tuple(runs), now)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def _read(self, obj: ObjectInfo, run: str) -> tuple[MemberRecord | None, Rejected | None]:
        listing = _listing(obj)
        seen = self._seen.get(obj.path)
        if seen is not None and seen.listing == listing:
            return seen.record, seen.error
        record: MemberRecord | None = None
        error: Rejected | None = None
        if obj.size > MAX_RECORD_BYTES:
            error = Rejected(obj.path, "malformed", f"{obj.size} bytes, at most {MAX_RECORD_BYTES} allowed")
        else:
            try:
                record = self._check(obj.path, run, self.store.get(obj.path))
            except NotFoundError:
                return None, None  # deleted between the listing and the read: a replica that left
            except _Refused as e:
                error = Rejected(obj.path, e.reason, str(e))
            except SignatureError as e:
                error = Rejected(obj.path, "bad_signature", str(e))
            except IntegrityError as e:
                error = Rejected(obj.path, "malformed", str(e))
            except FlipsyncError as e:
                # Not cached: the next scan tries again.
                return None, Rejected(obj.path, "unreadable", str(e))
        if error is not None:
            log.debug("member record %s: %s", obj.path, error.message)
        self._seen[obj.path] = _Seen(listing, record, error)
        return record, error

    def _check(self, path: str, run: str, data: bytes) -> MemberRecord:
        record = MemberRecord.from_json(data)
        expected = RunLayout(run).member_path(record.replica)
        if record.run != run or expected != path:
            raise _Refused(
                f"{path} holds the record of replica {record.replica!r} of run {record.run!r}: a record lives "
                "at runs/<its run>/members/<its replica>.json (copied from elsewhere?)",
                "misplaced",
            )
        if self.verifier is not None:
            sig = record.signature
            if sig is None:
                raise _Refused(f"{path} is not signed, and this board's members must sign their records", "unsigned")
            if sig.key_id not in self.verifier.key_ids:
                raise _Refused(f"{path} is signed by key {sig.key_id}, not a trusted member key", "untrusted_key")
            self.verifier.verify_payload(sig, record.signing_payload(), path, what="member records")
        return record


class _Refused(IntegrityError):
    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def _listing(obj: ObjectInfo) -> tuple[int, str, str | None]:
    return (obj.size, obj.modified.isoformat(), obj.etag)
