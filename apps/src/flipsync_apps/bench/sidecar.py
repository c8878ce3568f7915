"""``flipsync bench sidecar``: what an update costs a serving torch engine, against the size of the patch.

A replica (the real reconcile loop and request gate, a torch engine, a local-directory board) follows a
chain of versions whose patches change a growing fraction of the served values, from one in a million to
a few percent. For every update it records:

- **stage**: decoding the patch into ready-to-scatter buffers, while the engine keeps serving;
- **engine write**: the time decode steps are held off (the scatter into the served tensors, and for
  quantized formats the scatter of the parameter elements that staging found changed);
- **pause**: the time new requests wait at the gate (drain + write + fingerprint check + publish).

The first version is a keyframe (a full load, O(model)); the table compares every patch against it.
For bf16 the parameters are the served tensors. For a quantized format, staging dequantizes the touched
tensors while serving (O(touched tensors)) and the commit writes only the parameter elements that change;
a changed scale moves its whole block, so the pause grows a little faster than the changed count.

Changes are +-1 steps of the served bit patterns at random positions, the typical change under Adam at RL
learning rates. Timings are medians over repeats; the machine's other load shows up as noise.

**The vLLM kernel-state audit, per touched layer.** The vLLM worker's reload path (``WorkerCore``) runs on a
stand-in for vLLM CPU's linear layers (the post-load step packs the weight into a transposed copy the GEMM
reads, and drops the weight): for each layer size, one patch touching every layer is committed with the audit
``off``, ``sample`` and ``every``; the audit's cost (a twin loaded and processed, its tensors compared, the
GEMM run on identity rows: all of them for ``every``, 64 for ``sample``) is reported per touched layer beside
the reload's own (the checkpoint tensors rebuilt, reloaded and reprocessed).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from flipsync.board.reader import BoardReader
from flipsync.board.writer import BoardWriter
from flipsync.codec import apply_patch, diff_views
from flipsync.codec.bits import int_view
from flipsync.codec.fingerprint import FingerprintTable
from flipsync.engines.torch.engine import TorchEngine
from flipsync.engines.torch.models import build_model, preset_config
from flipsync.engines.vllm.kernels import KernelHooks, default_kind, default_transplant, default_twin, identity_rows
from flipsync.engines.vllm.kernels import probe_rows as pick_rows
from flipsync.engines.vllm.scratch import copy_attrs, default_policy
from flipsync.engines.vllm.worker import WorkerCore
from flipsync.formats import served_view
from flipsync.sidecar.gate import CommitMode
from flipsync.sidecar.metrics import SidecarMetrics
from flipsync.sidecar.replica import Replica, ReplicaConfig
from flipsync.stores import open_store
from flipsync_apps.bench.report import Figures, md_table, pyplot, save_figure

RUN = "bench"


@dataclass(frozen=True)
class Setup:
    model: str
    fractions: tuple[float, ...]
    repeat: int
    formats: tuple[str, ...]
    # (hidden, intermediate) of the stand-in layers the kernel-state audit is measured on
    audit_sizes: tuple[tuple[int, int], ...] = ((256, 704),)


QUICK = Setup("small", (1e-5, 1e-4, 1e-3, 1e-2), repeat=3, formats=("bf16", "fp8-block"), audit_sizes=((512, 1408),))
FULL = Setup(
    "base",
    (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 5e-2),
    repeat=3,
    formats=("bf16", "fp8-block"),
    audit_sizes=((1024, 2816), (2048, 5632)),
)


def _bump(view: dict[str, torch.Tensor], fraction: float, rng: np.random.Generator) -> None:
    """Move ``fraction`` of every tensor's elements by one step of their bit pattern, in place."""
    for t in view.values():
        flat = int_view(t)
        n = flat.numel()
        k = round(fraction * n)
        if k == 0 and rng.random() < fraction * n:
            k = 1  # keep the expected count right for tiny fractions
        if k == 0:
            continue
        pos = torch.from_numpy(rng.choice(n, size=k, replace=False).astype(np.int64))
        step = torch.from_numpy(rng.integers(0, 2, size=k).astype(np.int64) * 2 - 1).to(flat.dtype)
        flat[pos] = flat[pos] + step


