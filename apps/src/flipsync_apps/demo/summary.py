"""The demo's summary: its figures (``summarize``), the sentences printed at the end (``summary_lines``) and two
runs side by side (``comparison``).

Every sentence must be true of the run it describes, whatever its length and outcome: a comparison says "fewer"
or "less" only when the flipsync islands' figure is at least 5% below the control island's, "more" only when it
is at least 5% above, and "about as many" otherwise; a lag of zero is said as "never trailed"; the reward
windows at the start and the end of the run never overlap.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.table import Table

from flipsync.errors import ConfigError
from flipsync_apps.demo.experts import summary_line as experts_line
from flipsync_apps.demo.records import DemoConfig, DemoReport, StepRecord, VersionRow

CLEAR = 1.05  # how far apart two figures must be before a sentence calls one of them smaller
REWARD_WINDOW = 5  # steps averaged at each end of the run, fewer in a short run


def lr_text(lr: float, head_lr_scale: float | None) -> str:
    head = f" (LM head and final norm {lr * head_lr_scale:g})" if head_lr_scale not in (None, 1.0) else ""
    return f"lr {lr:g}{head}"


def reward_window(steps: int) -> int:
    """Steps averaged at each end: up to 5, and never more than half the run, so the two ends never overlap."""
    return max(1, min(REWARD_WINDOW, steps // 2))


def summarize(
    records: Sequence[StepRecord],
    rows: Sequence[VersionRow],
    samples: Sequence[tuple[float, int, Mapping[str, int]]],
    flipsync: Sequence[str],
    control: str | None,
    cfg: DemoConfig,
) -> dict[str, Any]:
    """The run's figures: bytes and lag of the flipsync islands against the control, reward, change rate."""
    rl = [s for s in samples if s[1] >= 1]  # from the first trainer step on

    def lag(name: str) -> float:  # over the samples the island was in (one may join late or be killed)
        mine = [max(0, step - held[name]) for _, step, held in rl if name in held]
        return statistics.fmean(mine) if mine else 0.0

    last = records[-1].islands if records else {}
    patches = [r for r in rows if r.version > 0]
    k = reward_window(len(records))
    out: dict[str, Any] = {
        "steps": len(records),
        "optimizer": getattr(cfg, "optimizer", "adam"),
        "control": control,
        "lag_steps": {n: lag(n) for n in [*flipsync, *([control] if control else [])]},
        "bytes": {n: last[n].bytes for n in last},
        "dropped": {n: sum(r.islands[n].dropped for r in records if n in r.islands) for n in last},
        "reward_window": k,
        "reward_first": statistics.fmean(r.reward for r in records[:k]) if records else None,
        "reward_last": statistics.fmean(r.reward for r in records[-k:]) if records else None,
        "changed_pct_mean": statistics.fmean(r.changed_pct for r in patches) if patches else None,
        "patch_bytes_mean": statistics.fmean(r.patch_bytes for r in patches) if patches else None,
        "checkpoint_bytes": rows[0].checkpoint_bytes if rows else None,
        "lr": cfg.lr,
        "head_lr_scale": cfg.head_lr_scale,
    }
    flipsync = [n for n in flipsync if n in last]  # an island killed before the last step has no last record
    if control and flipsync and last and control in last:
        f_bytes = statistics.fmean(last[n].bytes for n in flipsync)
        f_lag = statistics.fmean(out["lag_steps"][n] for n in flipsync)
        out["flipsync_bytes_mean"] = f_bytes
        out["flipsync_lag_mean"] = f_lag
        out["bytes_ratio"] = last[control].bytes / f_bytes if f_bytes else None
        out["lag_ratio"] = out["lag_steps"][control] / f_lag if f_lag > 0 else None
    return out


def quantile(hist: Mapping[int, int], q: float) -> int | None:
    """The ``q`` quantile of a histogram (value -> count): the smallest value with at least q of the mass."""
    total = sum(hist.values())
    if total == 0:
        return None
    seen = 0
    for value in sorted(hist):
        seen += hist[value]
        if seen >= q * total:
            return value
    return max(hist)


def merge_hists(hists: Sequence[Mapping[Any, int]]) -> dict[int, int]:
    out: dict[int, int] = {}
    for h in hists:
        for k, n in h.items():
            out[int(k)] = out.get(int(k), 0) + n  # JSON turned the keys into strings
    return dict(sorted(out.items()))


