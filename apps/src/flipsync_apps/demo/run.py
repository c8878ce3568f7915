"""``flipsync demo``: a small RL post-training run across rollout "regions", side by side with what users do
without flipsync, end to end, on this CPU.

The trainer (this process) warm-starts a Llama-architecture model built from a config (no downloads) on a
verifiable task, then runs GRPO-style policy-gradient steps with Adam. After every optimizer step a
`flipsync.trainer.Publisher` puts the new served view on a local board directory, and a `CheckpointShelf`
saves the full served view beside it, as a trainer that ships checkpoints does. Rollout islands (separate
processes) read through the same bandwidth-limited link: the flipsync islands follow the board (patches),
the control island downloads and reloads each newest full checkpoint. All of them generate the rollouts
the trainer learns from; every token carries the log-probability the engine sampled it with and the version
that produced it, and the trainer weights it by a truncated importance weight (`grpo.policy_loss`). The
rollout mode (``sync``, ``async``, ``inflight``; `rollouts.RolloutPool`, docs/async.md) decides when the
islands generate; rollouts more than ``max_staleness`` trainer steps old are dropped only when that hard cap
is set.

A monitor samples, every 50 ms, which trainer step each island serves and how many bytes its link has
carried, and, per published version, when the manifest appeared and when each island committed it.
With ``fleet`` on (the default) the flipsync islands' rollouts go through a gateway, a new island joins a
third of the way in and one is killed two thirds of the way in (`flipsync_apps.demo.fleet`). The
run ends with every flipsync island recomputing its fingerprints from the weights it holds, which must
equal the trainer's final served view, and is written out as JSON and PNG plots.

This module holds the loop (`run_demo`); its records are in `records`, the rollout pool in `rollouts`, the
monitor and the live table in `monitor`, and the files it writes in `outputs`.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import statistics
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import httpx
import torch
from rich.console import Console
from rich.console import Group as RenderGroup
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from flipsync.board.throttle import parse_bandwidth
from flipsync.checkpoint import load_checkpoint, save_checkpoint
from flipsync.codec.bits import int_view as bits_view
from flipsync.codec.fingerprint import FingerprintTable
from flipsync.engines.torch.model_dir import DEMO_MODELS, demo_config, write_model_dir
from flipsync.engines.torch.models import build_model
from flipsync.engines.torch.tokenizer import ByteTokenizer
from flipsync.engines.vllm.launch import spread_binding
from flipsync.errors import ConfigError, FlipsyncError
from flipsync.formats import get_format, served_view
from flipsync.trainer import Publisher, PublisherConfig, new_run_name
from flipsync_apps.demo.control import CheckpointShelf
from flipsync_apps.demo.experts import ExpertRates
from flipsync_apps.demo.fleet import FleetDirector, FleetPlan, GatewayProcess
from flipsync_apps.demo.grpo import Rollout, WeightConfig, optimizer_spec, policy_loss, rl_optimizer, warm_start
from flipsync_apps.demo.island import Island, board_url
from flipsync_apps.demo.island_link import IslandSpec
from flipsync_apps.demo.monitor import Monitor, StepTable
from flipsync_apps.demo.records import CONTROL, ROLLOUT_MODES, DemoConfig, DemoReport, IslandStep, StepRecord
from flipsync_apps.demo.rollouts import RolloutGroup, RolloutPool, StepIndex, busy_seconds
from flipsync_apps.demo.summary import lr_text, rollout_summary, summarize
from flipsync_apps.demo.task import ReverseDigits
from flipsync_apps.demo.vllm_server import vllm_python
from flipsync_apps.demo.warmup import compile_codec_kernels

ENGINES = ("torch", "vllm")
WARM_START_BATCH = 32  # problems per supervised step of the warm start

log = logging.getLogger(__name__)


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Every tensor of ``a`` and ``b`` has the same name, dtype, shape and bit pattern."""
    if set(a) != set(b):
        return False
    return all(
        x.dtype == b[k].dtype and x.shape == b[k].shape and bits_view(x).equal(bits_view(b[k])) for k, x in a.items()
    )


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
    if cfg.max_staleness is not None and cfg.max_staleness < 0:
        raise ConfigError("--max-staleness must be 0 or more trainer steps")
    if cfg.rollout not in ROLLOUT_MODES:
        raise ConfigError(f"unknown rollout mode {cfg.rollout!r}; modes: {', '.join(ROLLOUT_MODES)}")
    if cfg.is_cap <= 0 or cfg.staleness_bound < 0:
        raise ConfigError("--is-cap must be positive and --staleness-bound 0 or more trainer steps")
    if cfg.lr <= 0 or cfg.head_lr_scale <= 0:
        raise ConfigError("--lr and --head-lr-scale must be positive (1: the LM head learns at --lr)")
    optimizer_spec(cfg)  # an unknown optimizer fails here, before the warm start


