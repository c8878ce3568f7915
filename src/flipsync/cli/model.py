"""``flipsync model``: write a model folder that vLLM's CPU build and the torch engine both serve.

The folder holds ``config.json`` (a demo preset's or a given config), ``generation_config.json``, the byte-level
Hugging Face tokenizer with the torch engine's chat template (``flipsync.engines.torch.model_dir.write_model_dir``: the
same ids for the same prompt on both engines) and ``model.safetensors``: random weights from ``--seed``, or the
tensors of ``--weights`` (a served BF16 view, or FP32 masters, cast to BF16 by the served-view recipe).
``model`` is a plain Typer command function that ``flipsync.cli.main`` mounts; ``model_app`` holds it, so
``python -m flipsync.cli.model model ...`` works on its own too.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from flipsync.cli.terminal import command_app, command_error
from flipsync.errors import ConfigError, FlipsyncError

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

# torch and transformers are imported inside the command, so that mounting it keeps ``flipsync --help`` fast.

log = logging.getLogger(__name__)

model_app = command_app("flipsync-model", "Write a model folder (config, tokenizer, chat template, weights).")

SERVED_FORMAT = "bf16"  # what write_model_dir declares (torch_dtype bfloat16) and vLLM's CPU build serves


def model_config(preset: str | None, config: Path | None) -> PretrainedConfig:
    """The config of a demo preset or of a ``config.json`` (or a folder holding one), with the byte tokenizer's
    special ids; refuses what the tokenizer or the folder writer cannot serve."""
    from flipsync.engines.torch.model_dir import DEMO_MODELS, demo_config
    from flipsync.engines.torch.models import load_config
    from flipsync.engines.torch.tokenizer import ByteTokenizer

    if (preset is None) == (config is None):
        raise ConfigError(f"give one of --preset ({', '.join(DEMO_MODELS)}) or --config PATH/config.json")
    if preset is not None:
        return demo_config(preset)
    assert config is not None
    cfg = load_config(str(config))
    tok = ByteTokenizer()
    vocab = getattr(cfg, "vocab_size", None)
    if not isinstance(vocab, int) or vocab < tok.vocab_size:
        raise ConfigError(
            f"{config}: vocab_size is {vocab}, but the byte tokenizer needs at least {tok.vocab_size} ids "
            "(set vocab_size in config.json)"
        )
    cfg.bos_token_id, cfg.eos_token_id = tok.bos_id, tok.eos_id  # the tokenizer's, whatever the file said
    return cfg


def model_weights(cfg: PretrainedConfig, weights: Path | None, seed: int) -> dict[str, torch.Tensor]:
    """The served BF16 view to write: random from ``seed``, or ``weights`` checked against ``cfg``'s names,
    shapes and dtypes (FP32 masters are cast by the served-view recipe)."""
    import torch

    from flipsync.checkpoint import load_checkpoint
    from flipsync.engines.torch.models import build_model
    from flipsync.formats import served_view

    model = build_model(cfg, seed=seed, dtype=torch.float32)
    expected = served_view({k: v.detach() for k, v in model.state_dict().items()}, SERVED_FORMAT)
    if weights is None:
        return expected
    if not weights.exists():
        raise ConfigError(f"--weights {weights} does not exist (a .safetensors file, or a folder of shards)")
    try:
        given = load_checkpoint(weights)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read --weights {weights} as safetensors: {e}") from None
    missing, extra = sorted(set(expected) - set(given)), sorted(set(given) - set(expected))
    if missing or extra:
        raise ConfigError(
            f"--weights {weights} does not fit the config: {len(missing)} tensors missing (e.g. {missing[:3]}), "
            f"{len(extra)} unknown (e.g. {extra[:3]}); write the weights of a model built from this config"
        )
    if all(t.dtype == torch.float32 for t in given.values()):
        given = served_view(given, SERVED_FORMAT)  # masters: the served view by the pinned recipe
    for name, want in expected.items():
        got = given[name]
        if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
            raise ConfigError(
                f"--weights {weights}: tensor {name!r} is {tuple(got.shape)} {got.dtype}, the config wants "
                f"{tuple(want.shape)} {want.dtype} (a served BF16 view, or FP32 masters)"
            )
    return {name: given[name].contiguous() for name in expected}


def write_model(
    out: Path,
    *,
    preset: str | None = None,
    config: Path | None = None,
    weights: Path | None = None,
    seed: int = 0,
    force: bool = False,
) -> Path:
    """Write the folder (see the module docstring); refuses a non-empty ``out`` unless ``force``."""
    from flipsync.engines.torch.model_dir import write_model_dir

    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ConfigError(f"{out} is not empty; pass --force to write over it, or choose another folder")
    cfg = model_config(preset, config)
    view = model_weights(cfg, weights, seed)
    return write_model_dir(out, cfg, view)


@model_app.command("model")
def model(
    out: Annotated[Path, typer.Argument(help="The folder to write")],
    preset: Annotated[
        str | None, typer.Option(help="A demo model: llama-20m, llama-1m or moe-2m (or give --config)")
    ] = None,
    config: Annotated[
        Path | None, typer.Option(help="A Hugging Face config.json (or a folder holding one) instead of --preset")
    ] = None,
    weights: Annotated[
        Path | None,
        typer.Option(help="Served BF16 weights (or FP32 masters) as .safetensors (default: random from --seed)"),
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the random weights")] = 0,
    force: Annotated[bool, typer.Option(help="Write into a folder that is not empty")] = False,
) -> None:
    """Write a model folder (config, tokenizer, chat template, weights) that vLLM and the torch engine serve."""
    try:
        folder = write_model(out, preset=preset, config=config, weights=weights, seed=seed, force=force)
    except FlipsyncError as e:
        raise command_error(e) from None
    files = ", ".join(sorted(p.name for p in folder.iterdir()))
    typer.echo(f"flipsync model: wrote {folder} ({files})")
    typer.echo(f"  vLLM:  python -m vllm.entrypoints.openai.api_server --model {folder} --dtype bfloat16")
    typer.echo(f"  torch: flipsync sidecar --engine torch --model {folder} --board BOARD (weights from the board)")


if __name__ == "__main__":
    model_app()
