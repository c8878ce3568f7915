"""The version-aware proxy in front of a real torch engine server, both served by uvicorn on loopback."""

from __future__ import annotations

import importlib.util
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi import Request

from flipsync.domain.requests import BadRequest, VersionConstraint, parse_constraint, read_json
from flipsync.sidecar.gate import CommitMode
from tests.sidecar.body_cases import JSON_BODIES, UNREADABLE, gzip_bomb
from tests.sidecar.sidecar_helpers import FaultyEngine, Stack, StackFactory, Trainer, tiny_engine, wait_until


def events(lines: Iterator[str]) -> list[Any]:
    out: list[Any] = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[6:]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def slow_down(stack: Stack, seconds: float) -> None:
    """Make each decode step of the engine take at least ``seconds`` (so a commit lands mid-sequence)."""
    model = stack.torch_engine.model
    forward = model.forward

    def slow(*args: Any, **kw: Any) -> Any:
        time.sleep(seconds)
        return forward(*args, **kw)

    model.forward = slow  # type: ignore[method-assign]


def test_completion_reports_versions_in_body_and_headers(trainer: Trainer, make_stack: StackFactory) -> None:
    s = make_stack()
    assert s.replica.wait_version(0, 10)
    r = s.client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 6, "temperature": 0, "n": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["weight_version"] == {"start": 0, "end": 0}
    assert r.headers["x-flipsync-weight-version-start"] == "0" and r.headers["x-flipsync-weight-version-end"] == "0"
    assert len(body["choices"]) == 2 and all(c["token_versions"] == [0] * 6 for c in body["choices"])
    assert body["usage"]["completion_tokens"] == 12 and "date" in r.headers
    assert r.headers.get_list("date") == [r.headers["date"]]  # one date header, not the engine's as well

    trainer.step()
    assert s.replica.wait_version(1, 10)
    r = s.client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "weight_version": {"min_version": 1}},
    )
    assert r.status_code == 200, r.text
    assert r.json()["weight_version"] == {"start": 1, "end": 1}
    assert r.json()["choices"][0]["message"]["role"] == "assistant"


def test_streams_pass_through_with_versions_on_every_event(trainer: Trainer, make_stack: StackFactory) -> None:
    s = make_stack()
    assert s.replica.wait_version(0, 10)
    body = {"messages": [{"role": "user", "content": "hey"}], "max_tokens": 5, "stream": True, "temperature": 0}
    body["stream_options"] = {"include_usage": True}
    with s.client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-flipsync-weight-version-start"] == "0"
        evs = events(r.iter_lines())
    assert evs[-1] == "[DONE]"
    chunks = evs[:-1]
    assert all(c["weight_version"] == {"start": 0, "end": 0} for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    tokens = [c for c in chunks if c["choices"] and c["choices"][0]["token_versions"]]
    assert len(tokens) == 5 and chunks[-1]["usage"]["completion_tokens"] == 5
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finals[0]["choices"][0]["finish_reason"] == "length"
    # The same request without streaming generates the same text (greedy).
    plain = s.client.post("/v1/chat/completions", json={**body, "stream": False}).json()
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert plain["choices"][0]["message"]["content"] == streamed


def test_unsatisfied_constraints_answer_409_with_retry_after(trainer: Trainer, make_stack: StackFactory) -> None:
    s = make_stack()
    assert s.replica.wait_version(0, 10)
    r = s.client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, "weight_version": {"min_version": 3}})
    assert r.status_code == 409 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "weight_version_unavailable"
    assert r.json()["weight_version"]["current"] == 0
    r = s.client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1}, headers={"X-Flipsync-Min-Version": "2"})
    assert r.status_code == 409
    trainer.step()
    assert s.replica.wait_version(1, 10)
    r = s.client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, "weight_version": {"exact_version": 0}})
    assert r.status_code == 409 and "exactly v0" in r.json()["error"]["message"]
    r = s.client.post(
        "/v1/completions", json={"prompt": "a", "max_tokens": 1}, headers={"X-Flipsync-Exact-Version": "1"}
    )
    assert r.status_code == 200 and r.json()["weight_version"] == {"start": 1, "end": 1}
    r = s.client.post("/v1/completions", json={"prompt": "a", "weight_version": {"newest": True}})
    assert r.status_code == 400
    text = s.client.get("/metrics").text
    assert 'flipsync_proxy_requests_total{outcome="rejected_version"} 3.0' in text
    assert 'flipsync_proxy_requests_total{outcome="ok"} 1.0' in text


