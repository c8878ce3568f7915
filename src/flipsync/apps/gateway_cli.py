"""``flipsync gateway``: one OpenAI-compatible front door for a fleet, routing by policy version.

``gateway`` is a plain Typer command function; ``flipsync.apps.cli`` mounts it with ``app.command("gateway")(gateway)``.
``gateway_app`` holds it, so ``python -m flipsync.apps.gateway_cli gateway ...`` works on its own too.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer

from flipsync.apps.terminal import StoreOpt, command_app, command_error
from flipsync.errors import ConfigError, FlipsyncError

# The board, the gateway and uvicorn are imported inside the command, so that mounting it keeps
# ``flipsync --help`` fast.

gateway_app = command_app("flipsync-gateway", "One OpenAI-compatible front door for a fleet, routing by version.")


@gateway_app.command("gateway")
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
) -> None:
    """One OpenAI-compatible front door for a fleet: each request goes to a live replica that holds the
    version it asks for (or is ready), least loaded first; refusals and dead replicas are retried elsewhere."""
    from flipsync.serving import parse_listen, parse_pairs

    try:
        host, port = parse_listen(listen)
        if (board is None) == (not replica):
            raise ConfigError(
                "give either --board URL (the fleet's member records) or --replica URL ... (a static list)"
            )
        if max_lag < 0 or not hold >= 0 or not refresh > 0:
            raise ConfigError("--max-lag must be >= 0, --hold >= 0 and --refresh > 0 seconds")
        store_config = parse_pairs(store_option, "store option")
    except FlipsyncError as e:
        raise command_error(e) from None

    from flipsync.board.signing import Verifier
    from flipsync.fleet.gateway import Gateway
    from flipsync.fleet.pool import BoardPool, Pool, StaticPool
    from flipsync.fleet.routing import GatewayConfig
    from flipsync.serving import serve_until_signal
    from flipsync.stores import StoreOptions, open_store

    pool: Pool | None = None
    try:
        config = GatewayConfig(max_lag=max_lag, hold_s=hold, refresh_s=refresh, held_refresh_s=min(0.2, refresh))
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
            pool = StaticPool(replica)
            where = f"{len(replica)} static replica(s)"
        service = Gateway(pool, config)
        typer.echo(f"flipsync gateway: {where}, max lag {max_lag}, on {host}:{port}")
        serve_until_signal(service.app, host, port)
    except FlipsyncError as e:
        raise command_error(e) from None
    finally:
        if pool is not None:
            pool.close()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    gateway_app()
