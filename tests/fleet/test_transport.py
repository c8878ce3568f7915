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

from flipsync.fleet.transport import AsyncioBackend
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
