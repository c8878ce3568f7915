"""Apply is all or nothing: a wrong base, a corrupt patch, a failed write or an interrupt changes no byte."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flipsync.codec import FingerprintTable, Patch, apply_patch, diff_views
from flipsync.codec import apply as apply_mod
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


def test_wrong_base_is_refused_before_any_write(chain: list) -> None:
    p12, _ = diff_views(chain[1], chain[2])
    work = snapshot(chain[0])
    table = FingerprintTable.of(work)
    with pytest.raises(BaseMismatchError, match="fetch the patches in between"):
        apply_patch(work, p12, table)
    assert unchanged(work, chain[0])
    assert table == FingerprintTable.of(chain[0])


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
    data[8 + header_len + 40] ^= 0x5A  # inside the first section's coded streams
    work = snapshot(chain[0])
    with pytest.raises((VerificationError, CorruptPatchError)):
        apply_patch(work, Patch.from_bytes(bytes(data)), FingerprintTable.of(work))
    assert unchanged(work, chain[0])


def test_failure_midway_through_commit_rolls_back(chain: list, monkeypatch: pytest.MonkeyPatch) -> None:
    p01, _ = diff_views(chain[0], chain[1])
    work = snapshot(chain[0])
    table = FingerprintTable.of(work)
    real = apply_mod.int_view
    calls = {"n": 0}

    def flaky(t: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 3:  # the third tensor's scatter fails
            raise RuntimeError("device lost")
        return real(t)

    monkeypatch.setattr(apply_mod, "int_view", flaky)
    with pytest.raises(RuntimeError, match="device lost"):
        apply_patch(work, p01, table)
    monkeypatch.setattr(apply_mod, "int_view", real)
    assert unchanged(work, chain[0])
    assert table == FingerprintTable.of(chain[0])


def test_interrupt_midway_rolls_back(chain: list, monkeypatch: pytest.MonkeyPatch) -> None:
    p01, _ = diff_views(chain[0], chain[1])
    work = snapshot(chain[0])
    table = FingerprintTable.of(work)
    real = apply_mod.int_view
    calls = {"n": 0}

    def interrupted(t: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(t)

    monkeypatch.setattr(apply_mod, "int_view", interrupted)
    with pytest.raises(KeyboardInterrupt):
        apply_patch(work, p01, table)
    monkeypatch.setattr(apply_mod, "int_view", real)
    assert unchanged(work, chain[0])


def test_digest_mismatch_after_write_rolls_back(chain: list) -> None:
    p01, _ = diff_views(chain[0], chain[1])
    work = snapshot(chain[0])
    table = FingerprintTable.of(work)
    staged = apply_mod.stage(work, p01, table)
    staged[0].target_digest = "0" * 32  # as if the device wrote something else
    with pytest.raises(VerificationError, match="rolled back"):
        apply_mod.commit(work, staged, table, verify="digest")
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