def test_no_verified_version_answers_503(store: object, make_stack: StackFactory) -> None:
    Trainer(store)  # type: ignore[arg-type]
    s = make_stack(start_loop=False)
    r = s.client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1})
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert s.client.get("/flipsync/health").status_code == 503
    assert s.replica.sync_once()
    assert s.client.get("/flipsync/health").status_code == 200
    assert s.client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1}).status_code == 200


def test_control_endpoints(trainer: Trainer, make_stack: StackFactory) -> None:
    s = make_stack()
    r = s.client.get("/flipsync/wait", params={"min_version": 0, "timeout_s": 10})
    assert r.status_code == 200 and r.json()["satisfied"]
    r = s.client.get("/flipsync/wait", params={"min_version": 1, "timeout_s": 0.2})
    assert r.status_code == 408 and not r.json()["satisfied"]
    waited: dict[str, Any] = {}
    t = threading.Thread(
        target=lambda: waited.update(r=s.client.get("/flipsync/wait", params={"min_version": 1, "timeout_s": 20}))
    )
    t.start()
    time.sleep(0.1)
    trainer.step()
    t.join(20)
    assert waited["r"].status_code == 200 and waited["r"].json()["version"] == 1
    assert wait_until(lambda: s.client.get("/flipsync/status").json()["state"] == "idle", 10)
    st = s.client.get("/flipsync/status").json()
    assert st["version"] == 1 and st["proxy"]["gate_open"] and st["proxy"]["in_flight"] == 0
    assert st["last_update"]["target"] == 1
    assert s.client.post("/flipsync/sync").status_code == 202
    text = s.client.get("/metrics").text
    for name in (
        "flipsync_version 1.0",
        "flipsync_head_version 1.0",
        "flipsync_lag_versions 0.0",
        "flipsync_fetched_bytes_total",
        "flipsync_stage_seconds_count",
        "flipsync_commit_seconds_count",
        "flipsync_pause_seconds_count",
        "flipsync_failures_total",
    ):
        assert name in text
    models = s.client.get("/v1/models")  # passes through untouched
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "flipsync-torch"


def _stream_across_a_commit(s: Stack, trainer: Trainer, body: dict[str, Any]) -> tuple[list[Any], threading.Thread]:
    """Start a slow stream, publish v1 after its first tokens, and commit from another thread."""
    slow_down(s, 0.03)  # a window of a second or more for the commit, even on a loaded machine
    with s.client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got: list[str] = []
        for line in lines:
            got.append(line)
            if sum(1 for x in got if '"token_versions": [0]' in x or '"token_versions":[0]' in x) >= 3:
                break
        trainer.step()
        syncer = threading.Thread(target=s.replica.sync_once)
        syncer.start()
        got.extend(lines)
    return events(iter(got)), syncer


def test_in_place_commit_lands_mid_stream_and_both_versions_are_reported(
    trainer: Trainer, make_stack: StackFactory
) -> None:
    s = make_stack(mode=CommitMode.IN_PLACE, poll=30.0)
    assert s.replica.sync_once() and s.replica.version == 0
    body = {"prompt": "x", "max_tokens": 60, "temperature": 0, "stream": True}
    evs, syncer = _stream_across_a_commit(s, trainer, body)
    syncer.join(10)
    versions = [v for e in evs[:-1] if e["choices"] for v in e["choices"][0]["token_versions"]]
    assert versions[0] == 0 and versions[-1] == 1 and sorted(versions) == versions  # paused, applied, continued
    assert evs[-2]["weight_version"] == {"start": 0, "end": 1}
    assert s.replica.status()["last_update"]["drain_s"] < 1.0  # in_place did not wait for the stream


