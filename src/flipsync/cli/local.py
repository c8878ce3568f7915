"""``flipsync view | diff | apply | squash | inspect``: the codec from a shell, on checkpoint files.

Plain Typer command functions; ``flipsync.cli.main`` mounts them (``app.command("diff")(diff)``, ...).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import torch
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from flipsync.checkpoint import Checkpoint, save_checkpoint
from flipsync.cli.board import output_console
from flipsync.cli.terminal import human_size as _size
from flipsync.cli.terminal import run_or_exit as _run
from flipsync.codec import Patch, apply_patch, diff_views, squash
from flipsync.codec.bits import dtype_of
from flipsync.codec.fingerprint import FingerprintTable
from flipsync.domain.headers import ViewRef
from flipsync.errors import BaseMismatchError, ConfigError, FlipsyncError, PatchError
from flipsync.formats import FORMAT_NAMES, get_format, served_view

log = logging.getLogger("flipsync")

CODEC_DTYPES = "bf16, fp16, fp32, fp64, fp8 (e4m3, e5m2, e8m0), int8 to int64, uint8 and bool tensors"


class InputKind(StrEnum):
    auto = "auto"
    master = "master"
    served = "served"


class PatchMode(StrEnum):
    step = "step"
    overwrite = "overwrite"


class VerifyMode(StrEnum):
    fingerprint = "fingerprint"
    digest = "digest"


def format_name(value: str | None) -> str | None:
    """The canonical name of a served format ('BF16' -> 'bf16'); an unknown name passes through, to be refused
    with the list of valid names inside the command."""
    if value is None:
        return None
    try:
        return get_format(value).name
    except FlipsyncError:
        return value


FormatOpt = Annotated[
    str, typer.Option("--format", "-f", help=f"served format: {', '.join(FORMAT_NAMES)}", callback=format_name)
]
InputOpt = Annotated[
    InputKind,
    typer.Option(
        help="are the checkpoints master weights (quantized first) or served views? auto: masters "
        "if any tensor named *weight is float32/float64"
    ),
]


def _is_master(tensors: Mapping[str, torch.Tensor]) -> bool:
    return any(n.endswith("weight") and tensors[n].dtype in (torch.float32, torch.float64) for n in tensors)


def _served(path: Path, fmt: str | None, kind: InputKind, *, from_fp32: bool = False) -> dict[str, torch.Tensor]:
    """Load a checkpoint and return its served view (quantizing masters by ``fmt``)."""
    ckpt = Checkpoint(path)
    tensors = {name: ckpt[name] for name in ckpt}
    master = _is_master(tensors) if kind is InputKind.auto else kind is InputKind.master
    if not master:
        _check_dtypes(path, tensors)
        return tensors
    if fmt is None:
        raise ConfigError(f"{path} holds master weights: say which served format to quantize them to (--format)")
    log.info("quantizing %s to %s", path, fmt)
    return served_view(tensors, fmt, from_fp32=from_fp32)


def _check_dtypes(path: Path, tensors: Mapping[str, torch.Tensor]) -> None:
    """Name the tensor the codec cannot hold here, where the user can still act on the checkpoint."""
    for name, t in tensors.items():
        try:
            dtype_of(t)
        except PatchError:
            raise ConfigError(
                f"{path}: tensor {name!r} is {t.dtype}, which flipsync cannot patch (it patches {CODEC_DTYPES}); "
                "convert it or leave it out of the checkpoint"
            ) from None


def _view_bytes(view: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in view.values())


def view(
    master: Annotated[Path, typer.Argument(help="master checkpoint: a .safetensors file or an HF directory")],
    fmt: FormatOpt,
    out: Annotated[Path, typer.Option("--output", "-o", help="a .safetensors file or a directory (sharded)")],
    from_fp32: Annotated[bool, typer.Option(help="quantize fp32 masters directly, not bf16(master)")] = False,
) -> None:
    """Write the served view of a master checkpoint in checkpoint format (payloads and scales)."""

    def go() -> None:
        served = _served(master, fmt, InputKind.master, from_fp32=from_fp32)
        save_checkpoint(served, out, metadata={"flipsync_format": fmt})
        output_console().print(f"wrote the {fmt} served view of {master} to {out} ({_size(_view_bytes(served))})")

    _run(go)


def diff(
    old: Annotated[Path, typer.Argument(help="old checkpoint (masters or served view)")],
    new: Annotated[Path, typer.Argument(help="new checkpoint (masters or served view)")],
    out: Annotated[Path, typer.Option("--output", "-o", help="patch file to write")],
    fmt: Annotated[
        str | None, typer.Option("--format", "-f", help="served format of master inputs", callback=format_name)
    ] = None,
    input_kind: InputOpt = InputKind.auto,
    mode: Annotated[
        PatchMode, typer.Option(help="step: smallest; overwrite: raw new values, idempotent")
    ] = PatchMode.step,
    base_version: Annotated[int | None, typer.Option(help="version number of OLD")] = None,
    target_version: Annotated[int | None, typer.Option(help="version number of NEW")] = None,
) -> None:
    """Write the lossless patch that turns OLD's served view into NEW's, bit for bit."""

    def go() -> None:
        a, b = _served(old, fmt, input_kind), _served(new, fmt, input_kind)
        with Progress(
            TextColumn("diff"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            transient=True,
        ) as progress:
            task = progress.add_task("diff", total=len(a))
            patch, _ = diff_views(
                a,
                b,
                mode="raw" if mode is PatchMode.overwrite else "step",
                base_version=base_version,
                target_version=target_version,
                served_format=fmt,
                progress=lambda _n, _b: progress.advance(task),
            )
        data = patch.to_bytes()
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_bytes(data)
        tmp.replace(out)
        n = patch.header.n_changed
        total = sum(t.numel() for t in b.values())
        full = _view_bytes(b)
        output_console().print(
            f"{out}: {n:,} of {total:,} values changed ({100 * n / max(1, total):.3f}%), "
            f"{_size(len(data))} vs {_size(full)} served ({full / max(1, len(data)):.0f}x smaller), "
            f"{len(data) / max(1, n):.3f} bytes per changed value"
        )

    _run(go)


def apply(
    base: Annotated[Path, typer.Argument(help="the patch's base: its served view, or masters (quantized first)")],
    patch_path: Annotated[Path, typer.Argument(metavar="PATCH", help="patch file")],
    out: Annotated[Path, typer.Option("--output", "-o", help="where to write the patched served view")],
    fmt: Annotated[
        str | None, typer.Option("--format", "-f", help="served format (default: the patch's)", callback=format_name)
    ] = None,
    input_kind: InputOpt = InputKind.auto,
    verify: Annotated[
        VerifyMode, typer.Option(help="check fingerprints only, or also content digests")
    ] = VerifyMode.digest,
) -> None:
    """Apply PATCH to BASE and write the result; refuses a wrong base, verifies the target."""

    def go() -> None:
        patch = Patch.load(patch_path)
        made_for = patch.header.served_format
        if fmt is not None and made_for is not None and get_format(fmt).name != get_format(made_for).name:
            raise ConfigError(
                f"{patch_path} holds {made_for} served values, but --format {fmt} was given: "
                f"leave --format out (the patch's format is used) or pass --format {made_for}"
            )
        tensors = _served(base, fmt or made_for, input_kind)
        tensors = {k: v.clone() for k, v in tensors.items()}
        table = FingerprintTable.of(tensors)
        held = table.view_fp()
        try:
            result = apply_patch(tensors, patch, table, verify=verify.value)
        except BaseMismatchError as e:
            advice = (
                "pass the checkpoint the patch was diffed from (OLD of `flipsync diff OLD NEW`), its served view, "
                "or the output of applying the patches before this one"
            )
            wanted = patch.header.base.view
            if held != wanted and str(e).startswith("this patch applies to view"):
                # the layouts fit but the values differ: said in files, not in board versions and keyframes
                raise BaseMismatchError(
                    f"{base} is not the base {patch_path} was made from: it holds served view {held}, the patch "
                    f"applies to view {wanted}; {advice}"
                ) from None
            raise BaseMismatchError(f"{e} ({base} is not the base {patch_path} was made from: {advice})") from None
        save_checkpoint(tensors, out, metadata={"flipsync_view": table.view_fp()})
        output_console().print(
            f"applied {result.n_changed:,} changes to {len(patch)} tensors; {out} holds view {table.view_fp()} "
            f"(verified by {verify.value})"
        )

    _run(go)


def squash_cmd(
    patches: Annotated[list[Path], typer.Argument(help="patches v->v+1, ..., v+k-1->v+k, in order")],
    out: Annotated[Path, typer.Option("--output", "-o", help="patch file to write")],
    max_decoded_gib: Annotated[
        float,
        typer.Option(help="refuse patches whose declared changes take more memory than this once decoded"),
    ] = 8.0,
    base: Annotated[
        Path | None,
        typer.Option(
            help="the first patch's base (served view or masters): needed when positions are coded against it"
        ),
    ] = None,
    input_kind: InputOpt = InputKind.auto,
) -> None:
    """Merge a chain of patches into one patch from the first base to the last target."""

    def go() -> None:
        loaded = [Patch.load(p) for p in patches]
        first = loaded[0].header
        view = None if base is None else _served(base, first.served_format, input_kind)
        if view is None and any(p.needs_base for p in loaded):
            raise ConfigError(
                "these patches code positions against the tensors they change (the 'ctx' coder): pass the first "
                "patch's base with --base (the OLD checkpoint of its flipsync diff, or its served view)"
            )
        merged = squash(loaded, max_decoded_bytes=int(max_decoded_gib * (1 << 30)), base=view)
        data = merged.to_bytes()
        out.write_bytes(data)
        before = sum(len(p.to_bytes()) for p in loaded)
        output_console().print(f"{out}: {len(loaded)} patches, {_size(before)} -> {_size(len(data))}")

    _run(go)


def inspect(
    patch_path: Annotated[Path, typer.Argument(metavar="PATCH", help="patch file")],
    as_json: Annotated[bool, typer.Option("--json", help="print the header as JSON")] = False,
) -> None:
    """Summarise a patch: tensors, changed fraction, bytes per changed value, codecs."""

    def go() -> None:
        patch = Patch.load(patch_path)
        h = patch.header
        if as_json:
            typer.echo(json.dumps(h.describe(), indent=2))
            return

        def end(ref: ViewRef) -> str:
            return f"v{ref.version}" if ref.version is not None else ref.view[:12]

        t = Table(title=f"{patch_path}: {end(h.base)} -> {end(h.target)} ({h.served_format or 'served view'})")
        t.add_column("tensor", overflow="fold", min_width=24)
        # one header per cell: positions and value steps have a codec each
        for col in ("dtype", "shape", "changed", "%", "bytes", "B/chg", "pos codec", "value codec", "mode"):
            t.add_column(
                col, no_wrap=True, justify="left" if col in ("dtype", "pos codec", "value codec", "mode") else "right"
            )
        for s in h.sections:
            nbytes = patch.section_bytes(s.name)
            t.add_row(
                s.name,
                s.dtype,
                "x".join(map(str, s.shape)),
                f"{s.n:,}",
                f"{100 * s.n / max(1, s.numel):.3f}",
                f"{nbytes:,}",
                f"{nbytes / s.n:.3f}",
                str(s.pos.get("codec")),
                str(s.val.get("codec")),
                s.mode,
            )
        console = output_console()
        console.print(t)
        size = patch_path.stat().st_size
        console.print(
            f"base view {h.base.view}, target view {h.target.view}; {len(h.sections)} tensors changed, "
            f"{h.n_changed:,} values, {size:,} bytes ({size / max(1, h.n_changed):.3f} per changed value)"
        )
        against = [s.name for s in h.sections if patch.section_needs_base(s.name)]
        if against:
            console.print(
                f"the positions of {len(against)} of them are coded against the values they change ('ctx'): "
                "the patch decodes only with its base view at hand (apply, a sidecar whose engine holds the view, "
                "squash --base)"
            )

    _run(go)
