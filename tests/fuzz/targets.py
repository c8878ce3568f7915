"""Fuzz targets: each takes arbitrary bytes and may fail only with the flipsync error its contract names.

Any other exception, a wrong result, more than ``-timeout`` seconds on one input or more than
``-rss_limit_mb`` of memory is a finding. The targets are plain callables, so the regression tests run them
without atheris; ``main`` runs one under atheris (libFuzzer) with seeds built in process.

- ``patch``: a patch file (safetensors container) -> ``Patch.from_bytes``, every section decoded, a
  re-encode round trip, and an apply onto the seed's base view that either refuses and leaves the tensors
  untouched or yields exactly the verified target.
- ``sections``: the patch header's rows JSON (its fixed fields as hex under ``refs``) and the section
  streams, re-wrapped into a valid container, so that mutations reach the header validation and the stream
  decoders (rice, zstd, bits, rANS, ctx, kind flags) instead of dying in the container's own zstd layer.
- ``ctx``: a ``ctx`` position stream with its parameters (``CTX_PARAMS`` bytes: base index, n, classes,
  nbits) decoded against one of a few seed bases by the one-thread pass, the chunked pass on a pool, and
  both with the receiver's class index: all refuse it (``CorruptPatchError``) or all give the same n sorted
  positions inside the tensor.
- ``manifest``: manifest JSON -> ``Manifest.from_json``, canonical round trip, signature verification,
  board placement and catch-up planning.
- ``keyframe``: a keyframe's index JSON and one shard -> ``tensors_from_files`` and fingerprints.
- ``keys``: PEM bytes given as a signing or verification key -> ``Signer``/``Verifier.from_pem``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import safetensors.numpy
import torch
import zstandard
from obstore.store import MemoryStore

try:
    import atheris
except ImportError:  # the targets still run as plain functions (regression tests); only fuzzing needs it
    atheris = None

# numba compiles the kernels of every module that imports it (or the codec's ``kernel`` decorator) from their
# bytecode, which must stay free of atheris's hooks: found by scanning the source, so that moving a kernel
# cannot break the fuzz run.
_SRC = Path(__file__).resolve().parents[2] / "src"
_NUMBA_MODULES = [
    ".".join(p.relative_to(_SRC).with_suffix("").parts)
    for p in sorted((_SRC / "flipsync").rglob("*.py"))
    if re.search(r"^\s*(import numba|from numba|from flipsync\.codec\.jit import)", p.read_text(), re.MULTILINE)
]

with atheris.instrument_imports(include=["flipsync"], exclude=_NUMBA_MODULES) if atheris else contextlib.nullcontext():
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from flipsync.board.catalog import Catalog
    from flipsync.board.keyframes import INDEX_NAME, shard_name, tensors_from_files
    from flipsync.board.layout import RunLayout
    from flipsync.board.signing import Signer, Verifier
    from flipsync.codec import Patch, apply_patch
    from flipsync.codec.class_index import BaseBits, ClassIndex
    from flipsync.codec.container import CONTAINER_FORMAT, CONTAINER_KEY, HEADER_TENSOR
    from flipsync.codec.context import ContextCoder
    from flipsync.codec.fingerprint import FingerprintTable
    from flipsync.domain.catchup import plan_catchup
    from flipsync.domain.headers import varint
    from flipsync.domain.manifest import Kind, Manifest, canonical_json
    from flipsync.errors import (
        BoardError,
        ConfigError,
        CorruptPatchError,
        FlipsyncError,
        IntegrityError,
        PatchError,
    )
    from flipsync.stores import ObstoreStore

SEPARATOR = b"\x00"
Target = Callable[[bytes], None]


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and _bits(a[k]) == _bits(b[k]) for k in a
    )


class PatchTarget:
    """Decode a patch file completely, re-encode it, and apply it to the base it names when we hold it."""

    def __init__(self, cases: Iterable[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]]) -> None:
        # Views keyed by their fingerprint, so a fuzzed patch that still names a seed's base gets applied.
        self._views: dict[str, dict[str, torch.Tensor]] = {}
        for old, new in cases:
            for view in (old, new):
                self._views[FingerprintTable.of(view).view_fp()] = view

    def __call__(self, data: bytes) -> None:
        try:
            patch = Patch.from_bytes(data)
            # ctx positions decode only against their base: the seed view the header names
            changes = list(patch.changes(self._views.get(patch.header.base.view)))
        except CorruptPatchError:  # the decoder's whole contract: this, or a patch that decodes
            return
        except PatchError:  # or, for a ctx patch, a base we do not hold or that differs from its layout
            if not patch.needs_base:
                raise
            return
        assert container_end(data) == len(data), "a patch file with bytes past its container was accepted"
        for s, c in zip(patch.sections, changes, strict=True):
            assert c.positions.dtype == np.int64 and c.positions.size == c.values.size == s.n, s.name
            assert c.raw is None or c.raw.size == s.n, s.name
            assert s.n == 0 or (np.all(np.diff(c.positions) > 0) and c.positions[0] >= 0 and c.positions[-1] < s.numel)
        self._round_trip(patch, changes)
        self._apply(patch)

    @staticmethod
    def _round_trip(patch: Patch, changes: list) -> None:
        h = patch.header
        again = Patch.from_changes(changes, base=h.base, target=h.target, served_format=h.served_format, meta=h.meta)
        back = Patch.from_bytes(again.to_bytes())
        assert [s.name for s in back.sections] == [s.name for s in h.sections]
        for a, b in zip(changes, back.changes(), strict=True):
            assert np.array_equal(a.positions, b.positions) and np.array_equal(a.values, b.values), a.name
            assert (a.raw is None) == (b.raw is None) or a.mode == b.mode, a.name

    def _apply(self, patch: Patch) -> None:
        base = self._views.get(patch.header.base.view)
        if base is None:
            return
        work = {k: v.clone() for k, v in base.items()}
        table = FingerprintTable.of(work)
        try:
            result = apply_patch(work, patch, table, verify="digest")
        except PatchError:
            assert _same(work, base), "a refused apply changed the tensors"
            return
        # Finding F3: stage now refuses a header whose target view would not result, so every apply that
        # succeeds ends exactly at the view the header names.
        assert table.view_fp() == patch.header.target.view, "an apply ended at a view other than its target"
        result.undo.rollback(work, table)
        assert _same(work, base) and table.view_fp() == patch.header.base.view, "a rollback left other bits"
        apply_patch(work, patch, table, verify="digest")
        expected = self._views.get(patch.header.target.view)
        assert expected is None or _same(work, expected), "an apply reached the target fingerprint with other bits"


CTX_PARAMS = 7  # base index (1 byte), n (uint32 LE), classes (1 byte), nbits (1 byte)


class CtxTarget:
    """Decode a ctx position stream against a seed base with the one-thread and the chunked pass, each with its
    emit branching and branch-free, and with the receiver's class index: placed block by block, or chunked
    with the index's counts."""

    def __init__(self, bases: list[BaseBits]) -> None:
        self.bases = bases
        self.indexed = [ClassIndex(min_blocks=0).base("t", b.bits, b.dtype, fp=0) for b in bases]
        self.coders = (
            (ContextCoder(workers=1, dense_from=2.0), False),
            (ContextCoder(chunk=61, parallel_from=0, workers=3, dense_from=2.0), False),
            (ContextCoder(workers=1, dense_from=0.0), False),
            (ContextCoder(chunk=61, parallel_from=0, workers=3, dense_from=0.0), False),
            (ContextCoder(place_upto=float("inf")), True),
            (ContextCoder(chunk=61, parallel_from=0, workers=3, place_upto=0.0), True),
        )

    @staticmethod
    def pack(base_index: int, n: int, params: dict, blob: bytes) -> bytes:
        head = bytes([base_index]) + n.to_bytes(4, "little") + bytes([params["classes"] & 0xFF, params["nbits"]])
        return head + blob

    def __call__(self, data: bytes) -> None:
        if len(data) < CTX_PARAMS:
            return
        base, indexed = self.bases[data[0] % len(self.bases)], self.indexed[data[0] % len(self.bases)]
        n = int.from_bytes(data[1:5], "little")
        params = {"codec": "ctx", "classes": data[5], "nbits": data[6]}
        blob = data[CTX_PARAMS:]
        results = []
        for coder, with_index in self.coders:
            try:
                results.append(coder.decode(params, blob, n, base.bits.size, indexed if with_index else base))
            except CorruptPatchError:
                results.append(None)
        out = results[0]
        assert all((r is None) == (out is None) for r in results), "the chunked, one-thread and indexed passes disagree"
        if out is None:
            return
        assert out.dtype == np.int64 and out.size == n
        assert np.all(np.diff(out) > 0) and out[0] >= 0 and out[-1] < base.bits.size
        assert all(np.array_equal(r, out) for r in results), "the chunked, one-thread and indexed passes disagree"


