"""``flipsync bench codec``: our patch beside the encodings other systems ship, on the same served bytes.

Methods, all run in this process on the same pair of served views:
- flipsync: the patch file produced by :func:`flipsync.codec.diff_views` (headers and digests included);
- the peers as they ship (`flipsync.apps.bench.peers`: slime / miles xor and overwrite, slime #1806 deltas_zstd, TRL
  gap_delta and raw, vLLM sparse_nccl, verl delta_sharded), each decoded back and checked bit for bit;
- the bounds: per tensor, log2 C(U, n) bits for the position set plus n times the empirical entropy of the
  value steps, and the same with the positions conditioned on the base value's exponent class.
Rows come from Adam steps, and on the real weights also from Muon steps (`flipsync.apps.synthetic.OptimizerSpec`);
for those, `flipsync.apps.bench.contexts` measures richer position contexts. Throughput ratios compare methods timed
back to back in one process.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zstandard
from rich.console import Console
from rich.table import Table

from flipsync.apps.bench import contexts, peers
from flipsync.apps.bench.report import Figures, md_table, pyplot, save_figure
from flipsync.apps.bench.workload import (
    FULL,
    QUICK,
    REAL_WEIGHTS,
    AdamSteps,
    Shape,
    installed,
    llm_like_masters,
    real_masters,
    short_name,
)
from flipsync.apps.synthetic import OptimizerSpec, OptimizerSteps
from flipsync.codec import ClassIndex, DiffEngine, Patch, commit, diff_views, stage
from flipsync.codec.bits import bits_numpy, dtype_of, to_key, zigzag
from flipsync.codec.container import overhead_bytes
from flipsync.codec.context import conditional_position_bits
from flipsync.codec.diff import changed_positions_reference
from flipsync.codec.fingerprint import FingerprintTable, Hasher
from flipsync.formats import served_view

BENCH_FORMATS = ("bf16", "fp8-block", "mxfp4", "nvfp4")
STAGE_REPEAT = 5  # stage runs per patch at least: the v2 target is a ratio of two stages
LRS = (1e-6, 1e-5)
QUICK_REAL_PARAMS = 25_000_000
MUON = OptimizerSpec("muon")  # matched lr: adjust_lr_fn="match_rms_adamw", AdamW on the non-matrix tensors
MUON_FORMATS = ("bf16", "fp8-block")  # Muon rows: the formats whose positions the ctx coder conditions most


@dataclass
class CodecRow:
    workload: str
    format: str
    lr: float
    elements: int
    changed: int
    bound_bpc: float  # bytes per changed value
    cond_bound_bpc: float  # the same, positions conditioned on the base value's class (codec.context)
    ours_bpc: float
    plain_bpc: float  # the patch with the coders that need no base: diff_views(context=False)
    header_bpt: float  # bytes of the patch file outside its coded sections, per changed tensor
    stage_ns: float  # codec.stage per changed value (decode, base pass or class index, new bits, fingerprints)
    stage_plain_ns: float  # the same for the plain patch
    stage_ns_b: float  # codec.stage per byte of the base view (the ctx pass reads the base)
    stage_plain_ns_b: float  # the same for the plain patch
    index_ns_b: float  # building the receiver's class index of the ctx sections' tensors, per byte of the view
    xor_zstd_bpc: float  # XOR of the bytes + zstd-1 alone, no container (slime's payload, Modal Stitch's coder)
    peers_bpc: dict[str, float | None]  # peers.PEER_KEYS -> bytes per changed value (None: does not apply)
    peers_verified: bool  # every applicable peer decoded back to the new view bit for bit
    encode_mb_s: float  # served-view MB/s through diff_views
    slime_xor_mb_s: float  # served-view MB/s through slime's xor encoder (one pass)
    vllm_sparse_mb_s: float  # served-view MB/s through vLLM's sparse encoder (one pass)
    decode_mpos_s: float
    diff_speedup: float  # flatnonzero(a != b) time / our diff time
    apply_vs_copy: float  # commit (in-place scatter) time / full copy time
    optimizer: str = "adam"
    contexts_bpc: dict[str, float] | None = None  # BF16 rows of real weights: position bytes per context

    @property
    def changed_pct(self) -> float:
        return 100.0 * self.changed / max(1, self.elements)

    def peer(self, key: str) -> float | None:
        return self.peers_bpc.get(key)


def _best_of(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    best, out = math.inf, None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def _log2_binom(u: int, n: int) -> float:
    return (math.lgamma(u + 1) - math.lgamma(n + 1) - math.lgamma(u - n + 1)) / math.log(2)


def _entropy_bits(symbols: np.ndarray) -> float:
    if symbols.size == 0:
        return 0.0
    _, counts = np.unique(symbols, return_counts=True)
    p = counts / counts.sum()
    return float(-(counts * np.log2(p)).sum())


def _bounds(old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], engine: DiffEngine) -> dict[str, float]:
    """The two bounds, and XOR + zstd-1 of every tensor's bytes (no container)."""
    bound_bits = cond_bits = xor_bytes = 0.0
    changed = 0
    zc = zstandard.ZstdCompressor(level=1)
    for name in old:
        a, b = old[name].contiguous(), new[name].contiguous()
        d = dtype_of(a)
        ab, bb = bits_numpy(a), bits_numpy(b)
        xor_bytes += len(zc.compress((ab ^ bb).tobytes()))
        pos = engine.changed_positions(a, b)
        n = int(pos.size)
        if not n:
            continue
        steps = to_key(bb[pos], d) - to_key(ab[pos], d)
        value_bits = _entropy_bits(zigzag(steps))
        bound_bits += _log2_binom(a.numel(), n) + value_bits
        cond_bits += conditional_position_bits(ab, pos, d) + value_bits
        changed += n
    return {"changed": changed, "bound": bound_bits / 8, "cond": cond_bits / 8, "xor": xor_bytes}