def warm_start_cache_dir() -> Path:
    """Where warm-started policies are kept (``$XDG_CACHE_HOME/flipsync/demo-warm-start``)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flipsync" / "demo-warm-start"


def _source_digest(*objects: object) -> str:
    """A digest of the source files that define ``objects``."""
    h = hashlib.sha256()
    for path in sorted({inspect.getfile(o) for o in objects}):  # type: ignore[arg-type]
        h.update(Path(path).read_bytes())
    return h.hexdigest()[:16]


def cached_warm_start(
    model: torch.nn.Module, tok: ByteTokenizer, task: ReverseDigits, cfg: DemoConfig, arch: str
) -> float:
    """`warm_start`, or its result from the cache: the warm start is deterministic (the model's seed, the task's,
    the steps), so a run with the same settings loads the same weights instead of spending a minute on them.
    The task's sampler is moved on as the warm start moves it, so the RL prompts are the same either way."""
    settings = [arch, cfg.seed, cfg.warm_start_steps, cfg.warm_start_lr, cfg.stop_fraction, cfg.max_tokens]
    settings += [cfg.min_digits, cfg.max_digits, WARM_START_BATCH, torch.__version__]
    # The code that decides the weights too: a changed tokenizer, task, loss or model builder is a new key.
    settings += [_source_digest(warm_start, ReverseDigits, ByteTokenizer, build_model)]
    key = hashlib.sha256(json.dumps(settings, default=str).encode()).hexdigest()[:24]
    path = warm_start_cache_dir() / f"{key}.safetensors"
    if path.exists():
        try:
            model.load_state_dict(load_checkpoint(path))
            for _ in range(cfg.warm_start_steps * WARM_START_BATCH):
                task.sample()
            return float(json.loads(path.with_suffix(".json").read_text())["loss"])
        except (OSError, ValueError, KeyError, RuntimeError, FlipsyncError) as e:
            log.warning("warm-start cache %s unreadable (%s): warming up again", path, e)
            task.rng.seed(cfg.seed)
    loss = warm_start(
        model,
        tok,
        task,
        steps=cfg.warm_start_steps,
        lr=cfg.warm_start_lr,
        batch=WARM_START_BATCH,
        stop_fraction=cfg.stop_fraction,
        max_tokens=cfg.max_tokens,
        seed=cfg.seed,
    )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_checkpoint({k: v.detach().clone() for k, v in model.state_dict().items()}, path)
        path.with_suffix(".json").write_text(json.dumps({"loss": loss, "settings": settings}, default=str))
    except OSError as e:  # a read-only home: no cache, same run
        log.warning("cannot keep the warm start in %s: %s", path, e)
    return loss