def rollout_summary(
    cfg: DemoConfig,
    records: Sequence[StepRecord],
    rl_s: float,
    *,
    tokens: Mapping[str, int],
    generated: Mapping[str, int],
    dropped: Mapping[str, int],
    unaligned: Mapping[str, int],
    idle_s: Mapping[str, float],
) -> dict[str, Any]:
    """The rollout mode's figures: reward per trainer step and per minute, tokens per second across the
    islands, idle seconds, the staleness of every trained token (by its own version and by its response's),
    the behaviour->trained KL and the importance weights, and the rollouts dropped."""
    hist = merge_hists([r.staleness for r in records])
    by_response = merge_hists([r.staleness_response for r in records])
    trained = sum(hist.values())
    k = reward_window(len(records))
    first = statistics.fmean(r.reward for r in records[:k]) if records else None
    last = statistics.fmean(r.reward for r in records[-k:]) if records else None
    n_generated, n_dropped = sum(generated.values()), sum(dropped.values())
    minutes = rl_s / 60 if rl_s > 0 else None

    def weighted(attr: str) -> float | None:  # token-weighted mean over the steps
        n = sum(r.tokens for r in records)
        return sum(getattr(r, attr) * r.tokens for r in records) / n if n else None

    # tokens a per-response version would call older than they are (it gives each the response's first version)
    overstated = sum(by_response.get(s, 0) * s for s in by_response) - sum(hist.get(s, 0) * s for s in hist)
    return {
        "mode": cfg.rollout,
        "is_cap": cfg.is_cap,
        "staleness_bound": cfg.staleness_bound,
        "max_staleness": cfg.max_staleness,
        "rl_s": rl_s,
        "steps_per_min": len(records) / minutes if minutes else None,
        "wait_s_mean": statistics.fmean(r.wait_s for r in records) if records else None,
        "train_s_mean": statistics.fmean(r.train_s for r in records) if records else None,
        "reward_mean": statistics.fmean(r.reward for r in records) if records else None,
        "reward_first": first,
        "reward_last": last,
        "reward_gain_per_min": (last - first) / minutes if minutes and first is not None and last is not None else None,
        "tokens": dict(tokens),
        "tokens_per_s": sum(tokens.values()) / rl_s if rl_s > 0 else None,
        "idle_s": dict(idle_s),
        "idle_s_mean": statistics.fmean(idle_s.values()) if idle_s else None,
        "generated": n_generated,
        "dropped": dict(dropped),
        "dropped_total": n_dropped,
        "dropped_pct": 100.0 * n_dropped / n_generated if n_generated else 0.0,
        "unaligned": sum(unaligned.values()),
        "trained_tokens": trained,
        "staleness": hist,
        "staleness_response": by_response,
        "staleness_p50": quantile(hist, 0.5),
        "staleness_p90": quantile(hist, 0.9),
        "staleness_p99": quantile(hist, 0.99),
        "staleness_max": max(hist) if hist else None,
        "staleness_mean": sum(s * n for s, n in hist.items()) / trained if trained else None,
        "staleness_response_mean": sum(s * n for s, n in by_response.items()) / max(1, sum(by_response.values())),
        "staleness_overstated_steps": overstated,
        "kl_k1": weighted("kl_k1"),
        "kl_k2": weighted("kl_k2"),
        "kl_k3": weighted("kl_k3"),
        "weight_mean": weighted("weight_mean"),
        "clipped": weighted("clipped"),
    }


def rollout_line(s: Mapping[str, Any]) -> str | None:
    """One sentence on the rollout mode's figures (from ``summary['rollout']``)."""
    r = s.get("rollout")
    if not r:
        return None
    q = "/".join("-" if r.get(f"staleness_{p}") is None else str(r[f"staleness_{p}"]) for p in ("p50", "p90", "p99"))
    gain = r.get("reward_gain_per_min")
    return (
        f"rollout mode {r['mode']}: {_f(r.get('steps_per_min'), '.1f')} trainer steps/min, reward "
        f"{_f(gain, '+.3f')}/min, {_f(r.get('tokens_per_s'), '.1f')} tokens/s across the islands, idle "
        f"{_f(r.get('idle_s_mean'), '.1f')} s per island (mean); token staleness p50/p90/p99 {q} steps; "
        f"KL(behaviour||trained) {_f(r.get('kl_k2'), '.2e')} (k2); importance weight mean "
        f"{_f(r.get('weight_mean'), '.3f')}, clipped {_f(100 * (r.get('clipped') or 0), '.1f')}%; dropped "
        f"{r['dropped_total']} of {r['generated']} rollouts ({r['dropped_pct']:.1f}%)"
    )