def _measure(setup: Setup, fmt: str, console: Console) -> dict[str, Any]:
    config = preset_config(setup.model)
    model = build_model(config, seed=0, dtype=torch.float32)
    masters = {k: v.detach() for k, v in model.state_dict().items()}
    base = served_view(masters, fmt)
    del model, masters
    params = sum(t.numel() for t in base.values())
    view_bytes = sum(t.numel() * t.element_size() for t in base.values())
    prev = {k: v.clone() for k, v in base.items()}
    table = FingerprintTable.of(prev)
    rng = np.random.default_rng(0)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="flipsync-bench-sidecar-") as tmp:
        store = open_store(tmp)
        pub = BoardWriter(store, RUN, publisher_id="bench")
        pub.publish_snapshot(prev, version=0, view_fp=table.view_fp(), served_format=fmt)
        engine = TorchEngine(build_model(config, seed=1), served_format=fmt)
        replica = Replica(
            BoardReader(open_store(tmp), RUN),
            engine,
            config=ReplicaConfig(commit_mode=CommitMode.IN_PLACE, poll_interval_s=0.05),
            metrics=SidecarMetrics(),
        )
        if not replica.sync_once():
            raise RuntimeError(f"the bench replica failed to boot: {replica.status()['error']}")
        boot = replica.status()["last_update"]
        keyframe = {"pause_s": boot["pause_s"], "engine_write_s": engine.last_write.write_s, "bytes": boot["bytes"]}
        version = 0
        cur = {k: v.clone() for k, v in prev.items()}  # the trainer's next view; prev follows it by patches
        for r in range(setup.repeat):
            for f in setup.fractions:
                console.log(f"sidecar bench: {fmt}, changed fraction {f:g}, repeat {r + 1}/{setup.repeat}")
                _bump(cur, f, rng)
                patch, new_table = diff_views(
                    prev, cur, old_table=table, base_version=version, target_version=version + 1, served_format=fmt
                )
                data = patch.to_bytes()
                pub.publish_patch(
                    [data],
                    base_version=version,
                    target_version=version + 1,
                    base_view_fp=table.view_fp(),
                    target_view_fp=new_table.view_fp(),
                    served_format=fmt,
                )
                apply_patch(prev, patch, table)  # the trainer's copy moves on too (O(changed))
                version += 1
                if not replica.sync_once() or replica.version != version:
                    raise RuntimeError(f"the bench replica failed at v{version}: {replica.status()['error']}")
                u = replica.status()["last_update"]
                rows.append(
                    {
                        "fraction": f,
                        "changed": u["n_changed"],
                        "patch_bytes": len(data),
                        "stage_s": u["stage_s"],
                        "engine_write_s": engine.last_write.write_s,
                        "commit_s": u["commit_s"],
                        "pause_s": u["pause_s"],
                    }
                )
        store.close()
        replica.reader.store.close()
    by_fraction = []
    for f in setup.fractions:
        rs = [x for x in rows if x["fraction"] == f]
        by_fraction.append(
            {
                "fraction": f,
                "changed": int(statistics.median(x["changed"] for x in rs)),
                "patch_bytes": int(statistics.median(x["patch_bytes"] for x in rs)),
                **{
                    k: statistics.median(x[k] for x in rs) for k in ("stage_s", "engine_write_s", "commit_s", "pause_s")
                },
            }
        )
    return {
        "format": fmt,
        "model": setup.model,
        "params": params,
        "view_bytes": view_bytes,
        "keyframe": keyframe,
        "rows": by_fraction,
    }


# ------------------------------------------------------------------------------- the kernel-state audit
class _PackedLinear(torch.nn.Module):
    """vLLM CPU's linear layer, in miniature: the post-load step packs the weight into the transposed copy the
    GEMM reads (oneDNN's reorder) and drops the parameter."""

    def __init__(self, out_f: int, in_f: int) -> None:
        super().__init__()
        self.shape = (out_f, in_f)
        self.weight = torch.nn.Parameter(torch.zeros(out_f, in_f, dtype=torch.bfloat16), requires_grad=False)
        self.packed: torch.Tensor | None = None

    def process_weights_after_loading(self) -> None:
        self.packed = self.weight.detach().t().contiguous()
        self.weight = torch.nn.Parameter(torch.empty(0, dtype=torch.bfloat16), requires_grad=False)