def wait_for_step(monitor: Monitor, step: int, *, timeout_s: float) -> None:
    """Until every flipsync island following the board serves trainer ``step`` or later (bounded: a starved
    island holds the batch back at most ``timeout_s``; the proxy's ``min_version`` still keeps it on-policy)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with monitor.lock:
            if all(monitor.held.get(n, 0) >= step for n in monitor.following.followers()):
                return
        time.sleep(0.02)


def idle_seconds(
    alive: dict[str, list[float]], busy: Mapping[str, list[tuple[float, float]]], end: float
) -> dict[str, float]:
    """Per island, the seconds it was up during the RL steps with no request of the run's running on it."""
    out = {}
    for name, (a, b) in alive.items():
        b = min(b, end)
        out[name] = max(0.0, b - a - busy_seconds(list(busy.get(name, [])), a, b))
    return out


def to_rollouts(groups: list[RolloutGroup], step: int, *, per_token: bool) -> list[Rollout]:
    """The batch for trainer ``step``: each completion with its behaviour log-probs and each token's staleness
    (trainer steps between the policy being trained, after step - 1, and the weights that produced it), by the
    token's own version (``per_token``) or by the version its response began on (every token the oldest)."""
    out = []
    for g in groups:
        for c in g.completions:
            steps = c.steps if per_token else (c.start_step,) * len(c.tokens)
            stale = tuple(max(0, step - 1 - s) for s in steps) or (max(0, step - 1 - c.start_step),)
            reward = ReverseDigits.reward(g.problem, c.text)
            first, last = (min(steps), max(steps)) if steps else (c.start_step, c.start_step)
            facts = (c.behaviour, stale, c.stopped)
            out.append(Rollout(g.problem, g.group, c.text, c.tokens, reward, first, last, g.island, *facts))
    return out


