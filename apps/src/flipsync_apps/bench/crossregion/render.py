"""The crossregion benchmark's output: rich tables for the console, markdown and a plot for docs/benchmarks.md."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rich.table import Table

from flipsync_apps.bench.crossregion.race import METHOD_LABEL, METHODS
from flipsync_apps.bench.report import Figures, md_table, pyplot, save_figure


def fmt_s(s: float) -> str:
    if s < 10:
        return f"{s * 1e3:.0f} ms"
    if s < 1000:
        return f"{s:.1f} s"
    return f"{s:,.0f} s"


def fmt_range(st: Mapping[str, float]) -> str:
    if st["max"] <= st["min"] * 1.0005:
        return fmt_s(st["median"])
    return f"{fmt_s(st['median'])} ({fmt_s(st['min'])}-{fmt_s(st['max'])})"


def full_over_patch(row: Mapping[str, Any]) -> float:
    """A measured cell's full-checkpoint median over its patch median."""
    return float(row["full"]["median"] / row["patch"]["median"])


def _relay_wan_share(row: Mapping[str, Any], patch_bytes: int) -> float:
    """The relay's upstream (WAN) bytes over what N direct readers would fetch: 1/N means once per island."""
    return float(row["relay"]["wan_bytes"] / (row["replicas"] * patch_bytes))


def tables(result: Mapping[str, Any]) -> list[Table]:
    t = Table(title="optimizer.step() returned -> last replica verified: median (min-max) | cost model")
    for col in ("link", "N", *(METHOD_LABEL[m] for m in METHODS), "full / patch", "relay WAN / (N x patch)", "ok"):
        t.add_column(col, justify="right")
    for r in result["rows"]:
        t.add_row(*_measured_cells(r, result["patch_bytes"]))
    st = result["streaming"]
    y = Table(title=f"streaming on and off: N=1, {st['bandwidth']}, patch: median (min-max) | cost model")
    for col in ("part", "measured", "model", "ok"):
        y.add_column(col, justify="right")
    for label, cells in _streaming_cells(st):
        y.add_row(label, *cells)
    e = result["extrapolations"][0]
    x = Table(
        title=f"model: 500 GB bf16 view, {100 * e['changed_fraction']:.2f}% changed, "
        f"{e['bytes_per_change']:.3f} B/change ({e['source']}), patch {e['patch_bytes'] / 1e9:.2f} GB"
    )
    for col in ("link", "patch (this machine)", "full", "ratio", "patch (parallel model)", "full", "ratio", "wire"):
        x.add_column(col, justify="right")
    for r in e["rows"]:
        x.add_row(*_extrapolation_cells(r))
    return [t, y, x]


def _measured_cells(r: Mapping[str, Any], patch_bytes: int, *, markdown: bool = False) -> tuple[str, ...]:
    """One measured (link, N) row: per method the measured range and the model (one cell on the console, two
    in markdown), full / patch, the relay's WAN share and whether every replica ended bitwise at v1."""
    bold = "**" if markdown else ""
    if markdown:
        methods = [x for m in METHODS for x in (fmt_range(r[m]), fmt_s(r[m]["model"]))]
    else:
        methods = [f"{fmt_range(r[m])} | {fmt_s(r[m]['model'])}" for m in METHODS]
    return (
        r["bandwidth"],
        str(r["replicas"]),
        *methods,
        f"{bold}{full_over_patch(r):.1f}x{bold}",
        f"{_relay_wan_share(r, patch_bytes):.2f}",
        "yes" if r["bitwise"] else f"{bold}NO{bold}",
    )


def _streaming_cells(st: Mapping[str, Any]) -> list[tuple[str, tuple[str, str, str]]]:
    labels = {"streamed": f"streamed in {st['chunk_bytes'] >> 10} KiB chunks, fetched ahead", "whole": "whole"}
    return [
        (labels[k], (fmt_range(st[k]), fmt_s(st[k]["model"]), "yes" if st[k]["bitwise"] else "NO"))
        for k in ("streamed", "whole")
    ]


