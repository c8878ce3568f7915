"""``flipsync demo``: a small RL post-training run across rollout "regions", side by side with what users do
without flipsync, end to end, on this CPU.

The trainer (this process) warm-starts a Llama-architecture model built from a config (no downloads) on a
verifiable task, then runs GRPO-style policy-gradient steps with Adam. After every optimizer step a
`flipsync.trainer.Publisher` puts the new served view on a local board directory, and a `CheckpointShelf`
saves the full served view beside it, as a trainer that ships checkpoints does. Rollout islands (separate
processes) read through the same bandwidth-limited link: the flipsync islands follow the board (patches),
the control island downloads and reloads each newest full checkpoint. All of them generate the rollouts
the trainer learns from; each rollout carries the trainer step of the weights that produced it, and
rollouts more than ``max_staleness`` trainer steps old are dropped.

A monitor samples, every 50 ms, which trainer step each island serves and how many bytes its link has
carried, and, per published version, when the manifest appeared and when each island committed it.
With ``fleet`` on (the default) the flipsync islands' rollouts go through a gateway, a new island joins a
third of the way in and one is killed two thirds of the way in (`flipsync.apps.demo.fleet`). The
run ends with every flipsync island recomputing its fingerprints from the weights it holds, which must
equal the trainer's final served view, and is written out as JSON and PNG plots.
"""

from __future__ import annotations

import json
import logging
import queue
import random
import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Self

import httpx
import torch
from rich.console import Console
from rich.console import Group as RenderGroup
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from flipsync.apps.demo.control import CheckpointShelf
from flipsync.apps.demo.experts import ExpertRates
from flipsync.apps.demo.fleet import FleetDirector, FleetPlan, GatewayProcess
from flipsync.apps.demo.fleet import plot as plot_fleet
from flipsync.apps.demo.grpo import Rollout, optimizer_spec, policy_loss, rl_optimizer, warm_start
from flipsync.apps.demo.island import Island, IslandSpec, board_url, vllm_python
from flipsync.apps.demo.model import DEMO_MODELS, demo_config, write_model_dir
from flipsync.apps.demo.summary import lr_text, summarize
from flipsync.apps.demo.summary import summary_lines as summary_lines  # where callers have always found it
from flipsync.apps.demo.task import Problem, ReverseDigits
from flipsync.apps.demo.warmup import compile_codec_kernels
from flipsync.board.reader import BoardReader
from flipsync.board.throttle import parse_bandwidth
from flipsync.checkpoint import save_checkpoint
from flipsync.codec import Patch
from flipsync.codec.bits import int_view as bits_view
from flipsync.codec.fingerprint import FingerprintTable
from flipsync.domain.manifest import Kind
from flipsync.engines.torch.models import build_model
from flipsync.engines.torch.tokenizer import ByteTokenizer
from flipsync.errors import ConfigError, FlipsyncError
from flipsync.formats import get_format, served_view
from flipsync.stores import open_store
from flipsync.trainer import Publisher, PublisherConfig, new_run_name

log = logging.getLogger(__name__)

CONTROL = "full-ckpt"  # the control island's name
ENGINES = ("torch", "vllm")


@dataclass
class DemoConfig:
    steps: int = 40
    served_format: str = "bf16"
    lr: float = 3e-5
    head_lr_scale: float = 20.0  # the LM head and final norm learn at this times lr (see grpo.rl_optimizer)
    islands: int = 2  # flipsync islands
    control: bool = True  # one more island that reloads full checkpoints
    bandwidth: str | None = "100mbit"
    max_staleness: int = 1  # trainer steps
    group_size: int = 4
    prompts_per_step: int = 6
    model: str = "llama-20m"
    warm_start_steps: int = 100
    warm_start_lr: float = 3e-3
    stop_fraction: float = 0.5
    max_tokens: int = 6
    min_digits: int = 2
    max_digits: int = 3
    seed: int = 0
    engine: str = "torch"
    context: bool = True  # the publisher codes positions against their base (PublisherConfig.context)
    masters_at: tuple[int, ...] = (0, 1, -1)  # trainer steps whose FP32 masters are saved; -1: the last
    out: Path = Path("flipsync-demo")
    optimizer: str = "adam"  # adam, adamw, muon or sgd (see grpo.rl_optimizer)
    muon_lr_scaling: str = "match_rms_adamw"  # Muon's adjust_lr_fn
    fleet: bool = True  # rollouts through a gateway; an island joins and one is killed (flipsync.apps.demo.fleet)
    join_step: int | None = None  # when the new island joins (None: a third of the way in)
    kill_step: int | None = None  # when island-1 is killed (None: two thirds of the way in)