def _times(x: float) -> str:
    return f"{x:.1f}x" if x < 10 else f"{x:,.0f}x"


def bytes_verdict(flipsync: float, control: float) -> str:
    """How the flipsync islands' mean bytes compare with the control island's, in words that are true."""
    if flipsync == control:
        return "no bytes either" if flipsync == 0 else "flipsync moved as many bytes"
    if flipsync == 0:
        return "the flipsync islands moved no bytes"
    if control == 0:
        return "the full-checkpoint island moved no bytes"
    if control >= CLEAR * flipsync:
        return f"flipsync moved {_times(control / flipsync)} fewer bytes"
    if flipsync >= CLEAR * control:
        return f"flipsync moved {_times(flipsync / control)} more bytes"
    return "flipsync moved about as many bytes (within 5%)"


def lag_verdict(flipsync: float, control: float) -> str:
    """How far the flipsync islands trailed against the control island, in words that are true."""
    if flipsync == 0 and control == 0:
        return "neither trailed"
    if flipsync == 0:
        return "the flipsync islands never trailed"
    if control == 0:
        return "the full-checkpoint island never trailed"
    if control >= CLEAR * flipsync:
        return f"the flipsync islands trailed {_times(control / flipsync)} less"
    if flipsync >= CLEAR * control:
        return f"the full-checkpoint island trailed {_times(flipsync / control)} less"
    return "they trailed about as much (within 5%)"


def _steps(k: int) -> str:
    return "step" if k == 1 else f"{k} steps"


def summary_lines(report: DemoReport | Mapping[str, Any]) -> list[str]:
    """The sentences printed at the end of a run (from its ``summary``)."""
    s: Mapping[str, Any] = report if isinstance(report, Mapping) else report.summary
    lines = []
    control = s.get("control") or "full-ckpt"
    if "flipsync_bytes_mean" in s and control in s.get("bytes", {}):
        c_bytes, f_bytes = s["bytes"][control], s["flipsync_bytes_mean"]
        lines.append(
            f"bytes over each link: flipsync islands {f_bytes / 1e6:.1f} MB (mean), full-checkpoint island "
            f"{c_bytes / 1e6:.1f} MB: {bytes_verdict(f_bytes, c_bytes)}"
        )
        f_lag, c_lag = s["flipsync_lag_mean"], s["lag_steps"][control]
        lines.append(
            f"lag (trainer steps the served weights trailed the trainer, time-averaged): flipsync islands "
            f"{f_lag:.2f}, full-checkpoint island {c_lag:.2f}: {lag_verdict(f_lag, c_lag)}; "
            "rollouts dropped as stale: " + ", ".join(f"{n} {d}" for n, d in s["dropped"].items())
        )
    if s.get("reward_first") is not None:
        n, k = s.get("steps", 0), s.get("reward_window", 1)
        changed = f"{s['changed_pct_mean']:.2f}%" if s.get("changed_pct_mean") is not None else "- (no patch)"
        opt = s.get("optimizer", "adam")
        if n <= 1:
            reward = f"reward: {s['reward_first']:.3f} (one step)"
        else:
            reward = (
                f"reward: first {_steps(k)} {s['reward_first']:.3f}, last {_steps(k)} {s['reward_last']:.3f} "
                f"({s['reward_last'] - s['reward_first']:+.3f})"
            )
        patch = s.get("patch_bytes_mean")
        lines.append(
            f"{reward}; {opt}, {lr_text(s['lr'], s.get('head_lr_scale'))}: served values changed per version "
            f"{changed} (mean)" + (f", patch {patch / 1e3:,.1f} kB per version (mean)" if patch is not None else "")
        )
    if s.get("experts"):
        lines.append(experts_line(s["experts"]))
    if (line := rollout_line(s)) is not None:
        lines.append(line)
    return lines


def load_report(path: Path) -> dict[str, Any]:
    """A previous run's report.json (the file, or the folder that holds it)."""
    file = path / "report.json" if path.is_dir() else path
    try:
        doc = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read a demo report from {file}: {e}") from None
    if "summary" not in doc or "config" not in doc:
        raise ConfigError(f"{file} is not a flipsync demo report.json")
    return doc


def _mb(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e6:.1f}"


def _kb(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e3:,.1f}"


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _pair(r: Mapping[str, Any], a: str, b: str) -> str:
    return f"{_f(r.get(a), '.2f')} / {_f(r.get(b), '.2f')}" if r else "-"


