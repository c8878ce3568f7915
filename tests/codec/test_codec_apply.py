"""Apply is all or nothing: a wrong base, a corrupt patch, a failed write or an interrupt changes no byte."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flipsync.codec import Patch, apply_patch, diff_views
from flipsync.codec import apply as apply_mod
from flipsync.codec.bits import KIND_CODE
from flipsync.codec.container import HEADER_TENSOR, split_tail
from flipsync.codec.fingerprint import FingerprintTable
from flipsync.domain.headers import ViewRef
from flipsync.errors import BaseMismatchError, CorruptPatchError, PatchError, VerificationError
from tests.strategies import edit, same_bits


@pytest.fixture
def chain() -> list[dict[str, torch.Tensor]]:
    rng = np.random.default_rng(7)
    v0 = {
        "a.weight": torch.randn(300, 64).to(torch.bfloat16),
        "b.weight": torch.randn(5000).to(torch.float8_e4m3fn),
        "c.scale": torch.rand(40),
    }
    views = [v0]
    for _ in range(3):
        views.append({k: edit(rng, t, 0.05, style="ulp") for k, t in views[-1].items()})
    return views


def snapshot(view: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in view.items()}


def unchanged(work: dict[str, torch.Tensor], before: dict[str, torch.Tensor]) -> bool:
    return all(same_bits(work[k], before[k]) for k in before)


def assert_refused_untouched(base: dict[str, torch.Tensor], patch: Patch, error: type, match: str) -> None:
    """Applying ``patch`` to a copy of ``base`` raises ``error``, and neither the tensors nor the table moved."""
    work = snapshot(base)
    table = FingerprintTable.of(work)
    with pytest.raises(error, match=match):
        apply_patch(work, patch, table)
    assert unchanged(work, base)
    assert table == FingerprintTable.of(base)


def test_wrong_base_is_refused_before_any_write(chain: list) -> None:
    p12, _ = diff_views(chain[1], chain[2])
    assert_refused_untouched(chain[0], p12, BaseMismatchError, "fetch the patches in between")


def test_a_header_naming_another_target_view_is_refused_before_any_write(chain: list) -> None:
    # Every section reaching its own target is not enough: the view the header promises must result.
    p01, _ = diff_views(chain[0], chain[1])
    crafted = p01.with_refs(target=ViewRef(view=FingerprintTable.of(chain[2]).view_fp(), version=2))
    assert_refused_untouched(chain[0], crafted, VerificationError, "target view")


def test_wrong_shape_is_refused(chain: list) -> None:
    p01, _ = diff_views(chain[0], chain[1])
    work = snapshot(chain[0])
    work["a.weight"] = work["a.weight"].reshape(64, 300)
    with pytest.raises(BaseMismatchError, match="expects"):
        apply_patch(work, p01, FingerprintTable.of(work))


def test_applying_twice_is_refused(chain: list) -> None:
    p01, _ = diff_views(chain[0], chain[1])
    work = snapshot(chain[0])
    table = FingerprintTable.of(work)
    apply_patch(work, p01, table)
    with pytest.raises(BaseMismatchError):
        apply_patch(work, p01, table)
    assert unchanged(work, chain[1])


def test_overwrite_patches_are_idempotent(chain: list) -> None:
    p01, _ = diff_views(chain[0], chain[1], mode="raw")
    assert p01.header.idempotent
    work = snapshot(chain[0])
    table = FingerprintTable.of(work)
    for _ in range(2):
        apply_patch(work, p01, table, check=False)
        assert unchanged(work, chain[1])
        assert table == FingerprintTable.of(chain[1])
    step, _ = diff_views(chain[0], chain[1])
    with pytest.raises(PatchError, match="overwrite"):
        apply_patch(snapshot(chain[0]), step, FingerprintTable.of(chain[0]), check=False)


def test_tampered_values_fail_verification_before_any_write(chain: list) -> None:
    p01, _ = diff_views(chain[0], chain[1])
    data = bytearray(p01.to_bytes())
    header_len = int.from_bytes(data[:8], "little")
    start, end = json.loads(data[8 : 8 + header_len])[HEADER_TENSOR]["data_offsets"]
    _, _, _, positions, small = split_tail(data[8 + header_len + start : 8 + header_len + end])
    # inside the coded streams: past the grouped positions' k and count, or into the small sections
    data[8 + header_len + end - len(small) - len(positions or b"") + 3] ^= 0x5A
    work = snapshot(chain[0])
    with pytest.raises((VerificationError, CorruptPatchError)):
        apply_patch(work, Patch.from_bytes(bytes(data)), FingerprintTable.of(work))
    assert unchanged(work, chain[0])


@contextlib.contextmanager
def int_view_failing_at(monkeypatch: pytest.MonkeyPatch, call: int, error: BaseException) -> Iterator[None]:
    """Inside: the ``call``-th integer view apply takes raises ``error`` (a write that fails midway)."""
    real = apply_mod.int_view
    calls = 0

    def failing(t: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        if calls == call:
            raise error
        return real(t)

    monkeypatch.setattr(apply_mod, "int_view", failing)
    try:
        yield
    finally:
        monkeypatch.setattr(apply_mod, "int_view", real)


def test_failure_midway_through_commit_rolls_back(chain: list, monkeypatch: pytest.MonkeyPatch) -> None:
    p01, _ = diff_views(chain[0], chain[1])
    work = snapshot(chain[0])
    table = FingerprintTable.of(work)
    lost = RuntimeError("device lost")
    with int_view_failing_at(monkeypatch, 3, lost), pytest.raises(RuntimeError, match="device lost"):  # 3rd tensor
        apply_patch(work, p01, table)
    assert unchanged(work, chain[0])
    assert table == FingerprintTable.of(chain[0])


def test_interrupt_midway_rolls_back(chain: list, monkeypatch: pytest.MonkeyPatch) -> None:
    p01, _ = diff_views(chain[0], chain[1])
    work = snapshot(chain[0])
    table = FingerprintTable.of(work)
    with int_view_failing_at(monkeypatch, 2, KeyboardInterrupt()), pytest.raises(KeyboardInterrupt):
        apply_patch(work, p01, table)
    assert unchanged(work, chain[0])


def test_digest_mismatch_after_write_rolls_back(chain: list) -> None:
    p01, _ = diff_views(chain[0], chain[1])
    work = snapshot(chain[0])
    table = FingerprintTable.of(work)
    staged = apply_mod.stage(work, p01, table)
    with pytest.raises(VerificationError, match="rolled back"):  # as if the device wrote something else
        apply_mod.commit(work, staged, table, verify="digest", digest="0" * 32)
    assert unchanged(work, chain[0])
    assert table == FingerprintTable.of(chain[0])


def test_undo_record_restores_a_committed_version(chain: list) -> None:
    p01, _ = diff_views(chain[0], chain[1])
    work = snapshot(chain[0])
    table = FingerprintTable.of(work)
    result = apply_patch(work, p01, table)
    assert unchanged(work, chain[1])
    result.undo.rollback(work, table)
    assert unchanged(work, chain[0])
    assert table == FingerprintTable.of(chain[0])


def test_chain_of_patches_with_incremental_fingerprints(chain: list) -> None:
    work = snapshot(chain[0])
    table = FingerprintTable.of(work)
    pub_table = None
    for i in range(3):
        patch, pub_table = diff_views(chain[i], chain[i + 1], old_table=pub_table, base_version=i, target_version=i + 1)
        apply_patch(work, Patch.from_bytes(patch.to_bytes()), table)
        assert unchanged(work, chain[i + 1])
        assert table.view_fp() == pub_table.view_fp() == patch.header.target.view


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_diff_and_apply_match_cpu(chain: list) -> None:
    cuda = {k: v.cuda() for k, v in chain[0].items()}
    cuda_new = {k: v.cuda() for k, v in chain[1].items()}
    p_gpu, _ = diff_views(cuda, cuda_new)
    p_cpu, _ = diff_views(chain[0], chain[1])
    assert p_gpu.to_bytes() == p_cpu.to_bytes()
    apply_patch(cuda, p_cpu, FingerprintTable.of(cuda))
    assert all(same_bits(cuda[k].cpu(), chain[1][k]) for k in cuda)


@pytest.mark.parametrize("dtype", ["F64", "F32", "BF16", "F8_E4M3", "F8_E8M0", "I64", "I16", "I8", "U8"])
@pytest.mark.parametrize("mode", ["step", "raw", "mixed"])
@pytest.mark.parametrize("gathered", [False, True])
def test_stage_kernel_matches_the_reference_key_and_fingerprint(dtype: str, mode: str, gathered: bool) -> None:
    """The fused kernel is bitwise the numpy definitions: bits.to_key/from_key and digest.fingerprint_of,
    including steps that wrap past either end of the key range (any symbol is a legal step)."""
    from flipsync.codec.bits import dtype_named, from_key, to_key, unzigzag
    from flipsync.codec.fingerprint import fingerprint_of

    d = dtype_named(dtype)
    rng = np.random.default_rng(len(dtype) * 7 + len(mode))
    numel, n = 50_000, 5_000  # several kernel blocks
    tensor = rng.integers(0, 1 << 63, size=numel, dtype=np.uint64).astype(d.uint_numpy)
    positions = np.unique(rng.integers(0, numel, size=n)).astype(np.int64)
    n = positions.size
    small = rng.integers(0, 8, size=n).astype(np.uint64)
    wide = rng.integers(0, 1 << 63, size=n, dtype=np.uint64) * np.uint64(2) + rng.integers(0, 2, size=n).astype(
        np.uint64
    )
    steps = np.where(rng.random(n) < 0.9, small, wide)
    raw_bits = rng.integers(0, 1 << 63, size=n, dtype=np.uint64).astype(d.uint_numpy).astype(np.uint64)
    flags = {"step": np.zeros(n, bool), "raw": np.ones(n, bool), "mixed": rng.random(n) < 0.3}[mode]
    symbols = np.where(flags, raw_bits, steps)

    old = tensor[positions]
    keys = to_key(old, d) + unzigzag(steps)
    expected = np.where(flags, raw_bits.astype(d.uint_numpy), from_key(keys, d))
    expected_fp = (fingerprint_of(positions, expected) - fingerprint_of(positions, old)) & ((1 << 64) - 1)

    old_out, new_out = np.empty(n, d.uint_numpy), np.empty(n, d.uint_numpy)
    bad, delta = apply_mod._stage_kernel(
        old.copy() if gathered else tensor,
        positions,
        gathered,
        symbols,
        flags if mode == "mixed" else np.zeros(0, bool),
        apply_mod._MODE[mode],
        KIND_CODE[d.kind],
        d.bits,
        old_out,
        new_out,
    )
    assert bad == -1
    assert np.array_equal(old_out, old) and np.array_equal(new_out, expected)
    assert int(delta) == expected_fp


def test_stage_kernel_refuses_raw_values_wider_than_the_dtype() -> None:
    bits = np.zeros(10, np.uint16)
    out = np.empty(3, np.uint16), np.empty(3, np.uint16)
    symbols = np.array([5, 1 << 16, 7], np.uint64)
    bad, _ = apply_mod._stage_kernel(bits, np.array([1, 2, 3]), False, symbols, np.zeros(0, bool), 1, 0, 16, *out)
    assert bad == 1


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([np.uint8, np.uint16, np.uint32, np.uint64]), st.integers(0, 300), st.integers(0, 2**32))
def test_fingerprint_delta_is_the_difference_of_the_two_sums(width: type, n: int, seed: int) -> None:
    """One pass over (position, old, new) moves a fingerprint exactly as the two sums of `fingerprint_of` do, and
    as rehashing the whole tensor does."""
    from flipsync.codec.fingerprint import FingerprintTable, fingerprint_delta, fingerprint_of

    rng = np.random.default_rng(seed)
    info = np.iinfo(width)
    size = n + int(rng.integers(0, 50))
    old_all = rng.integers(0, info.max, size=size, dtype=width, endpoint=True)
    positions = np.sort(rng.choice(size, size=n, replace=False)).astype(np.int64)
    new_all = old_all.copy()
    new_all[positions] = rng.integers(0, info.max, size=n, dtype=width, endpoint=True)
    old, new = old_all[positions], new_all[positions]
    mask = (1 << 64) - 1
    delta = fingerprint_delta(positions, old, new)
    assert delta == (fingerprint_of(positions, new) - fingerprint_of(positions, old)) & mask
    if width in (np.uint8, np.uint16):  # a tensor dtype: the whole-tensor fingerprints move by the delta too
        as_t = {np.uint8: torch.uint8, np.uint16: torch.int16}[width]
        before = FingerprintTable.of(
            {"t": torch.from_numpy(old_all.view(np.int16) if width == np.uint16 else old_all).view(as_t)}
        )
        after = FingerprintTable.of(
            {"t": torch.from_numpy(new_all.view(np.int16) if width == np.uint16 else new_all).view(as_t)}
        )
        assert (before["t"].fp + delta) & mask == after["t"].fp
    with pytest.raises(ValueError, match="one length"):
        fingerprint_delta(positions, np.append(old, old[:1] if n else np.zeros(1, width)), new)  # one too many
