"""The crossregion cost model: per-unit costs fitted from the measurements, added up for one update.

Trainer seconds per byte of served view (plus a fixed part per publication), wire seconds per byte (1/B),
receiver seconds per changed value (stage + commit) or per byte (keyframe read + load + fingerprint), and a
fixed per-update latency (polling, manifests). Receivers share the machine's cores: their CPU terms scale by
max(1, N / cores). ``extrapolate`` applies the model to a 500 GB bf16 served view.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flipsync.board.part_stream import DEFAULT_CHUNK_BYTES
from flipsync.board.throttle import parse_bandwidth

TARGET_BYTES = 500e9  # the extrapolation: a 500 GB served view
# The parallel model's assumptions: the trainer's view is diffed by this many shards at once (e.g. 8 nodes
# x 8 GPUs, each diffing its own slice), and each receiver stages on this many cores.
TRAINER_SHARDS = 64
RECEIVER_CORES = 32


@dataclass(frozen=True)
class CostModel:
    """Per-unit costs; ``predict`` adds them up for one update."""

    trainer_patch_s_per_byte: float  # step returned -> patch on the board, per byte of served view
    trainer_full_s_per_byte: float  # step returned -> full view on the board, per byte
    trainer_patch_fixed_s: float  # the same, per publication whatever the size (threads, manifests)
    trainer_full_fixed_s: float
    receiver_s_per_change: float  # stage + commit, per changed value
    receiver_full_s_per_byte: float  # read + load + fingerprint of a full view, per byte
    fixed_s: float  # per update: polling, manifests, request latency
    relay_fixed_s: float  # the same through a relay (one more hop, HTTP)
    cores: int

    def predict(
        self,
        method: str,
        n: int,
        rate: float,
        view_bytes: float,
        changed: float,
        patch_bytes: float,
        *,
        trainer_shards: int = 1,
        receiver_cores: int = 1,
        chunk_bytes: float | None = None,
    ) -> float:
        """Seconds for one update. ``chunk_bytes``: the patch is streamed in chunks of this size (each shard's
        part), so its transfer overlaps the trainer's work; None: one after the other."""
        share = max(1.0, n / self.cores)  # replicas on this machine share its cores
        if method == "full":
            return (
                self.trainer_full_fixed_s
                + self.trainer_full_s_per_byte * view_bytes / trainer_shards
                + self.fixed_s
                + view_bytes / rate
                + self.receiver_full_s_per_byte * view_bytes * share / receiver_cores
            )
        trainer = self.trainer_patch_s_per_byte * view_bytes / trainer_shards
        wire = patch_bytes / rate
        if chunk_bytes is None:
            publish_and_send = trainer + wire
        else:
            # The first chunks leave once each shard has coded one; after the trainer's last section, every
            # shard's last chunk (at most one each) and header still have to cross.
            first = trainer * min(1.0, chunk_bytes * trainer_shards / patch_bytes) if patch_bytes else trainer
            tail = min(patch_bytes, chunk_bytes * trainer_shards) / rate
            publish_and_send = max(first + wire, trainer + tail)
        return (
            self.trainer_patch_fixed_s
            + publish_and_send
            + (self.relay_fixed_s if method == "relay" else self.fixed_s)
            + self.receiver_s_per_change * changed * share / receiver_cores
        )


def fit_line(a: tuple[float, float], b: tuple[float, float]) -> tuple[float, float]:
    """(fixed, per unit) of the line through two (size, seconds) points; neither below zero (noise)."""
    if b[0] <= a[0]:  # one size only: no fixed part can be told apart
        return 0.0, b[1] / b[0]
    slope = max(0.0, (b[1] - a[1]) / (b[0] - a[0]))
    fixed = max(0.0, b[1] - slope * b[0])
    if fixed == 0.0:  # the points say nothing fixed: all of it per byte, through the larger point
        slope = b[1] / b[0]
    return fixed, slope


def extrapolate(
    model: CostModel, bandwidths: tuple[str, ...], changed_fraction: float, bytes_per_change: float, source: str
) -> dict[str, Any]:
    """The cost model for one replica of a 500 GB bf16 view: this machine as measured, and the parallel model."""
    changed = changed_fraction * TARGET_BYTES / 2
    patch_bytes = bytes_per_change * changed
    rows = []
    for bw in bandwidths:
        rate = parse_bandwidth(bw)
        row: dict[str, Any] = {"bandwidth": bw}
        for label, shards, cores in (("single", 1, 1), ("parallel", TRAINER_SHARDS, RECEIVER_CORES)):
            p = model.predict(
                "patch",
                1,
                rate,
                TARGET_BYTES,
                changed,
                patch_bytes,
                trainer_shards=shards,
                receiver_cores=cores,
                chunk_bytes=DEFAULT_CHUNK_BYTES,
            )
            f = model.predict(
                "full", 1, rate, TARGET_BYTES, changed, patch_bytes, trainer_shards=shards, receiver_cores=cores
            )
            row[label] = {"patch_s": p, "full_s": f, "ratio": f / p}
        row["wire_ratio"] = TARGET_BYTES / patch_bytes
        rows.append(row)
    return {
        "view_bytes": TARGET_BYTES,
        "changed_fraction": changed_fraction,
        "bytes_per_change": bytes_per_change,
        "source": source,
        "changed": changed,
        "patch_bytes": patch_bytes,
        "trainer_shards": TRAINER_SHARDS,
        "receiver_cores": RECEIVER_CORES,
        "chunk_bytes": DEFAULT_CHUNK_BYTES,
        # What streaming the full checkpoint too could save at most: its (parallel) trainer and receiver terms.
        "full_overlap_s": model.trainer_full_fixed_s
        + model.trainer_full_s_per_byte * TARGET_BYTES / TRAINER_SHARDS
        + model.receiver_full_s_per_byte * TARGET_BYTES / RECEIVER_CORES,
        "rows": rows,
    }