def _staleness_cell(r: Mapping[str, Any]) -> str:
    if not r:
        return "-"
    return "/".join("-" if r.get(k) is None else str(r[k]) for k in ("staleness_p50", "staleness_p90", "staleness_max"))


def _mean_cell(r: Mapping[str, Any]) -> str:
    return f"{_f(r.get('staleness_mean'), '.2f')} ({_f(r.get('staleness_response_mean'), '.2f')})" if r else "-"


def _weight_cell(r: Mapping[str, Any]) -> str:
    if not r:
        return "-"
    clipped = 100 * r["clipped"] if r.get("clipped") is not None else None
    return f"{_f(r.get('weight_mean'), '.3f')} / {_f(clipped, '.1f')}"


def comparison(runs: Sequence[tuple[str, Mapping[str, Any]]]) -> Table:
    """Runs side by side (each ``(label, report.json document)``): reward, change rate, patch bytes and lag."""
    t = Table(title="Runs side by side", caption="reward: mean of the first and last steps' batches (window)")
    t.add_column("", justify="left")
    for label, _ in runs:
        t.add_column(label, justify="right")
    summaries = [doc["summary"] for _, doc in runs]
    configs = [doc["config"] for _, doc in runs]
    control = [s.get("control") or "full-ckpt" for s in summaries]
    rows: list[tuple[str, list[str]]] = [
        ("optimizer", [str(c.get("optimizer", "adam")) for c in configs]),
        ("lr", [lr_text(c["lr"], c.get("head_lr_scale")) for c in configs]),
        ("model, format", [f"{c.get('model')}, {c.get('served_format')}" for c in configs]),
        ("RL steps", [str(s.get("steps", "-")) for s in summaries]),
        ("reward window (steps)", [str(s.get("reward_window", "-")) for s in summaries]),
        ("reward, first steps", [_f(s.get("reward_first", s.get("reward_first5")), ".3f") for s in summaries]),
        ("reward, last steps", [_f(s.get("reward_last", s.get("reward_last5")), ".3f") for s in summaries]),
        ("served values changed per version %", [_f(s.get("changed_pct_mean"), ".3f") for s in summaries]),
        ("patch per version kB", [_kb(s.get("patch_bytes_mean")) for s in summaries]),
        ("flipsync islands: MB over the link", [_mb(s.get("flipsync_bytes_mean")) for s in summaries]),
        (
            "full-checkpoint island: MB",
            [_mb(s.get("bytes", {}).get(c)) for s, c in zip(summaries, control, strict=True)],
        ),
        ("flipsync islands: lag (steps)", [_f(s.get("flipsync_lag_mean"), ".2f") for s in summaries]),
        (
            "full-checkpoint island: lag (steps)",
            [_f(s.get("lag_steps", {}).get(c), ".2f") for s, c in zip(summaries, control, strict=True)],
        ),
    ]
    ro = [s.get("rollout") or {} for s in summaries]
    if any(ro):

        def cell(key: str, fmt: str, scale: float = 1.0) -> list[str]:
            return [_f(r[key] * scale if r.get(key) is not None else None, fmt) for r in ro]

        rows += [
            ("rollout mode", [str(r.get("mode", "-")) for r in ro]),
            ("RL wall time s", cell("rl_s", ".0f")),
            ("trainer steps per minute", cell("steps_per_min", ".2f")),
            (
                "trainer: waiting for the batch / training, s per step",
                [_pair(r, "wait_s_mean", "train_s_mean") for r in ro],
            ),
            ("reward, mean of all steps", cell("reward_mean", ".3f")),
            ("reward gain per minute", cell("reward_gain_per_min", "+.3f")),
            ("tokens/s across islands", cell("tokens_per_s", ".1f")),
            ("island idle s (mean)", cell("idle_s_mean", ".1f")),
            ("token staleness p50/p90/max", [_staleness_cell(r) for r in ro]),
            ("token staleness mean (per response)", [_mean_cell(r) for r in ro]),
            (
                "KL(behaviour||trained), k2 / k1",
                [f"{_f(r.get('kl_k2'), '.2e')} / {_f(r.get('kl_k1'), '.2e')}" for r in ro],
            ),
            ("importance weight mean / clipped %", [_weight_cell(r) for r in ro]),
            ("rollouts dropped", [f"{r['dropped_total']} of {r['generated']}" if r else "-" for r in ro]),
        ]
    for name, cells in rows:
        t.add_row(name, *cells)
    return t
