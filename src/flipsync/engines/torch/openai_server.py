"""The torch engine's OpenAI-compatible server, the upstream a sidecar's proxy forwards to; each choice carries
``token_versions``. See docs/sidecar.md ("The torch engine's OpenAI server")."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import Executor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from flipsync.engines.torch.engine import Generation, SamplingParams, TorchEngine
from flipsync.engines.torch.models import build_model, load_config
from flipsync.engines.torch.queue import GenerationPool
from flipsync.engines.torch.tokenizer import StreamDecoder
from flipsync.errors import ConfigError, EngineUnavailableError
from flipsync.serving import ServerThread, error_response, sse_event

log = logging.getLogger(__name__)

MAX_N = 16
MAX_PROMPTS = 64


MAX_LOGPROBS = 20  # alternatives per token (vLLM's default max_logprobs)


class BadRequest(ConfigError):
    """A request field the server refuses (400), naming the field (``param``) as vLLM's errors do."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    total = prompt_tokens + completion_tokens
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": total}


@dataclass
class ChoiceText:
    """Incremental detokenisation of one choice, holding back text that may be the start of a stop string."""

    stops: Sequence[str]
    decoder: StreamDecoder = field(default_factory=StreamDecoder)
    text: str = ""
    emitted: int = 0
    stopped: bool = False

    def push(self, token: int) -> str:
        """Add a token; return the text that is now safe to emit (stop strings never leak)."""
        self.text += self.decoder.push(token)
        return self._release(final=False)

    def finish(self) -> str:
        self.text += self.decoder.flush()
        return self._release(final=True)

    def _release(self, *, final: bool) -> str:
        if self.stopped:
            return ""
        cut = min((i for s in self.stops if (i := self.text.find(s, max(0, self.emitted - len(s)))) >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self.text = self.text[:cut]
            end = cut
        elif final:
            end = len(self.text)
        else:  # hold back the longest tail that starts a stop string
            n = len(self.text)
            hold = max(
                (k for s in self.stops for k in range(1, min(len(s) - 1, n) + 1) if self.text.endswith(s[:k])),
                default=0,
            )
            end = n - hold
        out = self.text[self.emitted : end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return out


@dataclass
class Job:
    """One choice to generate."""

    index: int
    prompt: list[int]
    params: SamplingParams


def _int(body: dict[str, Any], key: str, default: int, lo: int, hi: int) -> int:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise BadRequest(f"{key} must be an integer in {lo}..{hi}", key)
    return v


def _float(body: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or not lo <= float(v) <= hi:
        raise BadRequest(f"{key} must be a number in {lo:g}..{hi:g}", key)
    return float(v)


def _stops(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > 8 or not all(isinstance(s, str) and s for s in stops):
        raise BadRequest("stop must be a non-empty string or a list of at most 8 of them", "stop")
    return stops


def _sampling(body: dict[str, Any], engine: TorchEngine, max_tokens_limit: int, top_logprobs: int) -> SamplingParams:
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise BadRequest("seed must be an integer", "seed")
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    ignore_eos = body.get("ignore_eos", False)  # as vLLM: generate max_tokens whatever comes
    if not isinstance(ignore_eos, bool):
        raise BadRequest("ignore_eos must be true or false", "ignore_eos")
    return SamplingParams(
        max_tokens=_int({"max_tokens": limit}, "max_tokens", 16, 1, max_tokens_limit),
        temperature=_float(body, "temperature", 1.0, 0.0, 10.0),
        top_p=_float(body, "top_p", 1.0, 1e-6, 1.0),
        seed=seed,
        stop_token_ids=frozenset() if ignore_eos else engine.tokenizer.stop_ids,
        top_logprobs=top_logprobs,
    )


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """How many alternatives a request wants per token (None: no logprobs at all). Chat: ``logprobs: true`` with
    ``top_logprobs: N``; completions: ``logprobs: N`` (``true`` is 1, as vLLM's validation reads it)."""
    lp = body.get("logprobs")
    if chat:
        if lp is not None and not isinstance(lp, bool):
            raise BadRequest("logprobs must be true or false (top_logprobs: N asks for alternatives)", "logprobs")
        top = _int(body, "top_logprobs", 0, 0, MAX_LOGPROBS)
        return top if lp else None
    if lp is None or lp is False:
        return None
    if lp is True:
        return 1
    return _int(body, "logprobs", 0, 0, MAX_LOGPROBS)


def _check_model(body: dict[str, Any], engine: TorchEngine) -> Response | None:
    """vLLM's rule: no (or an empty) ``model`` is the served one; another name is a 404 naming it; not a string
    is a 400."""
    model = body.get("model")
    if model is None:
        return None
    if not isinstance(model, str):
        return _error(400, f"model must be a string (this server serves {engine.model_name!r})", "model")
    if model and model != engine.model_name:
        return _error(
            404,
            f"The model `{model}` does not exist. Valid aliases: {engine.model_name}.",
            "model",
            kind="NotFoundError",
        )
    return None


def _error(status: int, message: str, param: str | None, kind: str = "BadRequestError") -> Response:
    """vLLM's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": param, "code": status}}, status_code=status
    )


def _token_ids(x: Any) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(i, int) and not isinstance(i, bool) for i in x)


def _prompts(body: dict[str, Any], engine: TorchEngine) -> list[list[int]]:
    p = body.get("prompt")
    if isinstance(p, str) or _token_ids(p):
        p = [p]
    elif not (isinstance(p, list) and 0 < len(p) <= MAX_PROMPTS):
        raise BadRequest(
            f"prompt must be a non-empty string, token ids, or a list of at most {MAX_PROMPTS} of those", "prompt"
        )
    if not all(isinstance(x, str) or _token_ids(x) for x in p):
        raise BadRequest("prompt must be a string, a list of strings, or token ids", "prompt")
    return [engine.tokenizer.encode(x) if isinstance(x, str) else list(x) for x in p]


def _clamp(logprob: float) -> float:
    return max(logprob, -9999.0)  # JSON has no -inf; OpenAI and vLLM send -9999.0


@dataclass
class Logprobs:
    """OpenAI's logprobs of one choice, built as its tokens come: chat ``{"content": [...]}`` or completions
    ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``. ``token_logprobs`` is the sampled token's
    logprob under the raw model distribution (``Generation.logprobs``), whatever the alternatives asked."""

    engine: TorchEngine
    chat: bool
    top: int  # alternatives per token
    offset: int = 0  # completions: where the next token's text starts in the choice's text

    def chat_entry(self, token: int, logprob: float, alternatives: Sequence[tuple[int, float]]) -> dict[str, Any]:
        tok = self.engine.tokenizer
        alts = [
            {"token": tok.token_text(t), "logprob": _clamp(lp), "bytes": tok.token_bytes(t)}
            for t, lp in alternatives[: self.top]
        ]
        return {
            "token": tok.token_text(token),
            "logprob": _clamp(logprob),
            "bytes": tok.token_bytes(token),
            "top_logprobs": alts,
        }

    def completion_part(
        self, tokens: Sequence[int], logprobs: Sequence[float], tops: Sequence[Sequence[tuple[int, float]]]
    ) -> dict[str, Any]:
        tok = self.engine.tokenizer
        texts = [tok.token_text(t) for t in tokens]
        offsets = []
        for text in texts:
            offsets.append(self.offset)
            self.offset += len(text)
        top_logprobs = []
        for text, lp, top in zip(texts, logprobs, tops, strict=True):
            # The top N and the sampled token (OpenAI: up to logprobs + 1 entries). Keys are token texts, so
            # tokens of one text (bytes outside ASCII are all U+FFFD) share a key: the sampled token's value wins.
            entry = {tok.token_text(t): _clamp(v) for t, v in top[: self.top]}
            entry[text] = _clamp(lp)
            top_logprobs.append(entry)
        return {
            "tokens": texts,
            "token_logprobs": [_clamp(lp) for lp in logprobs],
            "top_logprobs": top_logprobs,
            "text_offset": offsets,
        }

    def whole(self, gen: Generation) -> dict[str, Any]:
        tops = gen.top_logprobs or [[] for _ in gen.tokens]
        if self.chat:
            return {
                "content": [
                    self.chat_entry(t, lp, top) for t, lp, top in zip(gen.tokens, gen.logprobs, tops, strict=True)
                ]
            }
        return self.completion_part(gen.tokens, gen.logprobs, tops)

    def one(self, token: int, logprob: float, alternatives: Sequence[tuple[int, float]]) -> dict[str, Any]:
        if self.chat:
            return {"content": [self.chat_entry(token, logprob, alternatives)]}
        return self.completion_part([token], [logprob], [alternatives])


@dataclass
class Completion:
    """One checked (chat) completion request: its choices to generate, answered whole or as a stream."""

    engine: TorchEngine
    pool: Executor
    jobs: list[Job]
    stops: list[str]
    chat: bool
    logprobs: int | None  # alternatives per token; None: no logprobs
    include_usage: bool
    prompt_tokens: int
    id: str  # "cmpl-..." or "chatcmpl-..."

    def _logprobs(self) -> Logprobs | None:
        return None if self.logprobs is None else Logprobs(self.engine, self.chat, self.logprobs)

    async def respond(self) -> Response:
        """Every choice generated, then one JSON answer."""
        loop = asyncio.get_running_loop()
        engine = self.engine

        def one(job: Job) -> tuple[Generation, ChoiceText]:
            text = ChoiceText(self.stops)
            gen = engine.generate(job.prompt, job.params, lambda tok, _v: (text.push(tok), not text.stopped)[1])
            text.finish()
            return gen, text

        try:
            results = await asyncio.gather(*(loop.run_in_executor(self.pool, one, j) for j in self.jobs))
        except EngineUnavailableError as e:
            return error_response(503, str(e), "service_unavailable")
        except ConfigError as e:
            return error_response(400, str(e))
        choices = []
        for job, (gen, text) in zip(self.jobs, results, strict=True):
            finish = "stop" if text.stopped or gen.finish_reason == "stop" else gen.finish_reason
            choice: dict[str, Any] = {"index": job.index, "finish_reason": finish, "token_versions": gen.versions}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": text.text}
            else:
                choice["text"] = text.text
            lp = self._logprobs()
            choice["logprobs"] = None if lp is None else lp.whole(gen)
            choices.append(choice)
        return JSONResponse(
            {
                "id": self.id,
                "object": "chat.completion" if self.chat else "text_completion",
                "created": int(time.time()),
                "model": engine.model_name,
                "choices": choices,
                "usage": _usage(self.prompt_tokens, sum(len(gen.tokens) for gen, _ in results)),
            }
        )

    async def events(self) -> AsyncIterator[bytes]:
        """The choices as server-sent events, token by token, as they are generated."""
        loop = asyncio.get_running_loop()
        engine, chat = self.engine, self.chat
        queue: asyncio.Queue[tuple[int, str, Any]] = asyncio.Queue()
        cancelled = threading.Event()
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": self.id, "object": obj, "created": int(time.time()), "model": engine.model_name}
        logprobs = {j.index: self._logprobs() for j in self.jobs}

        def put(item: tuple[int, str, Any]) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is gone: the client left
                loop.call_soon_threadsafe(queue.put_nowait, item)

        def run(job: Job) -> None:
            text = ChoiceText(self.stops)
            gen = Generation()
            lp = logprobs[job.index]

            def on_token(tok: int, version: int | None) -> bool:
                piece = text.push(tok)
                extra = None
                if lp is not None:  # generate has recorded this token's logprobs in gen before calling back
                    extra = lp.one(tok, gen.logprobs[-1], gen.top_logprobs[-1] if gen.top_logprobs else [])
                put((job.index, "token", (piece, version, extra)))
                return not text.stopped and not cancelled.is_set()

            try:
                engine.generate(job.prompt, job.params, on_token, out=gen)
                tail = text.finish()
                finish = "stop" if text.stopped or gen.finish_reason == "stop" else gen.finish_reason
                put((job.index, "end", (tail, finish, gen)))
            except Exception as e:  # reported in the stream: the status line has gone out already
                log.warning("a streamed choice failed after its first byte: %s", e)
                put((job.index, "error", str(e)))

        def chunk(
            index: int,
            text: str | None,
            finish: str | None,
            versions: list[int | None],
            extra: Any = None,
            first: bool = False,
        ) -> bytes:
            choice: dict[str, Any] = {"index": index, "finish_reason": finish, "token_versions": versions}
            if chat:
                choice["delta"] = {} if text is None else {"content": text}
                if first:
                    choice["delta"]["role"] = "assistant"  # the first chunk of a chat choice names the role
            else:
                choice["text"] = text or ""
            choice["logprobs"] = extra
            return sse_event({**head, "choices": [choice]})

        futures = [loop.run_in_executor(self.pool, run, j) for j in self.jobs]
        pending = len(self.jobs)
        completion_tokens = 0
        try:
            if chat:
                for j in self.jobs:
                    yield chunk(j.index, "", None, [], first=True)
            while pending:
                index, kind, payload = await queue.get()
                if kind == "token":
                    piece, version, extra = payload
                    completion_tokens += 1
                    yield chunk(index, piece, None, [version], extra)
                elif kind == "end":
                    tail, finish, _gen = payload
                    pending -= 1
                    yield chunk(index, tail or ("" if not chat else None), finish, [])
                else:
                    pending -= 1
                    yield sse_event({"error": {"message": payload, "type": "engine_error", "code": 500}})
            if self.include_usage:
                yield sse_event({**head, "choices": [], "usage": _usage(self.prompt_tokens, completion_tokens)})
            yield b"data: [DONE]\n\n"
        finally:
            cancelled.set()  # a client that went away stops its sequences at the next token
            for f in futures:
                f.cancel()


def create_engine_app(engine: TorchEngine, *, max_concurrency: int = 8, max_tokens_limit: int = 4096) -> FastAPI:
    """The OpenAI-compatible app of a torch engine (serve it with uvicorn on a loopback port); it answers as
    ``engine.model_name``."""
    pool = GenerationPool(max_concurrency, thread_name_prefix="flipsync-gen")
    engine.queue = pool  # what it holds is the load the engine reports (TorchEngine.load)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="flipsync torch engine", lifespan=lifespan)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.health() else 503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": engine.model_name,
            "object": "model",
            "owned_by": "flipsync",
            "created": 0,
            "root": engine.model_name,
            "max_model_len": engine.max_positions,
        }
        return {"object": "list", "data": [card]}

    async def handle(request: Request, chat: bool) -> Response:
        # Everything a request can be refused for is checked here, before a stream's status line goes out.
        try:
            try:
                body = await request.json()
            except (ValueError, UnicodeDecodeError):
                raise BadRequest("the body is not valid JSON") from None
            if not isinstance(body, dict):
                raise BadRequest("the body must be a JSON object")
            if (refused := _check_model(body, engine)) is not None:
                return refused
            n = _int(body, "n", 1, 1, MAX_N)
            logprobs = _logprobs(body, chat)
            params = _sampling(body, engine, max_tokens_limit, logprobs or 0)
            stops = _stops(body)
            if chat:
                messages = body.get("messages")
                if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
                    raise BadRequest("messages must be a non-empty list of {role, content} objects", "messages")
                prompts = [engine.tokenizer.chat_prompt(messages)]
            else:
                prompts = _prompts(body, engine)
            for prompt in prompts:
                engine.check_prompt(prompt)
            stream = body.get("stream", False)
            if not isinstance(stream, bool | None):
                raise BadRequest("stream must be true or false", "stream")
            options = body.get("stream_options") or {}
            if not isinstance(options, dict):
                raise BadRequest("stream_options must be an object", "stream_options")
            include_usage = bool(options.get("include_usage", False))
        except BadRequest as e:
            return _error(400, str(e), e.param)
        except ConfigError as e:
            return _error(400, str(e), None)
        if not engine.health():
            return error_response(503, "the engine is down", "service_unavailable")
        # n choices per prompt; distinct choices of one seeded request must differ, yet stay reproducible
        jobs = [
            Job(i, prompt, replace(params, seed=None if params.seed is None else params.seed + i))
            for i, prompt in enumerate(p for p in prompts for _ in range(n))
        ]
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        prompt_tokens = sum(len(p) for p in prompts)
        completion = Completion(engine, pool, jobs, stops, chat, logprobs, include_usage, prompt_tokens, rid)
        if stream:
            return StreamingResponse(completion.events(), media_type="text/event-stream")
        return await completion.respond()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle(request, chat=True)

    return app


__all__ = ["ChoiceText", "Logprobs", "create_engine_app"]


@dataclass
class TorchEngineHandle:
    engine: TorchEngine
    server: ServerThread

    @property
    def url(self) -> str:
        return self.server.url

    def stop(self) -> None:
        self.server.stop()
        self.engine.close()


def start_torch_engine(
    model_spec: str,
    served_format: str,
    *,
    device: str = "cpu",
    seed: int = 0,
    host: str = "127.0.0.1",
    port: int = 0,
    max_concurrency: int = 8,
    model_name: str = "flipsync-torch",
) -> TorchEngineHandle:
    """Build the torch engine (architecture from a preset or config.json; weights come from the board)."""
    # transformers types its to() as functools.wraps(nn.Module.to), whose signature keeps `self`.
    model = build_model(load_config(model_spec), seed=seed).to(device)  # type: ignore[arg-type]
    engine = TorchEngine(model, served_format=served_format, model_name=model_name)
    server = ServerThread(create_engine_app(engine, max_concurrency=max_concurrency), host, port).start()
    log.info("torch engine (%s, %s, %s) serves on %s", model_spec, served_format, device, server.url)
    return TorchEngineHandle(engine, server)
