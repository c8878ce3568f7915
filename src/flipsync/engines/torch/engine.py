"""The ``torch`` engine: an in-process Hugging Face causal LM whose weights a sidecar keeps at a board version.
See docs/sidecar.md ("The Engine port and the torch engine")."""

from __future__ import annotations

import inspect
import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from transformers import DynamicCache, PreTrainedModel

from flipsync.codec import ClassIndex, Patch, StagedWrite, UndoRecord, scatter
from flipsync.codec import commit as codec_commit
from flipsync.codec import stage as codec_stage
from flipsync.codec.bits import int_view
from flipsync.codec.fingerprint import FingerprintTable
from flipsync.domain.balance import EngineLoad
from flipsync.engines.base import Engine, Staged, Undo
from flipsync.engines.tokenization import tokenizer_digest
from flipsync.engines.torch.queue import GenerationPool
from flipsync.engines.torch.tokenizer import ByteTokenizer
from flipsync.errors import BaseMismatchError, ConfigError, EngineError, EngineUnavailableError, VerificationError
from flipsync.formats import get_format, served_view

log = logging.getLogger(__name__)

_MAX_LABELS = 64

# (token id, version of the weights that produced it) -> keep going?
TokenCallback = Callable[[int, int | None], bool]


class StepLock:
    """A readers-writer lock between decode steps (many at once) and weight writes (one, exclusive). Writers go
    first: once a commit asks, no new step starts, so the pause is the longest step in flight plus the write, and
    a step sees either the old or the new weights, never a mix."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0

    @contextmanager
    def step(self) -> Iterator[None]:
        """Held around one forward pass."""
        with self._cond:
            while self._writer or self._writers_waiting:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if self._readers == 0:
                    self._cond.notify_all()

    @contextmanager
    def write(self) -> Iterator[float]:
        """Held around a weight write; yields how long it waited for the steps in flight to finish."""
        t0 = time.perf_counter()
        with self._cond:
            self._writers_waiting += 1
            try:
                while self._writer or self._readers:
                    self._cond.wait()
            finally:
                self._writers_waiting -= 1
            self._writer = True
        try:
            yield time.perf_counter() - t0
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: frozenset[int] = frozenset()
    top_logprobs: int = 0  # the most likely tokens (id, logprob) to record at each step; 0: none (no top-k cost)


@dataclass
class Generation:
    """One finished sequence: its tokens, the board version behind each, and why it stopped.

    ``logprobs[i]`` is the log-probability of ``tokens[i]`` under the model's own distribution (the raw logits'
    log-softmax: temperature and top_p not applied, as vLLM's default ``raw_logprobs``); ``top_logprobs[i]``,
    when ``SamplingParams.top_logprobs`` asks, the most likely (id, logprob) pairs of that step, likeliest first.
    """

    tokens: list[int] = field(default_factory=list)
    versions: list[int | None] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str = "length"  # "stop" | "length" | "abort"


@dataclass
class TorchStaged(Staged):
    """Ready-to-scatter writes of one patch, and the view the engine will hold after them."""

    writes: list[StagedWrite]
    touched: frozenset[str]
    target_view: str
    n_changed: int
    params: dict[str, ParamWrite] = field(default_factory=dict)  # quantized: parameter changes, prepared


@dataclass
class TorchUndo(Undo):
    record: UndoRecord
    touched: frozenset[str]
    params: dict[str, ParamWrite] = field(default_factory=dict)


@dataclass
class ParamWrite:
    """The elements of one (dequantized) parameter that a patch changes: flat positions, old and new bits."""

    positions: torch.Tensor
    old_bits: torch.Tensor
    new_bits: torch.Tensor


@dataclass
class WriteTiming:
    """The last weight write: how long it waited for decode steps in flight, and how long it held them off."""

    wait_s: float = 0.0
    write_s: float = 0.0
    kind: str = ""


class TorchEngine(Engine[TorchStaged, TorchUndo]):
    """An in-process ``transformers`` causal LM on CPU or CUDA, kept bitwise at a served view."""

    name: ClassVar[str] = "torch"
    queue: GenerationPool | None = None  # set by its OpenAI server (openai_server.create_engine_app)

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        served_format: str = "bf16",
        tokenizer: ByteTokenizer | None = None,
        model_name: str = "flipsync-torch",
        stage_refresh: bool = True,
    ) -> None:
        self.format = get_format(served_format)
        self.stage_refresh = stage_refresh
        self.served_format = self.format.name
        self.model_name = model_name
        self.tokenizer = tokenizer or ByteTokenizer()
        if not self.format.quantized:
            # The parameters become the served tensors, so they take the served dtype.
            # transformers types its to() as functools.wraps(nn.Module.to), whose signature keeps `self`.
            model = model.to(self.format.payload_dtype)  # type: ignore[arg-type]
        self.model = model.eval().requires_grad_(False)
        self.device = next(model.parameters()).device
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 2048))
        self._cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self._lock = StepLock()
        self._params: dict[str, torch.Tensor] = {}
        self._served: dict[str, torch.Tensor] = {}
        self._refresh: dict[str, str] = {}  # served name -> parameter to recompute when it changes
        self._payloads: set[str] = set()
        self._build_layout()
        self._table = FingerprintTable.of(self._served)
        self._index = ClassIndex()  # kept current with the tensors: sparse ctx sections read only their blocks
        self._labels: OrderedDict[str, int] = OrderedDict()
        self._labels_lock = threading.Lock()
        self._version: int | None = None
        self._alive = True
        self.last_write = WriteTiming()

    # -- layout -----------------------------------------------------------------------------------------

    def _build_layout(self) -> None:
        params = {n: p.detach() for n, p in self.model.state_dict(keep_vars=True).items()}
        self._params = params
        if not self.format.quantized:
            self._served = dict(params)  # the same storage: a scatter is a write into the model
            return
        layout = served_view({n: p.float() for n, p in params.items()}, self.format)
        suffixes = self.format.scale_suffixes
        self._payloads = {
            k
            for k, t in layout.items()
            if k in params and t.dtype == self.format.payload_dtype and all(k + s in layout for s in suffixes)
        }
        for master in self._payloads:
            for component in self.format.component_names(master):
                self._refresh[component] = master
        for key, t in layout.items():
            p = params.get(key)
            if key in self._payloads or p is None:
                if key not in self._refresh:
                    raise ConfigError(f"served tensor {key!r} maps to no model parameter")
                self._served[key] = t.to(self.device).contiguous()
            elif p.dtype == t.dtype and p.shape == t.shape:
                self._served[key] = p  # kept in high precision and the model's dtype: zero copy
            else:
                self._served[key] = t.to(self.device).contiguous()
                self._refresh[key] = key

    def _masters_of(self, served_names: Iterable[str]) -> set[str]:
        return {self._refresh[n] for n in served_names if n in self._refresh}

    def _param_value(self, master: str, served: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """A parameter's value computed from (possibly patched copies of) its served components."""
        p = self._params[master]
        if master in self._payloads:
            comps = {c: served[c] for c in self.format.component_names(master)}
            value = self.format.dequantize(master, comps)
        else:
            value = served[master]
        return value.reshape(p.shape).to(p.dtype)

    def _write_params(self, touched: Iterable[str], prepared: Mapping[str, ParamWrite], *, undo: bool) -> None:
        """Bring the parameters behind ``touched`` to the served tensors: the prepared element changes
        (or, undoing, their old values) where staging prepared them, a whole refresh elsewhere."""
        for m in self._masters_of(touched):
            w = prepared.get(m)
            if w is None:
                self._params[m].copy_(self._param_value(m, self._served))
            elif w.positions.numel():
                scatter(self._params[m], w.positions, w.old_bits if undo else w.new_bits)

    def _prepare_params(self, writes: list[StagedWrite]) -> dict[str, ParamWrite]:
        """Which parameter elements ``writes`` change, and to what: from patched copies of the touched
        components, compared bitwise with the parameters. O(touched tensors), done while serving."""
        by_name = {w.name: w for w in writes}
        out: dict[str, ParamWrite] = {}
        for m in sorted(self._masters_of(by_name)):
            names = self.format.component_names(m) if m in self._payloads else (m,)
            patched: dict[str, torch.Tensor] = {}
            for c in names:
                w = by_name.get(c)
                if w is None:
                    patched[c] = self._served[c]
                else:
                    patched[c] = self._served[c].clone()
                    scatter(patched[c], w.positions, w.new_bits)
            new_bits = int_view(self._param_value(m, patched).contiguous())
            cur_bits = int_view(self._params[m])
            positions = torch.nonzero(new_bits != cur_bits).flatten()
            out[m] = ParamWrite(positions, cur_bits[positions].clone(), new_bits[positions].clone())
        return out

    @property
    def served(self) -> Mapping[str, torch.Tensor]:
        """The served view held now (read-only by convention; tests compare it bitwise)."""
        return self._served

    @property
    def zero_copy(self) -> bool:
        """True when the parameters are the served tensors (bf16 / fp16)."""
        return not self.format.quantized

    # -- Engine port ------------------------------------------------------------------------------------

    @property
    def table(self) -> FingerprintTable:
        return self._table

    @property
    def host_view(self) -> Mapping[str, torch.Tensor] | None:
        # On CPU the served tensors are host memory the sidecar may read while staging (never written there);
        # on CUDA they are not, and parts coded against their base cannot be joined here.
        return self._served if self.device.type == "cpu" else None

    def _check_alive(self) -> None:
        if not self._alive:
            raise EngineUnavailableError("the torch engine was closed; restart the sidecar")

    def load_view(self, view: Mapping[str, torch.Tensor]) -> None:
        self._check_alive()
        self._check_view_layout(view)  # before any write: a foreign view leaves the engine as it was
        with self._lock.write() as waited:
            t0 = time.perf_counter()
            try:
                for name, src in view.items():
                    int_view(self._served[name]).copy_(int_view(src.detach().to(self.device).contiguous()))
                self._write_params(list(self._refresh), {}, undo=False)  # every parameter, recomputed whole
                self._table = FingerprintTable.of(self._served)
                self._index = ClassIndex()
            except Exception as e:
                # Half-loaded: describe what is held now, so an audit sees it and nothing claims a version.
                self._table = FingerprintTable.of(self._served)
                self._version = None
                raise EngineError(f"loading a full view into the torch engine failed part-way: {e}") from e
            self._relabel()
            self.last_write = WriteTiming(waited, time.perf_counter() - t0, "load_view")

    def _check_view_layout(self, view: Mapping[str, torch.Tensor]) -> None:
        missing = sorted(set(self._served) - set(view))
        extra = sorted(set(view) - set(self._served))
        if missing or extra:
            raise EngineError(
                f"the view does not fit this model (missing {missing[:3]}, unknown {extra[:3]}): check that the "
                f"sidecar's model config and served format ({self.served_format}) match the trainer's"
            )
        for name, t in view.items():
            mine = self._served[name]
            if t.dtype != mine.dtype or tuple(t.shape) != tuple(mine.shape):
                raise EngineError(
                    f"tensor {name!r} is {tuple(t.shape)} {t.dtype} in the view but {tuple(mine.shape)} "
                    f"{mine.dtype} in the engine: check the model config and served format ({self.served_format})"
                )

    def stage(self, patch: Patch) -> TorchStaged:
        self._check_alive()
        fmt = patch.header.served_format
        if fmt is not None and fmt != self.served_format:
            raise BaseMismatchError(
                f"the patch is for served format {fmt!r}, but this engine serves {self.served_format!r}: start "
                f"the sidecar with --format {fmt} to match the board (and an engine that serves {fmt}), or follow "
                f"a run published in {self.served_format}"
            )
        # Decodes and verifies against the weights held now; reads only, so decoding runs while serving.
        writes = codec_stage(self._served, patch, self._table, index=self._index)
        return TorchStaged(
            writes=writes,
            touched=frozenset(w.name for w in writes),
            target_view=patch.header.target.view,
            n_changed=sum(int(w.positions.numel()) for w in writes),
            params=self._prepare_params(writes) if self._refresh and self.stage_refresh else {},
        )

    def commit(self, staged: TorchStaged) -> TorchUndo:
        self._check_alive()
        if not isinstance(staged, TorchStaged):
            raise EngineError(f"commit expects what TorchEngine.stage returned, not {type(staged).__name__}")
        with self._lock.write() as waited:
            t0 = time.perf_counter()
            record = codec_commit(self._served, staged.writes, self._table, index=self._index)  # all or nothing
            try:
                self._write_params(staged.touched, staged.params, undo=False)
                held = self._table.view_fp()
                if held != staged.target_view:
                    raise VerificationError(
                        f"after the commit the engine holds view {held}, not the patch's target "
                        f"{staged.target_view}; rolled back"
                    )
            except BaseException:
                # Checked before the lock is released, so no decode step ever runs on unverified weights.
                record.rollback(self._served, self._table)
                self._write_params(staged.touched, staged.params, undo=True)
                raise
            self._relabel(held)
            self.last_write = WriteTiming(waited, time.perf_counter() - t0, "commit")
        return TorchUndo(record, staged.touched, staged.params)

    def rollback(self, undo: TorchUndo) -> None:
        self._check_alive()
        if not isinstance(undo, TorchUndo):
            raise EngineError(f"rollback expects what TorchEngine.commit returned, not {type(undo).__name__}")
        with self._lock.write() as waited:
            t0 = time.perf_counter()
            undo.record.rollback(self._served, self._table)
            self._write_params(undo.touched, undo.params, undo=True)
            self._relabel()
            self.last_write = WriteTiming(waited, time.perf_counter() - t0, "rollback")

    def recompute_table(self) -> FingerprintTable:
        with self._lock.step():
            return FingerprintTable.of(self._served)

    def health(self) -> bool:
        return self._alive

    @property
    def tokenizer_digest(self) -> str | None:
        """How ``tokenizer`` tokenizes (`engines.tokenization`); the model folder flipsync writes digests alike."""
        return tokenizer_digest(self.tokenizer)

    def load(self) -> EngineLoad | None:
        """Sequences queued and being generated by its OpenAI server's pool (None before a server runs it)."""
        q = self.queue
        return None if q is None else EngineLoad(waiting=max(0, q.waiting), running=max(0, q.running))

    def close(self) -> None:
        self._alive = False

    # -- version labels ---------------------------------------------------------------------------------

    def label_version(self, view_fp: str, version: int) -> None:
        """Name the board version of a view, so tokens generated on it are stamped with that version."""
        with self._labels_lock:
            self._labels[view_fp] = version
            self._labels.move_to_end(view_fp)
            while len(self._labels) > _MAX_LABELS:
                self._labels.popitem(last=False)
        self._relabel()

    def _relabel(self, view_fp: str | None = None) -> None:
        fp = view_fp or self._table.view_fp()
        with self._labels_lock:
            self._version = self._labels.get(fp)

    @property
    def version(self) -> int | None:
        """The board version of the weights held now (None: not a labelled view)."""
        return self._version

    # -- generation -------------------------------------------------------------------------------------

    def check_prompt(self, prompt: list[int]) -> None:
        """Refuse (ConfigError) a prompt ``generate`` cannot take: empty, over the context, ids out of the vocab.
        The server calls it before answering, so a stream never starts on a prompt that fails."""
        if not prompt:
            raise ConfigError("the prompt is empty")
        if len(prompt) >= self.max_positions:
            raise ConfigError(
                f"the prompt has {len(prompt)} tokens; this model takes at most {self.max_positions - 1} "
                f"(its context is {self.max_positions} tokens, prompt and completion together)"
            )
        if any(not 0 <= t < self.model.config.vocab_size for t in prompt):
            raise ConfigError(f"prompt token ids must be in 0..{self.model.config.vocab_size - 1}")

    def generate(
        self,
        prompt: list[int],
        params: SamplingParams,
        on_token: TokenCallback | None = None,
        *,
        out: Generation | None = None,
    ) -> Generation:
        """Generate one sequence; ``on_token`` sees each token as it comes and may stop the sequence. ``out``
        (default: a new one) is filled as it goes, so a callback reads a token's logprobs there when it is called."""
        self._check_alive()
        self.check_prompt(prompt)
        budget = min(params.max_tokens, self.max_positions - len(prompt))
        gen = torch.Generator(device=self.device)
        gen.manual_seed(params.seed if params.seed is not None else secrets.randbits(63))
        cache = DynamicCache(config=self.model.config)
        ids = torch.tensor([prompt], device=self.device)
        out = Generation() if out is None else out
        with torch.no_grad():
            for _ in range(budget):
                self._check_alive()
                with self._lock.step():
                    logits = self.model(input_ids=ids, use_cache=True, logits_to_keep=1, **{self._cache_kw: cache})
                    version = self._version
                tok, logprob, top = _sample(logits.logits[0, -1].float(), params, gen)
                if tok in params.stop_token_ids:
                    out.finish_reason = "stop"
                    break
                out.tokens.append(tok)
                out.versions.append(version)
                out.logprobs.append(logprob)
                if params.top_logprobs:
                    out.top_logprobs.append(top)
                if on_token is not None and not on_token(tok, version):
                    out.finish_reason = "abort"
                    break
                ids = torch.tensor([[tok]], device=self.device)
        return out


def _sample(
    logits: torch.Tensor, params: SamplingParams, gen: torch.Generator
) -> tuple[int, float, list[tuple[int, float]]]:
    """The next token, its logprob under the raw model distribution, and the top ``params.top_logprobs`` of
    that distribution (empty when not asked: no top-k on the hot path)."""
    logprobs = torch.log_softmax(logits, dim=-1)
    top: list[tuple[int, float]] = []
    if params.top_logprobs:
        values, ids = torch.topk(logprobs, min(params.top_logprobs, logprobs.numel()))
        top = list(zip(ids.tolist(), values.tolist(), strict=True))
    if params.temperature <= 0:
        tok = int(torch.argmax(logits))
    else:
        probs = torch.softmax(logits / params.temperature, dim=-1)
        if params.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < params.top_p
            keep[0] = True
            probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
        tok = int(torch.multinomial(probs, 1, generator=gen))
    return tok, float(logprobs[tok]), top