@pytest.mark.parametrize("pinned", [False, True])
def test_drained_requests_finish_on_the_version_they_started(
    trainer: Trainer, make_stack: StackFactory, pinned: bool
) -> None:
    # quiesce drains every request; in_place drains only the requests pinned to an exact version.
    s = make_stack(mode=CommitMode.IN_PLACE if pinned else CommitMode.QUIESCE, poll=30.0)
    assert s.replica.sync_once() and s.replica.version == 0
    body: dict[str, Any] = {"prompt": "x", "max_tokens": 40, "temperature": 0, "stream": True}
    if pinned:
        body["weight_version"] = {"exact_version": 0}
    evs, syncer = _stream_across_a_commit(s, trainer, body)
    syncer.join(10)
    versions = [v for e in evs[:-1] if e["choices"] for v in e["choices"][0]["token_versions"]]
    assert len(versions) == 40 and set(versions) == {0}
    assert evs[-2]["weight_version"]["start"] == 0
    assert s.replica.version == 1
    last = s.replica.status()["last_update"]
    assert last["drained"] and last["drain_s"] > 0.05 and last["pause_s"] >= last["drain_s"]


def test_requests_wait_at_the_gate_during_a_commit(trainer: Trainer, make_stack: StackFactory) -> None:
    s = make_stack(poll=30.0)
    assert s.replica.sync_once()
    gate = s.sidecar.gate
    from flipsync.sidecar.gate import CommitMode as Mode

    result: dict[str, Any] = {}
    with gate.closed(Mode.IN_PLACE, 1.0):
        t = threading.Thread(
            target=lambda: result.update(r=s.client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}))
        )
        t.start()
        time.sleep(0.3)
        assert "r" not in result  # held at the door
    t.join(10)
    assert result["r"].status_code == 200


def test_upstream_down_answers_502(trainer: Trainer, make_stack: StackFactory) -> None:
    # A bound socket that never listens: connections are refused, and no other server can take the port.
    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))
        s = make_stack(upstream=f"http://127.0.0.1:{hole.getsockname()[1]}")
        assert s.replica.wait_version(0, 10)
        r = s.client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1})
        assert r.status_code == 502 and r.json()["error"]["type"] == "upstream_unavailable", r.text
        assert s.sidecar.gate.in_flight == 0
        assert s.client.get("/v1/models").status_code == 502


def test_the_gate_is_released_when_a_client_disconnects(trainer: Trainer, make_stack: StackFactory) -> None:
    s = make_stack()
    assert s.replica.wait_version(0, 10)
    slow_down(s, 0.05)  # 200 tokens take 10 s: the client leaves long before the end
    # ignore_eos: all 200 tokens whatever the weights (greedy decoding of one seed's weights once met a stop token
    # early in CI: the stream was over, and the gate released, before the first line was read)
    body = {"prompt": "x", "max_tokens": 200, "stream": True, "ignore_eos": True}
    t0 = time.monotonic()
    with s.client.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        first = next(lines)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), first
        if s.sidecar.gate.in_flight != 1:  # say how the stream ended, to know why
            rest = [line for line in lines if line]
            pytest.fail(f"the gate holds no ticket mid-stream; the stream: {first} ... {len(rest)} more: {rest[-3:]}")
    assert wait_until(lambda: s.sidecar.gate.in_flight == 0, 10)
    assert time.monotonic() - t0 < 8  # released on the disconnect, not at the end of the sequence


def test_parse_constraint() -> None:
    assert parse_constraint(None, {}) == VersionConstraint()
    assert parse_constraint({"min_version": 2}, {"x-flipsync-min-version": "5"}) == VersionConstraint(5, None)
    c = parse_constraint({"exact_version": 3}, {})
    assert c.pinned and c.satisfied_by(3) and not c.satisfied_by(4)
    for bad in ({"min_version": -1}, {"min_version": True}, {"exact": 1}, 3):
        with pytest.raises(Exception, match="version"):
            parse_constraint(bad, {})
    with pytest.raises(Exception, match="conflicting"):
        parse_constraint({"exact_version": 1}, {"x-flipsync-exact-version": "2"})
    # digits outside ASCII ("²" is a digit to str.isdigit, not to int) are a bad request, not a server error
    for header in ("\u00b2", "\u0663", "-1", "1.5", ""):
        with pytest.raises(BadRequest, match="non-negative integer"):
            parse_constraint(None, {"x-flipsync-min-version": header})
    assert httpx  # the module is used by fixtures through the client