def container_end(data: bytes) -> int:
    """Where a (parsed) patch file's safetensors container ends: its header, then its last tensor's bytes."""
    hlen = int.from_bytes(data[:8], "little")
    doc = json.loads(data[8 : 8 + hlen])
    return 8 + hlen + max((e["data_offsets"][1] for k, e in doc.items() if k != "__metadata__"), default=0)


def wrap_sections(data: bytes) -> bytes:
    """A patch file around ``rows JSON NUL section streams``: the rows' ``refs`` (hex) become the header's fixed
    fields, every section reads the small sections of the header tensor."""
    header, _, blob = data.partition(SEPARATOR)
    refs = b""
    try:
        doc = json.loads(header)
        refs = bytes.fromhex(doc.pop("refs"))
        header = json.dumps(doc, separators=(",", ":")).encode()
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        pass  # not such a document: the bytes go in as they are
    packed = zstandard.ZstdCompressor(level=1).compress(header)
    tail = b"".join(varint(len(part)) + part for part in (refs, packed, b"", b"")) + blob
    arrays = {HEADER_TENSOR: np.frombuffer(tail, dtype=np.uint8)}
    return safetensors.numpy.save(arrays, metadata={CONTAINER_KEY: CONTAINER_FORMAT})


class SectionsTarget(PatchTarget):
    def __call__(self, data: bytes) -> None:
        super().__call__(wrap_sections(data))


