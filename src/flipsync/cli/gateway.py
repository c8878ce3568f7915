"""``flipsync gateway``: one OpenAI-compatible front door for a fleet, routing by policy version.

``gateway`` is a plain Typer command function; ``flipsync.cli.main`` mounts it with ``app.command("gateway")(gateway)``.
``gateway_app`` holds it, so ``python -m flipsync.cli.gateway gateway ...`` works on its own too.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer

from flipsync.cli.terminal import StoreOpt, command_app, command_error, server_command
from flipsync.errors import ConfigError, FlipsyncError

log = logging.getLogger(__name__)

# The board, the gateway and uvicorn are imported inside the command, so that mounting it keeps
# ``flipsync --help`` fast.

gateway_app = command_app("flipsync-gateway", "One OpenAI-compatible front door for a fleet, routing by version.")


@gateway_app.command("gateway")
@server_command
def gateway(
    board: Annotated[
        str | None,
        typer.Option("--board", "-b", help="The board whose member records name the fleet (s3://..., ./board)"),
    ] = None,
    listen: Annotated[str, typer.Option(help="Where the gateway listens, HOST:PORT")] = "127.0.0.1:8300",
    run: Annotated[
        list[str] | None, typer.Option("--run", help="Route to the replicas of this run only (repeatable)")
    ] = None,
    replica: Annotated[
        list[str] | None,
        typer.Option("--replica", help="A static fleet instead of a board: a sidecar's URL (repeatable)"),
    ] = None,
    max_lag: Annotated[
        int, typer.Option(help="Versions behind HEAD a replica may be and still take unconstrained requests")
    ] = 2,
    hold: Annotated[
        float, typer.Option(help="Longest wait for a replica that can serve a request, then 409 / 503 (s)")
    ] = 10.0,
    refresh: Annotated[float, typer.Option(help="Seconds between reads of the member records")] = 1.0,
    member_key: Annotated[
        list[Path] | None,
        typer.Option("--member-key", help="A signed board: route only to records signed by this key (repeatable)"),
    ] = None,
    public_key: Annotated[
        list[Path] | None, typer.Option("--public-key", help="Read HEAD from manifests signed by this key only")
    ] = None,
    store_option: StoreOpt = None,
    max_connections: Annotated[
        int, typer.Option(help="Requests in flight to all replicas together (each holds a connection; more wait)")
    ] = 4096,
    connect_timeout: Annotated[float, typer.Option(help="Longest wait to connect to a replica (s)")] = 2.0,
    read_timeout: Annotated[
        float,
        typer.Option(
            help="Longest silence of a replica while it streams (s); a non-streaming answer is waited for until "
            "--total-timeout (it comes whole at the end)"
        ),
    ] = 600.0,
    total_timeout: Annotated[
        float | None, typer.Option(help="Longest time of a whole request, streams included (s; default: none)")
    ] = None,
    drain_timeout: Annotated[
        float, typer.Option(help="On SIGTERM, longest wait for the requests in flight before exiting (s)")
    ] = 30.0,
    affinity: Annotated[
        bool,
        typer.Option(help="Send a session's turns and a prompt's samples to one replica while it stays eligible"),
    ] = True,
    eject_after: Annotated[
        int, typer.Option(help="Failures in a row (502, 503, connection errors) that eject a replica (0: never)")
    ] = 2,
    eject_backoff: Annotated[
        float, typer.Option(help="First ejection's length (s); it doubles while probes fail, up to 300 s")
    ] = 15.0,
    api_keys_file: Annotated[
        Path | None,
        typer.Option(help="Clients must send one of these keys (one a line; also FLIPSYNC_API_KEYS, comma-separated)"),
    ] = None,
    replica_api_key: Annotated[
        str | None,
        typer.Option(help="The key to send to sidecars that require one (default: $FLIPSYNC_REPLICA_API_KEY)"),
    ] = None,
) -> None:
    """One OpenAI-compatible front door for a fleet: each request goes to a live replica that holds the
    version it asks for (or is ready), least loaded first; refusals and dead replicas are retried elsewhere."""
    from flipsync.auth import ApiKeys, replica_key
    from flipsync.serving import parse_listen, parse_pairs

    try:
        host, port = parse_listen(listen)
        if (board is None) == (not replica):
            raise ConfigError(
                "give either --board URL (the fleet's member records) or --replica URL ... (a static list)"
            )
        if max_lag < 0 or not hold >= 0 or not refresh > 0:
            raise ConfigError("--max-lag must be >= 0, --hold >= 0 and --refresh > 0 seconds")
        if max_connections < 1 or not connect_timeout > 0 or not read_timeout > 0:
            raise ConfigError("--max-connections must be >= 1, --connect-timeout and --read-timeout > 0 seconds")
        if total_timeout is not None and not total_timeout > 0:
            raise ConfigError("--total-timeout must be > 0 seconds (leave it out for none)")
        if not drain_timeout >= 0 or eject_after < 0 or not eject_backoff > 0:
            raise ConfigError("--drain-timeout must be >= 0, --eject-after >= 0 and --eject-backoff > 0 seconds")
        store_config = parse_pairs(store_option, "store option")
        api_keys = ApiKeys.load(api_keys_file)
        replica_auth = replica_key(replica_api_key)
    except FlipsyncError as e:
        raise command_error(e) from None

    from flipsync.board.signing import Verifier
    from flipsync.fleet.affinity import AffinityPolicy
    from flipsync.fleet.ejection import EjectionPolicy
    from flipsync.fleet.gateway import Gateway
    from flipsync.fleet.pool import BoardPool, Pool, StaticPool
    from flipsync.fleet.routing import GatewayConfig
    from flipsync.serving import serve_until_signal
    from flipsync.stores import StoreOptions, open_store

    pool: Pool | None = None
    try:
        config = GatewayConfig(
            max_lag=max_lag,
            hold_s=hold,
            refresh_s=refresh,
            held_refresh_s=min(0.2, refresh),
            max_connections=max_connections,
            connect_timeout_s=connect_timeout,
            request_timeout_s=read_timeout,
            total_timeout_s=total_timeout,
            drain_timeout_s=drain_timeout,
            affinity=AffinityPolicy(enabled=affinity),
            ejection=EjectionPolicy(after=eject_after, backoff_s=eject_backoff),
            api_keys=api_keys,
            replica_api_key=replica_auth,
        )
        raise_open_files(2 * max_connections + 1024)  # a stream holds a client socket and a replica socket
        if board is not None:
            # The board itself, not a relay: member records change every few seconds and a relay caches objects.
            store = open_store(board, StoreOptions(config=store_config))
            pool = BoardPool(
                store,
                runs=run or None,
                member_verifier=Verifier.from_pem(*member_key) if member_key else None,
                verifier=Verifier.from_pem(*public_key) if public_key else None,
            )
            where = f"members of {', '.join(run) if run else 'every run'} on {store.url}"
        else:
            assert replica
            pool = StaticPool(replica, api_key=replica_auth)
            where = f"{len(replica)} static replica(s)"
        service = Gateway(pool, config)
        auth = "API keys required" if api_keys is not None else "no client authentication"
        typer.echo(f"flipsync gateway: {where}, max lag {max_lag}, {auth}, on {host}:{port}")
        # The first SIGTERM / SIGINT drains (readyz 503, the requests in flight finish), then the server stops.
        serve_until_signal(service.app, host, port, before_exit=lambda: service.drain())
    except FlipsyncError as e:
        raise command_error(e) from None
    finally:
        if pool is not None:
            pool.close()


def raise_open_files(wanted: int) -> None:
    """Raise this process's open-file limit toward ``wanted`` (up to the hard limit): every connection is a file."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if target < wanted:
        log.warning("open files limited to %d (hard limit); --max-connections may not all be usable", target)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    gateway_app()
