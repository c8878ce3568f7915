"""Helpers for the trainer tests: tiny Llama models, real Adam steps, a replica that follows a run."""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch

from flipsync.board import BoardReader, Catalog, Follower, KeyframeStep, PatchStep, Step
from flipsync.board.reader import join_step
from flipsync.codec import apply_patch
from flipsync.codec.bits import int_view
from flipsync.codec.fingerprint import FingerprintTable
from flipsync.errors import BoardError, TransientStoreError
from flipsync.formats import served_view
from flipsync.stores import Store


def tiny_llama(
    seed: int = 0, *, tie: bool = True, hidden: int = 32, layers: int = 1, vocab: int = 64, **config: Any
) -> Any:
    """A tiny Llama from a config (``config``: more `LlamaConfig` fields, or other values for these)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    fields: dict[str, Any] = {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 32,
        "tie_word_embeddings": tie,
    }
    cfg = LlamaConfig(**{**fields, **config})
    return LlamaForCausalLM(cfg)


def adam(model: torch.nn.Module, lr: float = 1e-3) -> torch.optim.Adam:
    return torch.optim.Adam(model.parameters(), lr=lr)


def train(model: Any, opt: torch.optim.Optimizer, steps: int, *, seed: int = 0, vocab: int = 64) -> None:
    """Real Adam steps on random tokens (the publisher's hook runs inside opt.step())."""
    for i in range(steps):
        g = torch.Generator().manual_seed(seed * 1000 + i)
        x = torch.randint(0, vocab, (2, 8), generator=g)
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()


def expected_view(model: torch.nn.Module, fmt: str = "bf16") -> dict[str, torch.Tensor]:
    """The served view computed the plain way, without the tied alias (as in an HF checkpoint)."""
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight" or not _tied(model)}
    return {k: v.contiguous() for k, v in served_view(state, fmt).items()}


def _tied(model: torch.nn.Module) -> bool:
    sd = model.state_dict()
    return "lm_head.weight" in sd and sd["lm_head.weight"].data_ptr() == sd["model.embed_tokens.weight"].data_ptr()


def assert_bitwise(want: Mapping[str, torch.Tensor], got: Mapping[str, torch.Tensor]) -> None:
    assert set(want) == set(got), sorted(set(want) ^ set(got))
    for k in want:
        a, b = want[k].contiguous(), got[k].contiguous()
        assert a.dtype == b.dtype and a.shape == b.shape, k
        assert torch.equal(int_view(a), int_view(b)), f"tensor {k} differs"


class Replica:
    """A replica following one run on a board, applying every step with the codec (all parts)."""

    def __init__(self, store: Store, run: str) -> None:
        self.reader = BoardReader(store, run)
        self.follower = Follower(self.reader)
        self.tensors: dict[str, torch.Tensor] = {}
        self.table = FingerprintTable()
        self.steps: list[Step] = []

    def apply(self, step: Step) -> None:
        if isinstance(step, KeyframeStep):
            self.tensors = {k: v.clone() for k, v in step.tensors.items()}
            self.table = FingerprintTable.of(self.tensors)
        else:
            assert isinstance(step, PatchStep)
            patch = join_step(step, self.table, self.tensors)
            apply_patch(self.tensors, patch, self.table, verify="digest")
        assert self.table.view_fp() == step.manifest.target_view_fp
        self.steps.append(step)

    def sync(self, goal: int | None = None) -> int | None:
        return self.follower.sync(self.apply, goal=goal)

    def follow_each(self) -> int | None:
        """Go version by version (so every patch is applied, not a later keyframe)."""
        head = self.reader.head()
        assert head is not None
        for v in range(0 if self.follower.version is None else self.follower.version + 1, head + 1):
            assert self.sync(goal=v) == v
        return head

    @property
    def patches(self) -> list[PatchStep]:
        return [s for s in self.steps if isinstance(s, PatchStep)]


def follow_and_check(store: Store, run: str, model: torch.nn.Module, fmt: str = "bf16") -> Replica:
    """A replica that follows ``run`` version by version and ends serving ``model``'s view bit for bit."""
    replica = Replica(store, run)
    replica.follow_each()
    assert_bitwise(expected_view(model, fmt), replica.tensors)
    return replica


class ThreadRanks:
    """Shared state of N in-process "ranks" (threads) that implement the publisher's collectives."""

    def __init__(self, world: int, timeout_s: float = 10.0) -> None:
        self.world = world
        self.timeout_s = timeout_s
        self.barrier = threading.Barrier(world)
        self.box: list[Any] = [None] * world

    def group(self, rank: int) -> ThreadGroup:
        return ThreadGroup(self, rank)


class ThreadGroup:
    """`flipsync.trainer.Group` over threads: every call is a barrier-synchronised exchange."""

    def __init__(self, ranks: ThreadRanks, rank: int) -> None:
        self._ranks = ranks
        self.rank = rank
        self.size = ranks.world

    def _wait(self, what: str) -> None:
        try:
            self._ranks.barrier.wait(self._ranks.timeout_s)
        except threading.BrokenBarrierError:
            raise BoardError(f"rank {self.rank}: exchanging {what} failed (a rank left)") from None

    def all_gather(self, obj: Any, what: str) -> list[Any]:
        self._ranks.box[self.rank] = copy.deepcopy(obj)  # as if pickled over the wire
        self._wait(what)
        out = list(self._ranks.box)
        self._wait(what)
        return out

    def broadcast(self, obj: Any, what: str) -> Any:
        return self.all_gather(obj, what)[0]

    def gather(self, obj: Any, what: str) -> list[Any] | None:
        out = self.all_gather(obj, what)
        return out if self.rank == 0 else None

    def close(self) -> None:
        pass

    def abort(self) -> None:
        self._ranks.barrier.abort()


def run_threads(fns: list[Any], timeout_s: float = 60.0) -> list[Any]:
    """Run one callable per rank in threads; return their results (exceptions are returned, not raised)."""
    results: list[Any] = [None] * len(fns)

    def body(i: int) -> None:
        try:
            results[i] = fns[i]()
        except BaseException as e:
            results[i] = e

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
        assert not t.is_alive(), "a rank thread hung"
    return results


class RefusingStore:
    """Fails (TransientStoreError: a throttle that heals) the writes ``refuse(path, create_only, data)`` picks;
    counts them."""

    def __init__(self, inner: Any, refuse: Any) -> None:
        self._inner = inner
        self.refuse = refuse
        self.refused = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def put(self, path: str, data: bytes, *, create_only: bool = False) -> None:
        if self.refuse(path, create_only, data):
            self.refused += 1
            raise TransientStoreError(f"{self._inner.url}/{path}: 503 Slow Down (injected)")
        self._inner.put(path, data, create_only=create_only)


class SlowStore:
    """Every manifest create takes ``delay_s``, and waits while ``gate`` is clear: uploads fall behind."""

    def __init__(self, inner: Any, delay_s: float, gate: threading.Event | None = None) -> None:
        self._inner = inner
        self.delay_s = delay_s
        self.gate = gate

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def put(self, path: str, data: bytes, *, create_only: bool = False) -> None:
        if create_only:
            time.sleep(self.delay_s)
            if self.gate is not None:
                self.gate.wait()
        self._inner.put(path, data, create_only=create_only)


def versions_are_whole(store: Any, run: str) -> list[int]:
    """The published versions are contiguous, HEAD is the last, and every part they list is there."""
    cat = Catalog(store, run)
    versions = [v for v in cat.list_versions() if cat.has_version(v)]
    assert versions == list(range(len(versions)))
    assert BoardReader(store, run).head() == versions[-1]
    for v in versions:
        m = cat.version(v)
        assert cat.fetch_parts(m, cat.artifact_dir(m))
    return versions
