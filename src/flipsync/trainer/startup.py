"""How a publisher starts on a run: a new run, continuing HEAD, a takeover snapshot on top of it, or a refusal.
Rank 0 compares the run's HEAD manifest with this model's served view (`decide_start`, pure, so that every rule
is stated and tested in one place) and broadcasts the decision.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from datetime import UTC, datetime
from typing import Literal, NamedTuple

from flipsync.codec.fingerprint import FingerprintTable
from flipsync.domain.manifest import Manifest

log = logging.getLogger(__name__)

StartKind = Literal["new", "adopt", "takeover", "refuse", "refuse_model"]


class Start(NamedTuple):
    """``kind``: "new" (empty run), "adopt" (HEAD holds this view), "takeover" (a snapshot at HEAD + 1),
    "refuse" (an existing run without resume: ConflictError) or "refuse_model" (another model: ConfigError)."""

    kind: StartKind
    head: int | None
    message: str = ""


def new_run_name(prefix: str = "run") -> str:
    """A run name no earlier run has: UTC time plus random bits."""
    return f"{prefix}-{datetime.now(UTC):%Y%m%dT%H%M%SZ}-{secrets.token_hex(3)}"


def layout_fingerprint(table: FingerprintTable) -> str:
    """The served view's tensor names, dtypes and shapes (not its values), as 16 hex digits."""
    h = hashlib.blake2b(digest_size=8)
    for name in sorted(table):
        t = table[name]
        h.update(f"{name}\t{t.dtype}\t{','.join(map(str, t.shape))}\n".encode())
    return h.hexdigest()


def decide_start(
    head: Manifest | None,
    *,
    run: str,
    board_url: str,
    view_fp: str,
    layout: str,
    served_format: str,
    resume: bool,
    new_weights: bool,
) -> Start:
    """Start a run, continue it, take it over, or refuse (an existing run without ``resume``, or another
    model's view without ``new_weights``). ``head``: the run's HEAD manifest (None: an empty run)."""
    if head is None:
        return Start("new", None)
    if not resume:
        return Start(
            "refuse",
            head.version,
            f"run {run!r} already exists on {board_url} (HEAD v{head.version}, published by "
            f"{head.publisher} at {head.created}); a new run never mixes with an old one: choose another "
            "run name (or none, for a fresh one), or continue it with resume=True (CLI: --resume)",
        )
    if head.target_view_fp == view_fp and head.served_format == served_format:
        return Start("adopt", head.version)
    # Runs published before manifests named their layout: only the format can be compared.
    head_layout = head.meta.get("layout")
    other_format = head.served_format != served_format
    other_model = other_format or (head_layout is not None and head_layout != layout)
    if other_model and not new_weights:
        what = (
            f"served format {served_format}, HEAD's is {head.served_format}"
            if other_format
            else "tensors (names, dtypes or shapes) that differ from HEAD's"
        )
        return Start(
            "refuse_model",
            head.version,
            f"cannot resume run {run!r} on {board_url}: this model's served view has {what} "
            f"(HEAD v{head.version}); its replicas were built for that model. Publish to a new run (another "
            "--run name, or none for a fresh one), or replace the run's weights on purpose with "
            "new_weights=True (CLI: --resume --new-weights)",
        )
    if other_model:
        held = "another model's view (new_weights)"
    elif head_layout is not None:
        held = "other weights of this model"
    else:
        held = "another view (its manifests predate layout checks)"
    log.warning(
        "run %s: HEAD v%d holds %s; taking over with a snapshot at v%d", run, head.version, held, head.version + 1
    )
    return Start("takeover", head.version)
