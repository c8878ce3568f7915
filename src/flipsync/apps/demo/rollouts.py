"""The rollout side of the demo's loop: `RolloutPool` keeps requests in flight on every island and hands the
trainer groups no more than ``max_staleness`` steps old; `StepIndex` maps board versions to trainer steps, and
`Workers` is the thread set the pool and the monitor both are.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Self

import httpx

from flipsync.apps.demo.island import Island
from flipsync.apps.demo.records import DemoConfig
from flipsync.apps.demo.task import Problem, ReverseDigits
from flipsync.board.reader import BoardReader
from flipsync.engines.torch.tokenizer import ByteTokenizer
from flipsync.errors import FlipsyncError
from flipsync.stores import open_store


@dataclass(frozen=True)
class RolloutGroup:
    problem: Problem
    group: int
    completions: list[tuple[str, tuple[int, ...]]]  # text, token ids
    step: int  # the trainer step of the oldest weights that produced any of its tokens
    island: str


class StepIndex:
    """Board version -> the last trainer step it covers (manifest ``meta.step``), read once per version."""

    def __init__(self, board: str, run: str) -> None:
        self.reader = BoardReader(open_store(board), run)
        self._steps: dict[int, int] = {}
        self._lock = threading.Lock()

    def step(self, version: int) -> int:
        with self._lock:
            if version not in self._steps:
                meta = self.reader.catalog.version(version).meta or {}
                self._steps[version] = int(meta.get("step", version))
            return self._steps[version]


class Workers:
    """Threads that run until ``stop`` is set: ``start`` starts them all, ``close`` stops and joins them."""

    stop: threading.Event
    _threads: list[threading.Thread]

    def start(self) -> Self:
        for t in self._threads:
            t.start()
        return self

    def close(self) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(10)


class RolloutPool(Workers):
    """Keeps rollout requests in flight on every island; each answer is a group of samples for one prompt."""

    def __init__(
        self,
        islands: list[Island],
        task: ReverseDigits,
        tok: ByteTokenizer,
        cfg: DemoConfig,
        head_version: Callable[[], int],
        steps: StepIndex,
        gateway: str | None = None,
    ) -> None:
        self.islands, self.task, self.tok, self.cfg = islands, task, tok, cfg
        self.head_version, self.steps = head_version, steps
        self.gateway = gateway  # the flipsync islands' requests go there; it says which island served
        self.groups: queue.Queue[RolloutGroup] = queue.Queue(maxsize=4 * cfg.prompts_per_step)
        self.stop = threading.Event()
        self.errors: list[str] = []
        self._next_group = 0
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._loop, args=(island, k), daemon=True, name=f"rollouts-{island.spec.name}-{k}")
            for island in islands
            for k in range(2)
        ]

    def _request(self, island: Island, problem: Problem, seed: int) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": "flipsync-demo" if island.spec.engine == "vllm" and not island.spec.control else "flipsync-torch",
            "prompt": self.tok.encode(problem.prompt),  # token ids: the same for every engine
            "max_tokens": self.cfg.max_tokens,
            "n": self.cfg.group_size,
            "temperature": 1.0,
            "seed": seed,
        }
        if not island.spec.control:
            # the proxy holds or refuses the request until the island serves a recent enough version
            body["weight_version"] = {"min_version": max(0, self.head_version() - self.cfg.max_staleness)}
        return body

    def _loop(self, island: Island, k: int) -> None:
        rng = random.Random(hash((island.spec.name, k)))
        routed = self.gateway is not None and not island.spec.control
        base = self.gateway if routed else island.url
        with httpx.Client(base_url=base or "", timeout=60) as client:
            while not self.stop.is_set():
                with self._lock:
                    problem, gid = self.task.sample(), self._next_group
                    self._next_group += 1
                held_before = island.meters.held_step.value
                try:
                    r = client.post("/v1/completions", json=self._request(island, problem, rng.randrange(2**31)))
                except httpx.HTTPError as e:
                    self.errors.append(f"{island.spec.name}: {e}")
                    time.sleep(0.2)
                    continue
                if r.status_code in (409, 503):  # behind the trainer, or committing: retry shortly
                    time.sleep(min(0.2, float(r.headers.get("Retry-After", "0.1"))))
                    continue
                if r.status_code != 200:
                    self.errors.append(f"{island.spec.name}: HTTP {r.status_code} {r.text[:200]}")
                    time.sleep(0.2)
                    continue
                doc = r.json()
                name = r.headers.get("x-flipsync-replica", island.spec.name) if routed else island.spec.name
                try:
                    if island.spec.control:
                        # the engine stamps every token with the trainer step of the checkpoint it came from
                        stamps = [v for c in doc["choices"] for v in c.get("token_versions") or []]
                        if any(v is None for v in stamps):
                            continue  # generated while a load was half done: not a policy's sample
                        step = min(stamps) if stamps else held_before
                    else:
                        span = doc.get("weight_version", {})
                        step = self.steps.step(int(span["start"]))
                except (KeyError, ValueError, FlipsyncError) as e:
                    self.errors.append(f"{island.spec.name}: unreadable answer ({e})")
                    continue
                completions = [(c["text"], tuple(self.tok.encode(c["text"], bos=False))) for c in doc["choices"]]
                group = RolloutGroup(problem, gid, completions, step, name)
                while not self.stop.is_set():
                    try:
                        self.groups.put(group, timeout=0.2)
                        break
                    except queue.Full:
                        continue

    def take(self, n: int, step: int, timeout_s: float = 300.0) -> tuple[list[RolloutGroup], dict[str, int]]:
        """``n`` groups whose weights are at most ``max_staleness`` trainer steps older than the policy of
        ``step`` (the weights after step - 1); returns them and, per island, how many rollouts were dropped."""
        out: list[RolloutGroup] = []
        dropped: dict[str, int] = defaultdict(int, {i.spec.name: 0 for i in self.islands})
        deadline = time.monotonic() + timeout_s
        while len(out) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no rollouts within {timeout_s} s; island errors: {self.errors[-3:]}")
            try:
                g = self.groups.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if (step - 1) - g.step > self.cfg.max_staleness:
                dropped[g.island] += len(g.completions)
                continue
            out.append(g)
        return out, dropped