class ManifestTarget:
    """Parse a manifest as a reader does, then use it the ways a reader does; the same bytes as the run's
    ``latest.json`` HEAD hint must read as a version or as no hint, never raise."""

    def __init__(self) -> None:
        self._verifier = Verifier([Ed25519PrivateKey.generate().public_key()])
        self._catalog = Catalog(ObstoreStore(MemoryStore(), "memory://"), "run-1")

    def __call__(self, data: bytes) -> None:
        self._catalog.store.put(self._catalog.layout.latest, data)
        hint = self._catalog.read_hint()
        assert hint is None or (isinstance(hint, int) and hint >= 0)
        try:
            m = Manifest.from_json(data)
        except IntegrityError:
            return
        text = m.to_json()
        assert Manifest.from_json(text) == m and canonical_json(m.to_dict()) == text
        assert m.signing_payload().decode("ascii")
        with contextlib.suppress(IntegrityError):  # unsigned, or signed by another key: refused cleanly
            self._verifier.verify(m)
        with contextlib.suppress(BoardError):  # e.g. a version number past what a board folder can name
            layout = RunLayout(m.run)
            layout.artifact_dir(m, in_versions=m.kind is not Kind.SPAN)
        assert m.total_size >= 0
        start = None if m.kind is Kind.KEYFRAME else m.base_version
        plan = plan_catchup(start, m.target_version, [m])
        assert plan.steps == (m,) and plan.describe()


class KeyframeTarget:
    """Rebuild a one-shard keyframe from ``index JSON NUL shard`` and fingerprint the view it holds."""

    def __call__(self, data: bytes) -> None:
        index, _, shard = data.partition(SEPARATOR)
        try:
            tensors = tensors_from_files({INDEX_NAME: index, shard_name(1, 1): shard})
        except IntegrityError:
            return
        # A view the codec cannot fingerprint (e.g. a complex dtype) must be refused by a flipsync error.
        with contextlib.suppress(FlipsyncError):
            FingerprintTable.of(tensors).view_fp()


