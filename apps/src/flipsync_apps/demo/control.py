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
from collections.abc import Mapping
from multiprocessing.connection import Connection
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors

from flipsync.checkpoint import save_checkpoint
from flipsync.codec.fingerprint import FingerprintTable
from flipsync.errors import FlipsyncError, NotFoundError
from flipsync.stores import Store, open_store
from flipsync_apps.demo.island_link import IslandSpec, MeteredStore, Meters, serve_commands
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
    stop = threading.Event()

    def follow() -> None:
        held = -1
        while not stop.is_set():
            try:
                latest = int(store.get(LATEST).decode())
                if latest > held:
                    data = store.get(checkpoint_name(latest))
                    view = load_safetensors(data)
                    engine.label_version(FingerprintTable.of(view).view_fp(), latest)
                    engine.load_view(view)
                    held = latest
                    with meters.held_step.get_lock():
                        meters.held_step.value = latest
                    continue
            except NotFoundError:
                pass  # the newest file was pruned between reading latest and opening it: read latest again
            except (FlipsyncError, ValueError) as e:
                log.warning("control island: %s", e)
            stop.wait(0.05)

    follower = threading.Thread(target=follow, daemon=True, name="control-follow")
    follower.start()
    conn.send(("ready", handle.url))
    try:
        serve_commands(conn, engine, lambda: engine.version)
    finally:
        stop.set()
        follower.join(30)
        handle.stop()
        conn.close()


def _vllm_control(spec: IslandSpec, conn: Connection, meters: Meters, store: Store) -> None:
    """vLLM serves the model folder; each newest checkpoint is written to a folder of its own and reloaded whole
    through vLLM's own ``reload_weights`` (every layer reloaded and repacked). vLLM stamps no version: a
    rollout is labelled with the step the island held when it was sent (the rollout pool's ``held_step``)."""
    server = VllmServer(spec.model, spec.name).start()
    folders = Path(spec.model).parent / f"{spec.name}-checkpoints"
    stop = threading.Event()

    def follow() -> None:
        held, last = 0, None  # vLLM starts from the model folder: step 0's weights
        with meters.held_step.get_lock():
            meters.held_step.value = held
        while not stop.is_set():
            try:
                latest = int(store.get(LATEST).decode())
                if latest > held:
                    folder = folders / f"step-{latest:06d}"
                    folder.mkdir(parents=True, exist_ok=True)
                    (folder / "model.safetensors").write_bytes(store.get(checkpoint_name(latest)))
                    server.reload_weights(folder)
                    held = latest
                    with meters.held_step.get_lock():
                        meters.held_step.value = latest
                    if last is not None:
                        shutil.rmtree(last, ignore_errors=True)
                    last = folder
                    continue
            except NotFoundError:
                pass  # the newest file was pruned between reading latest and opening it: read latest again
            except (FlipsyncError, ValueError) as e:
                log.warning("control island: %s", e)
            stop.wait(0.05)

    follower = threading.Thread(target=follow, daemon=True, name="control-follow")
    follower.start()
    conn.send(("ready", server.url))
    try:
        serve_held_step(conn, meters)
    finally:
        stop.set()
        follower.join(60)
        server.stop()
        shutil.rmtree(folders, ignore_errors=True)
        conn.close()


def serve_held_step(conn: Connection, meters: Meters) -> None:
    """The command loop of an island whose engine's bytes flipsync does not read: its audit says which step it
    holds and no fingerprint (none is claimed for weights nobody recomputed)."""
    try:
        while True:
            command, _arg = conn.recv()
            if command == "stop":
                return
            if command == "audit":
                conn.send(("audit", {"version": meters.held_step.value, "view_fp": None, "tensors": None}))
    except EOFError:
        pass  # the parent went away