@dataclass
class VersionRow:
    version: int
    steps: int  # trainer steps it covers (more than one when the publisher squashed)
    step: int  # the last trainer step it covers
    changed: int
    served_values: int
    patch_bytes: int
    checkpoint_bytes: int
    publish_s: float | None = None  # the step's optimizer.step() returned -> its manifest on the board
    applied_s: dict[str, float] = field(default_factory=dict)  # island -> manifest on the board -> committed
    verified: dict[str, bool] = field(default_factory=dict)

    @property
    def changed_pct(self) -> float:
        return 100.0 * self.changed / max(1, self.served_values)


@dataclass
class IslandStep:
    behind: int  # trainer steps between the policy being trained and the weights the island served then
    used: int  # rollouts of this island in the step's batch
    dropped: int  # its rollouts dropped as more than max_staleness steps old
    rollout_lag: float | None  # mean trainer steps between the batch's policy and the rollouts' weights
    bytes: int  # bytes its link carried so far


@dataclass
class StepRecord:
    step: int
    reward: float
    rollouts: int
    islands: dict[str, IslandStep]


@dataclass
class DemoReport:
    config: dict[str, Any]
    run: str
    board: str
    parameters: int
    checkpoint_bytes: int
    versions: list[VersionRow]
    steps: list[StepRecord]
    lag_samples: list[tuple[float, int, dict[str, int]]]  # (seconds, trainer step, island -> step it serves)
    audits: dict[str, dict[str, Any]]
    final_view_fp: str
    bitwise_equal: dict[str, bool]  # flipsync islands only: the control is not expected to have caught up
    summary: dict[str, Any]
    timings: dict[str, float]
    masters: list[str]
    wall_s: float
    fleet: dict[str, Any] = field(default_factory=dict)  # the gateway's view: joins, leaves, readiness
    failed_rollouts: int = 0  # rollout requests that ended in an error (not a 409/503 retried)

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        for row, v in zip(doc["versions"], self.versions, strict=True):
            row["changed_pct"] = v.changed_pct
        return doc


@dataclass(frozen=True)
class RolloutGroup:
    problem: Problem
    group: int
    completions: list[tuple[str, tuple[int, ...]]]  # text, token ids
    step: int  # the trainer step of the oldest weights that produced any of its tokens
    island: str


class StepIndex:
    """Board version -> the last trainer step it covers (manifest ``meta.step``), read once per version."""

    def __init__(self, board: str, run: str) -> None:
        self.reader = BoardReader(open_store(board), run)
        self._steps: dict[int, int] = {}
        self._lock = threading.Lock()

    def step(self, version: int) -> int:
        with self._lock:
            if version not in self._steps:
                meta = self.reader.catalog.version(version).meta or {}
                self._steps[version] = int(meta.get("step", version))
            return self._steps[version]


class Workers:
    """Threads that run until ``stop`` is set: ``start`` starts them all, ``close`` stops and joins them."""

    stop: threading.Event
    _threads: list[threading.Thread]

    def start(self) -> Self:
        for t in self._threads:
            t.start()
        return self

    def close(self) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(10)


