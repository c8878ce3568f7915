"""What the gateway makes of a request before and after a replica answers it (issue 34): every body read as JSON
whatever it says it is, clear errors at once (404 for what the fleet does not serve, 400 for a malformed model),
answers a retry cannot change marked so for the openai client, a stream cut by a dying replica that a client sees
fail, and one model name routed only over replicas that tokenize alike."""

from __future__ import annotations

import importlib.util
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from flipsync.board.membership import MemberWriter
from flipsync.domain.fleet import MemberRecord, tokenizer_outliers
from flipsync.domain.manifest import utc_now_iso
from flipsync.engines.tokenization import folder_tokenizer_digest, tokenizer_digest
from flipsync.engines.torch.tokenizer import ByteTokenizer
from flipsync.stores import ObstoreStore
from tests.fleet.fleet_helpers import GatewayFactory, MemberFactory, impostor
from tests.sidecar.body_cases import JSON_BODIES, UNREADABLE
from tests.sidecar.sidecar_helpers import Trainer, wait_until


def record(replica: str, url: str, **over: Any) -> MemberRecord:
    fields: dict[str, Any] = {
        "replica": replica,
        "run": "run",
        "island": "stub",
        "url": url,
        "engine": "torch",
        "served_format": "bf16",
        "model": "flipsync-torch",
        "version": 0,
        "view_fp": "ab" * 16,
        "head": 0,
        "state": "idle",
        "serving": True,
        "in_flight": 0,
        "heartbeat": utc_now_iso(),
        "ttl_s": 60.0,
        "started": utc_now_iso(),
    }
    return MemberRecord(**{**fields, **over})


def sample(gw: Any, name: str, **labels: str) -> float:
    return gw.gateway.metrics.registry.get_sample_value(name, labels) or 0.0


def test_a_constraint_is_read_whatever_the_body_says_it_is(
    trainer: Trainer, make_member: MemberFactory, make_gateway: GatewayFactory
) -> None:
    m = make_member()
    assert wait_until(lambda: m.sidecar.replica.version == 0)
    gw = make_gateway(hold_s=0.2)
    assert wait_until(lambda: gw.fleet()["ready"] == 1)
    for how, encoder in JSON_BODIES.items():
        content, headers = encoder({"prompt": "hi", "max_tokens": 2, "weight_version": {"exact_version": 999999}})
        r = gw.client.post("/v1/completions", content=content, headers=headers)
        assert r.status_code == 409, (how, r.status_code, r.text)
        assert r.json()["weight_version"]["exact_version"] == 999999
        # NAME@FORMAT is rewritten, so the body is re-encoded: the replica reads what the gateway read.
        doc = {"model": "flipsync-torch@bf16", "prompt": "hé", "max_tokens": 2, "weight_version": {"min_version": 0}}
        content, headers = encoder(doc)
        r = gw.client.post("/v1/completions", content=content, headers=headers)
        assert r.status_code == 200, (how, r.text)
        assert r.json()["weight_version"] == {"start": 0, "end": 0} and r.json()["usage"]["prompt_tokens"] == 4
        assert r.json()["model"] == "flipsync-torch"
    for how, (content, headers, status, word) in UNREADABLE.items():
        r = gw.client.post("/v1/completions", content=content, headers=headers)
        assert r.status_code == status and word in r.json()["error"]["message"], (how, r.status_code, r.text)
        assert r.headers["x-should-retry"] == "false"
    assert sample(gw, "flipsync_gateway_requests_total", outcome="bad_request") == len(UNREADABLE)


def test_what_the_fleet_does_not_serve_is_a_404_at_once(
    trainer: Trainer, make_member: MemberFactory, make_gateway: GatewayFactory
) -> None:
    m = make_member()
    assert wait_until(lambda: m.sidecar.replica.version == 0)
    gw = make_gateway(hold_s=20.0)
    assert wait_until(lambda: gw.fleet()["ready"] == 1)
    t = time.monotonic()
    for model in ("gpt-4o", "no-such-model"):
        r = gw.complete(model=model)
        assert r.status_code == 404, r.text
        err = r.json()["error"]
        assert err["type"] == "NotFoundError" and err["code"] == 404 and f"`{model}`" in err["message"]
        assert "This fleet serves: flipsync-torch." in err["message"] and r.headers["x-should-retry"] == "false"
    r = gw.complete(model="flipsync-torch@fp8-block", weight_version={"min_version": 0})
    assert r.status_code == 404 and "format fp8-block. Formats served: bf16" in r.json()["error"]["message"]
    r = gw.client.post("/v1/completions", json={"prompt": "x"}, headers={"X-Flipsync-Run": "other"})
    assert r.status_code == 404 and "Runs served: run" in r.json()["error"]["message"]
    for bad in (123, ["flipsync-torch"], {"id": "flipsync-torch"}, True):
        r = gw.complete(model=bad)
        assert r.status_code == 400 and "model must be a string" in r.json()["error"]["message"], r.text
        assert "served: flipsync-torch" in r.json()["error"]["message"]
    assert time.monotonic() - t < 15  # none of them held (20 s)
    assert sample(gw, "flipsync_gateway_requests_total", outcome="not_found") == 4
    assert gw.complete(model=None).status_code == 200  # null is "any model", as vLLM reads it
    assert gw.complete(model="flipsync-torch@BF16").status_code == 200

    # A known model without a ready replica is held (it may come back), then 503: not a 404.
    short = make_gateway(hold_s=0.5)
    assert wait_until(lambda: short.fleet()["ready"] == 1)
    m.sidecar.gate.start_draining()
    assert wait_until(lambda: short.fleet()["ready"] == 0)
    t = time.monotonic()
    r = short.complete(model="flipsync-torch")
    assert r.status_code == 503 and time.monotonic() - t >= 0.45 and "no ready replica" in r.text
    assert r.headers["x-should-retry"] == "false" and r.headers["retry-after"] == "1"


