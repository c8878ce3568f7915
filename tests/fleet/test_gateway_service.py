"""The gateway as a service a team runs (docs/fleet.md#running-the-gateway): /livez and /readyz apart, SIGTERM
drains, timeouts that never cut a long generation, API keys on the gateway and the sidecars, per-replica metrics,
and the engine's load on a sidecar's status and member record."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from flipsync.auth import ENV_KEYS, ApiKeys, replica_key
from flipsync.board.membership import MemberReader
from flipsync.engines.torch.openai_server import create_engine_app
from flipsync.errors import ConfigError
from flipsync.fleet.pool import StaticPool
from flipsync.fleet.stub_replica import StubReplica
from flipsync.serving import ServerThread
from flipsync.sidecar.heartbeat import MembershipConfig
from flipsync.sidecar.load import parse_metrics
from flipsync.sidecar.proxy import ProxyConfig
from flipsync.sidecar.service import Sidecar
from flipsync.stores import open_store
from tests.fleet.stub_fleet import poll, stub_fleet
from tests.sidecar.sidecar_helpers import FAST, Trainer, fast_replica, stop_process, tiny_engine, wait_until


def test_livez_and_readyz_apart_from_health() -> None:
    with stub_fleet(1) as fleet:
        c = fleet.client
        assert c.get("/livez").status_code == 200
        assert c.get("/readyz").status_code == 200 and c.get("/readyz").json()["ready_replicas"] == 1
        fleet.stubs[0].draining = True
        assert poll(lambda: c.get("/readyz").status_code == 503)
        assert c.get("/livez").status_code == 200  # alive all the same: no restart for an empty fleet
        assert c.get("/flipsync/health").status_code == 503  # as it was


def test_timeouts_never_cut_a_long_generation_but_bound_silence_and_the_total() -> None:
    hold = threading.Event()
    stub = StubReplica(hold=hold).start()
    with stub_fleet(stubs=[stub], request_timeout_s=0.5) as fleet:
        # A non-streaming answer three read timeouts long: the replica is generating, not silent.
        threading.Timer(1.5, hold.set).start()
        r = fleet.client.post("/v1/completions", json={"prompt": "long"})
        assert r.status_code == 200
        # A stream whose replica says nothing for longer than the read timeout: 504 before its first byte.
        hold.clear()
        r = fleet.client.post("/v1/completions", json={"prompt": "s", "stream": True})
        assert r.status_code == 504 and r.json()["error"]["type"] == "upstream_timeout"
        hold.set()
    hold.clear()
    stub = StubReplica(hold=hold).start()
    with stub_fleet(stubs=[stub], total_timeout_s=0.5) as fleet:
        t = time.monotonic()
        r = fleet.client.post("/v1/completions", json={"prompt": "long"})
        assert r.status_code == 504 and time.monotonic() - t < 10
        hold.set()


def test_api_keys_on_the_gateway_and_its_own_key_to_the_replicas(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# clients\nclient-key-1\n\n  client-key-2  \n")
    with stub_fleet(1, api_keys=ApiKeys.load(keys, environ={}), replica_api_key="replica-key") as fleet:
        c, stub = fleet.client, fleet.stubs[0]
        body = {"prompt": "hi"}
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 401 and r.headers["x-should-retry"] == "false"
        err = r.json()["error"]
        assert (err["code"], err["type"]) == ("invalid_api_key", "invalid_request_error") and "Bearer" in err["message"]
        r = c.post("/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401 and "Incorrect API key" in r.json()["error"]["message"]
        assert c.get("/v1/models").status_code == 401
        assert not stub.hits  # nothing reached the replica
        for key in ("client-key-1", "client-key-2"):
            r = c.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200
        assert {h.authorization for h in stub.hits} == {"Bearer replica-key"}  # never the client's key
        for path in ("/livez", "/readyz", "/metrics", "/flipsync/health", "/flipsync/fleet"):
            assert c.get(path).status_code == 200, path  # probes and scrapers need no key
        metrics = c.get("/metrics").text
        replica = fleet.replica_of(stub)
        for series in (
            f'flipsync_gateway_replica_requests_total{{replica="{replica}"}} 2.0',
            f'flipsync_gateway_replica_first_byte_seconds_count{{replica="{replica}"}} 2.0',
            'flipsync_gateway_affinity_total{outcome="new"}',
        ):
            assert series in metrics, series


def test_keys_from_a_file_and_the_environment() -> None:
    assert ApiKeys.load(None, environ={}) is None
    keys = ApiKeys.load(None, environ={ENV_KEYS: "a, b,,c"})
    assert keys is not None and all(keys.allows(f"Bearer {k}") for k in "abc")
    assert not keys.allows("Bearer d") and not keys.allows("Basic a") and not keys.allows(None)
    assert keys.allows(b"bearer  a ")
    with pytest.raises(ConfigError, match="holds no API key"):
        ApiKeys.load(None, environ={ENV_KEYS: " , "})
    with pytest.raises(ConfigError, match="cannot read"):
        ApiKeys.load(Path("/nonexistent/keys"), environ={})
    assert replica_key(None, {"FLIPSYNC_REPLICA_API_KEY": "rk"}) == "rk" and replica_key(None, {}) is None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_sigterm_drains_the_gateway_then_exits_0(tmp_path: Path) -> None:
    hold = threading.Event()
    stub = StubReplica(hold=hold).start()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "flipsync.cli.gateway", "gateway", "--replica", stub.url]
    cmd += ["--listen", f"127.0.0.1:{port}", "--refresh", "0.2", "--drain-timeout", "60"]
    log = (tmp_path / "gateway.log").open("wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:

        def ready() -> bool:
            try:
                return httpx.get(f"{url}/readyz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        assert poll(ready, timeout=120, every=0.1), (tmp_path / "gateway.log").read_text()
        answer: list[httpx.Response] = []
        client = threading.Thread(
            target=lambda: answer.append(httpx.post(f"{url}/v1/completions", json={"prompt": "x"}, timeout=120))
        )
        client.start()
        assert poll(lambda: len(stub.hits) == 1)  # in flight, held at the replica
        proc.send_signal(signal.SIGTERM)
        assert poll(lambda: httpx.get(f"{url}/readyz", timeout=5).status_code == 503)  # flipped; still serving
        assert httpx.get(f"{url}/livez", timeout=5).status_code == 200
        assert proc.poll() is None
        hold.set()
        client.join(60)
        assert answer and answer[0].status_code == 200
        assert proc.wait(60) == 0
    finally:
        hold.set()
        stop_process(proc)
        log.close()
        stub.stop()


def test_sidecar_keys_and_engine_load(trainer: Trainer, board_dir: str) -> None:
    """A sidecar that requires a key refuses clients without it (401) but keeps /flipsync/* and /metrics open; a
    gateway with its replica key reaches it; the torch engine's queue is on its status and member record."""
    engine = tiny_engine("bf16")
    server = ServerThread(create_engine_app(engine, max_concurrency=2)).start()
    store = open_store(board_dir, FAST)
    proxy = ProxyConfig(server.url, admit_timeout_s=10.0, api_keys=ApiKeys.of(["sk"]))
    sidecar = Sidecar(store, "run", engine, server.url, replica_config=fast_replica(), proxy_config=proxy).start()
    try:
        sidecar.join(MembershipConfig(public_url=sidecar.url, interval_s=0.2, ttl_s=2.0, min_gap_s=0.02))
        assert wait_until(lambda: sidecar.replica.serving, timeout=30)
        body = {"prompt": "hi", "max_tokens": 2}
        r = httpx.post(f"{sidecar.url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 401 and r.headers["x-should-retry"] == "false"
        r = httpx.post(f"{sidecar.url}/v1/completions", json=body, headers={"Authorization": "Bearer sk"}, timeout=30)
        assert r.status_code == 200
        status = httpx.get(f"{sidecar.url}/flipsync/status", timeout=30).json()  # open
        assert status["load"] == {"waiting": 0, "running": 0, "kv_cache": None}
        assert httpx.get(f"{sidecar.url}/metrics", timeout=30).status_code == 200
        reader = MemberReader(open_store(board_dir, FAST), runs=("run",))
        assert wait_until(lambda: any(m.load is not None for m in reader.scan().live), timeout=30)
        reader.close()
        with stub_fleet(stubs=[], pool=StaticPool([sidecar.url], api_key="sk"), replica_api_key="sk") as fleet:
            r = fleet.client.post("/v1/completions", json=body)
            assert r.status_code == 200 and r.json()["weight_version"]["start"] == 0
    finally:
        sidecar.stop()
        server.stop()
        store.close()


def test_vllm_and_sglang_metrics_parse_into_a_load() -> None:
    vllm = """# HELP vllm:num_requests_waiting Number of requests waiting.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 2.0
vllm:num_requests_running{engine="0",model_name="m"} 7.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25
vllm:request_success_total{finished_reason="stop"} 10.0
"""
    load = parse_metrics(vllm, "vllm")
    assert load is not None and (load.waiting, load.running, load.kv_cache) == (5, 7, 0.375)
    old = parse_metrics("vllm:gpu_cache_usage_perc 0.9\n", "vllm")
    assert old is not None and old.kv_cache == 0.9 and old.waiting is None
    sg = parse_metrics("sglang:num_queue_reqs 4\nsglang:num_running_reqs 2\nsglang:token_usage 0.1\n", "sglang")
    assert sg is not None and (sg.waiting, sg.running, sg.kv_cache) == (4, 2, 0.1)
    assert parse_metrics("other 1\n", "vllm") is None and parse_metrics("x 1", "torch") is None
