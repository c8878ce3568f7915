"""Publish Hugging Face safetensors checkpoints that a trainer we do not control writes to a directory
(``flipsync watch``), each only once it is complete and stable. See docs/trainer.md ("Checkpoint watcher").
"""

from __future__ import annotations

import json
import logging
import re
import struct
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from flipsync.board import BoardReader
from flipsync.checkpoint import INDEX_NAME, load_checkpoint
from flipsync.errors import ConfigError, NotFoundError
from flipsync.stores import Store
from flipsync.trainer.config import PublisherConfig
from flipsync.trainer.publisher import Publisher

log = logging.getLogger(__name__)

_SHARD = re.compile(r"^(?P<stem>.+)-(?P<i>\d+)-of-(?P<n>\d+)\.safetensors$")
_STEP = re.compile(r"(\d+)(?!.*\d)")  # the last number in a name


@dataclass(frozen=True)
class CheckpointDir:
    """A complete checkpoint directory, and the signature (name, size, mtime) of its files."""

    path: Path
    signature: tuple[tuple[str, int, int], ...]

    @property
    def name(self) -> str:
        return self.path.name

    def order(self) -> tuple[int, int]:
        return (_step_of(self.name), max((mtime for _, _, mtime in self.signature), default=0))


def _step_of(name: str) -> int:
    """The last number in a checkpoint's name (-1: none)."""
    m = _STEP.search(name)
    return int(m.group(1)) if m else -1


def safetensors_complete(path: Path) -> bool:
    """Whether ``path`` is a whole safetensors file (not one still being written)."""
    try:
        with path.open("rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                return False
            (n,) = struct.unpack("<Q", raw)
            size = path.stat().st_size
            if n > 100 << 20 or size < 8 + n:
                return False
            header = json.loads(f.read(n))
    except (OSError, ValueError):
        return False
    if not isinstance(header, dict):
        return False
    end = 0
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            return False
        end = max(end, offsets[1])
    return size == 8 + n + end


def checkpoint_files(directory: Path) -> list[Path] | None:
    """The files of the checkpoint in ``directory`` if it is complete, else None."""
    try:
        names = {p.name for p in directory.iterdir() if p.is_file()}
    except OSError:
        return None
    index = directory / INDEX_NAME
    if INDEX_NAME in names:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            wanted = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError):
            return None  # the index itself is still being written
        if not wanted or not all(isinstance(w, str) and w in names for w in wanted):
            return None
    else:
        wanted = sorted(n for n in names if n.endswith(".safetensors"))
        if not wanted:
            return None
        for n in wanted:
            m = _SHARD.match(n)
            if m and not all(
                f"{m['stem']}-{i:0{len(m['i'])}d}-of-{m['n']}.safetensors" in names for i in range(1, int(m["n"]) + 1)
            ):
                return None
    files = [directory / w for w in wanted]
    return files if all(safetensors_complete(f) for f in files) else None


def _signature(files: list[Path]) -> tuple[tuple[str, int, int], ...] | None:
    try:
        return tuple((f.name, (st := f.stat()).st_size, st.st_mtime_ns) for f in files)
    except OSError:
        return None


def complete_checkpoint(path: Path) -> CheckpointDir:
    """``path`` (a checkpoint directory or one .safetensors file) if complete; else ConfigError."""
    files = [path] if safetensors_complete(path) else checkpoint_files(path)  # None for a missing or partial one
    sig = _signature(files) if files is not None else None
    if sig is None:
        raise ConfigError(f"{path} is not a complete safetensors checkpoint (missing or half-written files)")
    return CheckpointDir(path, sig)


class CheckpointScanner:
    """Finds complete, stable checkpoints under a directory (see the module doc)."""

    def __init__(self, root: Path, settle_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not root.is_dir():
            raise ConfigError(f"checkpoint directory {root} does not exist")
        self.root = root
        self.settle_s = settle_s
        self._clock = clock
        self._seen: dict[Path, tuple[tuple[tuple[str, int, int], ...], float]] = {}

    def ready(self) -> list[CheckpointDir]:
        """Complete checkpoints whose files have not changed for ``settle_s``, oldest first."""
        now = self._clock()
        out = []
        dirs = [self.root] if any(self.root.glob("*.safetensors")) else []
        for d in dirs + sorted(p for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".")):
            files = checkpoint_files(d)
            sig = _signature(files) if files is not None else None
            if sig is None:
                self._seen.pop(d, None)
                continue
            prev = self._seen.get(d)
            if prev is None or prev[0] != sig:
                self._seen[d] = (sig, now)
                if self.settle_s > 0:
                    continue
            elif now - prev[1] < self.settle_s:
                continue
            out.append(CheckpointDir(d, sig))
        return sorted(out, key=CheckpointDir.order)