class RolloutPool(Workers):
    """Keeps rollout requests in flight on every island; each answer is a group of samples for one prompt."""

    def __init__(
        self,
        islands: list[Island],
        task: ReverseDigits,
        tok: ByteTokenizer,
        cfg: DemoConfig,
        head_version: Callable[[], int],
        steps: StepIndex,
        gateway: str | None = None,
    ) -> None:
        self.islands, self.task, self.tok, self.cfg = islands, task, tok, cfg
        self.head_version, self.steps = head_version, steps
        self.gateway = gateway  # the flipsync islands' requests go there; it says which island served
        self.groups: queue.Queue[RolloutGroup] = queue.Queue(maxsize=4 * cfg.prompts_per_step)
        self.stop = threading.Event()
        self.errors: list[str] = []
        self._next_group = 0
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._loop, args=(island, k), daemon=True, name=f"rollouts-{island.spec.name}-{k}")
            for island in islands
            for k in range(2)
        ]

    def _request(self, island: Island, problem: Problem, seed: int) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": "flipsync-demo" if island.spec.engine == "vllm" and not island.spec.control else "flipsync-torch",
            "prompt": self.tok.encode(problem.prompt),  # token ids: the same for every engine
            "max_tokens": self.cfg.max_tokens,
            "n": self.cfg.group_size,
            "temperature": 1.0,
            "seed": seed,
        }
        if not island.spec.control:
            # the proxy holds or refuses the request until the island serves a recent enough version
            body["weight_version"] = {"min_version": max(0, self.head_version() - self.cfg.max_staleness)}
        return body

    def _loop(self, island: Island, k: int) -> None:
        rng = random.Random(hash((island.spec.name, k)))
        routed = self.gateway is not None and not island.spec.control
        base = self.gateway if routed else island.url
        with httpx.Client(base_url=base or "", timeout=60) as client:
            while not self.stop.is_set():
                with self._lock:
                    problem, gid = self.task.sample(), self._next_group
                    self._next_group += 1
                held_before = island.meters.held_step.value
                try:
                    r = client.post("/v1/completions", json=self._request(island, problem, rng.randrange(2**31)))
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
                name = r.headers.get("x-flipsync-replica", island.spec.name) if routed else island.spec.name
                try:
                    if island.spec.control:
                        # the engine stamps every token with the trainer step of the checkpoint it came from
                        stamps = [v for c in doc["choices"] for v in c.get("token_versions") or []]
                        if any(v is None for v in stamps):
                            continue  # generated while a load was half done: not a policy's sample
                        step = min(stamps) if stamps else held_before
                    else:
                        span = doc.get("weight_version", {})
                        step = self.steps.step(int(span["start"]))
                except (KeyError, ValueError, FlipsyncError) as e:
                    self.errors.append(f"{island.spec.name}: unreadable answer ({e})")
                    continue
                completions = [(c["text"], tuple(self.tok.encode(c["text"], bos=False))) for c in doc["choices"]]
                group = RolloutGroup(problem, gid, completions, step, name)
                while not self.stop.is_set():
                    try:
                        self.groups.put(group, timeout=0.2)
                        break
                    except queue.Full:
                        continue

    def take(self, n: int, step: int, timeout_s: float = 300.0) -> tuple[list[RolloutGroup], dict[str, int]]:
        """``n`` groups whose weights are at most ``max_staleness`` trainer steps older than the policy of
        ``step`` (the weights after step - 1); returns them and, per island, how many rollouts were dropped."""
        out: list[RolloutGroup] = []
        dropped: dict[str, int] = defaultdict(int, {i.spec.name: 0 for i in self.islands})
        deadline = time.monotonic() + timeout_s
        while len(out) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no rollouts within {timeout_s} s; island errors: {self.errors[-3:]}")
            try:
                g = self.groups.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if (step - 1) - g.step > self.cfg.max_staleness:
                dropped[g.island] += len(g.completions)
                continue
            out.append(g)
        return out, dropped


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


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Every tensor of ``a`` and ``b`` has the same name, dtype, shape and bit pattern."""
    if set(a) != set(b):
        return False
    return all(
        x.dtype == b[k].dtype and x.shape == b[k].shape and bits_view(x).equal(bits_view(b[k])) for k, x in a.items()
    )


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


def _check(cfg: DemoConfig) -> None:
    if cfg.islands < 1 or cfg.steps < 1 or cfg.group_size < 2:
        raise ConfigError("the demo needs at least one island, one step and groups of two or more samples")
    if cfg.engine not in ENGINES:
        raise ConfigError(f"unknown engine {cfg.engine!r}; the demo runs islands on: {', '.join(ENGINES)}")
    if cfg.engine == "vllm" and get_format(cfg.served_format).name != "bf16":
        raise ConfigError("the demo's vLLM islands serve bf16 (vLLM loads the model in bf16): leave --format out")
    if cfg.engine == "vllm":
        vllm_python()  # says how to get one when it is missing, before the warm start
    if cfg.model not in DEMO_MODELS:
        raise ConfigError(f"unknown demo model {cfg.model!r}; models: {', '.join(DEMO_MODELS)}")
    if cfg.max_staleness < 0:
        raise ConfigError("--max-staleness must be 0 or more trainer steps")
    if cfg.lr <= 0 or cfg.head_lr_scale <= 0:
        raise ConfigError("--lr and --head-lr-scale must be positive (1: the LM head learns at --lr)")
    optimizer_spec(cfg)  # an unknown optimizer fails here, before the warm start


def run_demo(cfg: DemoConfig, console: Console) -> DemoReport:
    _check(cfg)
    fmt = get_format(cfg.served_format).name
    bandwidth = parse_bandwidth(cfg.bandwidth) if cfg.bandwidth else None
    t_start = time.monotonic()
    timings: dict[str, float] = {}
    torch.manual_seed(cfg.seed)
    out = cfg.out
    out.mkdir(parents=True, exist_ok=True)
    board = board_url(out / "board")
    run = new_run_name("demo")
    tok = ByteTokenizer()
    task = ReverseDigits(min_len=cfg.min_digits, max_len=cfg.max_digits, seed=cfg.seed)

    with console.status("compiling the codec kernels (the first run on a machine only; cached afterwards)"):
        timings["compile_s"] = compile_codec_kernels(fmt)
    config = demo_config(cfg.model)
    model_dir = out / "model"
    write_model_dir(model_dir, config)

    def flipsync_spec(name: str) -> IslandSpec:
        return IslandSpec(
            name, board, run, str(model_dir), fmt, bandwidth, cfg.seed, engine=cfg.engine, fleet=cfg.fleet
        )

    specs = [flipsync_spec(f"island-{i}") for i in range(cfg.islands)]
    gateway = GatewayProcess(board, run, out / "gateway.log", max_lag=cfg.max_staleness) if cfg.fleet else None
    if cfg.control:
        specs.append(
            IslandSpec(
                CONTROL, board_url(out / "checkpoints"), run, str(model_dir), fmt, bandwidth, cfg.seed, control=True
            )
        )
    islands: list[Island] = []
    if cfg.engine == "torch":
        # Their engines need only the architecture: they start (imports, model build) during the warm start
        # and wait for the run's first version.
        islands = [Island(spec).start() for spec in specs]
    model = build_model(config, seed=cfg.seed, dtype=torch.float32)
    model.requires_grad_(True)
    parameters = sum(p.numel() for p in model.parameters())
    t = time.monotonic()
    with console.status(f"warm start: {cfg.warm_start_steps} supervised steps on the task"):
        loss = warm_start(
            model,
            tok,
            task,
            steps=cfg.warm_start_steps,
            lr=cfg.warm_start_lr,
            stop_fraction=cfg.stop_fraction,
            max_tokens=cfg.max_tokens,
            seed=cfg.seed,
        )
    timings["warm_start_s"] = time.monotonic() - t

    def masters() -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    view0 = served_view(masters(), fmt)
    served_values = sum(t.numel() for t in view0.values())
    checkpoint_bytes = sum(t.numel() * t.element_size() for t in view0.values())
    link = f" (a full checkpoint takes {checkpoint_bytes / bandwidth:.1f} s over the {cfg.bandwidth} link)"
    console.print(
        f"{cfg.model}: {parameters / 1e6:.1f}M parameters, served {fmt} view {checkpoint_bytes / 1e6:.1f} MB"
        + (link if bandwidth else "")
    )
    console.print(
        f"warm start done (loss {loss:.3f}, {timings['warm_start_s']:.0f} s); RL with "
        f"{optimizer_spec(cfg).describe()} at {lr_text(cfg.lr, cfg.head_lr_scale)}, {cfg.steps} steps"
    )
    if cfg.engine == "vllm":
        write_model_dir(model_dir, config, view0)  # vLLM starts from these weights: the board's v0

    saver = ThreadPoolExecutor(1, thread_name_prefix="demo-masters")
    masters_dir = out / "masters"
    masters_dir.mkdir(parents=True, exist_ok=True)
    keep_masters = {s if s >= 0 else cfg.steps + 1 + s for s in cfg.masters_at}
    master_paths: list[Path] = []

    def save_masters(step: int) -> None:
        if step in keep_masters:
            path = masters_dir / f"step-{step:04d}.safetensors"
            master_paths.append(path)
            saver.submit(save_checkpoint, masters(), path)

    save_masters(0)
    opt = rl_optimizer(model, cfg.lr, cfg.head_lr_scale, optimizer=optimizer_spec(cfg))
    model.train()
    # The publisher lowers its threads' priority (nice 19 by default) so training comes first; the demo's
    # islands, which stand for machines elsewhere, run at nice 10, so here it runs between the two.
    publisher = Publisher(
        model, board, format=fmt, run=run, optimizer=opt, config=PublisherConfig(nice=5, context=cfg.context)
    )
    publisher.flush()  # v0, a keyframe, is on the board before any island starts
    shelf: CheckpointShelf | None = None
    if cfg.control:
        shelf = CheckpointShelf(out / "checkpoints")
        shelf.put(0, view0)

    if not islands:
        islands = [Island(spec).start() for spec in specs]
    names = [i.spec.name for i in islands]
    flipsync_names = [i.spec.name for i in islands if not i.spec.control]
    first_names = list(flipsync_names)  # the islands there from the start
    pool: RolloutPool | None = None
    monitor: Monitor | None = None
    director: FleetDirector | None = None
    records: list[StepRecord] = []
    try:
        with console.status(f"starting {len(islands)} islands (each an {cfg.engine} engine behind a sidecar)"):
            for island in islands:
                island.wait_ready(timeout_s=900 if cfg.engine == "vllm" else 180)
            if gateway is not None:
                gateway.wait_ready(flipsync_names, timeout_s=180)
        timings["setup_s"] = time.monotonic() - t_start
        step_index = StepIndex(board, run)
        experts = ExpertRates.of(view0)
        monitor = Monitor(board, run, list(islands), step_index, served_values, checkpoint_bytes, experts).start()
        table = StepTable(cfg, run, names, monitor)
        head = lambda: publisher.stats.head or 0  # noqa: E731
        pool = RolloutPool(islands, task, tok, cfg, head, step_index, gateway.url if gateway else None).start()
        if gateway is not None:
            watching = monitor

            def joined(island: Island) -> None:
                watching.watch(island)
                names.append(island.spec.name)
                islands.append(island)

            director = FleetDirector(
                gateway,
                FleetPlan.for_run(cfg.steps, cfg.islands, join_step=cfg.join_step, kill_step=cfg.kill_step),
                console,
                start_island=lambda name: Island(flipsync_spec(name)).start(),
                on_join=joined,
                islands=lambda: list(islands),
            ).start()
        progress = Progress(TextColumn("RL steps"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        bar = progress.add_task("steps", total=cfg.steps)
        t_rl = time.monotonic()
        with Live(
            get_renderable=lambda: RenderGroup(table.render(), progress),
            console=console,
            refresh_per_second=1,  # the trainer's process holds the GIL while it renders: keep it rare
            vertical_overflow="visible",
        ):
            for step in range(1, cfg.steps + 1):
                groups, dropped = pool.take(cfg.prompts_per_step, step)
                with monitor.lock:
                    held = dict(monitor.held)  # when the batch was complete: what each island serves now
                rollouts = [
                    Rollout(
                        g.problem,
                        g.group,
                        text,
                        tokens,
                        ReverseDigits.reward(g.problem, text),
                        g.step,
                        g.step,
                        g.island,
                    )
                    for g in groups
                    for text, tokens in g.completions
                ]
                loss = policy_loss(model, tok, rollouts)
                opt.zero_grad()
                loss.backward()
                opt.step()  # the publisher's post-step hook takes the new weights from here
                with monitor.lock:
                    monitor.step_end[step] = time.monotonic()
                    monitor.trainer_step = step
                if shelf is not None:
                    shelf.put(step, served_view(masters(), fmt))
                save_masters(step)
                if director is not None:
                    director.after_step(step)
                per_island = {}
                for island in list(islands):
                    if island.spec.name not in held:
                        continue  # it joined while this step ran: its first row is the next step's
                    mine = [r for r in rollouts if r.island == island.spec.name]
                    per_island[island.spec.name] = IslandStep(
                        behind=max(0, step - 1 - held[island.spec.name]),
                        used=len(mine),
                        dropped=dropped[island.spec.name],
                        rollout_lag=statistics.fmean(step - 1 - r.version_start for r in mine) if mine else None,
                        bytes=island.meters.bytes_read.value,
                    )
                reward = sum(r.reward for r in rollouts) / len(rollouts)
                records.append(StepRecord(step, reward, len(rollouts), per_island))
                table.records = records
                progress.advance(bar)
            timings["rl_s"] = time.monotonic() - t_rl
            if director is not None:
                director.finish()
            killed = director.killed if director is not None else set()
            islands_alive = [i for i in islands if i.spec.name not in killed]
            flipsync_names = [i.spec.name for i in islands_alive if not i.spec.control]
            publisher.close()
            final = publisher.stats.head or 0
            for island in islands_alive:
                if not island.spec.control:
                    httpx.get(
                        f"{island.url}/flipsync/wait", params={"min_version": final, "timeout_s": 120}, timeout=130
                    )
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and (
                len(monitor.rows) <= final or any(len(r.applied_s) < len(flipsync_names) for r in monitor.rows.values())
            ):
                time.sleep(0.05)
        pool.close()
        pool_errors = list(pool.errors)
        pool = None
        monitor.close()
        audits = {island.spec.name: island.audit(tensors=True) for island in islands_alive}
        trainer_view = served_view(masters(), fmt)
        final_fp = FingerprintTable.of(trainer_view).view_fp()
        equal = {}
        for name in flipsync_names:
            a = audits[name]
            same = a["view_fp"] == final_fp and a["version"] == final
            if a["tensors"] is not None:  # the torch engine's tensors, compared bit for bit too
                same = same and same_bits(a["tensors"], trainer_view)
            equal[name] = same
        saver.shutdown(wait=True)
        if shelf is not None:
            shelf.close()
        rows = [monitor.rows[v] for v in sorted(monitor.rows)]
        report = DemoReport(
            config={k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
            run=run,
            board=board,
            parameters=parameters,
            checkpoint_bytes=checkpoint_bytes,
            versions=rows,
            steps=records,
            lag_samples=[s for s in monitor.samples if s[1] >= 1],
            audits={n: {k: v for k, v in a.items() if k != "tensors"} for n, a in audits.items()},
            final_view_fp=final_fp,
            bitwise_equal=equal,
            # The comparison with the control: the flipsync islands that ran the whole run (not the one that
            # joined late, nor the one killed), when there are any.
            summary={
                **summarize(
                    records,
                    rows,
                    monitor.samples,
                    [n for n in first_names if n in flipsync_names] or flipsync_names,
                    CONTROL if shelf else None,
                    cfg,
                ),
                **({"experts": monitor.experts.summary()} if monitor.experts is not None else {}),
            },
            timings=timings,
            masters=[str(p) for p in master_paths],
            wall_s=time.monotonic() - t_start,
            fleet=director.report() if director is not None else {},
            failed_rollouts=len(pool_errors),
        )
    finally:
        if pool is not None:
            pool.close()
        if monitor is not None:
            monitor.close()
        for island in islands:
            island.stop()
        if gateway is not None:
            gateway.stop()
        saver.shutdown(wait=True)
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

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        paths.append(out / name)
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(11, 4))
    if report.lag_samples:
        names = list(dict.fromkeys(n for _, _, held in report.lag_samples for n in held))  # joiners too
        for name in names:
            mine = [(t, step, held) for t, step, held in report.lag_samples if name in held]
            xs = [t for t, _, _ in mine]
            ys = [max(0, step - held[name]) for _, step, held in mine]
            style = {"lw": 2.2, "color": "tab:red"} if name == CONTROL else {"lw": 1.2, "alpha": 0.8}
            label = f"{name} (reloads full checkpoints)" if name == CONTROL else f"{name} (flipsync patches)"
            ax.step(xs, ys, where="post", label=label, **style)
    ax.set_xlabel("wall time since the islands started (s)")
    ax.set_ylabel("trainer steps behind")
    ax.set_title(f"How far each island's served weights trail the trainer ({report.config['bandwidth']} link)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0, fontsize=8)  # beside the data
    save(fig, "lag_over_time.png")

    if report.fleet.get("samples"):
        fig, ax = plt.subplots(figsize=(11, 4))
        plot_fleet(report.fleet, ax)
        save(fig, "fleet.png")

    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot([r.version for r in patches], [r.changed_pct for r in patches], marker="o")
    ax.set_xlabel("policy version")
    ax.set_ylabel("% of served values changed")
    ax.set_title(
        f"Served values changed per version ({report.config['served_format']}, "
        f"{lr_text(report.config['lr'], report.config.get('head_lr_scale'))})"
    )
    save(fig, "changed_fraction.png")

    fig, ax = plt.subplots(figsize=(8, 4))
    ax.semilogy([r.version for r in patches], [r.patch_bytes for r in patches], marker="o", label="patch")
    ax.semilogy(
        [r.version for r in patches], [r.checkpoint_bytes for r in patches], ls="--", label="full served checkpoint"
    )
    ax.set_xlabel("policy version")
    ax.set_ylabel("bytes shipped per version")
    ax.set_title("Patch vs checkpoint bytes")
    ax.legend()
    save(fig, "patch_vs_checkpoint.png")

    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot([s.step for s in report.steps], [s.reward for s in report.steps], marker="o")
    ax.set_xlabel("trainer step")
    ax.set_ylabel("mean reward of the batch")
    ax.set_ylim(0, 1)
    ax.set_title("Reward (rollouts generated by the islands)")
    save(fig, "reward.png")
    return paths