def measure_pair(
    workload: str,
    fmt: str,
    lr: float,
    old: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    repeat: int,
    *,
    optimizer: str = "adam",
    context_inputs: tuple[Mapping[str, torch.Tensor], ...] | None = None,
) -> CodecRow:
    """One row. ``context_inputs``: (the view before ``old``, the masters of ``old`` and of ``new``), for the
    position-context prototype (BF16 only)."""
    with DiffEngine() as engine, Hasher() as hasher:
        base = _bounds(old, new, engine)
        changed = max(1, int(base["changed"]))
        peer = peers.measure(old, new)
        table = FingerprintTable.of(old, hasher)
        view_bytes = sum(t.numel() * t.element_size() for t in new.values())
        enc_s, (patch, _) = _best_of(
            lambda: diff_views(old, new, old_table=table, engine=engine, hasher=hasher), repeat
        )
        data = patch.to_bytes()
        dec_s, _ = _best_of(lambda: list(Patch.from_bytes(data).changes(old)), repeat)
        plain_patch, _ = diff_views(old, new, old_table=table, engine=engine, hasher=hasher, context=False)
        plain_bytes = len(plain_patch.to_bytes())
        # A receiver that follows the board holds a class index of its tensors, built once after a full load
        # and kept current by every commit: stage runs with it warm, and its build is timed apart.
        index = ClassIndex()
        stage(old, patch, table.copy(), index=index)  # builds the trees of the tensors where they pay
        held = [k for k in old if k in index]
        index_s, _ = _best_of(lambda: [ClassIndex().tree(k, bits_numpy(old[k]), dtype_of(old[k]), 0) for k in held], 1)
        # Stage never writes. The two patches alternate, best of at least 5 each, so that their ratio compares
        # runs made under the same load (single runs here move by up to 1.5x on a shared machine).
        stage_s = stage_plain_s = math.inf
        for _ in range(max(repeat, STAGE_REPEAT)):
            stage_s = min(stage_s, _best_of(lambda: stage(old, patch, table.copy(), index=index), 1)[0])
            stage_plain_s = min(stage_plain_s, _best_of(lambda: stage(old, plain_patch, table.copy()), 1)[0])

        pairs = [(old[k], new[k]) for k in old]
        ours_s, _ = _best_of(lambda: engine.changed_positions_many(pairs), repeat)
        ref_s, _ = _best_of(lambda: [changed_positions_reference(old[k], new[k]) for k in old], repeat)

        work = {k: v.clone() for k, v in old.items()}
        apply_s, copy_s = _commit_vs_copy(work, patch, table, old, new, repeat)
    ctx_bpc = None
    if context_inputs is not None and fmt == "bf16":
        prev, old_m, new_m = context_inputs
        bits, _ = contexts.view_bits(prev, old, new, old_m, new_m)
        ctx_bpc = {k: v / 8 / changed for k, v in bits.items()}
    elements = sum(t.numel() for t in new.values())
    return CodecRow(
        workload=workload,
        format=fmt,
        lr=lr,
        elements=elements,
        changed=int(base["changed"]),
        bound_bpc=base["bound"] / changed,
        cond_bound_bpc=base["cond"] / changed,
        ours_bpc=len(data) / changed,
        plain_bpc=plain_bytes / changed,
        header_bpt=overhead_bytes(data) / max(1, len(patch.sections)),
        stage_ns=stage_s / changed * 1e9,
        stage_plain_ns=stage_plain_s / changed * 1e9,
        stage_ns_b=stage_s / view_bytes * 1e9,
        stage_plain_ns_b=stage_plain_s / view_bytes * 1e9,
        index_ns_b=index_s / view_bytes * 1e9,
        xor_zstd_bpc=base["xor"] / changed,
        peers_bpc={k: (r.bytes / changed if r.bytes is not None else None) for k, r in peer.items()},
        peers_verified=all(r.verified is not False for r in peer.values()),
        encode_mb_s=view_bytes / enc_s / 1e6,
        slime_xor_mb_s=view_bytes / max(peer["slime_xor"].encode_s, 1e-9) / 1e6,
        vllm_sparse_mb_s=view_bytes / max(peer["vllm_sparse"].encode_s, 1e-9) / 1e6,
        decode_mpos_s=changed / dec_s / 1e6,
        diff_speedup=ref_s / ours_s,
        apply_vs_copy=apply_s / copy_s,
        optimizer=optimizer,
        contexts_bpc=ctx_bpc,
    )