class _StandIn(torch.nn.Module):
    """``layers`` MLP blocks of packed linears, loaded by checkpoint name (vLLM's ``load_weights`` contract)."""

    def __init__(self, hidden: int, inter: int, layers: int) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList()
        for _ in range(layers):
            block = torch.nn.Module()
            block.mlp = torch.nn.Module()
            block.mlp.up_proj = _PackedLinear(inter, hidden)
            block.mlp.down_proj = _PackedLinear(hidden, inter)
            self.model.layers.append(block)

    def load_weights(self, weights: Any) -> set[str]:
        params = dict(self.named_parameters())
        for name, w in weights:
            params[name].data.copy_(w)
        return {name for name, _ in weights}


def _stand_in_core(hidden: int, inter: int, layers: int, view: dict[str, torch.Tensor]) -> WorkerCore:
    model = _StandIn(hidden, inter, layers)
    model.load_weights(view.items())
    for m in model.modules():
        if isinstance(m, _PackedLinear):
            m.process_weights_after_loading()

    def scratch(module: torch.nn.Module, pname: str, live: torch.Tensor | None) -> torch.Tensor | None:
        if isinstance(module, _PackedLinear) and (live is None or live.numel() == 0):
            return copy_attrs(torch.zeros(module.shape, dtype=torch.bfloat16), module.weight, module)
        return None if live is None else copy_attrs(torch.zeros_like(live), live, module)

    def reload(tensors: list[tuple[str, torch.Tensor]]) -> None:  # the layerwise reload: restore, load, process
        touched = {n.rpartition(".")[0] for n, _ in tensors}
        for name in touched:
            mod = model.get_submodule(name)
            assert isinstance(mod, _PackedLinear)
            mod.weight = torch.nn.Parameter(torch.zeros(mod.shape, dtype=torch.bfloat16), requires_grad=False)
        model.load_weights(tensors)
        for name in touched:
            model.get_submodule(name).process_weights_after_loading()  # type: ignore[operator]

    def probe(mname: str, module: torch.nn.Module, rows: int | None, seed: int) -> dict[str, torch.Tensor]:
        packed = getattr(module, "packed", None)
        if packed is None:
            return {}
        k = packed.shape[0]
        return {"identity": identity_rows(k, pick_rows(k, rows, seed), torch.bfloat16) @ packed}

    hooks = KernelHooks(default_twin, probe, default_transplant, default_kind)
    return WorkerCore(
        model, policy=default_policy, scratch=scratch, reloader=reload, hooks=hooks, default_source=lambda: view
    )


def audit_cost(sizes: tuple[tuple[int, int], ...], layers: int, console: Console) -> dict[str, Any]:
    """Per touched layer: the reload's time and the audit's (``sample``, ``every``) for each layer size."""
    from flipsync.engines.vllm.engine import VllmEngine
    from flipsync.engines.vllm.rpc_transports import LocalTransport
    from flipsync.engines.vllm.tensor_specs import specs_of

    out: dict[str, Any] = {"layers": layers, "rows": []}
    for hidden, inter in sizes:
        g = torch.Generator().manual_seed(hidden)
        view = {}
        for i in range(layers):
            view[f"model.layers.{i}.mlp.up_proj.weight"] = (torch.randn(inter, hidden, generator=g) * 0.02).bfloat16()
            view[f"model.layers.{i}.mlp.down_proj.weight"] = (torch.randn(hidden, inter, generator=g) * 0.02).bfloat16()
        row: dict[str, Any] = {"hidden": hidden, "inter": inter, "layer_params": hidden * inter}
        for mode in ("off", "sample", "every"):
            console.log(f"sidecar bench: kernel-state audit {mode}, layers {hidden}x{inter}")
            engine = VllmEngine(LocalTransport([_stand_in_core(hidden, inter, layers, view)]), specs_of(view),
                                table=FingerprintTable.of(view), audit=mode)  # fmt: skip
            cur = {k: v.clone() for k, v in view.items()}
            table = FingerprintTable.of(view)
            rng = np.random.default_rng(0)
            applies, audits, audited = [], [], []
            for _ in range(3):  # the first reload of a kind is always compared: measure the later ones
                prev = {k: v.clone() for k, v in cur.items()}
                _bump(cur, 1e-4, rng)
                patch, table = diff_views(prev, cur, old_table=table, context=False)
                engine.commit(engine.stage(patch))
                applies.append(engine.last_audit["apply_s"])
                audits.append(engine.last_audit["seconds"])
                audited.append(sum(len(v) for v in engine.last_audit["layers"].values()))
            touched = 2 * layers
            apply_s, audit_s = statistics.median(applies[1:]), statistics.median(audits[1:])
            row[mode] = {
                "apply_per_layer_s": apply_s / touched,
                "audit_per_layer_s": audit_s / touched,
                "reload_per_layer_s": (apply_s - audit_s) / touched,
                "audited_layers": audited[-1],  # read back by the last of the measured reloads
            }
        out["rows"].append(row)
    return out


