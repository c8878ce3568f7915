"""Assembly of one sidecar (`Sidecar`: board reader, engine, reconcile loop, request gate, metrics, proxy, and
its member record once it joins a fleet), and `run_sidecar`, one sidecar process from its `SidecarSettings`."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from fastapi import FastAPI

from flipsync.board.membership import MemberWriter
from flipsync.board.mirror import MirrorCollector, find_mirror
from flipsync.board.reader import BoardReader
from flipsync.board.signing import Signer, Verifier
from flipsync.engines.base import Engine
from flipsync.errors import ConfigError, TransientStoreError
from flipsync.formats import get_format
from flipsync.serving import ServerThread
from flipsync.sidecar.gate import RequestGate
from flipsync.sidecar.heartbeat import Heartbeat, MembershipConfig
from flipsync.sidecar.load import LoadReader
from flipsync.sidecar.metrics import SidecarMetrics
from flipsync.sidecar.proxy import ProxyConfig, create_proxy_app
from flipsync.sidecar.replica import Replica, ReplicaConfig
from flipsync.stores import Store

if TYPE_CHECKING:
    from flipsync.engines.torch.openai_server import TorchEngineHandle
    from flipsync.sidecar.settings import SidecarSettings

log = logging.getLogger(__name__)
T = TypeVar("T")


def read_at_boot(read: Callable[[], T], store: Store, *, poll_s: float, timeout_s: float | None = None) -> T:
    """``read()``, tried again while the board fails transiently: a sidecar may start before the relay or the
    store it reads (containers of one pod start together), which is waited for as a run with no version is. It says
    why every minute and raises the store's last error after ``timeout_s`` (None: never)."""
    start = time.monotonic()
    next_warning = start
    while True:
        try:
            return read()
        except TransientStoreError as e:
            now = time.monotonic()
            if timeout_s is not None and now - start >= timeout_s:
                raise
            if now >= next_warning:
                log.warning("the board %s cannot be read yet (%s); the sidecar keeps trying", store.url, e)
                next_warning = now + 60.0
            time.sleep(poll_s)


def find_run(store: Store) -> str:
    """The board's only run (a sidecar may leave ``--run`` out when there is just one)."""
    runs = store.list_dirs("runs")
    if len(runs) == 1:
        return runs[0]
    if not runs:
        raise ConfigError(f"the board {store.url} has no run yet: pass --run NAME (the trainer's run name)")
    raise ConfigError(f"the board {store.url} has several runs ({', '.join(runs[:10])}): pass --run NAME")


def board_format(reader: BoardReader) -> str | None:
    """The served format of the board's HEAD (None: nothing published yet)."""
    head = reader.head()
    return None if head is None else reader.catalog.version(head).served_format


def no_version_yet(store: Store, run: str) -> str:
    """Why ``run`` has no version, naming the runs that do exist when it is not one of them (a typo?)."""
    runs = store.list_dirs("runs")
    if run in runs:
        return f"run {run!r} on {store.url} has no version yet"
    if not runs:
        return f"the board {store.url} has no run yet (this sidecar follows run {run!r})"
    shown = ", ".join(runs[:10]) + (f", ... ({len(runs)} runs)" if len(runs) > 10 else "")
    return (
        f"run {run!r} does not exist on {store.url}; the runs there are: {shown}. If --run is a typo, pass one "
        f"of them; otherwise a trainer has yet to create {run!r}"
    )


def wait_for_format(reader: BoardReader, *, poll_s: float, timeout_s: float | None = None) -> str:
    """The served format of the run's HEAD, polling until the run has a first version: a sidecar may start before
    its trainer, so an empty or missing run is waited for, not refused. It says why every minute (naming the runs
    that exist when the run is not one of them), and gives up with a ConfigError after ``timeout_s`` (None: never).
    A board that cannot be read yet is waited for too (`read_at_boot`).
    """
    start = time.monotonic()
    next_warning = start

    def head_format() -> str | None:
        return read_at_boot(lambda: board_format(reader), reader.store, poll_s=poll_s, timeout_s=timeout_s)

    while (fmt := head_format()) is None:
        now = time.monotonic()
        if timeout_s is not None and now - start >= timeout_s:
            raise ConfigError(
                f"{no_version_yet(reader.store, reader.run)}; gave up waiting for its first version after "
                f"{timeout_s:g} s (--wait-timeout)"
            )
        if now >= next_warning:
            log.warning(
                "%s; waiting for its first version to learn the served format (%.0f s so far)",
                no_version_yet(reader.store, reader.run),
                now - start,
            )
            next_warning = now + 60.0
        time.sleep(poll_s)
    return fmt