Event = Callable[[str, Mapping[str, Any]], None]


def _quiet(_kind: str, _info: Mapping[str, Any]) -> None:
    pass


class CheckpointPublisher:
    """Publishes checkpoints as consecutive versions of one run (a `Publisher` over loaded state dicts)."""

    def __init__(
        self,
        store: Store,
        *,
        run: str | None = None,
        format: str = "bf16",
        resume: bool = False,
        new_weights: bool = False,
        on_event: Event = _quiet,
        config: PublisherConfig | None = None,
    ) -> None:
        self.store = store
        self.run = run
        self.format = format
        self.resume = resume
        self.on_event = on_event
        self.new_weights = new_weights
        self.config = config or PublisherConfig()
        self._state: Mapping[str, torch.Tensor] = {}
        self.publisher: Publisher | None = None
        self.last: CheckpointDir | None = None
        self.after: str | None = self._resume_point() if resume and run else None

    def _resume_point(self) -> str | None:
        """The checkpoint HEAD was made from (``meta.source``), so a restarted watcher continues after it."""
        assert self.run is not None
        reader = BoardReader(self.store, self.run)
        try:
            head = reader.head()
            source = reader.catalog.version(head).meta.get("source") if head is not None else None
        except NotFoundError:
            return None
        return source if isinstance(source, str) else None

    def wants(self, ckpt: CheckpointDir) -> bool:
        """False for a checkpoint at or before the last one published (or the one HEAD came from)."""
        if self.last is not None:
            return ckpt.order() > self.last.order() and ckpt.signature != self.last.signature
        if self.after is not None:
            return ckpt.name == self.after or _step_of(ckpt.name) > _step_of(self.after) >= 0
        return True

    def publish(self, ckpt: CheckpointDir) -> int | None:
        """Publish one checkpoint as the next version; returns the board's HEAD afterwards."""
        self.on_event("loading", {"checkpoint": str(ckpt.path)})
        self._state = load_checkpoint(ckpt.path)
        meta = {"source": ckpt.name}
        if self.publisher is None:
            self.publisher = Publisher(
                lambda: self._state,
                self.store,
                run=self.run,
                format=self.format,
                resume=self.resume or self.after is not None,
                new_weights=self.new_weights,
                config=replace(self.config, background=False, meta=meta),
            )
            self.run = self.publisher.run
            if self.publisher.started == "adopt":
                self.on_event("adopted", {"checkpoint": ckpt.name, "version": self.publisher.stats.head})
        else:
            self.publisher.step(meta=meta)
        self._state = {}
        self.last = ckpt
        head = self.publisher.stats.head
        self.on_event("published", {"checkpoint": ckpt.name, "version": head, "run": self.run})
        return head

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()


def watch(
    ckpt_dir: str | Path,
    store: Store,
    *,
    run: str | None = None,
    format: str = "bf16",
    resume: bool = False,
    poll_s: float = 5.0,
    settle_s: float = 10.0,
    once: bool = False,
    max_checkpoints: int | None = None,
    stop: threading.Event | None = None,
    new_weights: bool = False,
    on_event: Event = _quiet,
    config: PublisherConfig | None = None,
) -> CheckpointPublisher:
    """Publish every new complete checkpoint under ``ckpt_dir`` until ``stop`` is set, ``max_checkpoints`` are
    published, or (``once``) what is complete and stable now is (waiting ``settle_s`` to tell). Returns the
    CheckpointPublisher (its ``run`` and ``last``)."""
    scanner = CheckpointScanner(Path(ckpt_dir), settle_s)
    pub = CheckpointPublisher(
        store, run=run, format=format, resume=resume, new_weights=new_weights, on_event=on_event, config=config
    )
    stop = stop or threading.Event()
    published = 0
    first_scan: float | None = None
    try:
        while not stop.is_set():
            scanned = time.monotonic()
            first_scan = scanned if first_scan is None else first_scan
            ready = [c for c in scanner.ready() if pub.wants(c)]
            for ckpt in ready:  # oldest first: every checkpoint becomes a version
                pub.publish(ckpt)
                published += 1
                if max_checkpoints is not None and published >= max_checkpoints:
                    return pub
            # Timed from the scans, not from the start: a slow first scan must not use up the settle time.
            if once and not ready and scanned - first_scan > settle_s:
                return pub  # everything that was complete at the first scan is published
            if not ready:
                on_event("waiting", {"dir": str(ckpt_dir), "published": published})
            stop.wait(poll_s)
    finally:
        pub.close()
    return pub
