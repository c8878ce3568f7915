"""Reading a run's board: manifests (validated, signature-checked, cached by path: they never change once
written), listings, HEAD discovery and verified part downloads. Every board reader reads through a Catalog.
Only immutable manifests are trusted: the ``latest.json`` hint is where HEAD discovery starts, nothing more.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import blake3

from flipsync.board.layout import RunLayout, parse_span_name, parse_version_name
from flipsync.board.signing import Verifier
from flipsync.domain.manifest import Kind, Manifest, Part
from flipsync.errors import IntegrityError, NotFoundError
from flipsync.stores import Store

log = logging.getLogger(__name__)

_PARALLEL_HASH_BYTES = 8 << 20  # above this, let BLAKE3 use every core
_CHECK_SIZE_FIRST_BYTES = 64 << 20


def content_hash(data: bytes | bytearray | memoryview) -> str:
    """BLAKE3-256 hex of a part's bytes."""
    threads = blake3.blake3.AUTO if len(data) >= _PARALLEL_HASH_BYTES else 1
    return blake3.blake3(data, max_threads=threads).hexdigest()


class Catalog:
    """Read access to one run on a board."""

    def __init__(self, store: Store, run: str, *, verifier: Verifier | None = None, max_parallel: int = 8) -> None:
        self.store = store
        self.layout = RunLayout(run)
        self.run = run
        self.verifier = verifier
        self.max_parallel = max_parallel
        self._cache: dict[str, Manifest] = {}
        self._lock = threading.Lock()

    # -- manifests ------------------------------------------------------------------------------------

    def _read_manifest(self, path: str, expect: Callable[[Manifest], tuple[str, int | None, int]]) -> Manifest:
        """Read, parse, validate against its location, verify the signature; cache once all passed."""
        with self._lock:
            cached = self._cache.get(path)
        if cached is not None:
            return cached
        raw = self.store.get(path)
        where = f"{self.store.url}/{path}"
        try:
            m = Manifest.from_json(raw)
        except IntegrityError as e:
            raise IntegrityError(f"{where}: {e}") from None
        kind, base, target = expect(m)
        if m.run != self.run:
            raise IntegrityError(f"{where} belongs to run {m.run!r}, not {self.run!r}")
        if m.kind.value != kind or m.base_version != base or m.target_version != target:
            raise IntegrityError(
                f"{where} describes {m.kind.value} {m.base_version}->{m.target_version}, "
                f"but its location says {kind} {base}->{target}"
            )
        if self.verifier is not None:
            self.verifier.verify(m, where)
        with self._lock:
            self._cache[path] = m
        return m

    def version(self, v: int) -> Manifest:
        """The manifest of published version ``v`` (a patch from v-1, or a snapshot keyframe)."""

        def expect(m: Manifest) -> tuple[str, int | None, int]:
            return (Kind.KEYFRAME.value, None, v) if m.kind is Kind.KEYFRAME else (Kind.PATCH.value, v - 1, v)

        return self._read_manifest(self.layout.version_manifest(v), expect)

    def keyframe(self, v: int) -> Manifest:
        return self._read_manifest(self.layout.keyframe_manifest(v), lambda _m: (Kind.KEYFRAME.value, None, v))

    def span(self, base: int, target: int) -> Manifest:
        return self._read_manifest(self.layout.span_manifest(base, target), lambda _m: (Kind.SPAN.value, base, target))

    def read_many(self, reads: Sequence[Callable[[], Manifest]], problems: list[str] | None = None) -> list[Manifest]:
        """Read manifests in parallel, in order, skipping missing (retention) and unusable ones (in ``problems``)."""
        if not reads:
            return []

        def one(read: Callable[[], Manifest]) -> Manifest | None:
            try:
                return read()
            except NotFoundError:
                return None
            except IntegrityError as e:
                log.warning("skipping an unusable manifest: %s", e)
                if problems is not None:
                    problems.append(str(e))
                return None

        with ThreadPoolExecutor(min(self.max_parallel, len(reads)), thread_name_prefix="flipsync-m") as pool:
            return [m for m in pool.map(one, reads) if m is not None]

    def read_versions(self, versions: Iterable[int], problems: list[str] | None = None) -> dict[int, Manifest]:
        """``read_many`` of version manifests, by version."""
        return {m.version: m for m in self.read_many([partial(self.version, v) for v in versions], problems)}

    def artifact_dir(self, m: Manifest) -> str:
        """The folder of a manifest read through this catalog (a keyframe may be a version's snapshot)."""
        if m.kind is Kind.KEYFRAME:
            with self._lock:
                snapshot = self._cache.get(self.layout.version_manifest(m.version))
            return self.layout.artifact_dir(m, in_versions=snapshot == m)
        return self.layout.artifact_dir(m, in_versions=m.kind is Kind.PATCH)

    def forget(self, m: Manifest) -> None:
        """Drop a manifest from the cache (after it was found broken or deleted)."""
        with self._lock:
            for k in [k for k, v in self._cache.items() if v is m]:
                del self._cache[k]

    # -- listings -------------------------------------------------------------------------------------

    def list_versions(self) -> list[int]:
        """Version folders present (a folder may lack a manifest: a publish in progress, or crashed)."""
        names = self.store.list_dirs(self.layout.versions_dir)
        return sorted(v for n in names if (v := parse_version_name(n)) is not None)

    def list_keyframes(self) -> list[int]:
        names = self.store.list_dirs(self.layout.keyframes_dir)
        return sorted(v for n in names if (v := parse_version_name(n)) is not None)

    def list_spans(self) -> list[tuple[int, int]]:
        return sorted(s for n in self.store.list_dirs(self.layout.spans_dir) if (s := parse_span_name(n)) is not None)

    def has_version(self, v: int) -> bool:
        return self.store.exists(self.layout.version_manifest(v))

    def read_hint(self) -> int | None:
        """The ``latest.json`` hint, or None when it is missing or unreadable (it is only a hint)."""
        try:
            v = json.loads(self.store.get(self.layout.latest))["version"]
            return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None
        except NotFoundError:
            return None
        except (ValueError, KeyError, TypeError, RecursionError) as e:  # RecursionError: absurdly nested JSON
            log.warning("ignoring unreadable HEAD hint %s/%s: %s", self.store.url, self.layout.latest, e)
            return None

    def discover_head(self, known: int | None = None) -> int | None:
        """The newest version whose manifest exists (None: nothing published yet): from the larger of ``known``
        and the hint (or a listing, when that manifest is gone), gallop and bisect to the first missing version.
        Versions are contiguous: each is created only on top of the one before."""
        start = known
        hint = self.read_hint()
        if hint is not None and (start is None or hint > start) and self.has_version(hint):
            start = hint
        if start is not None and not self.has_version(start):
            start = None  # gone (retention or a rolled-back board): fall back to a listing
        if start is None:
            start = next((v for v in reversed(self.list_versions()) if self.has_version(v)), None)
            if start is None:
                return None
        # Gallop: find a step that is missing, then bisect between the last present and it.
        lo, step = start, 1
        while self.has_version(lo + step):
            lo, step = lo + step, step * 2
        hi = lo + step  # missing
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.has_version(mid):
                lo = mid
            else:
                hi = mid
        return lo

    # -- parts ----------------------------------------------------------------------------------------

    def _fetch_object(self, artifact_dir: str, rel: str, size: int) -> bytes:
        """Download one object of a part and check its size."""
        path = f"{artifact_dir}/{rel}"
        where = f"{self.store.url}/{path}"
        try:
            if size > _CHECK_SIZE_FIRST_BYTES:
                # Large reads allocate the whole object up front: confirm the size before trusting it.
                actual_size = self.store.head(path).size
                if actual_size != size:
                    raise IntegrityError(f"part {where} has {actual_size} bytes, its manifest says {size}")
            data = self.store.get(path, size=size)
        except NotFoundError:
            raise IntegrityError(f"part {where} is missing, though its manifest lists it") from None
        if len(data) != size:
            raise IntegrityError(f"part {where} has {len(data)} bytes, its manifest says {size}")
        return data

    def fetch_parts(self, m: Manifest, artifact_dir: str, parts: Sequence[Part] | None = None) -> list[bytes]:
        """Download and verify parts (all of the manifest's by default), their objects in parallel; in order."""
        todo = list(m.parts if parts is None else parts)
        objects = [o for p in todo for o in p.objects]
        if len(objects) == 1:
            got = [self._fetch_object(artifact_dir, *objects[0])]
        else:
            with ThreadPoolExecutor(min(self.max_parallel, len(objects)), thread_name_prefix="flipsync-part") as pool:
                got = list(pool.map(lambda o: self._fetch_object(artifact_dir, *o), objects))
        out, i = [], 0
        for p in todo:
            pieces = got[i : i + len(p.objects)]
            i += len(pieces)
            data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
            actual = content_hash(data)
            if actual != p.hash:
                where = f"{self.store.url}/{artifact_dir}/{p.path}"
                raise IntegrityError(
                    f"part {where} is corrupt: BLAKE3 {actual[:16]}..., manifest says {p.hash[:16]}..."
                )
            out.append(data)
        return out
