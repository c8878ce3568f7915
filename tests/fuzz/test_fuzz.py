"""The fuzz targets: their seeds and every finding as regression inputs (always), and a short coverage-guided
run of each target under atheris (where atheris installs: Linux x86_64, CPython 3.11-3.13)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from obstore.store import MemoryStore
from safetensors.torch import save

from flipsync.board.catalog import Catalog
from flipsync.board.keyframes import INDEX_NAME, parse_index, shard_name, tensors_from_files
from flipsync.board.signing import Signer, Verifier
from flipsync.codec import Patch
from flipsync.domain.manifest import Manifest
from flipsync.errors import ConfigError, CorruptPatchError, IntegrityError
from flipsync.stores import ObstoreStore
from tests.fuzz import seeds, targets

ROOT = Path(__file__).resolve().parents[2]
NAMES = ("patch", "sections", "ctx", "manifest", "keyframe", "keys")
SECONDS_PER_TARGET = 2  # six targets forked from one process that starts in ~3.5 s: about 20 s in all


@pytest.fixture(scope="module")
def cases() -> list[seeds.PatchCase]:
    return seeds.patch_cases()


def test_seeds_decode_and_pass_their_targets(cases: list[seeds.PatchCase]) -> None:
    """The seeds are real artifacts (so the fuzzer starts deep), and the targets accept them."""
    modes = {s.mode for c in cases for s in Patch.from_bytes(c.data).sections}
    assert modes == {"step", "raw", "mixed"}
    codecs = {(s.pos["codec"], s.val["codec"]) for c in cases for s in Patch.from_bytes(c.data).sections}
    assert {p for p, _ in codecs} == {"rice", "zstd", "ctx"} and len({v for _, v in codecs}) >= 2
    for name in NAMES:
        target, inputs = targets.build(name)
        assert inputs
        for data in inputs:
            target(data)


def test_mutated_ctx_streams_are_refused_or_decode_alike_in_both_passes() -> None:
    """Without atheris too: random flips, cuts and parameter changes of the ctx seeds through the ctx target."""
    target, inputs = targets.build("ctx")
    rng = np.random.default_rng(0)
    assert len(inputs) >= 10
    for data in inputs:
        for _ in range(60):
            raw = bytearray(data)
            how = rng.integers(0, 4)
            if how == 0:
                i = int(rng.integers(targets.CTX_PARAMS, len(raw)))
                raw[i] ^= 1 << int(rng.integers(0, 8))
            elif how == 1:
                raw = raw[: int(rng.integers(targets.CTX_PARAMS, len(raw)))]
            elif how == 2:
                raw[1:5] = int(rng.integers(0, 3 * int.from_bytes(raw[1:5], "little") + 8)).to_bytes(4, "little")
            else:
                raw[int(rng.integers(5, 7))] = int(rng.integers(0, 256))
            target(bytes(raw))  # only CorruptPatchError is caught inside; anything else fails here


def test_bytes_past_the_container_are_refused(cases: list[seeds.PatchCase]) -> None:
    """F6: a patch file that continued past its container (a truncated or spliced upload) was accepted."""
    target, _ = targets.build("patch")
    for data in seeds.spliced_patches(cases):
        with pytest.raises(CorruptPatchError, match="extra bytes past the end of its container"):
            Patch.from_bytes(data)
        target(data)
    for c in cases:
        assert targets.container_end(c.data) == len(c.data)


def test_the_sections_wrapper_rebuilds_each_seed_patch(cases: list[seeds.PatchCase]) -> None:
    for c in cases:
        again = Patch.from_bytes(targets.wrap_sections(seeds.split_sections(c.data)))
        original = Patch.from_bytes(c.data)
        assert again.header == original.header
        for a, b in zip(again.changes(c.old), original.changes(c.old), strict=True):
            assert (a.positions == b.positions).all() and (a.values == b.values).all()


def test_a_header_naming_another_target_view_is_rolled_back(cases: list[seeds.PatchCase]) -> None:
    """F3: apply_patch verifies tensors, not the header's target view; the rollback callers rely on restores."""
    target = targets.SectionsTarget([(c.old, c.new) for c in cases])
    header, _, blob = seeds.split_sections(cases[0].data).partition(seeds.SEPARATOR)
    doc = json.loads(header)
    h = Patch.from_bytes(cases[0].data).header
    doc["refs"] = replace(h, target=replace(h.target, view="0" * 32)).refs_bytes().hex()
    target(json.dumps(doc).encode() + seeds.SEPARATOR + blob)