def _table(result: dict[str, Any]) -> Table:
    kf = result["keyframe"]
    t = Table(
        title=f"torch engine, {result['model']} ({result['params'] / 1e6:.1f}M params, "
        f"{result['view_bytes'] / 2**20:.0f} MiB served, {result['format']}): full keyframe load pause "
        f"{kf['pause_s'] * 1e3:.1f} ms"
    )
    for col in ("changed", "of view", "patch", "stage ms", "engine write ms", "pause ms", "pause / keyframe"):
        t.add_column(col, justify="right")
    for row in result["rows"]:
        t.add_row(
            f"{row['changed']:,}",
            f"{row['fraction']:.0e}",
            f"{row['patch_bytes'] / 1024:,.1f} KiB",
            f"{row['stage_s'] * 1e3:.2f}",
            f"{row['engine_write_s'] * 1e3:.2f}",
            f"{row['pause_s'] * 1e3:.2f}",
            f"{row['pause_s'] / kf['pause_s']:.3f}" if kf["pause_s"] > 0 else "-",
        )
    return t


def run(console: Console, quick: bool = False, *, setup: Setup | None = None) -> dict[str, Any]:
    """Measure stage time and engine pause against patch size; print a table per format, return numbers."""
    setup = setup or (QUICK if quick else FULL)
    results: dict[str, Any] = {"quick": quick, "model": setup.model, "formats": {}}
    t0 = time.perf_counter()
    for fmt in setup.formats:
        res = _measure(setup, fmt, console)
        results["formats"][fmt] = res
        console.print(_table(res))
    bf16 = results["formats"].get("bf16")
    if bf16 and len(bf16["rows"]) >= 2:
        lo, hi = bf16["rows"][0], bf16["rows"][-1]
        results["bf16_scaling"] = {
            "changed_ratio": hi["changed"] / max(1, lo["changed"]),
            "pause_ratio": hi["pause_s"] / lo["pause_s"] if lo["pause_s"] > 0 else None,
            "largest_patch_pause_vs_keyframe": hi["pause_s"] / bf16["keyframe"]["pause_s"],
        }
        console.print(
            f"bf16: {hi['changed'] / max(1, lo['changed']):,.0f}x more changed values cost "
            f"{hi['pause_s'] / max(lo['pause_s'], 1e-9):,.1f}x the pause; the largest patch pauses "
            f"{hi['pause_s'] * 1e3:.1f} ms against {bf16['keyframe']['pause_s'] * 1e3:.1f} ms for a full load"
        )
    results["audit"] = audit_cost(setup.audit_sizes, 2, console)
    console.print(_audit_table(results["audit"]))
    results["seconds"] = time.perf_counter() - t0
    return results


def _audit_rows(audit: dict[str, Any]) -> list[tuple[str, ...]]:
    out = []
    for r in audit["rows"]:
        reload = r["off"]["reload_per_layer_s"]
        for mode in ("sample", "every"):
            a = r[mode]["audit_per_layer_s"]
            out.append(
                (
                    f"{r['hidden']}x{r['inter']} ({r['layer_params'] / 1e6:.1f}M)",
                    mode,
                    f"{reload * 1e3:.2f}",
                    f"{a * 1e3:.2f}",
                    f"{a / reload:.2f}" if reload > 0 else "-",
                )
            )
    return out


AUDIT_COLUMNS = ("layer (params)", "audit", "reload ms / layer", "audit ms / layer", "audit / reload")


def _audit_table(audit: dict[str, Any]) -> Table:
    t = Table(title="vLLM kernel-state audit, per touched layer (stand-in for vLLM CPU's packed linears)")
    for col in AUDIT_COLUMNS:
        t.add_column(col, justify="right")
    for row in _audit_rows(audit):
        t.add_row(*row)
    return t