def test_an_empty_fleet_holds_then_503(trainer: Trainer, make_gateway: GatewayFactory) -> None:
    """Nothing known yet (replicas booting): any model may appear, so the request holds instead of a 404."""
    gw = make_gateway(hold_s=0.5)
    assert wait_until(lambda: gw.gateway.view.scans > 0)
    t = time.monotonic()
    r = gw.complete(model="anything")
    assert r.status_code == 503 and time.monotonic() - t >= 0.45, r.text
    assert "0 live" in r.json()["error"]["message"]


def test_the_openai_client_does_not_repeat_a_hold(
    trainer: Trainer, make_member: MemberFactory, make_gateway: GatewayFactory
) -> None:
    """The openai client retries 409 and 503 twice by default: an answer after a hold says x-should-retry:
    false, so one impossible min_version costs one hold, not three."""
    m = make_member()
    assert wait_until(lambda: m.sidecar.replica.version == 0)
    gw = make_gateway(hold_s=1.0)
    assert wait_until(lambda: gw.fleet()["ready"] == 1)
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="none")  # default max_retries=2
    assert client.max_retries == 2
    try:
        with pytest.raises(openai.ConflictError) as conflict:
            client.completions.create(
                model="flipsync-torch", prompt="a", max_tokens=1, extra_body={"weight_version": {"min_version": 99}}
            )
        assert conflict.value.response.headers["x-should-retry"] == "false"
        assert sample(gw, "flipsync_gateway_requests_total", outcome="rejected_version") == 1
        assert sample(gw, "flipsync_gateway_held_seconds_count") == 1
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="gpt-4o", prompt="a", max_tokens=1)
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="flipsync-torch", prompt="a", extra_body={"model": 123})
        assert sample(gw, "flipsync_gateway_requests_total", outcome="not_found") == 1
        assert sample(gw, "flipsync_gateway_requests_total", outcome="bad_request") == 1
        out = client.completions.create(model="flipsync-torch", prompt="a", max_tokens=2)
        assert out.choices[0].text is not None
    finally:
        client.close()