def test_keyframe_shards_with_e8m0_tensors_load() -> None:
    """F1: safetensors.torch.load raised a bare KeyError on F8_E8M0, a dtype the codec serves."""
    scale = torch.tensor([0x7F, 0x80, 0x00], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    index = json.dumps({"weight_map": {"s": shard_name(1, 1)}}).encode()
    got = tensors_from_files({INDEX_NAME: index, shard_name(1, 1): save({"s": scale})})
    assert got["s"].dtype == torch.float8_e8m0fnu
    assert got["s"].view(torch.uint8).tolist() == [0x7F, 0x80, 0x00]


@pytest.mark.parametrize("dtype", [torch.complex64, torch.uint16, torch.uint32])
def test_keyframe_shards_with_dtypes_flipsync_does_not_serve_are_refused(dtype: torch.dtype) -> None:
    index = json.dumps({"weight_map": {"x": shard_name(1, 1)}}).encode()
    with pytest.raises(IntegrityError, match="which flipsync does not serve"):
        tensors_from_files({INDEX_NAME: index, shard_name(1, 1): save({"x": torch.zeros(2, dtype=dtype)})})


# F2: an Ed25519 public key whose algorithm OID the fuzzer changed to 1.3.69.112; cryptography raised
# UnsupportedAlgorithm, which is not a ValueError, straight through Verifier.from_pem.
UNKNOWN_KEY_TYPE = (
    b"-----BEGIN PUBLIC KEY-----\n"
    b"MCowBQYDK0VwAyEAa9/eXYTopPtOXgPntgfYlIBOAkfx4LUaXBKDpe4EVS4=\n"
    b"-----END PUBLIC KEY-----\n"
)
# F4: an Ed448 private key whose raw key bytes the fuzzer cut short; OpenSSL refused it with an InternalError.
CORRUPT_ED448 = (
    b"-----BEGIN PRIVATE KEY-----\n"
    b"MC4CAQAwBQYDK2VxBCIEIHe9CB2jj/mFpeVlG6pjw/4oiPhggIrL0VmVw6Av1NSb\n"
    b"-----END PRIVATE KEY-----\n"
)


def test_a_key_of_an_unknown_type_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="cannot load the Ed25519 public key"):
        Verifier.from_pem(UNKNOWN_KEY_TYPE)
    with pytest.raises(ConfigError, match="cannot load the Ed25519 private key"):
        Signer.from_pem(UNKNOWN_KEY_TYPE.replace(b"PUBLIC", b"PRIVATE"))
    targets.KeysTarget()(UNKNOWN_KEY_TYPE)


def test_corrupt_key_bytes_are_a_config_error() -> None:
    with pytest.raises(ConfigError, match="its key bytes are corrupt"):
        Signer.from_pem(CORRUPT_ED448)
    targets.KeysTarget()(CORRUPT_ED448)


# F5 (found reviewing the JSON entry points the targets share, not by the fuzzer: libFuzzer rarely builds
# a thousand nested brackets): json.loads raises RecursionError, which is not a ValueError.
DEEP = b"[" * 100_000


def test_deeply_nested_json_is_refused_cleanly() -> None:
    with pytest.raises(IntegrityError, match="not valid JSON"):
        Manifest.from_json(DEEP)
    with pytest.raises(IntegrityError, match="keyframe index is not valid JSON"):
        parse_index(DEEP)
    catalog = Catalog(ObstoreStore(MemoryStore(), "memory://"), "run-1")
    catalog.store.put(catalog.layout.latest, DEEP)
    assert catalog.read_hint() is None
    targets.ManifestTarget()(DEEP)
    targets.KeyframeTarget()(DEEP)


@pytest.fixture(scope="session")  # one run of every target, on the worker that runs their group
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, int]]:
    """Every target fuzzed for a few seconds, each forked from one process that imported flipsync once
    (``fuzz_each.py``): the folder of their logs, corpora and findings, and each one's exit status."""
    folder = tmp_path_factory.mktemp("fuzz")
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tests" / "fuzz" / "fuzz_each.py"),
            str(folder),
            *NAMES,
            "--",
            f"-max_total_time={SECONDS_PER_TARGET}",
            "-print_final_stats=1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONHASHSEED": "0"},
        cwd=folder,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (proc.stdout + proc.stderr)[-3000:]
    return folder, json.loads(lines[-1].removeprefix("RESULT "))


@pytest.mark.skipif(importlib.util.find_spec("atheris") is None, reason="atheris is not installed (no wheel here)")
@pytest.mark.xdist_group("fuzz")  # one worker runs them all, so the targets are fuzzed once
@pytest.mark.parametrize("name", NAMES)
def test_fuzz_briefly(name: str, fuzzed: tuple[Path, dict[str, int]]) -> None:
    """A few seconds of coverage-guided fuzzing per target; any crash, leak or hang fails the test."""
    folder, codes = fuzzed
    tail = (folder / f"{name}.log").read_text(errors="replace")[-3000:]
    assert codes[name] == 0, tail
    assert "stat::number_of_executed_units" in tail, tail
    assert not list((folder / name / "artifacts").iterdir()), tail