ABOUT = (
    "A replica (the real reconcile loop and request gate) over the PyTorch engine (`TorchEngine`, a "
    "{params:.0f}M-parameter Llama built from a config, no download) follows a local-directory board whose "
    "patches change a growing share of the served values (one-step moves of the bit patterns at random "
    "positions), {repeat} times over; medians shown. *pause* is how long new requests wait at the gate (drain, "
    "engine write, fingerprint check, publish); *engine write* is the scatter into the served tensors (for "
    "quantized formats, the parameter elements that staging found changed); *stage* is decoding and "
    "preparing the writes while the engine keeps serving. The first version is a keyframe (a full load); "
    "*pause / full load* compares each patch with it. The vLLM engine's pause is timed by its live tests "
    "(docs/engines.md), not here; its worker's kernel-state audit is measured below on a stand-in."
)


def markdown(result: dict[str, Any], figures: Figures | None = None) -> str:
    formats = result["formats"]
    first = next(iter(formats.values()))
    repeat = (QUICK if result.get("quick") else FULL).repeat
    parts = [ABOUT.format(params=first["params"] / 1e6, repeat=repeat)]
    for fmt, res in formats.items():
        kf = res["keyframe"]["pause_s"]
        parts.append(
            f"**{fmt}** ({res['view_bytes'] / 2**20:.0f} MiB served): full keyframe load pauses {kf * 1e3:.1f} ms."
        )
        parts.append(
            md_table(
                ("changed values", "of view", "patch", "stage ms", "engine write ms", "pause ms", "pause / full load"),
                (
                    (
                        f"{r['changed']:,}",
                        f"{r['fraction']:.0e}",
                        f"{r['patch_bytes'] / 1024:,.1f} KiB",
                        f"{r['stage_s'] * 1e3:.2f}",
                        f"{r['engine_write_s'] * 1e3:.2f}",
                        f"**{r['pause_s'] * 1e3:.2f}**",
                        f"{r['pause_s'] / kf:.3f}" if kf > 0 else "-",
                    )
                    for r in res["rows"]
                ),
                left=0,
            )
        )
    s = result.get("bf16_scaling")
    if s and s.get("pause_ratio"):
        parts.append(
            f"BF16: {s['changed_ratio']:,.0f}x more changed values cost {s['pause_ratio']:,.1f}x the pause; the "
            f"largest patch pauses {100 * s['largest_patch_pause_vs_keyframe']:.0f}% of a full load."
        )
    if figures is not None:
        parts.append(figures.link(plot(result, figures.path("engine-pause.png")).name, "engine pause"))
    if result.get("audit"):
        parts.append(
            "**The vLLM kernel-state audit, per touched layer.** vLLM's worker half (`WorkerCore`) on a stand-in for "
            "vLLM CPU's linear layers (the post-load step packs the weight into the transposed copy the GEMM reads "
            "and drops it); one patch touching every layer, committed with the audit off, `sample` and `every`. "
            "*reload* is the reload path's own cost per layer (checkpoint tensors rebuilt, reloaded, reprocessed), "
            "*audit* the twin (loaded, processed), the tensor comparison and the GEMM on identity rows (every row "
            "for `every`, 64 for `sample`)."
        )
        parts.append(md_table(AUDIT_COLUMNS, _audit_rows(result["audit"]), left=0))
    return "\n\n".join(parts)


def plot(result: dict[str, Any], path: Path) -> Path:
    """Pause against changed values per format (log-log), with each format's full-load pause as a line."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, (fmt, res) in enumerate(result["formats"].items()):
        rows = res["rows"]
        ax.plot([r["changed"] for r in rows], [r["pause_s"] * 1e3 for r in rows], "-o", color=f"C{i}", label=f"{fmt}")
        ax.plot(
            [r["changed"] for r in rows],
            [r["stage_s"] * 1e3 for r in rows],
            ":",
            color=f"C{i}",
            label=f"{fmt} stage (off the pause)",
        )
        ax.axhline(res["keyframe"]["pause_s"] * 1e3, color=f"C{i}", ls="--", lw=1, label=f"{fmt} full load")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("changed values in the patch")
    ax.set_ylabel("ms")
    ax.set_title("PyTorch engine: pause (requests gated) per commit", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    return save_figure(fig, path)
