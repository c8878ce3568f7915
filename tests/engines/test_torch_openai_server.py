"""The torch engine's OpenAI server as real clients see it: every refusal a 4xx before any byte of a stream,
one model name (404 for another, 400 for a non-string), and logprobs in OpenAI's format, read through the
official ``openai`` SDK (chat ``logprobs.content``, completions ``top_logprobs``), streamed and not, ``n=2``."""

from __future__ import annotations

import math
from collections.abc import Iterator

import httpx
import openai
import pytest

from flipsync.engines.torch.engine import TorchEngine
from flipsync.engines.torch.models import build_model
from flipsync.engines.torch.openai_server import create_engine_app
from flipsync.serving import ServerThread
from tests.sidecar.sidecar_helpers import TINY

NAME = "tiny-policy"


@pytest.fixture(scope="module")
def engine() -> TorchEngine:
    return TorchEngine(build_model(TINY, seed=123), model_name=NAME)


@pytest.fixture(scope="module")
def url(engine: TorchEngine) -> Iterator[str]:
    with ServerThread(create_engine_app(engine, max_concurrency=2)) as server:
        yield server.url


@pytest.fixture(scope="module")
def client(url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60) as c:
        yield c


def _post(url: str, path: str, body: dict[str, object]) -> httpx.Response:
    with httpx.Client(timeout=60) as c:
        return c.post(url + path, json=body)


# -- refusals before the stream -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": [1] * 300}, None),  # over the 256-token context
        ("/v1/completions", {"prompt": "x" * 400}, None),
        ("/v1/completions", {"prompt": [99999]}, None),  # an id outside the vocabulary
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "y" * 400}]}, None),
        ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, None),
        ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": 3}, "logprobs"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 99}, "top_logprobs"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ],
)
def test_a_streamed_request_that_cannot_run_is_a_400_before_any_event(
    url: str, path: str, body: dict[str, object], param: str | None
) -> None:
    with (
        httpx.Client(timeout=60) as c,
        c.stream("POST", url + path, json={**body, "stream": True, "max_tokens": body.get("max_tokens", 4)}) as r,
    ):
        assert r.status_code == 400, r.read()
        assert r.headers["content-type"].startswith("application/json")
        err = r.read()
    assert b"data:" not in err
    doc = httpx.Response(400, content=err).json()["error"]
    assert doc["code"] == 400 and doc["param"] == param and doc["message"]
    unstreamed = _post(url, path, {**body, "max_tokens": body.get("max_tokens", 4)})
    assert unstreamed.status_code == 400 and unstreamed.json()["error"]["message"] == doc["message"]


def test_the_context_error_says_what_fits(url: str) -> None:
    r = _post(url, "/v1/completions", {"prompt": [1] * 300, "stream": True})
    assert r.status_code == 400 and "at most 255" in r.json()["error"]["message"]


# -- one model name -----------------------------------------------------------------------------------------


