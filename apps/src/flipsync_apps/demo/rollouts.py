"""The rollout side of the demo's loop: `RolloutPool` keeps requests in flight on every island and hands the
trainer groups, each completion with its per-token facts (behaviour log-prob, version); `StepIndex` maps
board versions to trainer steps, and `Workers` is the thread set the pool and the monitor both are.

The pool runs in one of three modes (docs/async.md): ``sync`` generates one batch per trainer step, on the
newest version, and waits for the next (its islands idle while the trainer steps); ``async`` keeps
generating into a buffer four batches deep and labels each response with the version it started on;
``inflight`` keeps generating into a buffer one batch deep, versions land mid-sequence, and every token
carries the version that produced it.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Self

import httpx

from flipsync.board.reader import BoardReader
from flipsync.engines.torch.tokenizer import ByteTokenizer
from flipsync.errors import FlipsyncError
from flipsync.stores import open_store
from flipsync_apps.demo.island import Island
from flipsync_apps.demo.records import DemoConfig
from flipsync_apps.demo.task import Problem, ReverseDigits


@dataclass(frozen=True)
class Sample:
    """One completion and its per-token facts, as the engine reported them."""

    text: str
    tokens: tuple[int, ...]  # completion token ids (the text re-encoded; without the stop token)
    behaviour: tuple[float | None, ...]  # the log-prob each token was sampled with (+ the stop token's, if given)
    steps: tuple[int, ...]  # per token: the trainer step of the weights that produced it (exact, where known)
    start_step: int  # the trainer step of the version the response started on (the per-response bound)
    stopped: bool  # ended with the stop token, not at max_tokens


@dataclass(frozen=True)
class RolloutGroup:
    problem: Problem
    group: int
    completions: list[Sample]
    step: int  # the trainer step of the oldest weights that produced any of its tokens
    island: str
    round: int = 0  # sync mode: the batch it was generated for

    @property
    def tokens(self) -> int:
        return sum(len(c.tokens) for c in self.completions)


@dataclass
class PoolStats:
    """What the islands generated, per island: tokens and rollouts received, rollouts dropped (too stale for
    the hard cap, or unreadable), completions whose per-token facts did not line up with their text, and the
    request intervals (start, end) that make its busy time."""

    tokens: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    rollouts: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    dropped: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    unaligned: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    busy: dict[str, list[tuple[float, float]]] = field(default_factory=lambda: defaultdict(list))


def busy_seconds(intervals: list[tuple[float, float]], start: float, end: float) -> float:
    """Length of the union of ``intervals`` within [start, end]: the time an island had a request running."""
    total, reach = 0.0, start
    for a, b in sorted(intervals):
        a, b = max(a, reach), min(b, end)
        if b > a:
            total += b - a
            reach = b
    return total


def _lines_up(tok: ByteTokenizer, tokens: tuple[int, ...], logprobs: list[Any], pieces: Any) -> bool:
    """Whether the engine's per-token log-probs are those of ``tokens`` (the text re-encoded): one per token,
    each (where the engine names its tokens) the byte the text has at that place. A sampled id outside the
    byte range has no text, so it would shift every later token, or pass for the stop token at the end: one
    entry more than the text has is refused too (the stop token's log-prob cannot be told from it)."""
    if len(logprobs) != len(tokens):
        return False
    if not isinstance(pieces, list) or len(pieces) != len(logprobs):
        return True  # unnamed tokens: only the count can be checked
    pairs = zip(pieces, tokens, strict=True)
    return all(isinstance(piece, str) and tok.encode(piece, bos=False) == [t] for piece, t in pairs)


def parse_sample(
    tok: ByteTokenizer, choice: dict[str, Any], start_step: int, to_step: Callable[[int], int]
) -> tuple[Sample, bool]:
    """A choice of a completions answer as a `Sample`; and whether its per-token facts lined up with its text
    (when not, the behaviour log-probs are left out: the trainer weights those tokens 1, uncorrected)."""
    text = choice["text"]
    tokens = tuple(tok.encode(text, bos=False))
    stopped = choice.get("finish_reason") == "stop"
    lp = choice.get("logprobs") or {}
    logprobs = list(lp.get("token_logprobs") or []) if isinstance(lp, dict) else []
    versions = list(choice.get("token_versions") or [])
    n = len(tokens)
    aligned = _lines_up(tok, tokens, logprobs, lp.get("tokens") if isinstance(lp, dict) else None)
    behaviour: tuple[float | None, ...] = tuple(logprobs) if aligned else ()
    if len(versions) == n and all(v is not None for v in versions):
        steps = tuple(max(start_step, to_step(int(v))) for v in versions)
    else:  # no exact versions (vLLM, or a text that does not line up): the response's start bounds every token
        steps = (start_step,) * n
    return Sample(text, tokens, behaviour, steps, start_step, stopped), aligned or not logprobs


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
    """Keeps rollout requests in flight on every island; each answer is a group of samples for one prompt.

    In sync mode an island takes part in a batch only once it holds the batch's version: a flipsync island's
    sidecar holds the request until it does; the control island is asked only once its own meter says it loaded
    that step's checkpoint (-1 before its first load)."""

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
        depth = {"sync": 1000, "async": 4, "inflight": 1}[cfg.rollout]  # batches the buffer holds
        self.groups: queue.Queue[RolloutGroup] = queue.Queue(maxsize=depth * cfg.prompts_per_step)
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.stats = PoolStats()
        self._next_group = 0
        self._lock = threading.Lock()
        # sync mode: the batch being generated (round number, its trainer step and version, groups still to issue)
        self._round = threading.Condition(self._lock)
        self._round_id, self._round_step, self._round_version, self._to_issue = 0, 0, 0, 0
        self._threads = [
            threading.Thread(target=self._loop, args=(island, k), daemon=True, name=f"rollouts-{island.spec.name}-{k}")
            for island in islands
            for k in range(2)
        ]

    def _request(self, island: Island, problem: Problem, seed: int, min_version: int | None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": "flipsync-demo" if island.spec.engine == "vllm" else "flipsync-torch",
            "prompt": self.tok.encode(problem.prompt),  # token ids: the same for every engine
            "max_tokens": self.cfg.max_tokens,
            "n": self.cfg.group_size,
            "temperature": 1.0,  # the trainer's log-probs are at 1.0 too (grpo.policy_loss)
            "seed": seed,
            "logprobs": 1,  # the sampled token's log-prob: the behaviour policy of the importance weight
        }
        if not island.spec.control and min_version is not None:
            # the proxy holds or refuses the request until the island serves a recent enough version
            body["weight_version"] = {"min_version": max(0, min_version)}
        return body

    def open_round(self, step: int, version: int, n: int) -> None:
        """Sync mode: generate ``n`` groups for trainer ``step`` on board ``version`` (the weights after step - 1)."""
        with self._round:
            self._round_id += 1
            self._round_step, self._round_version, self._to_issue = step - 1, version, n
            self._round.notify_all()

    def _ticket(self, island: Island) -> tuple[int, int | None] | None:
        """Wait for leave to send a request: (round, min_version) or None when stopping. Outside sync mode at
        once; in sync mode while the batch still needs groups and the island holds its version."""
        if self.cfg.rollout != "sync":
            cap = self.cfg.max_staleness
            return 0, (self.head_version() - cap) if cap is not None else None
        with self._round:
            while not self.stop.is_set():
                # the control island's own meter: the monitor's view counts a control that loaded nothing yet as
                # step 0, and tokens generated before its first load carry no version (the group is dropped)
                ready = not island.spec.control or island.meters.held_step.value >= self._round_step
                if self._to_issue > 0 and ready:
                    self._to_issue -= 1
                    return self._round_id, self._round_version
                self._round.wait(0.05)
        return None

    def _give_back(self, round_id: int) -> None:
        if self.cfg.rollout == "sync":
            with self._round:
                if round_id == self._round_id:
                    self._to_issue += 1
                    self._round.notify_all()

    def _loop(self, island: Island, k: int) -> None:
        rng = random.Random(hash((island.spec.name, k)))
        routed = self.gateway is not None and not island.spec.control
        base = self.gateway if routed else island.url
        with httpx.Client(base_url=base or "", timeout=60) as client:
            while not self.stop.is_set():
                ticket = self._ticket(island)
                if ticket is None:
                    return
                round_id, min_version = ticket
                with self._lock:
                    problem, gid = self.task.sample(), self._next_group
                    self._next_group += 1
                held_before = island.meters.held_step.value
                t_send = time.monotonic()
                try:
                    r = client.post(
                        "/v1/completions", json=self._request(island, problem, rng.randrange(2**31), min_version)
                    )
                except httpx.HTTPError as e:
                    self.errors.append(f"{island.spec.name}: {e}")
                    self._give_back(round_id)
                    time.sleep(0.2)
                    continue
                t_recv = time.monotonic()
                if r.status_code in (409, 503):  # behind the trainer, or committing: retry shortly
                    self._give_back(round_id)
                    time.sleep(min(0.2, float(r.headers.get("Retry-After", "0.1"))))
                    continue
                if r.status_code != 200:
                    self.errors.append(f"{island.spec.name}: HTTP {r.status_code} {r.text[:200]}")
                    self._give_back(round_id)
                    time.sleep(0.2)
                    continue
                name = r.headers.get("x-flipsync-replica", island.spec.name) if routed else island.spec.name
                group = self._group(island, name, problem, gid, r.json(), held_before, round_id)
                with self._lock:
                    self.stats.busy[name].append((t_send, t_recv))
                if group is None:
                    self._give_back(round_id)
                    continue
                while not self.stop.is_set():
                    try:
                        self.groups.put(group, timeout=0.2)
                        break
                    except queue.Full:  # the buffer is full: this island waits (counted as idle)
                        continue

    def _group(
        self, island: Island, name: str, problem: Problem, gid: int, doc: dict[str, Any], held: int, round_id: int
    ) -> RolloutGroup | None:
        """The answer as a group with its per-token facts; None (counted as dropped) when it cannot be read."""
        choices = doc.get("choices") or []
        try:
            if island.spec.control:
                # the torch engine stamps every token with the trainer step of the checkpoint it came from; vLLM
                # stamps none: its answer is labelled with the step held when the request was sent
                stamps = [v for c in choices for v in c.get("token_versions") or []]
                if any(v is None for v in stamps):
                    raise ValueError("generated while a load was half done: not a policy's sample")
                start = min(stamps) if stamps else held
                to_step: Callable[[int], int] = int
            else:
                start = self.steps.step(int(doc.get("weight_version", {})["start"]))
                to_step = self.steps.step
            parsed = [parse_sample(self.tok, c, start, to_step) for c in choices]
        except (KeyError, TypeError, ValueError, FlipsyncError) as e:
            with self._lock:
                self.errors.append(f"{name}: unreadable answer ({e})")
                self.stats.dropped[name] += len(choices)
            return None
        samples = [s for s, _ in parsed]
        with self._lock:
            self.stats.tokens[name] += sum(len(s.tokens) for s in samples)
            self.stats.rollouts[name] += len(samples)
            self.stats.unaligned[name] += sum(1 for _, ok in parsed if not ok)
        step = min((min(s.steps, default=s.start_step) for s in samples), default=start)
        return RolloutGroup(problem, gid, samples, step, name, round_id)

    def take(self, n: int, step: int, timeout_s: float = 300.0) -> tuple[list[RolloutGroup], dict[str, int]]:
        """``n`` groups for trainer ``step`` (the policy after step - 1); returns them and, per island, how many
        rollouts were dropped: older than ``max_staleness`` trainer steps (when set), or, in sync mode, made
        for an earlier batch. In sync mode the caller opens the round first (`open_round`)."""
        out: list[RolloutGroup] = []
        dropped: dict[str, int] = defaultdict(int, {i.spec.name: 0 for i in self.islands})
        deadline = time.monotonic() + timeout_s
        cap = self.cfg.max_staleness
        while len(out) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no rollouts within {timeout_s} s; island errors: {self.errors[-3:]}")
            try:
                g = self.groups.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            stale = cap is not None and (step - 1) - g.step > cap
            if stale or (self.cfg.rollout == "sync" and g.round != self._round_id):
                dropped[g.island] += len(g.completions)
                with self._lock:
                    self.stats.dropped[g.island] += len(g.completions)
                continue
            out.append(g)
        return out, dropped