def response_staleness(groups: list[RolloutGroup], step: int) -> dict[int, int]:
    """Tokens by staleness, each counted at the version its response began on (what a per-response version says)."""
    hist: dict[int, int] = {}
    for g in groups:
        for c in g.completions:
            s = max(0, step - 1 - c.start_step)
            hist[s] = hist.get(s, 0) + len(c.tokens) + (1 if c.stopped else 0)
    return dict(sorted(hist.items()))


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

    # vLLM servers share this host's CPUs: each binds its worker to CPUs of its own (in turn when there are more
    # servers than CPUs) instead of all on the same ones. Slots: the islands, the control, a joiner.
    servers = cfg.islands + 2

    def binding(slot: int) -> dict[str, str]:
        return spread_binding(slot, servers=servers) if cfg.engine == "vllm" else {}

    def flipsync_spec(name: str, slot: int) -> IslandSpec:
        return IslandSpec(
            name,
            board,
            run,
            str(model_dir),
            fmt,
            bandwidth,
            cfg.seed,
            engine=cfg.engine,
            fleet=cfg.fleet,
            binding=binding(slot),
        )

    specs = [flipsync_spec(f"island-{i}", i) for i in range(cfg.islands)]
    # the gateway's readiness bound (versions behind HEAD an island may serve unconstrained requests at)
    max_lag = cfg.max_staleness if cfg.max_staleness is not None else 1
    gateway = GatewayProcess(board, run, out / "gateway.log", max_lag=max_lag) if cfg.fleet else None
    if cfg.control:
        specs.append(
            IslandSpec(
                CONTROL,
                board_url(out / "checkpoints"),
                run,
                str(model_dir),
                fmt,
                bandwidth,
                cfg.seed,
                engine=cfg.engine,  # like for like: on vLLM, vLLM's own reload of each whole checkpoint
                control=True,
                binding=binding(cfg.islands),
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
        loss = cached_warm_start(model, tok, task, cfg, config.to_json_string())
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
        watching = monitor
        pool = RolloutPool(
            islands,
            task,
            tok,
            cfg,
            head,
            step_index,
            gateway.url if gateway else None,
        ).start()
        weights = WeightConfig(cfg.is_cap, cfg.staleness_bound)
        alive: dict[str, list[float]] = {n: [time.monotonic(), float("inf")] for n in names}  # for idle seconds
        if gateway is not None:

            def joined(island: Island) -> None:
                watching.watch(island)
                names.append(island.spec.name)
                islands.append(island)
                alive[island.spec.name] = [time.monotonic(), float("inf")]

            def killed_now(name: str) -> None:
                watching.leave(name)
                if name in alive:
                    alive[name][1] = time.monotonic()

            director = FleetDirector(
                gateway,
                FleetPlan.for_run(cfg.steps, cfg.islands, join_step=cfg.join_step, kill_step=cfg.kill_step),
                console,
                start_island=lambda name: Island(flipsync_spec(name, cfg.islands + 1)).start(),
                on_join=joined,
                islands=lambda: list(islands),
                on_kill=killed_now,
            ).start()
        progress = Progress(TextColumn("RL steps"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        bar = progress.add_task("steps", total=cfg.steps)
        t_rl = time.monotonic()
        timings["load_avg_start"] = os.getloadavg()[0]  # a shared machine's other work shows in every wall time
        with Live(
            get_renderable=lambda: RenderGroup(table.render(), progress),
            console=console,
            refresh_per_second=1,  # the trainer's process holds the GIL while it renders: keep it rare
            vertical_overflow="visible",
        ):
            for step in range(1, cfg.steps + 1):
                t_wait = time.monotonic()
                if cfg.rollout == "sync":
                    # on-policy: the batch is generated only once every following island serves the weights
                    # after step - 1 (the publisher's flush: the version is on the board)
                    publisher.flush()
                    wait_for_step(monitor, step - 1, timeout_s=120)
                    pool.open_round(step, publisher.stats.head or 0, cfg.prompts_per_step)
                groups, dropped = pool.take(cfg.prompts_per_step, step)
                with monitor.lock:
                    held = dict(monitor.held)  # when the batch was complete: what each island serves now
                t_train = time.monotonic()
                rollouts = to_rollouts(groups, step, per_token=cfg.rollout != "async")
                loss, stats = policy_loss(model, tok, rollouts, weights)
                opt.zero_grad()
                loss.backward()
                opt.step()  # the publisher's post-step hook takes the new weights from here
                t_done = time.monotonic()
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
                records.append(
                    StepRecord(
                        step,
                        reward,
                        len(rollouts),
                        per_island,
                        t=time.monotonic() - t_rl,
                        wait_s=t_train - t_wait,
                        train_s=t_done - t_train,
                        tokens=stats.tokens,
                        weight_mean=stats.weight_mean,
                        clipped=stats.clipped,
                        kl_k1=stats.kl_k1,
                        kl_k2=stats.kl_k2,
                        kl_k3=stats.kl_k3,
                        staleness=stats.staleness or {},
                        staleness_response=response_staleness(groups, step),
                        outliers=stats.outliers or [],
                    )
                )
                table.records = records
                progress.advance(bar)
            timings["rl_s"] = time.monotonic() - t_rl
            timings["load_avg_end"] = os.getloadavg()[0]
            t_rl_end = time.monotonic()
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
            while time.monotonic() < deadline and (len(monitor.rows) <= final or not monitor.complete()):
                time.sleep(0.05)
        pool.close()
        pool_errors = list(pool.errors)
        pool_stats = pool.stats
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
                "rollout": rollout_summary(
                    cfg,
                    records,
                    timings["rl_s"],
                    tokens=dict(pool_stats.tokens),
                    generated=dict(pool_stats.rollouts),
                    dropped=dict(pool_stats.dropped),
                    unaligned=dict(pool_stats.unaligned),
                    idle_s=idle_seconds(alive, pool_stats.busy, t_rl_end),
                ),
            },
            timings=timings,
            masters=[str(p) for p in master_paths],
            wall_s=time.monotonic() - t_start,
            fleet={**director.report(), "catch_up": list(monitor.following.events)} if director is not None else {},
            failed_rollouts=len(pool_errors),
            rollout_errors=pool_errors[:20],
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
