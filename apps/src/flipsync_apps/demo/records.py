"""The demo's records: its configuration (`DemoConfig`), one row per published version, one record per trainer
step, and the `DemoReport` a run returns and writes as JSON; the summary and the outputs read these.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

CONTROL = "full-ckpt"  # the control island's name
ROLLOUT_MODES = ("sync", "async", "inflight")  # see docs/async.md


@dataclass
class DemoConfig:
    steps: int = 40
    served_format: str = "bf16"
    lr: float = 3e-5
    head_lr_scale: float = 20.0  # the LM head and final norm learn at this times lr (see grpo.rl_optimizer)
    islands: int = 2  # flipsync islands
    control: bool = True  # one more island that reloads full checkpoints
    bandwidth: str | None = "100mbit"
    max_staleness: int | None = None  # a hard cap (trainer steps): older rollouts are dropped; None: no cap
    rollout: str = "inflight"  # sync | async | inflight (ROLLOUT_MODES; docs/async.md)
    is_cap: float = 2.0  # the truncated importance weight's cap (grpo.WeightConfig)
    staleness_bound: int = 2  # tokens older than this (trainer steps) get a cap falling as is_cap * bound / s
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
    fleet: bool = True  # rollouts through a gateway; an island joins and one is killed (flipsync_apps.demo.fleet)
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
    # the flipsync islands following the board when the manifest appeared (a joiner still catching up is not)
    followers: list[str] = field(default_factory=list)

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
    t: float = 0.0  # seconds since the RL steps started, when the step ended
    wait_s: float = 0.0  # the trainer waited this long for the batch (sync: for the version to land, too)
    train_s: float = 0.0  # forward, backward and optimizer step
    tokens: int = 0  # scored tokens of the batch
    weight_mean: float = 1.0  # mean truncated importance weight
    clipped: float = 0.0  # share of tokens whose ratio exceeded its cap
    kl_k1: float = 0.0  # KL(behaviour || trained), estimated from the tokens' log-probs
    kl_k2: float = 0.0  # the same, Schulman's k2 (low variance)
    kl_k3: float = 0.0  # and k3 (unbiased, heavy-tailed)
    staleness: dict[int, int] = field(default_factory=dict)  # trainer steps -> tokens, by each token's version
    staleness_response: dict[int, int] = field(default_factory=dict)  # the same, by the version a response began on
    outliers: list[tuple[float, int, int, str, str]] = field(default_factory=list)  # grpo.LossStats.outliers


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
    rollout_errors: list[str] = field(default_factory=list)  # what the first of them (and unreadable answers) said

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        for row, v in zip(doc["versions"], self.versions, strict=True):
            row["changed_pct"] = v.changed_pct
        return doc