class KeysTarget:
    """Bytes handed over as a signing key, or as a key to verify with."""

    def __call__(self, data: bytes) -> None:
        for load in (Signer.from_pem, Verifier.from_pem):
            with contextlib.suppress(ConfigError):
                load(data)


def build(name: str) -> tuple[Target, list[bytes]]:
    """A target and its seed inputs (real artifacts built in process)."""
    from tests.fuzz import seeds

    if name in ("patch", "sections"):
        cases = seeds.patch_cases()
        pairs = [(c.old, c.new) for c in cases]
        if name == "patch":
            return PatchTarget(pairs), [c.data for c in cases] + seeds.spliced_patches(cases)
        inputs = [seeds.split_sections(c.data) for c in cases]
        return SectionsTarget(pairs), inputs
    if name == "ctx":
        bases, inputs = seeds.ctx_seeds()
        return CtxTarget(bases), [CtxTarget.pack(*i) for i in inputs]
    if name == "manifest":
        return ManifestTarget(), seeds.manifest_seeds()
    if name == "keyframe":
        return KeyframeTarget(), seeds.keyframe_seeds()
    if name == "keys":
        return KeysTarget(), seeds.key_seeds()
    raise ValueError(f"unknown fuzz target {name!r}")


# libFuzzer options every run gets unless the command line sets them: one input may take at most 10 s and
# the process at most 3 GiB (torch and numba alone take about 0.6 GiB), so blowups are findings.
DEFAULTS = {"-timeout": "10", "-rss_limit_mb": "3072", "-max_len": "65536"}


def main(name: str, argv: list[str] | None = None) -> None:
    """``python tests/fuzz/fuzz_<name>.py [libFuzzer flags] [CORPUS_DIR]``; seeds go into the corpus."""
    if atheris is None:
        sys.exit("atheris is not installed: pip install atheris (wheels: Linux x86_64, CPython 3.11-3.13)")
    args = list(sys.argv if argv is None else argv)
    dirs = [a for a in args[1:] if not a.startswith("-")]
    if not dirs:
        dirs = [tempfile.mkdtemp(prefix=f"flipsync-fuzz-{name}-")]
        args.append(dirs[0])
    target, seed_inputs = build(name)
    corpus = Path(dirs[0])
    corpus.mkdir(parents=True, exist_ok=True)
    for i, seed in enumerate(seed_inputs):
        path = corpus / f"seed-{i:02d}"
        if not path.exists():
            path.write_bytes(seed)
    for flag, value in DEFAULTS.items():
        if not any(a.startswith(flag + "=") for a in args):
            args.insert(1, f"{flag}={value}")
    print(f"fuzzing {name}: corpus {corpus} ({len(seed_inputs)} seeds)", file=sys.stderr)
    atheris.Setup(args, target)
    atheris.Fuzz()


def main_each(names: list[str], folder: Path, libfuzzer_args: list[str]) -> dict[str, int]:
    """Fuzz each of ``names`` in turn, each in a child forked from this process, which imported (and
    instrumented) flipsync once: a fresh interpreter per target spent ~3.5 s of CPU on its imports alone. A
    target's corpus goes to ``folder/NAME/corpus``, its findings to ``folder/NAME/artifacts/``, its libFuzzer
    output to ``folder/NAME.log``; the exit status of each (0: no finding)."""
    codes: dict[str, int] = {}
    for name in names:
        (folder / name / "artifacts").mkdir(parents=True, exist_ok=True)
        log = os.open(folder / f"{name}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: libFuzzer ends the process itself; anything else is a failure
            code = 70
            try:
                os.dup2(log, 2)
                os.dup2(log, 1)
                args = [f"fuzz_{name}", f"-artifact_prefix={folder / name / 'artifacts'}/", *libfuzzer_args]
                main(name, [*args, str(folder / name / "corpus")])
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                os._exit(code)
        os.close(log)
        codes[name] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    return codes
