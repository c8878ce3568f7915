"""``flipsync bench trainer``: what the publisher adds to a training step, side by side in one process.

A small Llama (transformers ``LlamaForCausalLM`` from a config with a fixed seed; no downloads) is trained
with Adam on the CPU, four times over from the same weights and batches:

- *bare*: no publisher;
- *background*: ``PublisherConfig(background=True)``: the step computes the served view (bf16 cast + checks) and
  hands it over; diff, encode and upload run on a lower-priority thread during the next steps;
- *background, no spans*: the same without squashed catch-up spans (``spans=False``);
- *inline*: ``PublisherConfig(background=False)``: the step waits for diff, encode and upload.

The three run in interleaved blocks of a few steps (so that load from elsewhere on the machine hits all of
them alike), each publisher flushed after its block (untimed). *Added wall* is the median over rounds of
(mean step time of the block) / (mean step time of the bare block of the same round) - 1: what a training
loop feels. The inline publisher is called by hand after each step, so the process CPU time of one
publication is measured on its own: the work no thread can hide on a machine whose cores the training
step keeps busy, as a share of a training step's CPU time. Peak memory is the most bytes of served views a
publisher held at once, as a multiple of one served view.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from flipsync.board import Store, open_store
from flipsync.trainer import Publisher, PublisherConfig
from flipsync_apps.bench.report import md_table


@dataclass(frozen=True)
class Setup:
    hidden: int
    intermediate: int
    layers: int
    vocab: int
    seq: int
    batch: int
    rounds: int
    block: int
    lr: float = 1e-6  # an RL learning rate: most served values do not move (Adam absorption)


QUICK = Setup(hidden=128, intermediate=344, layers=2, vocab=2048, seq=128, batch=16, rounds=3, block=3)
FULL = Setup(hidden=256, intermediate=688, layers=4, vocab=8192, seq=256, batch=16, rounds=5, block=3)
WARMUP = 2


def make_model(s: Setup, seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=s.vocab,
        hidden_size=s.hidden,
        intermediate_size=s.intermediate,
        num_hidden_layers=s.layers,
        num_attention_heads=max(1, s.hidden // 64),
        num_key_value_heads=max(1, s.hidden // 128),
        max_position_embeddings=s.seq,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg)


class Trainer:
    """One model + Adam (+ publisher), stepping through the same batches as the others."""

    def __init__(self, name: str, s: Setup, board: Store | None, config: PublisherConfig | None = None) -> None:
        self.name = name
        self.model = make_model(s)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=s.lr)
        self.inline = board is not None and config is not None and not config.background
        self.pub = (
            Publisher(
                self.model,
                board,
                run=f"bench-{name.replace(', ', '-').replace(' ', '-')}",
                optimizer=None if self.inline else self.opt,  # inline: step() by hand, timed on its own
                config=config,
            )
            if board is not None
            else None
        )
        self.s = s
        self.step_s: list[float] = []
        self.block_means: list[float] = []
        self.train_cpu_s: list[float] = []  # process CPU of forward + backward + optimizer
        self.publish_cpu_s: list[float] = []  # process CPU of one inline publication
        self.flush_s: list[float] = []
        self.i = 0

    def step(self) -> float:
        g = torch.Generator().manual_seed(self.i)
        self.i += 1
        x = torch.randint(0, self.s.vocab, (self.s.batch, self.s.seq), generator=g)
        t, cpu = time.perf_counter(), time.process_time()
        self.model(input_ids=x, labels=x).loss.backward()
        self.opt.step()  # an attached publisher's hooks run here
        self.opt.zero_grad(set_to_none=True)
        self.train_cpu_s.append(time.process_time() - cpu)
        if self.inline:
            assert self.pub is not None
            cpu = time.process_time()
            self.pub.step()
            self.publish_cpu_s.append(time.process_time() - cpu)
        return time.perf_counter() - t

    def block(self, n: int, record: bool) -> None:
        times = [self.step() for _ in range(n)]
        if self.pub is not None:
            t = time.perf_counter()
            self.pub.flush()
            if record:
                self.flush_s.append(time.perf_counter() - t)
        if record:
            self.step_s += times
            self.block_means.append(statistics.fmean(times))
        else:
            self.train_cpu_s.clear()
            self.publish_cpu_s.clear()

    def close(self) -> None:
        if self.pub is not None:
            self.pub.close()


def _ratio(rows: list[float], base: list[float]) -> float:
    return statistics.median(a / b - 1 for a, b in zip(rows, base, strict=True))


def run(console: Console, quick: bool = False, setup: Setup | None = None) -> dict[str, Any]:
    """Measure and print; returns the numbers (also what docs/trainer.md quotes)."""
    s = setup or (QUICK if quick else FULL)
    with tempfile.TemporaryDirectory(prefix="flipsync-bench-trainer-") as tmp:
        board = open_store(tmp)
        trainers: list[Trainer] = []
        try:
            with console.status("trainer bench: building four copies of the model") as status:
                trainers = [
                    Trainer("bare", s, None),
                    Trainer("background", s, board, PublisherConfig(background=True)),
                    Trainer("background, no spans", s, board, PublisherConfig(background=True, spans=False)),
                    Trainer("inline", s, board, PublisherConfig(background=False)),
                ]
                for t in trainers:
                    t.block(WARMUP, record=False)
                for r in range(s.rounds):
                    status.update(f"trainer bench: round {r + 1} of {s.rounds}")
                    order = trainers if r % 2 == 0 else trainers[::-1]  # alternate who runs first
                    for t in order:
                        t.block(s.block, record=True)
            return _report(console, s, trainers)
        finally:
            for t in trainers:
                t.close()


def _report(console: Console, s: Setup, trainers: list[Trainer]) -> dict[str, Any]:
    bare, inline = trainers[0], trainers[-1]
    params = sum(p.numel() for p in bare.model.parameters())
    train_cpu = statistics.median(bare.train_cpu_s)
    publish_cpu = statistics.median(inline.publish_cpu_s)
    out: dict[str, Any] = {
        "params": params,
        "tokens_per_step": s.batch * s.seq,
        "torch_threads": torch.get_num_threads(),
        "steps_per_config": len(bare.step_s),
        "bare_step_s": statistics.median(bare.step_s),
        "train_cpu_s": train_cpu,
        "publish_cpu_s": publish_cpu,
        "publish_cpu_fraction": publish_cpu / train_cpu,
        "configs": {},
    }
    table = Table(
        title=f"publisher cost per training step: Llama {params / 1e6:.1f}M params, Adam lr {s.lr:g}, "
        f"{s.batch}x{s.seq} tokens, {torch.get_num_threads()} torch threads"
    )
    for col in ("config", "median step", "added wall", "versions", "squashed", "peak views", "flush"):
        table.add_column(col, justify="left" if col == "config" else "right")
    table.add_row("bare", f"{out['bare_step_s'] * 1e3:.1f} ms", *["-"] * 5)
    for t in trainers[1:]:
        assert t.pub is not None
        st = t.pub.stats
        row = {
            "median_step_s": statistics.median(t.step_s),
            "added": _ratio(t.block_means, bare.block_means),
            "versions": st.versions,
            "steps": st.steps,
            "squashed_steps": st.squashed_steps,
            "view_bytes": st.view_bytes,
            "peak_view_multiple": st.peak_view_bytes / max(1, st.view_bytes),
            "median_flush_s": statistics.median(t.flush_s) if t.flush_s else 0.0,
        }
        out["configs"][t.name] = row
        table.add_row(
            t.name,
            f"{row['median_step_s'] * 1e3:.1f} ms",
            f"{100 * row['added']:+.1f}%",
            f"{st.versions} / {st.steps} steps",
            str(st.squashed_steps),
            f"{row['peak_view_multiple']:.2f}x of {st.view_bytes / 1e6:.1f} MB",
            f"{row['median_flush_s'] * 1e3:.0f} ms",
        )
    console.print(table)
    console.print(
        f"CPU per step: training {train_cpu * 1e3:.0f} ms; one publication (served view, diff, encode, upload, "
        f"spans) {publish_cpu * 1e3:.0f} ms = {100 * publish_cpu / train_cpu:.1f}% of a training step's CPU"
    )
    return out


def markdown(result: dict[str, Any], *, quick: bool = False) -> str:
    """The trainer section: the publisher's added step time, per configuration."""
    s = QUICK if quick else FULL
    rows = [("bare", f"{result['bare_step_s'] * 1e3:.1f} ms", "-", "-", "-", "-")]
    for name, c in result["configs"].items():
        rows.append(
            (
                name,
                f"{c['median_step_s'] * 1e3:.1f} ms",
                f"**{100 * c['added']:+.1f}%**",
                f"{c['versions']} / {c['steps']}",
                f"{c['peak_view_multiple']:.2f}x",
                f"{c['median_flush_s'] * 1e3:.0f} ms",
            )
        )
    return "\n\n".join(
        [
            f"A Llama-architecture model ({result['params'] / 1e6:.1f}M parameters, hidden {s.hidden}, {s.layers} "
            f"layers; transformers `LlamaForCausalLM` from a config, no download) trained with Adam (lr {s.lr:g}) on "
            f"{s.batch}x{s.seq}-token batches with {result['torch_threads']} torch threads, four times from the same "
            "weights and batches, in interleaved blocks: *bare* (no publisher), *background* "
            "(`PublisherConfig(background=True)`: the step hands the masters over; view, diff, encode and upload run "
            "on lower-priority threads), *background, no spans* and *inline* (the step waits for the publication). "
            "*added* is the median over rounds of the block's mean step time over the bare block's, minus one; "
            "*peak views* the most served-view bytes a publisher held at once, as a multiple of one view; *flush* "
            "the wait for the last upload at the end of a block (not part of the step).",
            md_table(("setup", "median step", "added", "versions / steps", "peak views", "flush"), rows),
            f"CPU per step: training {result['train_cpu_s'] * 1e3:.0f} ms; one publication (served view, diff, "
            f"encode, upload, spans) {result['publish_cpu_s'] * 1e3:.0f} ms = "
            f"{100 * result['publish_cpu_fraction']:.1f}% of a training step's CPU. Training keeps every core "
            "busy here, so background publishing costs about its own CPU share.",
        ]
    )