def _extrapolation_cells(r: Mapping[str, Any], bold: str = "") -> tuple[str, ...]:
    s, p = r["single"], r["parallel"]
    return (
        r["bandwidth"],
        fmt_s(s["patch_s"]),
        fmt_s(s["full_s"]),
        f"{bold}{s['ratio']:.1f}x{bold}",
        fmt_s(p["patch_s"]),
        fmt_s(p["full_s"]),
        f"{bold}{p['ratio']:.1f}x{bold}",
        f"{r['wire_ratio']:.0f}x",
    )


ABOUT = """**Trainer.** FP32 masters (four `(rows, 1024)` matrices, N(0, 0.02^2)) trained by `torch.optim.Adam`
(lr {lr:g}, betas 0.9/0.999) on Gaussian-noise gradients: {warmup} warm-up steps, then one measured step. Every
run restores the state after the warm-up and takes the same step, so every method and repeat ships the same
v0 -> v1; every replica's tensors are compared bit for bit with the expected v1 (*bitwise*).

**Clock.** From `optimizer.step()` returning to the last replica holding v1 with its fingerprint verified.
*patch* and *patch + relay*: the step runs with the real trainer publisher attached (`flipsync.trainer.Publisher`,
background mode: the post-step hook hands the masters to the view thread; diff, encode and upload run on the
worker; its default coders, positions coded against the base where the rank holds it), after two versions of
unchanged weights, so the measured step is a steady-state one (its buffers are
reused, as in every step of a training run; the replicas start from that HEAD). *full checkpoint*: the trainer
casts the masters to BF16, fingerprints them and writes the whole view as a snapshot
(`board.BoardWriter.publish_snapshot`). Both include the trainer's work, the board write (a local directory), the
replicas' polling, download, decode, apply and verification.

**Streaming.** The trainer uploads its part in {chunk_kib} KiB chunks while it codes it (`chunk_bytes`; the
default, 8 MiB, is sized for GB patches), and commits the manifest once all are up. Each direct replica watches
the next version's folder every 10 ms (`flipsync.board.ahead.FetchAhead`, `flipsync sidecar --fetch-ahead`) and
downloads the chunks as they land; a relay does the same for its island while its sidecars wait.

**Replicas.** N real reconcile loops (`Replica` + `BoardReader`) over a light in-memory engine
(`flipsync.engines.memory.MemoryEngine`: a dict of tensors kept current by `codec.stage`/`codec.commit`,
fingerprint checked), all in this process and sharing this machine's {cores} cores, so above {cores} replicas
their CPU work queues.

**Links.** Each replica reads the board through its own link: a token bucket in the store client
(`flipsync.board.throttle.ThrottledStore`) charges every byte read, refills at the link's rate and holds at most
50 ms of traffic. It models bandwidth only (no latency, no loss); writes are not limited. *patch + relay*: one
relay per island (`flipsync relay`, a read-through cache over HTTP); only the relay's upstream is limited, so
the WAN carries each object once (*relay WAN / (N x patch)* is the relay's upstream bytes over what N direct
replicas would fetch).

Each cell ran {repeats} time(s), methods interleaved; shown: median (min-max), then the cost model's
prediction."""

MODEL_ABOUT = """**Cost model.** Per-unit costs, each from its own measurement: *trainer* seconds per publication plus
seconds per byte of served view (the line through the median step-to-published times of the N = 1 runs on
this view and of unlimited-link runs on a view 1/8 its size; the fixed part is not divided among shards); *wire*
1/B per byte at link rate B; *receiver* seconds per changed value (stage + commit of the patch on one engine,
best of 3) or, for a full checkpoint, per byte (read the snapshot from the local board, load it, fingerprint
it); *fixed* seconds per update (polling, manifests: an unlimited-link N = 1 run minus its trainer and
receiver parts, for direct reads and through a relay). A full checkpoint's prediction is trainer + fixed +
bytes / B + receiver x max(1, N / cores) x view bytes. A streamed patch's transfer overlaps the trainer:
trainer + bytes / B becomes max(first + bytes / B, trainer + tail / B), where *first* is the trainer's time to
code its first chunk (trainer x chunk x shards / patch bytes) and *tail* the chunks still to cross when it ends
(at most one per shard); then + fixed + receiver x max(1, N / cores) x changed values. Left out: the relay's own CPU for
serving N replicas over local HTTP, and the cost of N polling Python threads sharing two cores beyond their
share of the decode and apply work; where the measured and model columns part (many replicas, the relay), that
is the gap."""