def _commit_vs_copy(
    work: dict[str, torch.Tensor],
    patch: Patch,
    table: FingerprintTable,
    old: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    repeat: int,
) -> tuple[float, float]:
    """Best commit time (the in-place scatter a serving engine pauses for; staging happens before)
    and best time to copy the whole new view into the same tensors."""
    commit_s = copy_s = math.inf
    for _ in range(repeat):
        work_table = table.copy()
        staged = stage(work, patch, work_table)
        t = time.perf_counter()
        undo = commit(work, staged, work_table)
        commit_s = min(commit_s, time.perf_counter() - t)
        undo.rollback(work, work_table)
        t = time.perf_counter()
        for k, w in work.items():
            w.copy_(new[k])
        copy_s = min(copy_s, time.perf_counter() - t)
        for k, w in work.items():  # back to the base for the next round
            w.copy_(old[k])
    return commit_s, copy_s


@dataclass
class ApplyRow:
    elements: int
    changed_pct: float
    stage_ms: float
    commit_ms: float
    copy_ms: float

    @property
    def commit_vs_copy(self) -> float:
        return self.commit_ms / self.copy_ms


def _stage_fresh(work: dict[str, torch.Tensor], patch: Patch, table: FingerprintTable) -> None:
    stage(work, patch, table.copy())


def apply_cost(numel: int = 1 << 26, fractions: tuple[float, ...] = (0.003, 0.01), repeat: int = 3) -> list[ApplyRow]:
    """Stage and commit a patch of one-ulp changes into one large bf16 tensor, against copying it whole."""
    rng = np.random.default_rng(0)
    base = torch.randn(numel).to(torch.bfloat16)
    rows = []
    for frac in fractions:
        target = base.clone()
        idx = torch.from_numpy(np.sort(rng.choice(numel, int(numel * frac), replace=False)))
        target.view(torch.int16)[idx] += 1
        patch, _ = diff_views({"w": base}, {"w": target}, digests=False)
        table = FingerprintTable.of({"w": base})
        work = {"w": base.clone()}
        stage_s, _ = _best_of(functools.partial(_stage_fresh, work, patch, table), repeat)
        commit_s, copy_s = _commit_vs_copy(work, patch, table, {"w": base}, {"w": target}, repeat)
        rows.append(ApplyRow(numel, 100 * frac, stage_s * 1e3, commit_s * 1e3, copy_s * 1e3))
    return rows


@dataclass
class Workload:
    name: str
    params: int
    tensors: int


@dataclass
class ReferenceCheck:
    """The peers on a pair of MiniLM BF16 views as dense as the one their own code was measured on."""

    workload: str
    lr: float
    changed: int
    changed_pct: float
    ours_bpc: float
    peers_bpc: dict[str, float | None]


@dataclass
class CodecReport:
    rows: list[CodecRow]
    apply: list[ApplyRow]
    workloads: list[Workload] = field(default_factory=list)
    reference: ReferenceCheck | None = None


# The Adam lr at which MiniLM's measured step (2 warm-up steps, then one) changes 1.63% of its BF16 values
# (369,651 of 22.7M): the density of the pair the peers' own encoders were run on (369,689 changed).
REFERENCE_LR = 1.6e-6


def reference_check_pair(workload: str, masters: Mapping[str, torch.Tensor]) -> ReferenceCheck:
    steps = AdamSteps(dict(masters), REFERENCE_LR)
    steps.step()
    before = steps.step()
    after = steps.step()
    old, new = served_view(before, "bf16"), served_view(after, "bf16")
    result = peers.measure(old, new)
    patch, _ = diff_views(old, new)
    n = patch.header.n_changed
    elements = sum(t.numel() for t in new.values())
    return ReferenceCheck(
        workload,
        REFERENCE_LR,
        n,
        100 * n / elements,
        len(patch.to_bytes()) / n,
        {k: (r.bytes / n if r.bytes is not None else None) for k, r in result.items()},
    )


def _warm_up(formats: tuple[str, ...]) -> None:
    """One untimed pass over a tiny view per format, so that no timing below includes JIT compilation."""
    masters = llm_like_masters(Shape(hidden=64, intermediate=128, layers=1, vocab=256))
    steps = AdamSteps(masters, 1e-3)
    before, after = steps.step(), steps.step()
    for fmt in formats:
        measure_pair("warm-up", fmt, 1e-3, served_view(before, fmt), served_view(after, fmt), 1)
    apply_cost(numel=1 << 16, repeat=1)


