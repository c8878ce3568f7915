"""The demo's control: what a rollout fleet does without flipsync, over the same link.

The trainer side (`CheckpointShelf`) saves the full served view after every step, as a trainer that ships
checkpoints does, and points ``latest`` at it. The control island (`control_main`, a process like the
flipsync islands) polls ``latest`` and downloads the newest full checkpoint through the same bandwidth
limit, loads it into its engine and labels the weights with the trainer step, so its rollouts carry the
step that produced them. Its engine is the flipsync islands' kind, so the comparison is like for like: the
torch engine loads the view, vLLM reloads it whole through its own ``reload_weights``. It skips
versions that appeared while it was downloading, as a sensible loader does: it never falls further behind than
the link forces it to.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_safetensors

from flipsync.checkpoint import save_checkpoint
from flipsync.codec.fingerprint import FingerprintTable
from flipsync.errors import FlipsyncError, NotFoundError
from flipsync.stores import Store, open_store
from flipsync_apps.demo.island_link import IslandSpec, MeteredStore, Meters, engine_audit, serve_commands
from flipsync_apps.demo.vllm_server import VllmServer

log = logging.getLogger(__name__)

LATEST = "latest"


def checkpoint_name(step: int) -> str:
    return f"step-{step:06d}.safetensors"


class CheckpointShelf:
    """Trainer side: saves each step's full served view in the background and keeps the newest ``keep``."""

    def __init__(self, root: Path, *, keep: int = 3) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self._queue: queue.Queue[tuple[int, Mapping[str, torch.Tensor]] | None] = queue.Queue()
        self._saved: list[int] = []
        self.saved_at: dict[int, float] = {}  # step -> when its checkpoint was complete (monotonic)
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, daemon=True, name="demo-checkpoints")
        self._thread.start()

    def put(self, step: int, view: Mapping[str, torch.Tensor]) -> None:
        self._queue.put((step, view))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(60)

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            step, view = item
            if not self._queue.empty():
                continue  # a newer step is waiting: a saver that falls behind saves the newest one
            try:
                save_checkpoint(dict(view), self.root / checkpoint_name(step))  # written aside, then renamed
                tmp = self.root / f"{LATEST}.tmp"
                tmp.write_text(str(step))
                tmp.replace(self.root / LATEST)
                self.saved_at[step] = time.monotonic()
                self._saved.append(step)
                while len(self._saved) > self.keep:
                    # a reader that opened an older file keeps reading it (unlinked files stay readable)
                    with contextlib.suppress(OSError):
                        (self.root / checkpoint_name(self._saved.pop(0))).unlink()
            except OSError as e:
                self.error = e
                log.warning("could not save the checkpoint of step %d: %s", step, e)


def control_main(spec: IslandSpec, conn: Connection, meters: Meters) -> None:
    """The control island process: an engine (the flipsync islands' kind) that reloads the newest full
    checkpoint, forever."""
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    store = MeteredStore(open_store(spec.board), spec.bandwidth_bytes_per_s, meters)
    if spec.engine == "vllm":
        _vllm_control(spec, conn, meters, store)
    else:
        _torch_control(spec, conn, meters, store)


def _torch_control(spec: IslandSpec, conn: Connection, meters: Meters, store: Store) -> None:
    """The torch engine loads each checkpoint and stamps every token with the step of the weights it came from."""
    from flipsync.engines.torch.openai_server import start_torch_engine

    handle = start_torch_engine(spec.model, spec.served_format, seed=spec.seed, max_concurrency=spec.max_concurrency)
    engine = handle.engine

    def load(step: int, data: bytes) -> None:
        view = load_safetensors(data)
        engine.label_version(FingerprintTable.of(view).view_fp(), step)
        engine.load_view(view)

    _serve(
        conn,
        handle.url,
        _Follower(store, meters, load, held=-1),
        engine_audit(engine, lambda: engine.version),
        handle.stop,
    )


def _vllm_control(spec: IslandSpec, conn: Connection, meters: Meters, store: Store) -> None:
    """vLLM serves the model folder; each newest checkpoint is written to a folder of its own and reloaded whole
    through vLLM's own ``reload_weights`` (every layer reloaded and repacked). vLLM stamps no version: a
    rollout is labelled with the step the island held when it was sent (the rollout pool's ``held_step``)."""
    server = VllmServer(spec.model, spec.name, binding=spec.binding).start()
    folders = Path(spec.model).parent / f"{spec.name}-checkpoints"

    def load(step: int, data: bytes) -> None:
        folder = folders / f"step-{step:06d}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "model.safetensors").write_bytes(data)
        server.reload_weights(folder)
        for old in folders.iterdir():  # only the checkpoint vLLM now holds stays
            if old != folder:
                shutil.rmtree(old, ignore_errors=True)

    def stop() -> None:
        server.stop()
        shutil.rmtree(folders, ignore_errors=True)

    follower = _Follower(store, meters, load, held=0)  # vLLM starts from the model folder: step 0's weights

    def held(_tensors: bool) -> dict[str, Any]:
        """vLLM's bytes are not read back here: the step it holds, and no fingerprint claimed."""
        return {"version": meters.held_step.value, "view_fp": None, "tensors": None}

    _serve(conn, server.url, follower, held, stop)


class _Follower(threading.Thread):
    """Loads the newest full checkpoint whenever ``latest`` moves past the one held, skipping those that came
    while it was downloading or loading."""

    def __init__(self, store: Store, meters: Meters, load: Callable[[int, bytes], None], *, held: int) -> None:
        super().__init__(daemon=True, name="control-follow")
        self.store, self.meters, self.load, self.held = store, meters, load, held
        self.stop = threading.Event()
        self._set_held(held)

    def _set_held(self, step: int) -> None:
        with self.meters.held_step.get_lock():
            self.meters.held_step.value = step

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                latest = int(self.store.get(LATEST).decode())
                if latest > self.held:
                    self.load(latest, self.store.get(checkpoint_name(latest)))
                    self.held = latest
                    self._set_held(latest)
                    continue
            except NotFoundError:
                pass  # the newest file was pruned between reading latest and opening it: read latest again
            except (FlipsyncError, ValueError) as e:
                log.warning("control island: %s", e)
            self.stop.wait(0.05)


def _serve(
    conn: Connection,
    url: str,
    follower: _Follower,
    audit: Callable[[bool], dict[str, Any]],
    stop_engine: Callable[[], None],
) -> None:
    """Follow the checkpoints, say ready, answer the parent's commands; then stop following and the engine."""
    follower.start()
    conn.send(("ready", url))
    try:
        serve_commands(conn, audit)
    finally:
        follower.stop.set()
        follower.join(60)
        stop_engine()
        conn.close()
