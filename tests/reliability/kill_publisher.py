"""Child process for test_kill.py: publishes deterministic versions to a board until it is killed.

Version k's served view is a pure function of k, so the parent can check any HEAD the child left behind.
Usage: python kill_publisher.py BOARD_DIR RUN MAX_VERSION
"""

from __future__ import annotations

import sys

import torch

from flipsync.board.writer import BoardWriter
from flipsync.codec import diff_views
from flipsync.codec.fingerprint import FingerprintTable
from flipsync.stores import open_store


def view_of(k: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = {f"layer{i}.weight": torch.randn(256, 256, generator=g) for i in range(4)}
    step = torch.Generator().manual_seed(1)
    drift = {name: torch.randn(t.shape, generator=step) for name, t in base.items()}
    return {name: (t + 2e-3 * k * drift[name]).to(torch.bfloat16) for name, t in base.items()}


def main() -> None:
    board, run, last = sys.argv[1], sys.argv[2], int(sys.argv[3])
    pub = BoardWriter(open_store(board), run, publisher_id="killable")
    head = pub.resume()
    if head is None:
        v0 = view_of(0)
        pub.publish_snapshot(v0, version=0, view_fp=FingerprintTable.of(v0).view_fp(), served_format="bf16")
        k = 0
    else:
        k = head.version
    old = view_of(k)
    table = FingerprintTable.of(old)
    while k < last:
        new = view_of(k + 1)
        patch, new_table = diff_views(old, new, old_table=table, base_version=k, target_version=k + 1)
        pub.publish_patch(
            [patch.to_bytes()],
            base_version=k,
            target_version=k + 1,
            base_view_fp=table.view_fp(),
            target_view_fp=new_table.view_fp(),
            served_format="bf16",
        )
        k, old, table = k + 1, new, new_table
        print(k, flush=True)


if __name__ == "__main__":
    main()