def test_the_engine_answers_with_its_model_name(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [NAME]
    assert client.completions.create(model=NAME, prompt="ab", max_tokens=2).model == NAME
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert chat.model == NAME


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_an_unknown_model_is_a_404_naming_the_served_one(url: str, path: str, stream: bool) -> None:
    body = {"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    r = _post(url, path, {**body, "model": "gpt-4o", "stream": stream, "max_tokens": 2})
    assert r.status_code == 404
    assert r.json() == {
        "error": {
            "message": f"The model `gpt-4o` does not exist. Valid aliases: {NAME}.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }
    wrong_type = _post(url, path, {**body, "model": 123, "stream": stream, "max_tokens": 2})
    assert wrong_type.status_code == 400 and wrong_type.json()["error"]["param"] == "model"
    # As vLLM: no model, or an empty one, is the served model.
    for ok in ({}, {"model": ""}, {"model": NAME}):
        answer = _post(url, path, {**body, **ok, "max_tokens": 2})
        assert answer.status_code == 200 and answer.json()["model"] == NAME


def test_the_sdk_sees_a_404_as_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="nope", prompt="x", max_tokens=2)


# -- logprobs -----------------------------------------------------------------------------------------------


def _check_alternatives(top: list[tuple[str, float]], sampled: tuple[str, float], k: int) -> None:
    assert len(top) == k
    lps = [lp for _, lp in top]
    assert lps == sorted(lps, reverse=True) and all(lp <= 0 for lp in lps)
    assert sum(math.exp(lp) for lp in lps) <= 1 + 1e-5
    assert sampled[1] <= lps[0] + 1e-6  # nothing is likelier than the top alternative


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_are_openai_shaped(client: openai.OpenAI, stream: bool) -> None:
    kw = dict(
        model=NAME,
        messages=[{"role": "user", "content": "héllo"}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        n=2,
        extra_body={"ignore_eos": True},
    )
    per_choice: dict[int, list[object]] = {0: [], 1: []}
    if stream:
        for ev in client.chat.completions.create(stream=True, **kw):  # type: ignore[call-overload]
            for ch in ev.choices:
                if ch.logprobs is not None and ch.logprobs.content:
                    per_choice[ch.index].extend(ch.logprobs.content)
    else:
        resp = client.chat.completions.create(**kw)  # type: ignore[call-overload]
        for ch in resp.choices:
            assert ch.logprobs is not None and ch.logprobs.content is not None
            per_choice[ch.index] = list(ch.logprobs.content)
    for content in per_choice.values():
        assert len(content) == 6
        for entry in content:
            assert isinstance(entry.token, str) and entry.bytes is not None
            _check_alternatives([(t.token, t.logprob) for t in entry.top_logprobs], (entry.token, entry.logprob), 3)
            assert all(t.bytes is not None for t in entry.top_logprobs)
            # greedy: the sampled token is the likeliest, with its logprob exactly
            assert entry.top_logprobs[0].logprob == entry.logprob and entry.top_logprobs[0].token == entry.token
    assert [e.token for e in per_choice[0]] == [e.token for e in per_choice[1]]  # type: ignore[attr-defined]


def test_chat_logprobs_without_alternatives_and_off(client: openai.OpenAI) -> None:
    msgs = [{"role": "user", "content": "x"}]
    on = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=3, logprobs=True)  # type: ignore[arg-type]
    content = on.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and all(e.top_logprobs == [] for e in content)
    off = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=3)  # type: ignore[arg-type]
    assert off.choices[0].logprobs is None


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_carry_alternatives(client: openai.OpenAI, url: str, stream: bool) -> None:
    kw = dict(model=NAME, prompt="ab", max_tokens=5, logprobs=2, n=2, seed=3, temperature=1.0)
    choices: dict[int, dict[str, list[object]]] = {i: {"tokens": [], "lps": [], "tops": [], "offs": []} for i in (0, 1)}
    versions: dict[int, list[object]] = {0: [], 1: []}
    if stream:
        for ev in client.completions.create(stream=True, extra_body={"ignore_eos": True}, **kw):  # type: ignore[call-overload]
            for ch in ev.choices:
                versions[ch.index].extend(getattr(ch, "token_versions", None) or [])
                if ch.logprobs is not None:
                    c = choices[ch.index]
                    c["tokens"] += ch.logprobs.tokens
                    c["lps"] += ch.logprobs.token_logprobs
                    c["tops"] += ch.logprobs.top_logprobs
                    c["offs"] += ch.logprobs.text_offset
    else:
        resp = client.completions.create(extra_body={"ignore_eos": True}, **kw)  # type: ignore[call-overload]
        for ch in resp.choices:
            lp = ch.logprobs
            assert lp is not None and lp.top_logprobs is not None
            choices[ch.index] = {
                "tokens": lp.tokens,
                "lps": lp.token_logprobs,
                "tops": lp.top_logprobs,
                "offs": lp.text_offset,
            }
            versions[ch.index] = ch.token_versions  # type: ignore[attr-defined]
    for i, c in choices.items():
        assert len(c["tokens"]) == len(c["lps"]) == len(c["tops"]) == len(c["offs"]) == 5
        assert len(versions[i]) == 5  # token_versions stay one per token
        for tok, lp, top in zip(c["tokens"], c["lps"], c["tops"], strict=True):
            assert isinstance(top, dict) and 1 <= len(top) <= 3  # the top 2 and the sampled token
            assert top[tok] == lp  # type: ignore[index]
            ranked = sorted(top.values(), reverse=True)  # type: ignore[union-attr]
            assert ranked[0] >= lp  # type: ignore[operator]
        assert c["offs"] == [sum(len(t) for t in c["tokens"][:k]) for k in range(5)]  # type: ignore[arg-type,misc]


def test_token_logprobs_are_the_raw_model_distribution(engine: TorchEngine, url: str) -> None:
    """The sampled token's logprob is log_softmax of the raw logits (temperature not applied), the same with and
    without alternatives, streamed and not: the behaviour-policy logprob off-policy RL corrects with."""
    import torch

    body = {"prompt": "ab", "max_tokens": 4, "seed": 11, "temperature": 0.7, "ignore_eos": True}
    plain = _post(url, "/v1/completions", {**body, "logprobs": 0}).json()["choices"][0]
    with_top = _post(url, "/v1/completions", {**body, "logprobs": 5}).json()["choices"][0]
    assert plain["text"] == with_top["text"]
    assert plain["logprobs"]["token_logprobs"] == with_top["logprobs"]["token_logprobs"]
    assert plain["logprobs"]["top_logprobs"] == [
        {t: lp} for t, lp in zip(plain["logprobs"]["tokens"], plain["logprobs"]["token_logprobs"], strict=True)
    ]
    ids = engine.tokenizer.encode("ab")
    gen_ids = list(ids)
    expected = []
    gen = engine.generate(ids, engine_params(temperature=0.7, seed=11))
    for tok in gen.tokens:
        with torch.no_grad():
            logits = engine.model(input_ids=torch.tensor([gen_ids])).logits[0, -1].float()
        expected.append(float(torch.log_softmax(logits, -1)[tok]))
        gen_ids.append(tok)
    assert plain["logprobs"]["token_logprobs"] == pytest.approx(expected, abs=1e-3)
    assert plain["logprobs"]["token_logprobs"] == gen.logprobs  # exactly what the engine recorded


def engine_params(**kw: object) -> object:
    from flipsync.engines.torch.engine import SamplingParams

    return SamplingParams(max_tokens=4, stop_token_ids=frozenset(), **kw)  # type: ignore[arg-type]