def _components(result: Mapping[str, Any]) -> str:
    m = result["model"]
    phases = result.get("trainer_phases") or {}
    split = ", ".join(f"{k} {v * 1e9:.2f}" for k, v in phases.items())
    rows = [
        (
            "trainer, patch",
            f"{fmt_s(m['trainer_patch_fixed_s'])} + {m['trainer_patch_s_per_byte'] * 1e9:.3f} ns/B",
            "view, diff, encode, upload"
            + (f" (the publisher's own timings, ns/B of the view: {split}; the view is the CPU cast)" if split else ""),
        ),
        (
            "trainer, full checkpoint",
            f"{fmt_s(m['trainer_full_fixed_s'])} + {m['trainer_full_s_per_byte'] * 1e9:.3f} ns/B",
            "cast, fingerprint, write",
        ),
        ("receiver, patch", f"{m['receiver_s_per_change'] * 1e9:.1f} ns/change", "stage + commit + verify"),
        ("receiver, full checkpoint", f"{m['receiver_full_s_per_byte'] * 1e9:.3f} ns/B", "read + load + fingerprint"),
        ("fixed per update", fmt_s(m["fixed_s"]), "polling and manifests"),
        ("fixed per update, via relay", fmt_s(m["relay_fixed_s"]), "the same plus one local HTTP hop"),
        ("wire", "1 / link rate", "token bucket"),
    ]
    return md_table(("component", "cost", "covers"), rows, left=3)


def _extrapolation_md(e: Mapping[str, Any], *, first: bool = True) -> str:
    rows = [_extrapolation_cells(r, bold="**") for r in e["rows"]]
    head = (
        "link",
        "patch, this machine",
        "full, this machine",
        "full / patch",
        "patch, parallel model",
        "full, parallel model",
        "full / patch",
        "bytes only",
    )
    if not first:
        return "\n\n".join(
            [
                f"The same model with the change rate of {e['source']}: {100 * e['changed_fraction']:.2f}% changed "
                f"at {e['bytes_per_change']:.3f} B per change, patch {e['patch_bytes'] / 1e9:.2f} GB.",
                md_table(head, rows),
            ]
        )
    return "\n\n".join(
        [
            f"**Extrapolation (a model, not a measurement).** One replica of a 500 GB BF16 served view "
            f"({e['changed'] / 1e9:.2f}G of 250G values changed = {100 * e['changed_fraction']:.2f}%, at "
            f"{e['bytes_per_change']:.3f} B per change, from {e['source']}: what the "
            f"trainer publishes by default): patch {e['patch_bytes'] / 1e9:.2f} GB against 500 GB. "
            "*This machine*: the per-unit costs as measured here, one trainer process and one "
            f"receiver core. *Parallel model*: assumes the trainer's view is diffed by {e['trainer_shards']} "
            f"shards at once (each rank its own slice, as `flipsync.trainer` does under torch.distributed) and "
            f"each receiver stages on {e['receiver_cores']} cores, with the same per-unit costs; the full "
            "checkpoint gets the same parallelism for its write and load. The patch is streamed in the trainer's "
            f"default {e['chunk_bytes'] >> 20} MiB chunks (the overlap term above); the full checkpoint is "
            "modelled as it is measured, written whole, then read and loaded: were it written and loaded while it "
            f"crosses the wire, it would save at most its trainer and receiver terms, {fmt_s(e['full_overlap_s'])} "
            "under the parallel model. *bytes only* is 500 GB over the patch bytes: the ratio if only the wire "
            "counted.",
            md_table(head, rows),
        ]
    )