def run(
    console: Console,
    *,
    quick: bool = False,
    formats: tuple[str, ...] = BENCH_FORMATS,
    lrs: tuple[float, ...] = LRS,
    warmup_steps: int = 2,
    real: bool = True,
    muon: bool = True,
) -> CodecReport:
    """Measure every (workload, format, lr) under Adam, and on the real weights under Muon too (``MUON_FORMATS``);
    then the apply cost. Prints the tables and returns them."""
    workloads: list[tuple[str, dict[str, torch.Tensor]]] = [
        ("llm-like" + (" (quick)" if quick else ""), llm_like_masters(QUICK if quick else FULL))
    ]
    if real:
        # --quick keeps to small real models, so that it stays a run of seconds
        workloads += [
            (w, m) for w, m in real_masters() if not quick or sum(t.numel() for t in m.values()) <= QUICK_REAL_PARAMS
        ]
    repeat = 1 if quick else 3
    rows = []
    with console.status("benchmarking the codec") as status:
        status.update("codec bench: compiling the kernels")
        _warm_up(formats)
        for wname, masters in workloads:
            real_weights = not wname.startswith("llm-like")
            specs = [OptimizerSpec("adam")] + ([MUON] if muon and real_weights else [])
            for spec in specs:
                fmts = formats if spec.name == "adam" else tuple(f for f in formats if f in MUON_FORMATS)
                for lr in lrs:
                    steps = (
                        AdamSteps(masters, lr) if spec.name == "adam" else OptimizerSteps(masters, lr, optimizer=spec)
                    )
                    prev = before = masters
                    for _ in range(warmup_steps):
                        prev, before = before, steps.step()
                    after = steps.step()
                    for fmt in fmts:
                        status.update(f"codec bench: {wname}, {spec.name}, {fmt}, lr={lr:g}")
                        old, new = served_view(before, fmt), served_view(after, fmt)
                        ctx = (served_view(prev, fmt), before, after) if real_weights and fmt == "bf16" else None
                        rows.append(
                            measure_pair(wname, fmt, lr, old, new, repeat, optimizer=spec.name, context_inputs=ctx)
                        )
        reference = None
        minilm = [(w, m) for w, m in workloads if w.startswith("all-MiniLM")]
        if minilm:
            status.update("codec bench: the peers at the density of their own measurement")
            reference = reference_check_pair(*minilm[0])
        status.update("codec bench: apply cost")
        applied = apply_cost(numel=1 << (22 if quick else 26), repeat=repeat)
    infos = [Workload(w, sum(t.numel() for t in m.values()), len(m)) for w, m in workloads]
    report = CodecReport(rows, applied, infos, reference)
    for t in terminal_tables(report):
        console.print(t)
    return report


