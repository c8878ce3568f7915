"""A rank of the Hugging Face DDP test: a plain ``Trainer`` on two CPU processes (accelerate sets up gloo from
the torchrun-style environment), with FlipsyncCallback on every rank. Writes the final served view (rank 0)
and what each rank's callback published under ``out_dir``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch


def ddp_trainer(rank: int, world: int, init_file: str, board: str, out_dir: str) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=Path(init_file).read_text().strip(),
        GLOO_SOCKET_IFNAME="lo",  # loopback only
    )
    torch.set_num_threads(1)
    from datasets import Dataset
    from safetensors.torch import save_file
    from trainer_helpers import tiny_llama
    from transformers import Trainer, TrainingArguments

    from flipsync.formats import served_view
    from flipsync.integrations.hf import FlipsyncCallback

    model = tiny_llama(0, tie=False)
    ids = torch.randint(0, 64, (16, 12), generator=torch.Generator().manual_seed(0))
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    args = TrainingArguments(
        output_dir=str(Path(out_dir) / "out"),
        max_steps=3,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=1e-2,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        ddp_backend="gloo",
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    cb = FlipsyncCallback(board, format="bf16", run="ddp", background=False, timeout_s=60.0)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[cb])
    trainer.train()
    wrapped = type(trainer.model_wrapped).__name__
    note = {"version": cb.published.version if cb.published else None, "wrapped": wrapped}
    (Path(out_dir) / f"hf-{rank}.json").write_text(json.dumps(note))
    if rank == 0:
        state = {k: v.detach() for k, v in model.state_dict().items()}
        save_file({k: v.contiguous() for k, v in served_view(state, "bf16").items()}, str(Path(out_dir) / "ddp.st"))
    torch.distributed.barrier()  # both ranks tear down together
    torch.distributed.destroy_process_group()
