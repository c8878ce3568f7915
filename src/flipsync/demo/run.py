"""``flipsync demo``: a small RL post-training run across rollout "regions", end to end, on this CPU.

The trainer (this process) warm-starts a Llama-architecture model built from a config (no downloads) on a
verifiable task, then runs GRPO-style policy-gradient steps with Adam at an RL learning rate. After every
optimizer step a `flipsync.trainer.Publisher` puts the new served view on a local board directory. Two or
more islands (separate processes, each a torch engine behind a sidecar) follow the board through a
bandwidth-limited link, and generate the rollouts the trainer learns from; each rollout carries the policy
version that produced it, and rollouts older than ``max_staleness`` versions are dropped.

A monitor watches the board and the islands: for every version it records the share of served values
that changed, the patch size against the checkpoint size, when the version appeared on the board, when
each island applied it, and whether the island's weights then matched the trainer's view fingerprint. At
the end every island recomputes its fingerprints from the weights it holds, which must equal the
trainer's final served view, and the run is written out as JSON and PNG plots.
"""

from __future__ import annotations

import json
import logging
import queue
import random
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch
from rich.console import Console
from rich.console import Group as RenderGroup
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from flipsync.board.reader import BoardReader
from flipsync.board.store import open_store
from flipsync.board.throttle import parse_bandwidth
from flipsync.codec import FingerprintTable, Patch
from flipsync.codec import int_view as bits_view
from flipsync.demo.grpo import Rollout, policy_loss, warm_start
from flipsync.demo.island import Island, IslandSpec, board_url
from flipsync.demo.task import Problem, ReverseDigits
from flipsync.domain.manifest import Kind
from flipsync.engines.torch.models import build_model, preset_config
from flipsync.engines.torch.tokenizer import ByteTokenizer
from flipsync.errors import ConfigError, FlipsyncError
from flipsync.formats import served_view
from flipsync.trainer import Publisher
from flipsync.trainer.publisher import new_run_name

log = logging.getLogger(__name__)


@dataclass
class DemoConfig:
    steps: int = 30
    served_format: str = "bf16"
    lr: float = 1e-6
    islands: int = 2
    bandwidth: str | None = "100mbit"
    max_staleness: int = 2
    group_size: int = 4
    prompts_per_step: int = 6
    model: str = "tiny"
    warm_start_steps: int = 150
    max_tokens: int = 8
    seed: int = 0
    out: Path = Path("flipsync-demo")


@dataclass
class VersionRow:
    version: int
    steps: int
    changed: int
    served_values: int
    patch_bytes: int
    checkpoint_bytes: int
    publish_s: float | None = None  # optimizer.step() returned -> version on the board
    applied_s: dict[str, float] = field(default_factory=dict)  # island -> step returned -> applied
    verified: dict[str, bool] = field(default_factory=dict)

    @property
    def changed_pct(self) -> float:
        return 100.0 * self.changed / max(1, self.served_values)


@dataclass
class StepRecord:
    step: int
    reward: float
    rollouts: int
    staleness: float  # mean versions between a rollout's start version and the newest published one
    dropped: int  # groups refused as too stale


@dataclass
class DemoReport:
    config: dict[str, Any]
    run: str
    board: str
    versions: list[VersionRow]
    steps: list[StepRecord]
    audits: dict[str, dict[str, Any]]
    final_view_fp: str
    bitwise_equal: dict[str, bool]
    wall_s: float

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        for row, v in zip(doc["versions"], self.versions, strict=True):
            row["changed_pct"] = v.changed_pct
        return doc


@dataclass(frozen=True)
class Group:
    problem: Problem
    group: int
    completions: list[tuple[str, tuple[int, ...], int, int]]  # text, tokens, version start, version end
    island: str