def markdown(result: Mapping[str, Any], figures: Figures | None = None) -> str:
    setup = result["setup"]
    head = (
        f"Served view {result['view_bytes'] / 1e6:.1f} MB BF16 ({result['elements']:,} values); the measured step "
        f"changed {result['changed']:,} of them ({100 * result['changed'] / result['elements']:.2f}%); patch "
        f"{result['patch_bytes'] / 1e3:.1f} kB ({result['bytes_per_changed']:.3f} B per change; the trainer's part "
        f"on the board {result.get('published_bytes', 0) / 1e3:.1f} kB); stage + commit on "
        f"one engine {result['apply_s'] * 1e3:.1f} ms; full snapshot read + load {result['load_s'] * 1e3:.0f} ms."
    )
    cells = [_measured_cells(r, result["patch_bytes"], markdown=True) for r in result["rows"]]
    table = md_table(
        (
            "link",
            "N",
            "patch",
            "model",
            "patch + relay",
            "model",
            "full checkpoint",
            "model",
            "full / patch",
            "relay WAN / (N x patch)",
            "bitwise",
        ),
        cells,
    )
    parts = [
        ABOUT.format(
            lr=setup["lr"],
            warmup=setup["warmup"],
            cores=result["model"]["cores"],
            repeats=setup["repeats"],
            chunk_kib=result["streaming"]["chunk_bytes"] >> 10,
        ),
        head,
        table,
        _streaming_md(result["streaming"]),
    ]
    if figures is not None:
        parts.append(figures.link(plot(result, figures.path("crossregion.png")).name, "update latency vs replicas"))
    parts += [MODEL_ABOUT, _components(result)]
    parts += [_extrapolation_md(e, first=i == 0) for i, e in enumerate(result["extrapolations"])]
    return "\n\n".join(parts)


def _streaming_md(st: Mapping[str, Any]) -> str:
    text = (
        f"**Streaming on and off** (N = 1, {st['bandwidth']}, patch, methods interleaved): on a link slow enough "
        "that the wire outweighs the trainer, the same step with the part streamed and fetched ahead, and with the "
        "part uploaded whole after the diff and fetched after the manifest (as before streaming). The model's "
        "overlap term is checked here, where the transfer hides the trainer's work, and in the cells above, "
        "where the trainer's work hides the transfer."
    )
    rows = [(label, *cells) for label, cells in _streaming_cells(st)]
    return "\n\n".join([text, md_table(("part", "measured", "model", "bitwise"), rows)])


def plot(result: Mapping[str, Any], path: Path) -> Path:
    """Latency against N, one panel per link: measured medians with min-max bars, the model dashed."""
    plt = pyplot()
    links = list(dict.fromkeys(r["bandwidth"] for r in result["rows"]))
    fig, axes = plt.subplots(1, len(links), figsize=(4.2 * len(links), 3.8), squeeze=False, sharey=True)
    for ax, bw in zip(axes[0], links, strict=True):
        mine = [r for r in result["rows"] if r["bandwidth"] == bw]
        ns = [r["replicas"] for r in mine]
        for i, m in enumerate(METHODS):
            med = [r[m]["median"] for r in mine]
            err = [[r[m]["median"] - r[m]["min"] for r in mine], [r[m]["max"] - r[m]["median"] for r in mine]]
            ax.errorbar(ns, med, yerr=err, fmt="-o", color=f"C{i}", label=METHOD_LABEL[m], capsize=3)
            ax.plot(
                ns, [r[m]["model"] for r in mine], "--", color=f"C{i}", alpha=0.6, label=f"{METHOD_LABEL[m]} (model)"
            )
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_yscale("log")
        ax.set_title(bw, fontsize=10)
        ax.set_xlabel("replicas N")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("step returned -> last replica verified (s)")
    axes[0][-1].legend(fontsize=7)
    return save_figure(fig, path)