def test_faults_keep_the_last_version_serving_through_the_proxy(trainer: Trainer, make_stack: StackFactory) -> None:
    engine = FaultyEngine(tiny_engine())
    s = make_stack(engine=engine)
    assert s.replica.wait_version(0, 10)
    engine.fail_commits = 10**6  # the engine refuses every commit
    trainer.step()
    assert wait_until(lambda: (s.replica.status()["error"] or {}).get("kind") == "engine_rejected", 10)
    r = s.client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["weight_version"] == {"start": 0, "end": 0}
    st = s.client.get("/flipsync/status").json()
    assert st["version"] == 0 and st["head"] == 1 and st["lag"] == 1 and st["error"]["kind"] == "engine_rejected"
    assert 'flipsync_failures_total{kind="engine_rejected"}' in s.client.get("/metrics").text
    engine.dead = True  # and now it dies: nothing may be served
    assert wait_until(lambda: s.client.get("/flipsync/health").status_code == 503, 10)
    r = s.client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
    assert r.status_code == 503 and "engine_down" in r.json()["error"]["message"]
    engine.dead, engine.fail_commits = False, 0  # back, intact: it converges
    assert s.replica.wait_version(1, 10)
    r = s.client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "weight_version": {"min_version": 1}})
    assert r.status_code == 200 and r.json()["weight_version"] == {"start": 1, "end": 1}


def _deep(levels: int) -> str:
    return "[" * levels + "]" * levels


def test_deeply_nested_json_is_refused_cleanly(trainer: Trainer, make_stack: StackFactory) -> None:
    """json.loads raises RecursionError (not ValueError) on deep nesting: a client's body answers 400, an
    engine's answer 502 (an error event once a stream has started), never a 500."""
    from fastapi import FastAPI
    from fastapi.responses import Response as FastResponse

    from flipsync.serving import ServerThread

    deep = '{"choices": ' + _deep(100_000) + "}"
    engine = FastAPI()

    @engine.post("/v1/completions")
    async def completions() -> FastResponse:
        return FastResponse(deep, media_type="application/json")

    @engine.post("/v1/chat/completions")
    async def chat() -> FastResponse:
        events = f"data: {deep}\n\ndata: [DONE]\n\n"
        return FastResponse(events, media_type="text/event-stream")

    with ServerThread(engine) as fake:
        s = make_stack(upstream=fake.url)
        assert s.replica.wait_version(0, 10)
        body = '{"prompt": ' + _deep(100_000) + "}"
        r = s.client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert "nests arrays/objects too deeply" in r.json()["error"]["message"]

        r = s.client.post("/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 502, r.text
        assert "nested too deeply" in r.json()["error"]["message"] and fake.url in r.json()["error"]["message"]

        with s.client.stream("POST", "/v1/chat/completions", json={"messages": [], "stream": True}) as r:
            evs = events(r.iter_lines())
        assert evs[0]["error"]["type"] == "upstream_invalid_response" and evs[-1] == "[DONE]"


# -- issue 34: every body read as JSON, answers a retry cannot change, cut streams -------------------------------


@pytest.mark.parametrize("how", sorted(JSON_BODIES))
def test_a_constraint_is_read_whatever_the_body_says_it_is(
    trainer: Trainer, make_stack: StackFactory, how: str
) -> None:
    """The torch engine reads a body as JSON whatever its Content-Type: a constraint the proxy skipped would be
    silently ignored (v0 served for exactly v999999). Every way of sending JSON is read, and forwarded so that
    the engine reads the same request."""
    s = make_stack()
    assert s.replica.wait_version(0, 10)
    content, headers = JSON_BODIES[how]({"prompt": "hi", "max_tokens": 2, "weight_version": {"exact_version": 999999}})
    r = s.client.post("/v1/completions", content=content, headers=headers)
    assert r.status_code == 409, (how, r.status_code, r.text)
    assert r.json()["weight_version"]["exact_version"] == 999999
    content, headers = JSON_BODIES[how]({"prompt": "hé", "max_tokens": 2, "weight_version": {"min_version": 0}})
    r = s.client.post("/v1/completions", content=content, headers=headers)
    assert r.status_code == 200, (how, r.text)
    assert r.json()["weight_version"] == {"start": 0, "end": 0} and r.json()["usage"]["prompt_tokens"] == 4


@pytest.mark.parametrize("how", sorted(UNREADABLE))
def test_a_body_that_is_not_json_is_refused(trainer: Trainer, make_stack: StackFactory, how: str) -> None:
    s = make_stack()
    assert s.replica.wait_version(0, 10)
    content, headers, status, word = UNREADABLE[how]
    r = s.client.post("/v1/completions", content=content, headers=headers)
    assert r.status_code == status and word in r.json()["error"]["message"], (how, r.status_code, r.text)
    assert r.headers["x-should-retry"] == "false"


def test_read_json_decodes_and_bounds() -> None:
    doc = {"prompt": "x", "weight_version": {"min_version": 1}}
    for how, encoder in JSON_BODIES.items():
        content, headers = encoder(doc)
        got = read_json(content, headers.get("content-type"), headers.get("content-encoding"), 1 << 20)
        assert got is not None and got.doc == doc, how
        assert got.as_sent == (how in ("application/json", "json; charset=utf-8", "vendor +json", "identity")), how
    assert read_json(b"", "text/plain", None, 10) is None
    bomb, headers = gzip_bomb(10_000)
    assert len(bomb) < 1000
    with pytest.raises(BadRequest, match="exceeds 10000 bytes") as e:
        read_json(bomb, headers["content-type"], headers["content-encoding"], 10_000)
    assert e.value.status == 413


def test_refusals_say_whether_a_retry_can_help(trainer: Trainer, make_stack: StackFactory) -> None:
    s = make_stack()
    assert s.replica.wait_version(0, 10)
    trainer.step()
    assert s.replica.wait_version(1, 10)
    ahead = s.client.post("/v1/completions", json={"prompt": "a", "weight_version": {"min_version": 5}})
    assert ahead.status_code == 409 and ahead.headers["retry-after"] == "1" and "x-should-retry" not in ahead.headers
    passed = s.client.post("/v1/completions", json={"prompt": "a", "weight_version": {"exact_version": 0}})
    assert passed.status_code == 409 and passed.headers["x-should-retry"] == "false"  # v0 never comes back here
    bad = s.client.post("/v1/completions", json={"prompt": "a", "weight_version": {"min_version": -1}})
    assert bad.status_code == 400 and bad.headers["x-should-retry"] == "false"


def _engine_that_dies_mid_stream() -> Any:
    """An OpenAI-looking engine whose streams send two events and then break off (the connection drops)."""
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    app = FastAPI()

    @app.post("/v1/completions")
    async def completions() -> StreamingResponse:
        async def body() -> Any:
            for i in range(2):
                yield f'data: {{"choices": [{{"index": 0, "text": "t{i}", "finish_reason": null}}]}}\n\n'.encode()
            raise RuntimeError("the engine died")  # uvicorn drops the connection mid-body

        return StreamingResponse(body(), media_type="text/event-stream")

    return app


def test_a_stream_the_engine_breaks_off_fails_at_the_client(trainer: Trainer, make_stack: StackFactory) -> None:
    """After a 200 the proxy cannot change the status: it sends an error event, then cuts the connection before
    the chunked body's end, so that httpx (and openai), and aiohttp (vLLM's benchmark client) see a failure, not
    a short success."""
    import openai

    from flipsync.serving import ServerThread

    with ServerThread(_engine_that_dies_mid_stream()) as fake:
        s = make_stack(upstream=fake.url)
        assert s.replica.wait_version(0, 10)
        body = {"model": "m", "prompt": "x", "max_tokens": 5, "stream": True}
        got: list[str] = []
        with pytest.raises(httpx.RemoteProtocolError), s.client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                got.append(line)
        evs = events(iter(got))
        assert [e["choices"][0]["text"] for e in evs[:2]] == ["t0", "t1"]
        assert evs[-1]["error"]["type"] == "upstream_unavailable" and "[DONE]" not in evs
        assert wait_until(lambda: s.sidecar.gate.in_flight == 0, 10)

        client = openai.OpenAI(base_url=s.sidecar.url + "/v1", api_key="none", max_retries=0)
        with pytest.raises((openai.APIError, httpx.HTTPError)):
            for _ in client.completions.create(model="m", prompt="x", max_tokens=5, stream=True):
                pass
        client.close()

        if importlib.util.find_spec("aiohttp") is not None:
            assert _aiohttp_stream(s.sidecar.url + "/v1/completions", body) == "ClientPayloadError"


def _slow_engine(delay_s: float) -> Any:
    """An OpenAI-looking engine that thinks ``delay_s`` before its first byte, streamed or not."""
    import asyncio

    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:  # Request from the module: FastAPI resolves it there
        stream = (await request.json()).get("stream") is True
        await asyncio.sleep(delay_s)
        if not stream:
            return JSONResponse({"choices": [{"index": 0, "text": "done", "finish_reason": "length"}]})

        async def body() -> Any:
            yield b'data: {"choices": [{"index": 0, "text": "t", "finish_reason": null}]}\n\n'
            yield b"data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    return app


def test_a_long_generation_is_not_cut_by_the_read_timeout(trainer: Trainer, make_stack: StackFactory) -> None:
    """The read timeout bounds an engine's silence while it streams; a non-streaming answer comes whole at its
    end, so it waits as long as the generation takes (it was answered 504 once the read timeout passed)."""
    from flipsync.serving import ServerThread

    with ServerThread(_slow_engine(1.5)) as fake:
        s = make_stack(upstream=fake.url, read_timeout_s=0.5)
        assert s.replica.wait_version(0, 10)
        whole = s.client.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 5})
        assert whole.status_code == 200, whole.text
        assert whole.json()["choices"][0]["text"] == "done"
        streamed = s.client.post("/v1/completions", json={"model": "m", "prompt": "x", "stream": True})
        assert streamed.status_code == 504, streamed.text  # silent past the read timeout before its first byte
        assert wait_until(lambda: s.sidecar.gate.in_flight == 0, 10)