class RolloutPool:
    """Keeps rollout requests in flight on every island; each answer is a group of samples for one prompt."""

    def __init__(
        self,
        islands: list[Island],
        task: ReverseDigits,
        tok: ByteTokenizer,
        cfg: DemoConfig,
        current_version: Callable[[], int],
    ) -> None:
        self.islands, self.task, self.tok, self.cfg = islands, task, tok, cfg
        self.current_version = current_version
        self.groups: queue.Queue[Group] = queue.Queue(maxsize=4 * cfg.prompts_per_step)
        self.stop = threading.Event()
        self.errors: list[str] = []
        self._next_group = 0
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._loop, args=(island, k), daemon=True, name=f"rollouts-{island.spec.name}-{k}")
            for island in islands
            for k in range(2)
        ]

    def start(self) -> RolloutPool:
        for t in self._threads:
            t.start()
        return self

    def close(self) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(10)

    def _loop(self, island: Island, k: int) -> None:
        rng = random.Random(hash((island.spec.name, k)))
        with httpx.Client(base_url=island.url or "", timeout=60) as client:
            while not self.stop.is_set():
                with self._lock:
                    problem, gid = self.task.sample(), self._next_group
                    self._next_group += 1
                min_version = max(0, self.current_version() - self.cfg.max_staleness)
                body = {
                    "model": "flipsync-torch",
                    "prompt": problem.prompt,
                    "max_tokens": self.cfg.max_tokens,
                    "n": self.cfg.group_size,
                    "temperature": 1.0,
                    "seed": rng.randrange(2**31),
                    "weight_version": {"min_version": min_version},
                }
                try:
                    r = client.post("/v1/completions", json=body)
                except httpx.HTTPError as e:
                    self.errors.append(f"{island.spec.name}: {e}")
                    time.sleep(0.2)
                    continue
                if r.status_code in (409, 503):  # behind the trainer, or committing: retry shortly
                    time.sleep(min(0.2, float(r.headers.get("Retry-After", "0.1"))))
                    continue
                if r.status_code != 200:
                    self.errors.append(f"{island.spec.name}: HTTP {r.status_code} {r.text[:200]}")
                    time.sleep(0.2)
                    continue
                doc = r.json()
                span = doc.get("weight_version", {})
                start, end = int(span.get("start", -1)), int(span.get("end", -1))
                completions = []
                for choice in doc["choices"]:
                    text = choice["text"]
                    completions.append((text, tuple(self.tok.encode(text, bos=False)), start, end))
                group = Group(problem, gid, completions, island.spec.name)
                while not self.stop.is_set():
                    try:
                        self.groups.put(group, timeout=0.2)
                        break
                    except queue.Full:
                        continue

    def take(self, n: int, min_version: int, timeout_s: float = 300.0) -> tuple[list[Group], int]:
        """``n`` groups generated at ``min_version`` or newer; returns them and how many stale ones were dropped."""
        out: list[Group] = []
        dropped = 0
        deadline = time.monotonic() + timeout_s
        while len(out) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no rollouts within {timeout_s} s; island errors: {self.errors[-3:]}")
            try:
                g = self.groups.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if min(c[2] for c in g.completions) < min_version:
                dropped += 1
                continue
            out.append(g)
        return out, dropped


