"""The records a ``flipsync bench codec`` run produces: one row per measured pair of views, the apply cost,
the workloads and the check against the peers' own figures, gathered in a `CodecReport`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
