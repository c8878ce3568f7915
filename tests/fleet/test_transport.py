"""The gateway's asyncio network backend for httpcore: requests and kept-alive connections, a server that
closed an idle connection, TLS, and the errors httpcore expects (refused, timed out)."""

from __future__ import annotations

import asyncio
import datetime
import socket
import ssl
import threading
from pathlib import Path

import httpcore
import pytest
import uvicorn
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from fastapi import FastAPI

from flipsync.fleet.stub_replica import StubReplica
from flipsync.fleet.transport import AsyncioBackend, ReplicaConnections
from flipsync.serving import ServerThread


def app() -> FastAPI:
    a = FastAPI()

    @a.post("/echo")
    async def echo(body: dict[str, int]) -> dict[str, int]:
        return {"n": body["n"] + 1}

    return a


def test_requests_reuse_connections_and_notice_a_closed_one() -> None:
    server = ServerThread(app()).start()
    port, url = server.port, server.url
    try:

        async def go() -> None:
            async with httpcore.AsyncConnectionPool(network_backend=AsyncioBackend()) as pool:
                for n in range(5):
                    r = await pool.request(
                        "POST",
                        url + "/echo",
                        content=f'{{"n": {n}}}'.encode(),
                        headers={"content-type": "application/json"},
                    )
                    assert r.status == 200 and r.content == f'{{"n":{n + 1}}}'.encode()
                assert len(pool.connections) == 1 and "Request Count: 5" in repr(pool.connections[0])
                # The server closes its idle connections (a restart): the next request must not fail.
                conn = pool.connections[0]
                stream = conn._connection._network_stream  # type: ignore[union-attr]
                assert stream.get_extra_info("is_readable") is False
                assert stream.get_extra_info("server_addr")[1] == port
                await asyncio.to_thread(server.stop)
                new = ServerThread(app(), port=port).start()
                try:
                    for _ in range(50):
                        if stream.get_extra_info("is_readable"):
                            break
                        await asyncio.sleep(0.02)
                    assert stream.get_extra_info("is_readable") is True
                    r = await pool.request(
                        "POST", url + "/echo", content=b'{"n": 7}', headers={"content-type": "application/json"}
                    )
                    assert r.status == 200 and r.content == b'{"n":8}'
                finally:
                    await asyncio.to_thread(new.stop)

        asyncio.run(go())
    finally:
        server.stop()