class Monitor:
    """Watches the board and the islands; fills one `VersionRow` per published version."""

    def __init__(self, board: str, run: str, islands: list[Island], served_values: int, checkpoint_bytes: int) -> None:
        self.reader = BoardReader(open_store(board), run)
        self.islands = islands
        self.served_values, self.checkpoint_bytes = served_values, checkpoint_bytes
        self.rows: dict[int, VersionRow] = {}
        self.step_end: dict[int, float] = {}  # trainer step -> when optimizer.step() returned
        self.version_step: dict[int, int] = {}  # version -> the last trainer step it covers
        self.fps: dict[int, str] = {}
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.on_complete: Callable[[VersionRow], None] = lambda row: None
        self._done: set[int] = set()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="demo-monitor")

    def start(self) -> Monitor:
        self._thread.start()
        return self

    def close(self) -> None:
        self.stop.set()
        self._thread.join(10)

    def _new_version(self, v: int, now: float) -> None:
        m = self.reader.catalog.version(v)
        changed = 0
        if m.kind is not Kind.KEYFRAME:
            parts = self.reader.catalog.fetch_parts(m, self.reader.catalog.artifact_dir(m))
            changed = sum(Patch.from_bytes(p).header.n_changed for p in parts)
        steps = int(m.meta.get("steps", 1)) if m.meta else 1
        row = VersionRow(v, steps, changed, self.served_values, m.total_size, self.checkpoint_bytes)
        step = int(m.meta["step"]) if m.meta and "step" in m.meta else None
        if step is not None and step in self.step_end:
            row.publish_s = now - self.step_end[step]
            self.version_step[v] = step
        self.fps[v] = m.target_view_fp
        self.rows[v] = row

    def _loop(self) -> None:
        clients = {i.spec.name: httpx.Client(base_url=i.url or "", timeout=5) for i in self.islands}
        known = -1
        try:
            while not self.stop.is_set():
                now = time.monotonic()
                try:
                    head = self.reader.head()
                except FlipsyncError:
                    head = None
                with self.lock:
                    while head is not None and known < head:
                        known += 1
                        try:
                            self._new_version(known, now)
                        except FlipsyncError as e:
                            log.warning("monitor: cannot read v%d: %s", known, e)
                    for name, client in clients.items():
                        try:
                            status = client.get("/flipsync/status").json()
                        except (httpx.HTTPError, ValueError):
                            continue
                        held = status.get("version")
                        if held is None:
                            continue
                        for v, row in self.rows.items():
                            if v <= held and name not in row.applied_s:
                                step = self.version_step.get(v)
                                start = self.step_end.get(step) if step is not None else None
                                row.applied_s[name] = now - start if start is not None else 0.0
                                row.verified[name] = held in self.fps and status.get("view_fp") == self.fps[held]
                    for v, row in sorted(self.rows.items()):
                        if v not in self._done and len(row.applied_s) == len(self.islands):
                            self._done.add(v)
                            self.on_complete(row)
                time.sleep(0.02)
        finally:
            for c in clients.values():
                c.close()


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Every tensor of ``a`` and ``b`` has the same name, dtype, shape and bit pattern."""
    if set(a) != set(b):
        return False
    return all(
        x.dtype == b[k].dtype and x.shape == b[k].shape and bits_view(x).equal(bits_view(b[k])) for k, x in a.items()
    )


def _row_cells(row: VersionRow) -> list[str]:
    applied = max(row.applied_s.values()) if row.applied_s else None
    return [
        f"v{row.version}",
        str(row.steps),
        f"{row.changed_pct:.3f}%" if row.changed else "keyframe" if row.version == 0 else "0%",
        f"{row.patch_bytes:,}",
        f"{row.checkpoint_bytes:,}",
        f"{row.checkpoint_bytes / max(1, row.patch_bytes):.0f}x",
        f"{row.publish_s:.2f}" if row.publish_s is not None else "-",
        f"{applied:.2f}" if applied is not None else "-",
        " ".join("✓" if row.verified.get(n) else "✗" for n in sorted(row.verified)),
    ]


ROW_COLUMNS = (
    "version",
    "steps",
    "changed",
    "patch B",
    "checkpoint B",
    "ratio",
    "publish s",
    "all applied s",
    "verified",
)


def run_demo(cfg: DemoConfig, console: Console) -> DemoReport:
    if cfg.islands < 1 or cfg.steps < 1 or cfg.group_size < 2:
        raise ConfigError("the demo needs at least one island, one step and groups of two or more samples")
    bandwidth = parse_bandwidth(cfg.bandwidth) if cfg.bandwidth else None
    t0 = time.monotonic()
    torch.manual_seed(cfg.seed)
    out = cfg.out
    out.mkdir(parents=True, exist_ok=True)
    board = board_url(out / "board")
    run = new_run_name("demo")
    tok, task = ByteTokenizer(), ReverseDigits(seed=cfg.seed)

    model = build_model(preset_config(cfg.model), seed=cfg.seed, dtype=torch.float32)
    model.requires_grad_(True)
    with console.status(f"warm start: {cfg.warm_start_steps} supervised steps on the task"):
        loss: float | torch.Tensor = warm_start(model, tok, task, steps=cfg.warm_start_steps)
    console.print(f"warm start done (loss {loss:.3f}); RL with Adam at lr={cfg.lr:g}, format {cfg.served_format}")

    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    model.train()
    publisher = Publisher(model, board, format=cfg.served_format, run=run, optimizer=opt)
    publisher.flush()  # v0, a keyframe, is on the board before any island starts
    view0 = served_view({k: v.detach() for k, v in model.state_dict().items()}, cfg.served_format)
    served_values = sum(t.numel() for t in view0.values())
    checkpoint_bytes = sum(t.numel() * t.element_size() for t in view0.values())

    islands = [
        Island(IslandSpec(f"island-{i}", board, run, cfg.model, cfg.served_format, bandwidth, cfg.seed)).start()
        for i in range(cfg.islands)
    ]
    pool: RolloutPool | None = None
    monitor: Monitor | None = None
    steps: list[StepRecord] = []
    try:
        with console.status(f"starting {cfg.islands} islands (each a torch engine behind a sidecar)"):
            for island in islands:
                island.wait_ready()
        monitor = Monitor(board, run, islands, served_values, checkpoint_bytes)
        rewards: dict[int, float] = {}  # trainer step -> mean reward of its batch
        completed: queue.Queue[VersionRow] = queue.Queue()
        monitor.on_complete = completed.put
        table = Table(title=f"run {run}: {cfg.served_format}, lr {cfg.lr:g}, {cfg.islands} islands", expand=False)
        for col in (*ROW_COLUMNS, "reward"):
            table.add_column(col, justify="right")

        def show_completed() -> None:
            while not completed.empty():
                row = completed.get()
                step = monitor.version_step.get(row.version) if monitor else None
                reward = rewards.get(step) if step is not None else None
                table.add_row(*_row_cells(row), f"{reward:.3f}" if reward is not None else "-")

        monitor.start()

        def current_version() -> int:
            return publisher.stats.head or 0

        pool = RolloutPool(islands, task, tok, cfg, current_version).start()
        progress = Progress(TextColumn("RL steps"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        bar = progress.add_task("steps", total=cfg.steps)
        with Live(RenderGroup(table, progress), console=console, refresh_per_second=4, vertical_overflow="visible"):
            for step in range(1, cfg.steps + 1):
                version = current_version()
                groups, dropped = pool.take(cfg.prompts_per_step, max(0, version - cfg.max_staleness))
                rollouts = [
                    Rollout(g.problem, g.group, text, tokens, ReverseDigits.reward(g.problem, text), s, e, g.island)
                    for g in groups
                    for text, tokens, s, e in g.completions
                ]
                loss = policy_loss(model, tok, rollouts)
                opt.zero_grad()
                loss.backward()
                opt.step()  # the publisher's post-step hook takes the new weights from here
                monitor.step_end[step] = time.monotonic()
                rewards[step] = sum(r.reward for r in rollouts) / len(rollouts)
                staleness = sum(version - r.version_start for r in rollouts) / len(rollouts)
                steps.append(StepRecord(step, rewards[step], len(rollouts), staleness, dropped))
                progress.advance(bar)
                show_completed()
            publisher.close()
            final = publisher.stats.head or 0
            for island in islands:
                httpx.get(f"{island.url}/flipsync/wait", params={"min_version": final, "timeout_s": 120}, timeout=130)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and (
                len(monitor.rows) <= final or any(len(r.applied_s) < len(islands) for r in monitor.rows.values())
            ):
                time.sleep(0.05)
                show_completed()
            show_completed()
        pool.close()
        pool = None
        monitor.close()
        audits = {island.spec.name: island.audit(tensors=True) for island in islands}
        masters = {k: v.detach() for k, v in model.state_dict().items()}
        trainer_view = served_view(masters, cfg.served_format)
        final_fp = FingerprintTable.of(trainer_view).view_fp()
        equal = {
            name: a["view_fp"] == final_fp and a["version"] == final and same_bits(a["tensors"], trainer_view)
            for name, a in audits.items()
        }
        report = DemoReport(
            config={k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
            run=run,
            board=board,
            versions=[monitor.rows[v] for v in sorted(monitor.rows)],
            steps=steps,
            audits={n: {k: v for k, v in a.items() if k != "tensors"} for n, a in audits.items()},
            final_view_fp=final_fp,
            bitwise_equal=equal,
            wall_s=time.monotonic() - t0,
        )
    finally:
        if pool is not None:
            pool.close()
        if monitor is not None:
            monitor.close()
        for island in islands:
            island.stop()
    return report


def write_outputs(report: DemoReport, out: Path) -> list[Path]:
    """The JSON report and the PNG plots; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "report.json"]
    paths[0].write_text(json.dumps(report.to_json(), indent=2))
    patches = [r for r in report.versions if r.version > 0]

    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot([r.version for r in patches], [r.changed_pct for r in patches], marker="o")
    ax.set_xlabel("policy version")
    ax.set_ylabel("% of served values changed")
    ax.set_title(f"Served values changed per version ({report.config['served_format']}, lr {report.config['lr']:g})")
    fig.tight_layout()
    paths.append(out / "changed_fraction.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4))
    ax.semilogy([r.version for r in patches], [r.patch_bytes for r in patches], marker="o", label="patch")
    ax.semilogy(
        [r.version for r in patches], [r.checkpoint_bytes for r in patches], ls="--", label="full served checkpoint"
    )
    ax.set_xlabel("policy version")
    ax.set_ylabel("bytes shipped per version")
    ax.set_title("Patch vs checkpoint bytes")
    ax.legend()
    fig.tight_layout()
    paths.append(out / "patch_vs_checkpoint.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot([s.step for s in report.steps], [s.reward for s in report.steps], marker="o")
    ax.set_xlabel("trainer step")
    ax.set_ylabel("mean reward of the batch")
    ax.set_ylim(0, 1)
    ax.set_title("Reward (rollouts generated by the islands)")
    fig.tight_layout()
    paths.append(out / "reward.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths
