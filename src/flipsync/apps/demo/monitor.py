"""What the demo watches while it runs: `Monitor` follows the board and every island (version rows, which
trainer step each island serves), and `StepTable` is the live table drawn from it, one row per trainer step.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Self

import httpx
from rich.table import Table

from flipsync.apps.demo.experts import ExpertRates
from flipsync.apps.demo.island import Island
from flipsync.apps.demo.records import CONTROL, DemoConfig, StepRecord, VersionRow
from flipsync.apps.demo.rollouts import StepIndex, Workers
from flipsync.apps.demo.summary import lr_text
from flipsync.board.reader import BoardReader
from flipsync.codec import Patch
from flipsync.domain.manifest import Kind
from flipsync.errors import FlipsyncError
from flipsync.stores import open_store

log = logging.getLogger(__name__)


class Monitor(Workers):
    """Watches the board and the islands: version rows, and which trainer step each island serves.

    One thread per source (the board, each flipsync island's status, the control island's counter and the
    sampler), so that an island slow to answer delays nothing else's timestamps. They poll at 10-20 Hz, not
    faster: they share the trainer's process, and its publisher, with the GIL.
    """

    def __init__(
        self,
        board: str,
        run: str,
        islands: list[Island],
        steps: StepIndex,
        served_values: int,
        checkpoint_bytes: int,
        experts: ExpertRates | None = None,
    ) -> None:
        self.reader = BoardReader(open_store(board), run)
        self.experts = experts  # a mixture of experts: where each version's changes land
        self.islands = islands
        self.steps = steps
        self.served_values, self.checkpoint_bytes = served_values, checkpoint_bytes
        self.rows: dict[int, VersionRow] = {}
        self.seen: dict[int, float] = {}  # version -> when its manifest was seen on the board
        self.step_end: dict[int, float] = {}  # trainer step -> when optimizer.step() returned
        self.trainer_step = 0
        self.held: dict[str, int] = {i.spec.name: 0 for i in islands}  # island -> trainer step it serves
        self.samples: list[tuple[float, int, dict[str, int]]] = []
        self.t0 = time.monotonic()
        self.fps: dict[int, str] = {}
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self._threads = [threading.Thread(target=self._board_loop, daemon=True, name="demo-monitor-board")]
        self._threads += [
            threading.Thread(target=self._island_loop, args=(i,), daemon=True, name=f"demo-monitor-{i.spec.name}")
            for i in islands
            if not i.spec.control
        ]
        self._threads.append(threading.Thread(target=self._sample_loop, daemon=True, name="demo-monitor-samples"))

    def start(self) -> Self:
        self.t0 = time.monotonic()
        return super().start()

    def watch(self, island: Island) -> None:
        """Follow an island that joined during the run."""
        with self.lock:
            self.islands.append(island)
            self.held[island.spec.name] = 0
        t = threading.Thread(
            target=self._island_loop, args=(island,), daemon=True, name=f"demo-monitor-{island.spec.name}"
        )
        self._threads.append(t)
        t.start()

    def _new_version(self, v: int, now: float) -> VersionRow:
        m = self.reader.catalog.version(v)
        changed = 0
        if m.kind is not Kind.KEYFRAME:
            parts = self.reader.catalog.fetch_parts(m, self.reader.catalog.artifact_dir(m))
            patches = [Patch.from_bytes(p) for p in parts]
            changed = sum(p.header.n_changed for p in patches)
            if self.experts is not None:
                self.experts.add(patches)
        meta = m.meta or {}
        step = int(meta.get("step", v))
        steps = int(meta.get("steps", 1))
        row = VersionRow(v, steps, step, changed, self.served_values, m.total_size, self.checkpoint_bytes)
        with self.lock:
            if step in self.step_end:
                row.publish_s = now - self.step_end[step]
            self.seen[v] = now
            self.fps[v] = m.target_view_fp
            self.rows[v] = row
        return row

    def _board_loop(self) -> None:
        known = -1
        while not self.stop.is_set():
            now = time.monotonic()
            try:
                head = self.reader.head()
            except FlipsyncError:
                head = None
            while head is not None and known < head:
                known += 1
                try:
                    self._new_version(known, now)
                except FlipsyncError as e:
                    log.warning("monitor: cannot read v%d: %s", known, e)
            time.sleep(0.05)

    def _island_loop(self, island: Island) -> None:
        name = island.spec.name
        with httpx.Client(base_url=island.url or "", timeout=10) as client:
            while not self.stop.is_set():
                try:
                    status = client.get("/flipsync/status").json()
                except (httpx.HTTPError, ValueError):
                    time.sleep(0.05)
                    continue
                now = time.monotonic()  # the answer's arrival: an upper bound on when the commit happened
                held = status.get("version")
                with self.lock:
                    if held is not None and held in self.rows:
                        self.held[name] = self.rows[held].step
                        for v, row in self.rows.items():
                            if v <= held and name not in row.applied_s:
                                row.applied_s[name] = max(0.0, now - self.seen[v])
                                row.verified[name] = status.get("view_fp") == self.fps[held]
                time.sleep(0.1)

    def _sample_loop(self) -> None:
        while not self.stop.is_set():
            with self.lock:
                for island in self.islands:
                    if island.spec.control:
                        self.held[island.spec.name] = max(0, island.meters.held_step.value)
                self.samples.append((time.monotonic() - self.t0, self.trainer_step, dict(self.held)))
            time.sleep(0.2)


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f}"


class StepTable:
    """The live table: one row per trainer step, version columns filled in as the version lands."""

    def __init__(self, cfg: DemoConfig, run: str, names: list[str], monitor: Monitor) -> None:
        self.cfg, self.run, self.names, self.monitor = cfg, run, names, monitor
        self.records: list[StepRecord] = []

    def render(self) -> Table:
        cfg = self.cfg
        t = Table(
            title=f"run {self.run}: {cfg.model}, {cfg.served_format}, {lr_text(cfg.lr, cfg.head_lr_scale)}, "
            f"{cfg.bandwidth or 'unlimited'} link",
            caption="per island: trainer steps its weights trailed the policy when the batch was taken · rollouts "
            "dropped as too stale · MB over its "
            "link so far. publish: step end -> manifest on the board; applied: manifest -> last flipsync island "
            "committed",
            expand=False,
        )
        for col in ("step", "reward", "version", "changed", "patch KB", "publish s", "applied s"):
            t.add_column(col, justify="right")
        for name in self.names:
            t.add_column(f"{name}\nbehind·drop·MB", justify="right")
        with self.monitor.lock:
            by_step = {r.step: r for r in self.monitor.rows.values() if r.version > 0}
        flipsync = [n for n in self.names if n != CONTROL]
        for rec in self.records:
            row = by_step.get(rec.step)
            version_cells = ["-"] * 5
            if row is not None:
                applied = [row.applied_s[n] for n in flipsync if n in row.applied_s]
                version_cells = [
                    f"v{row.version}" + (f" ({row.steps} steps)" if row.steps > 1 else ""),
                    f"{row.changed_pct:.2f}%",
                    f"{row.patch_bytes / 1e3:,.0f}",
                    f"{row.publish_s:.2f}" if row.publish_s is not None else "-",
                    f"{max(applied):.2f}" if len(applied) == len(flipsync) else "…",
                ]
            islands = [
                f"{s.behind} · {s.dropped} · {_mb(s.bytes)}" if (s := rec.islands.get(n)) else "-" for n in self.names
            ]
            t.add_row(str(rec.step), f"{rec.reward:.3f}", *version_cells, *islands)
        return t