def self_signed(tmp: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_path, cert_path = tmp / "key.pem", tmp / "cert.pem"
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key_path, cert_path


def test_tls(tmp_path: Path) -> None:
    key, cert = self_signed(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = uvicorn.Config(
        app(), host="127.0.0.1", port=port, log_level="warning", ssl_keyfile=str(key), ssl_certfile=str(cert)
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        for _ in range(200):
            if server.started:
                break
            threading.Event().wait(0.02)
        context = ssl.create_default_context(cafile=str(cert))

        async def go() -> None:
            async with httpcore.AsyncConnectionPool(network_backend=AsyncioBackend(), ssl_context=context) as pool:
                r = await pool.request(
                    "POST",
                    f"https://localhost:{port}/echo",
                    content=b'{"n": 1}',
                    headers={"content-type": "application/json"},
                )
                assert r.status == 200 and r.content == b'{"n":2}'
                stream = pool.connections[0]._connection._network_stream  # type: ignore[union-attr]
                assert stream.get_extra_info("ssl_object") is not None
            async with httpcore.AsyncConnectionPool(network_backend=AsyncioBackend()) as strict:
                with pytest.raises(httpcore.ConnectError):  # not a trusted certificate
                    await strict.request("POST", f"https://localhost:{port}/echo", content=b'{"n": 1}')

        asyncio.run(go())
    finally:
        server.should_exit = True
        thread.join(10)


def test_refused_and_silent_servers_raise_what_httpcore_expects() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # accepts connections, never answers

    async def go() -> None:
        async with httpcore.AsyncConnectionPool(network_backend=AsyncioBackend()) as pool:
            with pytest.raises(httpcore.ConnectError):
                await pool.request("POST", f"http://127.0.0.1:{closed}/echo", content=b"{}")
            timeouts = {"connect": 2.0, "read": 0.3, "write": 2.0, "pool": 2.0}
            with pytest.raises(httpcore.ReadTimeout):
                await pool.request(
                    "POST",
                    f"http://127.0.0.1:{silent.getsockname()[1]}/echo",
                    content=b"{}",
                    extensions={"timeout": timeouts},
                )

    try:
        asyncio.run(go())
    finally:
        silent.close()


# -- ReplicaConnections: the gateway's pools ----------------------------------------------------------------------


def _post(url: str, pool_timeout: float = 10.0) -> httpcore.Request:
    body = b'{"prompt": "hi", "max_tokens": 1}'
    return httpcore.Request(
        b"POST",
        url + "/v1/completions",
        headers=[(b"host", url.split("//")[1].encode()), (b"content-length", str(len(body)).encode())],
        content=body,
        extensions={"timeout": {"pool": pool_timeout}},
    )


async def _answer(conns: ReplicaConnections, url: str, pool_timeout: float = 10.0) -> int:
    resp = await conns.handle_async_request(_post(url, pool_timeout))
    try:
        body = b"".join([c async for c in resp.aiter_stream()])
        assert b"choices" in body, body
        return resp.status
    finally:
        await resp.aclose()


def test_replica_connections_add_pools_for_a_burst_and_close_them_after() -> None:
    hold = threading.Event()
    stubs = [StubReplica(hold=hold).start(), StubReplica().start()]
    a, b = (s.url for s in stubs)

    async def go() -> None:
        conns = ReplicaConnections(1000, per_pool=8)
        origin = httpcore.URL(a).origin
        key = (origin.scheme, origin.host, origin.port)
        burst = [asyncio.create_task(_answer(conns, a)) for _ in range(20)]  # held by the stub: 20 in flight
        for _ in range(200):
            if len(stubs[0].hits) >= 20:
                break
            await asyncio.sleep(0.05)
        assert conns.pools(key) == 3  # 8 + 8 + 4
        assert await _answer(conns, b) == 200  # another replica's request does not wait for a's
        hold.set()
        assert await asyncio.gather(*burst) == [200] * 20
        assert conns.pools(key) == 1  # the extras closed as the burst ended; the first keeps its connections
        assert await _answer(conns, a) == 200
        conns.forget([b])  # a left the fleet: its pools close (on a task of their own)
        assert conns.pools(key) == 0
        assert await _answer(conns, a) == 200  # and come back if it does
        await conns.aclose()

    try:
        asyncio.run(go())
    finally:
        hold.set()
        for s in stubs:
            s.stop()


def test_replica_connections_bound_the_requests_in_flight_and_give_back_failed_ones() -> None:
    hold = threading.Event()
    stub = StubReplica(hold=hold).start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        refused = f"http://127.0.0.1:{s.getsockname()[1]}"  # nobody listens there

    async def go() -> None:
        conns = ReplicaConnections(2, per_pool=8)
        for _ in range(5):  # failed connects give their slots back
            with pytest.raises(httpcore.ConnectError):
                await conns.handle_async_request(_post(refused))
        held = [asyncio.create_task(_answer(conns, stub.url)) for _ in range(2)]
        for _ in range(200):
            if len(stub.hits) >= 2:
                break
            await asyncio.sleep(0.05)
        with pytest.raises(httpcore.PoolTimeout, match="all 2 connections"):
            await _answer(conns, stub.url, pool_timeout=0.2)
        waiting = asyncio.create_task(_answer(conns, stub.url, pool_timeout=30))
        await asyncio.sleep(0.1)
        assert not waiting.done()
        hold.set()  # the two answers end: the waiting request gets a slot
        assert await asyncio.gather(*held, waiting) == [200, 200, 200]
        await conns.aclose()

    try:
        asyncio.run(go())
    finally:
        hold.set()
        stub.stop()