def check_decodable(reader: BoardReader, engine: Engine) -> None:
    """Refuse at boot a run whose patches code positions against their base when the engine cannot decode
    them (it would exclude every patch and wait for keyframes)."""
    head = reader.head()
    if head is None or engine.decodes_context:
        return
    if reader.catalog.version(head).meta.get("context", 0):
        raise ConfigError(
            f"run {reader.run!r} codes its patches against their base values (PublisherConfig(context=True), the "
            f"default), which the {engine.name} engine cannot decode without a host copy of its weights: give it "
            "one (vllm: --engine-option host_copy=FILE, or leave host_copy out for the default), or publish the run "
            "with PublisherConfig(context=False)"
        )


def check_format(requested: str | None, board: str, run: str) -> str:
    """The served format to run the engine in: the board's; a different ``--format`` is refused."""
    if requested is not None and get_format(requested).name != get_format(board).name:
        raise ConfigError(
            f"--format {requested} does not match run {run!r}, whose manifests say it serves {board}: start the "
            f"sidecar with --format {board} (and a model/engine that serves {board}), or leave --format out to "
            "take the board's format"
        )
    return board


class Sidecar:
    """One sidecar: keeps ``engine`` at the board's HEAD and serves the proxy in front of ``upstream_url``."""

    def __init__(
        self,
        store: Store,
        run: str,
        engine: Engine,
        upstream_url: str,
        *,
        verifier: Verifier | None = None,
        replica_config: ReplicaConfig | None = None,
        proxy_config: ProxyConfig | None = None,
    ) -> None:
        self.store = store
        self.metrics = SidecarMetrics()
        if (mirror := find_mirror(store)) is not None:  # a replicated board: its lag on /metrics too
            self.metrics.registry.register(MirrorCollector(mirror))
        self.gate = RequestGate()
        self.reader = BoardReader(store, run, verifier=verifier)
        self.replica = Replica(self.reader, engine, config=replica_config, gate=self.gate, metrics=self.metrics)
        self.proxy_config = proxy_config or ProxyConfig(upstream_url)
        if self.proxy_config.upstream_url != upstream_url:
            raise ConfigError("upstream_url and proxy_config.upstream_url differ")
        self.load = LoadReader(engine, upstream_url)  # the engine's load, on its status and member record
        self.app: FastAPI = create_proxy_app(self.replica, self.proxy_config, load=self.load)
        self.server: ServerThread | None = None
        self.heartbeat: Heartbeat | None = None

    def start(self, host: str = "127.0.0.1", port: int = 0) -> Sidecar:
        """Start the reconcile loop and the proxy on a thread (tests, embedding); see ``run`` for a CLI."""
        self.replica.start()
        self.server = ServerThread(self.app, host, port).start()
        return self

    def join(
        self, membership: MembershipConfig, *, store: Store | None = None, signer: Signer | None = None
    ) -> Heartbeat:
        """Join the fleet: keep this replica's member record on ``store`` (default: the board it reads),
        signed with ``signer`` on a signed board. A relay is read-only: records go to the board itself."""
        if self.heartbeat is not None:
            raise ConfigError("this sidecar has joined a fleet already")
        writer = MemberWriter(store if store is not None else self.store, self.reader.run, signer=signer)
        self.heartbeat = Heartbeat(
            writer, self.replica, membership, upstream_url=self.proxy_config.upstream_url, load=self.load
        ).start()
        log.info("joined the fleet as %s (%s) at %s", membership.replica, membership.island, membership.public_url)
        return self.heartbeat

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Leave: refuse new requests (503, so gateways send them elsewhere), mark the record draining, wait
        up to ``timeout_s`` for the requests in flight, then delete the record. True if all of them finished."""
        self.gate.start_draining()
        if self.heartbeat is not None:
            self.heartbeat.beat()  # the record says draining now
        n = self.gate.in_flight
        done = self.gate.wait_idle(timeout_s)
        if not done:
            log.warning(
                "%d request(s) still in flight after %g s of draining; leaving anyway", self.gate.in_flight, timeout_s
            )
        if self.heartbeat is not None:
            self.heartbeat.stop(deregister=True)
            self.heartbeat = None
        log.info("drained (%d request(s) were in flight) and left the fleet", n)
        return done

    @property
    def url(self) -> str:
        if self.server is None:
            raise ConfigError("the sidecar is not started")
        return self.server.url

    def stop(self, *, deregister: bool = True) -> None:
        """Stop serving; a member record is deleted (``deregister=False`` leaves it to expire, as a crash does)."""
        if self.heartbeat is not None:
            self.heartbeat.stop(deregister=deregister)
            self.heartbeat = None
        if self.server is not None:
            self.server.stop()
            self.server = None
        self.replica.stop()
        self.load.close()


def run_sidecar(settings: SidecarSettings, *, started: Callable[[str], None] | None = None) -> None:
    """Run one sidecar until SIGINT / SIGTERM (the first drains): open the board, start or reach the engine,
    follow the board, serve the proxy on the main thread, join the fleet when ``settings.public_url`` is set.
    ``started`` is told one line once the proxy is about to serve. Raises FlipsyncError on a setting that
    cannot be used (a relay as the fleet's board, an unknown format, a run with no version in time, ...)."""
    from flipsync.board.ahead import FetchAhead
    from flipsync.engines.registry import EngineOptions, load_engine
    from flipsync.serving import exit_on_signals, parse_listen, serve_until_signal
    from flipsync.stores import StoreOptions, is_relay_url, open_store

    s = settings
    if s.public_url is not None and s.fleet_board is None and is_relay_url(s.board):
        raise ConfigError(
            "--board is a relay, which is read-only: pass --fleet-board with the board itself (where the "
            "gateways read member records)"
        )
    if s.served_format is not None:
        get_format(s.served_format)  # an unknown name is refused before waiting for the board
    torch_handle: TorchEngineHandle | None = None  # the in-process torch engine's server, when engine="torch"
    service: Sidecar | None = None
    store: Store | None = None
    try:
        verifier = Verifier.from_pem(*s.public_keys) if s.public_keys else None
        store = open_store(s.board, StoreOptions(config=dict(s.store_options)))
        if s.origin is not None or s.mirror_wait_s is not None:
            from flipsync.board.mirror import MirrorPolicy, MirrorStore

            origin = open_store(s.origin, StoreOptions(config=dict(s.origin_options))) if s.origin else None
            wait_s = 30.0 if s.mirror_wait_s is None else s.mirror_wait_s
            store = MirrorStore(store, origin, MirrorPolicy(wait_s=wait_s))
        if s.fetch_ahead_s > 0:
            store = FetchAhead(store, interval_s=s.fetch_ahead_s)
        board = store  # `store` may be None in the finally below; the closures take the opened one

        def at_boot(read: Callable[[], T]) -> T:
            with exit_on_signals():
                return read_at_boot(read, board, poll_s=max(s.poll_s, 0.5), timeout_s=s.wait_timeout_s)

        run = s.run or at_boot(lambda: find_run(board))
        fmt = s.served_format
        if s.engine == "torch" or s.served_format is not None:
            # The torch engine is built in the board's format, and a format is checked against it: both need a
            # version, so a run the trainer has not published yet is waited for (no guessing a format).
            with exit_on_signals():
                board_fmt = wait_for_format(
                    BoardReader(store, run, verifier=verifier), poll_s=s.poll_s, timeout_s=s.wait_timeout_s
                )
            fmt = check_format(s.served_format, board_fmt, run)
        elif at_boot(lambda: board_format(BoardReader(board, run, verifier=verifier))) is None:
            log.warning("%s; the sidecar waits for it", no_version_yet(store, run))
        if s.engine == "torch":
            from flipsync.engines.torch.openai_server import start_torch_engine  # the torch-engine extra

            if s.threads:
                import torch

                torch.set_num_threads(s.threads)
            assert fmt is not None
            ehost, eport = parse_listen(s.engine_listen)
            # The name the engine answers with ("model", /v1/models) is the member record's: one name, one behaviour.
            torch_handle = start_torch_engine(
                s.model,
                fmt,
                device=s.device,
                host=ehost,
                port=eport,
                max_concurrency=s.max_concurrency,
                **({"model_name": s.model_name} if s.model_name is not None else {}),
            )
            engine: Engine = torch_handle.engine
            upstream_url = torch_handle.url
        else:
            assert s.upstream is not None
            engine = load_engine(s.engine, EngineOptions(s.upstream, fmt, s.device, dict(s.engine_options)))
            upstream_url = s.upstream
        at_boot(lambda: check_decodable(BoardReader(board, run, verifier=verifier), engine))
        service = Sidecar(
            store,
            run,
            engine,
            upstream_url,
            verifier=verifier,
            replica_config=s.replica_config(),
            proxy_config=s.proxy_config(upstream_url),
        )
        service.replica.start()
        if (membership := s.membership()) is not None:
            signer = Signer.from_pem(s.member_key) if s.member_key is not None else None
            member_store = store
            if s.fleet_board is not None:
                member_store = open_store(s.fleet_board, StoreOptions(config=dict(s.store_options)))
            service.join(membership, store=member_store, signer=signer)
        host, port = parse_listen(s.listen)
        if started is not None:
            started(f"run {run!r} on {store.url}, {s.engine} engine, proxy on {host}:{port}")
        the_service = service
        # The proxy runs on the main thread so that SIGINT / SIGTERM stop it cleanly; the first one drains.
        serve_until_signal(service.app, host, port, before_exit=lambda: the_service.drain(s.exit_timeout_s))
    finally:
        if service is not None:
            if service.heartbeat is not None:  # not drained (an error): leave the fleet all the same
                service.heartbeat.stop(deregister=True)
            service.replica.stop()
            service.load.close()
            service.replica.engine.close()
        if torch_handle is not None:
            torch_handle.stop()
        if store is not None:
            store.close()
