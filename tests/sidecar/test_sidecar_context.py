"""A run's patches are coded against their base by default; a sidecar whose engine cannot decode them learns
it from the run's manifests at boot and refuses with what to do, instead of excluding every patch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flipsync.board import BoardReader, open_store
from flipsync.engines.memory import MemoryEngine
from flipsync.engines.torch.models import build_model, preset_config
from flipsync.errors import ConfigError
from flipsync.sidecar.service import check_decodable
from flipsync.trainer import Publisher, PublisherConfig


class NoHostCopy(MemoryEngine):
    """An engine whose weights the sidecar cannot read (a vLLM engine attached without a host copy)."""

    @property
    def decodes_context(self) -> bool:
        return False


def publish(board: Path, run: str, context: bool) -> None:
    model = build_model(preset_config("tiny"), seed=0, dtype=torch.float32)
    model.train().requires_grad_(True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with Publisher(model, board, run=run, format="bf16", optimizer=opt, config=PublisherConfig(context=context)):
        ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()


@pytest.mark.parametrize("context", [True, False])
def test_a_run_coded_against_its_base_is_refused_by_an_engine_that_cannot_decode_it(
    tmp_path: Path, context: bool
) -> None:
    publish(tmp_path, "r", context)
    reader = BoardReader(open_store(tmp_path), "r")
    engine = NoHostCopy({"w": torch.zeros(4, dtype=torch.bfloat16)})
    check_decodable(reader, MemoryEngine({"w": torch.zeros(4, dtype=torch.bfloat16)}))  # holds its tensors
    if context:
        with pytest.raises(ConfigError, match="host_copy"):
            check_decodable(reader, engine)
    else:
        check_decodable(reader, engine)