class DyingReplica:
    """A stub replica that answers each request with a 200 event stream, sends two events, then dies (closes
    the connection mid-body, as a SIGKILLed engine's kernel does)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.served = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                head, _, body = data.partition(b"\r\n\r\n")
                fields = dict(x.partition(b":")[::2] for x in head.lower().split(b"\r\n")[1:])
                length = int(fields.get(b"content-length", b"0"))
                while len(body) < length:
                    body += conn.recv(65536)
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
                    b"x-flipsync-weight-version-start: 0\r\n\r\n"
                )
                for i in range(2):
                    event = b'data: {"choices": [{"index": 0, "text": "t%d", "finish_reason": null}]}\n\n' % i
                    conn.sendall(b"%x\r\n%s\r\n" % (len(event), event))
                self.served += 1
                conn.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def dying(store: ObstoreStore) -> Iterator[DyingReplica]:
    stub = DyingReplica()
    MemberWriter(store, "run").put(record("dying", stub.url))
    yield stub
    stub.close()


def test_a_stream_cut_by_a_dying_replica_fails_at_the_client(
    trainer: Trainer, dying: DyingReplica, make_gateway: GatewayFactory
) -> None:
    """Tokens already relayed cannot be taken back, and a resumed stream could not promise the same tokens (the
    sampler's state stays with the dead replica): the gateway sends an error event, then cuts the connection
    before the chunked body's end, so that httpx, openai and aiohttp (vLLM's benchmark client) count a failure."""
    gw = make_gateway()
    assert wait_until(lambda: len(gw.fleet()["members"]) == 1)
    body = {"model": "flipsync-torch", "prompt": "x", "max_tokens": 5, "stream": True}
    got: list[str] = []
    with pytest.raises(httpx.RemoteProtocolError), gw.client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["x-flipsync-replica"] == "dying"
        for line in r.iter_lines():
            got.append(line)
    events = [json.loads(line[6:]) for line in got if line.startswith("data: {")]
    assert [e["choices"][0]["text"] for e in events[:2]] == ["t0", "t1"]
    assert events[-1]["error"]["type"] == "upstream_unavailable" and "dying" in events[-1]["error"]["message"]
    assert not any(line.startswith("data: [DONE]") for line in got)
    assert sample(gw, "flipsync_gateway_requests_total", outcome="stream_cut") == 1

    # The suspect mark would skip it now: let it be tried again.
    gw.gateway.view.suspects.clear()
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0)
    try:
        with pytest.raises((openai.APIError, httpx.HTTPError)):
            for _ in client.completions.create(model="flipsync-torch", prompt="x", max_tokens=5, stream=True):
                pass
    finally:
        client.close()
    if importlib.util.find_spec("aiohttp") is not None:
        from tests.sidecar.test_sidecar_proxy import _aiohttp_stream

        gw.gateway.view.suspects.clear()
        assert _aiohttp_stream(gw.url + "/v1/completions", body) == "ClientPayloadError"
    assert wait_until(lambda: gw.gateway.view.in_flight == {}, timeout=5)


# -- one model name, one tokenization --------------------------------------------------------------------------


def test_member_records_carry_the_tokenizer_and_old_records_still_parse() -> None:
    r = record("a", "http://127.0.0.1:1", tokenizer="0123456789abcdef")
    assert MemberRecord.from_json(r.to_json()) == r and '"tokenizer":"0123456789abcdef"' in r.to_json()
    old = record("a", "http://127.0.0.1:1")
    assert "tokenizer" not in old.to_json()  # unknown: left out, so older gateways read the record as before
    assert MemberRecord.from_json(old.to_json()).tokenizer is None
    with pytest.raises(Exception, match="tokenizer must be"):
        record("a", "http://127.0.0.1:1", tokenizer="no spaces allowed")


def test_tokenizer_outliers() -> None:
    url = "http://127.0.0.1:1"
    a = record("a", url, tokenizer="aaaa", started="2026-01-01T00:00:02.000000Z")
    b = record("b", url, tokenizer="aaaa", started="2026-01-01T00:00:03.000000Z")
    c = record("c", url, tokenizer="cccc", started="2026-01-01T00:00:01.000000Z")
    unknown = record("d", url)
    other_model = record("e", url, tokenizer="cccc", model="other")
    out = tokenizer_outliers([a, b, c, unknown, other_model])
    assert set(out) == {"c"} and "tokenizer cccc" in out["c"] and "2 replica(s)" in out["c"]  # the majority wins
    out = tokenizer_outliers([b, c])  # a tie: the replica serving longest wins
    assert set(out) == {"b"}
    assert tokenizer_outliers([a, unknown]) == {}


def test_the_torch_engine_tokenizes_as_the_model_folder(tmp_path: Any) -> None:
    """The torch engine's digest is the digest of the model folder flipsync writes for vLLM (same BOS rule,
    specials, chat template and stop tokens), so a mixed fleet serves one model name."""
    from flipsync.engines.torch.model_dir import demo_config, write_model_dir

    folder = write_model_dir(tmp_path / "model", demo_config("llama-1m"))
    assert folder_tokenizer_digest(folder) == tokenizer_digest(ByteTokenizer())
    assert folder_tokenizer_digest(tmp_path / "nothing-here") is None


def test_a_replica_that_tokenizes_differently_is_not_routed(
    trainer: Trainer, store: ObstoreStore, make_member: MemberFactory, make_gateway: GatewayFactory
) -> None:
    a, b = make_member(), make_member()
    assert wait_until(lambda: a.sidecar.replica.version == 0 and b.sidecar.replica.version == 0)
    digest = tokenizer_digest(ByteTokenizer())
    assert a.sidecar.heartbeat is not None
    assert wait_until(lambda: a.sidecar.heartbeat.last is not None)  # type: ignore[union-attr]
    assert a.sidecar.heartbeat.last is not None and a.sidecar.heartbeat.last.tokenizer == digest
    server, hits = impostor()
    try:
        # A replica of the same model name that adds no BOS (say): fewer replicas, so it is the one refused.
        MemberWriter(store, "run").put(record("odd", server.url, tokenizer="feedfacefeedface", in_flight=0))
        # Another model name may tokenize as it likes.
        MemberWriter(store, "run").put(record("other", server.url, tokenizer="feedfacefeedface", model="other"))
        gw = make_gateway()
        assert wait_until(lambda: gw.fleet()["ready"] == 3)
        fleet = gw.fleet()
        rejected = {r["path"].rsplit("/", 1)[-1]: r for r in fleet["rejected"]}
        assert set(rejected) == {"odd.json"} and rejected["odd.json"]["reason"] == "tokenizer_mismatch"
        why = rejected["odd.json"]["message"]
        assert f"tokenizer {digest}" in why and "chat template" in why
        assert "odd" not in {m["replica"] for m in fleet["members"]}
        for _ in range(12):
            r = gw.complete(model="flipsync-torch", weight_version={"min_version": 0})
            assert r.status_code == 200 and r.headers["x-flipsync-replica"] in (a.replica_id, b.replica_id)
        assert hits == []
        metrics = gw.client.get("/metrics").text
        assert 'flipsync_gateway_rejected_records{reason="tokenizer_mismatch"} 1.0' in metrics
    finally:
        server.stop()
