"""What the demo watches while it runs: `Monitor` follows the board and every island (version rows, which
trainer step each island serves), and `StepTable` is the live table drawn from it, one row per trainer step.

A version's *applied* time waits only for the flipsync islands that were following the board when its
manifest appeared (`Following`): an island that joins mid-run follows from the moment it first reaches HEAD
(its catch-up is an event of its own, not the applied time of the versions it replays), and an island that
dies or leaves stops counting at that moment.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from typing import Any, Self

import httpx
from rich.table import Table

from flipsync.board.reader import BoardReader
from flipsync.codec import Patch
from flipsync.domain.manifest import Kind
from flipsync.errors import FlipsyncError
from flipsync.stores import open_store
from flipsync_apps.demo.experts import ExpertRates
from flipsync_apps.demo.island import Island
from flipsync_apps.demo.records import DemoConfig, StepRecord, VersionRow
from flipsync_apps.demo.rollouts import StepIndex, Workers
from flipsync_apps.demo.summary import lr_text

log = logging.getLogger(__name__)


class Following:
    """Which flipsync islands each version's *applied* time waits for. No threads, no clocks of its own: the
    monitor feeds it events (times in seconds on any one clock) and a test can feed it synthetic ones."""

    def __init__(self, initial: Iterable[str], t0: float = 0.0) -> None:
        self.since: dict[str, float] = dict.fromkeys(initial, t0)  # island -> when it began following
        self.joining: dict[str, float] = {}  # island -> when it joined (still catching up)
        self.left: dict[str, float] = {}  # island -> when it died or left
        self.events: list[dict[str, Any]] = []  # catch-ups: island, joined_t, t, catch_up_s, version

    def followers(self) -> list[str]:
        """The islands following now: a version published now waits for these."""
        return sorted(n for n in self.since if n not in self.left)

    def joined(self, name: str, t: float) -> None:
        self.joining[name] = t

    def leave(self, name: str, t: float) -> None:
        self.left.setdefault(name, t)

    def committed(self, name: str, held: int, head: int, t: float) -> bool:
        """An island holds ``held`` while the board's newest version is ``head``: a joiner that reached HEAD
        follows from now on (returns True then)."""
        if name in self.joining and name not in self.since and name not in self.left and held >= head:
            joined = self.joining.pop(name)
            self.since[name] = t
            self.events.append({"island": name, "joined_t": joined, "t": t, "catch_up_s": t - joined, "version": held})
            return True
        return False

    def applied(self, row: VersionRow) -> tuple[float | None, bool]:
        """(the slowest commit among the row's followers so far, whether every follower still there has
        committed). A follower that left before committing no longer counts; none left: (None, True)."""
        waiting = [n for n in row.followers if n in row.applied_s or n not in self.left]
        done = [row.applied_s[n] for n in waiting if n in row.applied_s]
        return (max(done) if done else None), len(done) == len(waiting)


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
        self.following = Following([i.spec.name for i in islands if not i.spec.control], self.t0)
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
            self.following.joined(island.spec.name, time.monotonic())
        t = threading.Thread(
            target=self._island_loop, args=(island,), daemon=True, name=f"demo-monitor-{island.spec.name}"
        )
        self._threads.append(t)
        t.start()

    def leave(self, name: str) -> None:
        """An island died or left: the versions it had not committed stop waiting for it."""
        with self.lock:
            self.following.leave(name, time.monotonic())

    def complete(self) -> bool:
        """Every version seen so far committed by each of its followers still there."""
        with self.lock:
            return all(self.following.applied(r)[1] for r in self.rows.values())

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
            row.followers = self.following.followers()
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
                            # only the versions it was following for: a joiner's catch-up is its own event
                            if v <= held and name in row.followers and name not in row.applied_s:
                                row.applied_s[name] = max(0.0, now - self.seen[v])
                                row.verified[name] = status.get("view_fp") == self.fps[held]
                        self.following.committed(name, held, max(self.rows), now)
                time.sleep(0.1)

    def _sample_loop(self) -> None:
        while not self.stop.is_set():
            with self.lock:
                for island in self.islands:
                    if island.spec.control:
                        self.held[island.spec.name] = max(0, island.meters.held_step.value)
                self.samples.append((time.monotonic() - self.t0, self.trainer_step, dict(self.held)))
            time.sleep(0.2)


def applied_cell(slowest: float | None, complete: bool) -> str:
    """The table's applied cell: seconds once every follower committed, "…" while some have not, "-" when no
    follower is left to commit it."""
    if not complete:
        return "…"
    return "-" if slowest is None else f"{slowest:.2f}"


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
            "link so far. publish: step end -> manifest on the board; applied: manifest -> the last commit among "
            "the flipsync islands following the board then (a joiner counts once caught up, a killed island "
            "stops counting at its death)",
            expand=False,
        )
        for col in ("step", "reward", "version", "changed", "patch KB", "publish s", "applied s"):
            t.add_column(col, justify="right")
        for name in self.names:
            t.add_column(f"{name}\nbehind·drop·MB", justify="right")
        with self.monitor.lock:
            by_step = {r.step: r for r in self.monitor.rows.values() if r.version > 0}
            applied_cells = {r.step: applied_cell(*self.monitor.following.applied(r)) for r in by_step.values()}
        for rec in self.records:
            row = by_step.get(rec.step)
            version_cells = ["-"] * 5
            if row is not None:
                version_cells = [
                    f"v{row.version}" + (f" ({row.steps} steps)" if row.steps > 1 else ""),
                    f"{row.changed_pct:.2f}%",
                    f"{row.patch_bytes / 1e3:,.0f}",
                    f"{row.publish_s:.2f}" if row.publish_s is not None else "-",
                    applied_cells[rec.step],
                ]
            islands = [
                f"{s.behind} · {s.dropped} · {_mb(s.bytes)}" if (s := rec.islands.get(n)) else "-" for n in self.names
            ]
            t.add_row(str(rec.step), f"{rec.reward:.3f}", *version_cells, *islands)
        return t