def _aiohttp_stream(url: str, body: dict[str, Any]) -> str:
    """How aiohttp (vLLM's benchmark client reads streams with it) ends reading a stream: "ok" or the error."""
    import asyncio

    import aiohttp

    async def read() -> str:
        async with aiohttp.ClientSession() as session, session.post(url, json=body) as response:
            try:
                async for _ in response.content.iter_any():
                    pass
            except aiohttp.ClientPayloadError:
                return "ClientPayloadError"
            return "ok"

    return asyncio.run(read())


class _DroppingEngine:
    """A raw HTTP engine on loopback that closes its first ``drops`` connections once it has read the request,
    without a byte of answer (what a server does to a keep-alive connection whose idle time ran out as the
    client reused it), and answers the rest with a small completion."""

    def __init__(self, drops: int) -> None:
        self.drops, self.requests = drops, 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            with conn:
                head = b""
                while b"\r\n\r\n" not in head:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    head += chunk
                self.requests += 1
                if self.requests <= self.drops:
                    continue  # closed without an answer
                body = b'{"choices": [{"index": 0, "text": "ok", "finish_reason": "length"}]}'
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n"
                    b"content-length: %d\r\n\r\n%s" % (len(body), body)
                )

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("drops", [1, 2])
def test_a_connection_dropped_before_any_answer_is_sent_again_once(
    trainer: Trainer, make_stack: StackFactory, drops: int
) -> None:
    """A connection the engine closes before answering (its keep-alive ran out as the proxy reused it) costs
    the client nothing: the request goes again, once, on a new connection. Twice in a row is a 502 that names
    what happened."""
    engine = _DroppingEngine(drops)
    try:
        s = make_stack(upstream=engine.url)
        assert s.replica.wait_version(0, 60)
        r = s.client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1})
        assert engine.requests == 2
        if drops == 1:
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ok", r.text
        else:
            assert r.status_code == 502 and r.json()["error"]["type"] == "upstream_unavailable", r.text
            # a close seen before or after the request went out: either error the retry covers, named
            assert any(e in r.json()["error"]["message"] for e in ("RemoteProtocolError", "ReadError", "WriteError"))
        assert s.sidecar.gate.in_flight == 0
    finally:
        engine.close()