def apply_table(rows: list[ApplyRow]) -> Table:
    t = Table(title="Apply into one bf16 tensor: stage (decode, off the pause) and commit (in-place scatter)")
    for col in ("elements", "changed %", "stage ms", "commit ms", "full copy ms", "commit / copy"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(*_apply_cells(r))
    return t


def _apply_cells(r: ApplyRow) -> tuple[str, ...]:
    return (
        f"{r.elements:,}",
        f"{r.changed_pct:.2f}",
        f"{r.stage_ms:.1f}",
        f"{r.commit_ms:.2f}",
        f"{r.copy_ms:.1f}",
        f"{r.commit_vs_copy:.3f}",
    )


def _label(r: CodecRow) -> str:
    """A row's workload as the terminal shows it: the short name, ``/muon`` for a Muon row."""
    return short_name(r.workload) + ("" if r.optimizer == "adam" else f"/{r.optimizer}")


def _table(title: str, head: tuple[str, ...], rows: list[tuple[str, ...]], left: int = 2, caption: str = "") -> Table:
    t = Table(title=title, caption=caption or None)
    for i, col in enumerate(head):
        t.add_column(col, justify="left" if i < left else "right", no_wrap=True)
    for r in rows:
        t.add_row(*r)
    return t


def _cell(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None else f"{x:{fmt}}"


# The peers' columns: (key, terminal header, markdown header)
PEER_COLUMNS = (
    ("slime_xor", "xor", "slime 0.4.0 / miles xor+zstd-1 (with its safetensors container and index)"),
    ("slime_overwrite", "ovw", "slime 0.4.0 / miles overwrite"),
    ("slime_deltas_zstd", "#1806", "slime #1806 deltas_zstd"),
    ("trl_gap_delta", "gap", "TRL #5937 gap_delta (its default)"),
    ("trl_raw", "raw", "TRL #5937 raw"),
    ("vllm_sparse", "vLLM", "vLLM 0.32.0 sparse_nccl (int32 + values)"),
    ("verl_delta_sharded", "verl", "verl 0.9 delta_sharded (int32 + values)"),
)


def terminal_tables(report: CodecReport) -> list[Table]:
    """The codec tables as a terminal shows them, each within 100 columns: size against the bounds, the peers,
    speed, stage, then the apply cost. Every figure, and the ratios, are in the JSON and the markdown."""
    rows = report.rows
    row_id = [(_label(r), r.format, f"{r.lr:g}") for r in rows]
    size = _table(
        "Patch size, bytes per changed value",
        ("workload", "format", "lr", "chg %", "bound", "cond", "ours", "plain", "ours/cond"),
        [
            (
                *ident,
                f"{r.changed_pct:.3f}",
                f"{r.bound_bpc:.3f}",
                f"{r.cond_bound_bpc:.3f}",
                f"{r.ours_bpc:.3f}",
                f"{r.plain_bpc:.3f}",
                f"{r.ours_bpc / r.cond_bound_bpc:.3f}",
            )
            for ident, r in zip(row_id, rows, strict=True)
        ],
        left=3,
        caption="bound: positions as equally likely; cond: conditioned on the base value's exponent class; "
        "ours: the whole patch; plain: without base-coded positions",
    )
    peer_tab = _table(
        "The peers as they ship, bytes per changed value (each decoded back bit for bit)",
        ("workload", "format", "lr", "ours", *(h for _, h, _ in PEER_COLUMNS)),
        [
            (*ident, f"{r.ours_bpc:.2f}", *(_cell(r.peer(k), ".2f") for k, _, _ in PEER_COLUMNS))
            for ident, r in zip(row_id, rows, strict=True)
        ],
        left=3,
        caption="xor, ovw: slime 0.4.0 / miles disk delta; #1806: slime deltas_zstd; gap, raw: TRL #5937; "
        "vLLM 0.32.0 sparse_nccl; verl 0.9 delta_sharded; -: does not apply to this view",
    )
    speed = _table(
        "Speed",
        ("workload", "format", "lr", "ours", "xor", "vLLM", "decode", "diff x", "commit"),
        [
            (
                *ident,
                f"{r.encode_mb_s:.0f}",
                f"{r.slime_xor_mb_s:.0f}",
                f"{r.vllm_sparse_mb_s:.0f}",
                f"{r.decode_mpos_s:.1f}",
                f"{r.diff_speedup:.2f}",
                f"{r.apply_vs_copy:.3f}",
            )
            for ident, r in zip(row_id, rows, strict=True)
        ],
        left=3,
        caption="ours, xor (slime), vLLM: MB/s of served view through each encoder; decode: M changed values/s; "
        "diff x: our diff over np.flatnonzero(a != b); commit: in-place commit / copying the view",
    )
    stage_tab = _table(
        "Stage (what a receiver does off the pause)",
        ("workload", "format", "lr", "ns/chg", "plain", "ratio", "ns/B", "plain/B", "index", "hdr B"),
        [
            (
                *ident,
                f"{r.stage_ns:.0f}",
                f"{r.stage_plain_ns:.0f}",
                f"{r.stage_ns / r.stage_plain_ns:.2f}",
                f"{r.stage_ns_b:.2f}",
                f"{r.stage_plain_ns_b:.2f}",
                f"{r.index_ns_b:.2f}",
                f"{r.header_bpt:.0f}",
            )
            for ident, r in zip(row_id, rows, strict=True)
        ],
        left=3,
        caption="codec.stage per changed value (ns/chg) and per base byte (ns/B), the patch and its plain twin "
        "(no base-coded positions); index: building the class index, ns/B; hdr B: bytes outside the coded sections "
        "per changed tensor",
    )
    return [size, peer_tab, speed, stage_tab, apply_table(report.apply)]


def table(rows: list[CodecRow]) -> Table:
    """The size table alone (what ``terminal_tables`` shows first)."""
    return terminal_tables(CodecReport(rows, []))[0]


METHODS_MD = """Methods, all applied to the same pair of served views in this process:

- **flipsync**: the whole patch file from `flipsync.codec.diff_views` (safetensors container, compressed
  compact header with the view fingerprints and one xxh3-128 digest of the changed tensors, Rice- or
  ctx-coded positions, rANS-coded value steps);
- **bound**: per tensor, log2 C(U, n) bits for the set of n changed positions out of U, plus n times the
  empirical entropy of the value steps: no code that treats every position alike can do better on average;
- **conditional bound**: the same with the positions split by the class of the base value both sides hold
  (its exponent bits; for packed FP4 bytes both codes' exponent bits): sum over classes of log2 C(U_c, n_c),
  which the `ctx` coder aims at;
- **plain coders**: flipsync's patch without positions coded against the base (`diff_views(..., context=False)`),
  side by side;
- **the peers, as they ship** (`flipsync.apps.bench.peers`): each system's encoder re-implemented from its
  source, byte layout and container included, and counted whole (every byte that crosses to the rollout side):
  - *slime 0.4.0 / miles xor+zstd-1* (the default of their disk delta; Modal Stitch codes its deltas the same
    way): per changed tensor the XOR of its old and new raw bytes, zstd level 1, the blobs in one safetensors
    file whose metadata holds each tensor's xxh3-128 digest, plus its `model.safetensors.index.json`;
  - *slime 0.4.0 / miles overwrite*: per changed tensor a u4 count of changed bytes, their u4 positions and
    the new bytes, zstd level 1, same container;
  - *slime #1806 deltas_zstd*: per changed element, uint16 gaps (uint32 where one does not fit) and the raw
    value, one safetensors file with a JSON manifest, compressed whole by zstd level 1; needs one element dtype
    across the view (not FP8/FP4 views with their scales: -);
  - *TRL #5937 gap_delta* (its default) and *raw*: one safetensors file with `{name}.idx` (uint16/uint32 gaps,
    or int32 positions) and `{name}.val` (values cast to bf16) for every parameter; the cast makes it
    lossless for BF16 views only (others: -);
  - *vLLM 0.32.0 sparse_nccl*: per changed tensor int32 indices and raw values broadcast over NCCL, plus the
    JSON update info (names, dtypes, shapes, counts); not int64, as this table used to say;
  - *verl 0.9 delta_sharded*: one flush of int32 positions and concatenated raw values (one dtype: not for
    FP8/FP4 views) behind a pickled manifest.

  How each was checked: every peer's output on every row is decoded back (by our decoder of its layout) and
  compared with the new view bit for bit, or the run fails; each layout was read from the system's own code
  (paths and versions in `flipsync.apps.bench.peers`); and the table *reproducing the peers' own figures* below
  sets them beside the bytes per changed value that each system's own encoder wrote on MiniLM BF16 views
  (Adam at lr 1e-6, 1.63% changed), measured once outside this repository.

*stage ns/chg* is `codec.stage` (decode, new bits, fingerprint checks; for `ctx` sections, ranks to
positions: a pass over the base, or, with few changes per block, a read of only the blocks that hold them,
found in the receiver's class index) per changed value, for the patch and for the plain patch; *stage
ns/B* the same per byte of the base view; *index ns/B* is building that class index (for the tensors whose
sections it serves), per byte of the view: once after a full load, since every commit keeps it current;
*hdr B/tensor* (*header B/changed tensor*) is the patch file's bytes outside its coded sections (the
safetensors table and the compact header: names, shapes, counts, codec parameters, the two view fingerprints
and one content digest) per changed tensor.

Columns: *changed %* is the share of served values that differ after the step; *B/chg* is bytes per changed
value (the patch, or the method's output, divided by the number of changed values); the ratio columns
divide two methods' sizes on the same row. Speed: *encode MB/s* is megabytes of served view per second
through each method's encoder (flipsync: diff, fingerprints, digests and coding, best of the repeats; slime
xor and vLLM sparse: one pass each, NumPy and zstd); *decode M/s* is millions of changed values decoded per
second; *diff vs flatnonzero* is how much faster our changed-position finder is than `np.flatnonzero(a != b)`
over the same tensors; *commit / copy* is the in-place commit of the whole patch (what an engine pauses for)
against copying the whole view."""

# What each peer's own encoder wrote on all-MiniLM-L6-v2's BF16 views, 3 Adam steps at lr 1e-6, 369,689 values
# changed (1.63%): measured outside this repository with the peers' own code (the project's reference notes).
PEER_REFERENCE = {
    "slime_xor": 2.68,
    "slime_overwrite": 4.30,
    "slime_deltas_zstd": 2.84,
    "trl_gap_delta": 4.06,
    "trl_raw": 6.06,
    "vllm_sparse": 6.02,
    "verl_delta_sharded": 6.03,
    "flipsync": 0.86,
}


def _shape_md(quick: bool) -> str:
    s = QUICK if quick else FULL
    return f"hidden {s.hidden}, intermediate {s.intermediate}, {s.layers} layers, vocab {s.vocab}"


def _data_md(report: CodecReport, quick: bool) -> str:
    lines = [
        "Data: FP32 masters moved by `torch.optim.Adam` (betas 0.9/0.999) on Gaussian-noise gradients with a "
        "per-row scale: two warm-up steps, then one measured step; the served views (BF16, FP8 with 128x128 "
        "block scales, MXFP4, NVFP4) before and after that step are diffed. The change rate therefore comes "
        "from real Adam absorption at each learning rate. On the real weights, *muon* rows take the same steps "
        f"with {MUON.describe()}, at the same lr (matched lr; {', '.join(MUON_FORMATS)} views).",
        "",
    ]
    names = {w.name: w for w in report.workloads}
    for w in report.workloads:
        if w.name.startswith("llm-like"):
            lines.append(
                f"- **{w.name}**: synthetic Llama-shaped weights ({_shape_md(quick)};"
                f" N(0, 0.02^2) with outlier input channels x10-x30, norms near 1): {w.params / 1e6:.1f}M parameters, "
                f"{w.tensors} tensors."
            )
    for rw in REAL_WEIGHTS:
        if rw.name in names:
            w = names[rw.name]
            lines.append(
                f"- **{rw.name}**: {rw.about}. {w.params / 1e6:.1f}M parameters in {w.tensors} tensors, read from "
                f"the installed pip package (`{rw.install}`)."
            )
        elif installed(rw):
            lines.append(
                f"- *{rw.name}*: installed, left out of `--quick` (over {QUICK_REAL_PARAMS / 1e6:.0f}M parameters)."
            )
        else:
            lines.append(f"- *{rw.name}*: not installed here, so not measured; `{rw.install}` adds it.")
    return "\n".join(lines)


def _md_id(r: CodecRow) -> tuple[str, ...]:
    return (r.workload, r.optimizer, r.format, f"{r.lr:g}", f"{r.changed_pct:.3f}")


def _best_peer(r: CodecRow) -> tuple[str, float]:
    found = [(k, v) for k, v in r.peers_bpc.items() if v is not None]
    return min(found, key=lambda kv: kv[1])


def reference_check(report: CodecReport) -> str:
    """The peers' own figures (``PEER_REFERENCE``) beside our re-implementations on a pair as dense."""
    ref = report.reference
    if ref is None:
        return ""
    labels = {k: md for k, _, md in PEER_COLUMNS} | {"flipsync": "flipsync (the whole patch)"}
    body = [
        (
            labels[k],
            f"{theirs:.2f}",
            _cell(ref.ours_bpc if k == "flipsync" else ref.peers_bpc.get(k), ".2f"),
        )
        for k, theirs in PEER_REFERENCE.items()
    ]
    return (
        "Reproducing the peers' own figures: each peer's own code, run once outside this repository on "
        "all-MiniLM-L6-v2's BF16 views after 3 Adam steps at lr 1e-6 (369,689 values changed, 1.63%), beside our "
        f"re-implementation on this run's MiniLM BF16 pair of the same density (Adam at lr {ref.lr:g}, two "
        f"warm-up steps and one: {ref.changed:,} changed, {ref.changed_pct:.2f}%). XOR + zstd depends on where "
        "the changes fall, so it agrees within a few hundredths; the index + value layouts agree exactly.\n\n"
        + md_table(("encoding", "its own code B/chg", "ours B/chg"), body)
    )


def contexts_md(rows: list[CodecRow]) -> str:
    with_ctx = [r for r in rows if r.contexts_bpc]
    if not with_ctx:
        return ""
    head = ("workload", "optimizer", "lr", "changed %", *(f"{c} B/chg" for c in contexts.CONTEXTS), "best / exponent")
    body = []
    for r in with_ctx:
        c = r.contexts_bpc or {}
        known = {k: v for k, v in c.items() if "oracle" not in k}
        best = min(known.values())
        body.append(
            (
                r.workload,
                r.optimizer,
                f"{r.lr:g}",
                f"{r.changed_pct:.3f}",
                *(f"{c[k]:.3f}" for k in contexts.CONTEXTS),
                f"{best / c['exponent']:.3f}",
            )
        )
    intro = (contexts.__doc__ or "").split("\n\n", 1)[1].strip()
    return (
        "### Position contexts under Muon (a prototype)\n\n"
        + intro
        + " *best / exponent* is the best context the receiver could compute over the exponent class alone "
        "(the oracles left out). Positions only, BF16 rows of the real weights.\n\n" + md_table(head, body, left=2)
    )


def markdown(report: CodecReport, figures: Figures | None = None, *, quick: bool = False) -> str:
    """The codec section: data, methods, the size, peers, speed and stage tables, the contexts and the apply table."""
    rows = report.rows
    size = md_table(
        (
            "workload",
            "optimizer",
            "format",
            "lr",
            "changed %",
            "bound B/chg",
            "conditional bound B/chg",
            "flipsync B/chg",
            "flipsync plain coders B/chg",
            "flipsync / bound",
            "flipsync / conditional bound",
            "flipsync / plain coders",
            "conditional / independent bound",
            "flipsync header B/changed tensor",
        ),
        (
            (
                *_md_id(r),
                f"{r.bound_bpc:.3f}",
                f"{r.cond_bound_bpc:.3f}",
                f"**{r.ours_bpc:.3f}**",
                f"{r.plain_bpc:.3f}",
                f"{r.ours_bpc / r.bound_bpc:.3f}",
                f"{r.ours_bpc / r.cond_bound_bpc:.3f}",
                f"{r.ours_bpc / r.plain_bpc:.3f}",
                f"{r.cond_bound_bpc / r.bound_bpc:.3f}",
                f"{r.header_bpt:.1f}",
            )
            for r in rows
        ),
        left=3,
    )
    peer_md = md_table(
        (
            "workload",
            "optimizer",
            "format",
            "lr",
            "changed %",
            "flipsync B/chg",
            *(f"{md} B/chg" for _, _, md in PEER_COLUMNS),
            "smallest peer / flipsync",
            "decoded bitwise",
        ),
        (
            (
                *_md_id(r),
                f"**{r.ours_bpc:.3f}**",
                *(_cell(r.peer(k)) for k, _, _ in PEER_COLUMNS),
                f"{_best_peer(r)[1] / r.ours_bpc:.2f}x",
                "yes" if r.peers_verified else "NO",
            )
            for r in rows
        ),
        left=3,
    )
    speed = md_table(
        (
            "workload",
            "optimizer",
            "format",
            "lr",
            "flipsync encode MB/s",
            "slime xor encode MB/s",
            "vLLM sparse encode MB/s",
            "flipsync decode M/s",
            "diff vs flatnonzero",
            "commit / copy",
        ),
        (
            (
                r.workload,
                r.optimizer,
                r.format,
                f"{r.lr:g}",
                f"{r.encode_mb_s:.0f}",
                f"{r.slime_xor_mb_s:.0f}",
                f"{r.vllm_sparse_mb_s:.0f}",
                f"{r.decode_mpos_s:.1f}",
                f"{r.diff_speedup:.2f}x",
                f"{r.apply_vs_copy:.3f}",
            )
            for r in rows
        ),
        left=3,
    )
    stage_md = md_table(
        (
            "workload",
            "optimizer",
            "format",
            "lr",
            "stage ns/chg",
            "plain stage ns/chg",
            "stage / plain stage",
            "stage ns/B",
            "plain stage ns/B",
            "index ns/B",
        ),
        (
            (
                r.workload,
                r.optimizer,
                r.format,
                f"{r.lr:g}",
                f"{r.stage_ns:.0f}",
                f"{r.stage_plain_ns:.0f}",
                f"{r.stage_ns / r.stage_plain_ns:.2f}x",
                f"{r.stage_ns_b:.2f}",
                f"{r.stage_plain_ns_b:.2f}",
                f"{r.index_ns_b:.2f}",
            )
            for r in rows
        ),
        left=3,
    )
    apply = md_table(
        (
            "elements",
            "changed %",
            "stage ms (decode, off the pause)",
            "commit ms (in-place scatter)",
            "full copy ms",
            "commit / copy",
        ),
        (_apply_cells(r) for r in report.apply),
    )
    parts = [
        _data_md(report, quick),
        METHODS_MD,
        "### Patch size: bytes per changed value",
        size,
    ]
    if figures is not None:
        parts.append(
            figures.link(plot(report, figures.path("codec-bytes-per-change.png")).name, "bytes per changed value")
        )
    parts += ["### The peers as they ship: bytes per changed value", peer_md]
    if check := reference_check(report):
        parts.append(check)
    if ctx := contexts_md(rows):
        parts.append(ctx)
    parts += [
        "### Speed",
        speed,
        "### Stage",
        stage_md,
        "### Apply into one large tensor",
        "One BF16 tensor with a share of its values moved by one step: staging (decode and base check, while "
        "the engine keeps serving), the commit (the in-place scatter the engine pauses for) and, for scale, "
        "copying the whole tensor.",
        apply,
    ]
    return "\n\n".join(parts) + "\n"


def plot(report: CodecReport, path: Path) -> Path:
    """Bytes per changed value: one panel per (workload and optimizer, lr), bars per format and method; log scale."""
    plt = pyplot()
    panels = list(dict.fromkeys((_label(r), r.lr) for r in report.rows))
    workloads = list(dict.fromkeys(w for w, _ in panels))
    lrs = list(dict.fromkeys(lr for _, lr in panels))
    fig, axes = plt.subplots(
        len(workloads), len(lrs), figsize=(5.2 * len(lrs), 3.0 * len(workloads)), squeeze=False, sharey=True
    )
    methods = (
        ("bound", "bound"),
        ("ours", "flipsync"),
        ("slime_xor", "slime xor+zstd-1"),
        ("trl_gap_delta", "TRL gap_delta"),
        ("vllm_sparse", "vLLM sparse_nccl"),
    )
    width = 0.8 / len(methods)

    def value(r: CodecRow, key: str) -> float:
        if key == "bound":
            return r.bound_bpc
        if key == "ours":
            return r.ours_bpc
        return r.peer(key) or 0.0

    for i, w in enumerate(workloads):
        for j, lr in enumerate(lrs):
            ax = axes[i][j]
            rows = [r for r in report.rows if _label(r) == w and r.lr == lr]
            for k, (key, label) in enumerate(methods):
                xs = [x + (k - (len(methods) - 1) / 2) * width for x in range(len(rows))]
                ax.bar(xs, [value(r, key) for r in rows], width, label=label, color=f"C{k}")
            ax.set_xticks(range(len(rows)), [r.format for r in rows])
            ax.set_yscale("log")
            ax.set_title(f"{w}, lr {lr:g}", fontsize=9)
            ax.grid(True, axis="y", which="both", alpha=0.3)
            if j == 0:
                ax.set_ylabel("bytes per changed value")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(methods), fontsize=8)  # above the panels, off the bars
    return save_figure(fig, path, top=1 - 0.35 / fig.get_figheight())


def as_dict(report: CodecReport) -> dict[str, Any]:
    return {
        "rows": [asdict(r) | {"changed_pct": r.changed_pct} for r in report.rows],
        "apply": [asdict(r) | {"commit_vs_copy": r.commit_vs_copy} for r in report.apply],
        "workloads": [asdict(w) for w in report.workloads],
        "peer_reference": PEER_REFERENCE,
        "reference_check": asdict(report.reference) if report.reference else None,
    }
