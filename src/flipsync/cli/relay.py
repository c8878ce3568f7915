"""``flipsync relay``: serve a board to the sidecars of one island.

``relay`` is a plain Typer command function; ``flipsync.cli.main`` mounts it with ``app.command("relay")(relay)``.
``relay_app`` holds it, so ``python -m flipsync.cli.relay relay ...`` works on its own too.
"""

from __future__ import annotations

import logging
from typing import Annotated

import typer

from flipsync.cli.terminal import StoreOpt, command_app, command_error, server_command
from flipsync.errors import FlipsyncError

# Everything heavy (uvicorn, the board's stores) is imported inside the command, so that mounting it keeps
# ``flipsync --help`` and the other commands fast.


relay_app = command_app(
    "flipsync-relay", "Serve a board to the sidecars of one island: a read-through cache with coalesced fetches."
)


BoardOpt = Annotated[str, typer.Option("--board", "-b", help="Board URL or path (s3://..., ./board) the relay reads")]


@relay_app.command("relay")
@server_command
def relay(
    board: BoardOpt,
    listen: Annotated[str, typer.Option(help="Where the relay listens, HOST:PORT")] = "127.0.0.1:8200",
    cache_mib: Annotated[int, typer.Option(help="Memory for cached objects (MiB)")] = 4096,
    max_object_mib: Annotated[int, typer.Option(help="Larger objects are relayed but not cached (MiB)")] = 1024,
    hint_ttl: Annotated[float, typer.Option(help="Seconds the HEAD hint (latest.json) is cached")] = 0.5,
    listing_ttl: Annotated[float, typer.Option(help="Seconds a listing is cached")] = 1.0,
    negative_ttl: Annotated[float, typer.Option(help="Seconds a missing object is remembered")] = 0.25,
    watch_interval: Annotated[
        float, typer.Option(help="Seconds between the relay's checks for an object sidecars wait for")
    ] = 0.05,
    fetch_ahead: Annotated[
        bool,
        typer.Option(help="While sidecars wait for a version, cache the parts already uploaded to its folder"),
    ] = True,
    store_option: StoreOpt = None,
) -> None:
    """Serve a board to the sidecars of one island: a read-through cache with coalesced fetches."""
    from flipsync.relay.server import RelayCache, RelayConfig, create_relay_app
    from flipsync.serving import parse_listen, parse_pairs, serve_until_signal
    from flipsync.stores import StoreOptions, open_store

    store = None
    try:
        host, port = parse_listen(listen)
        store = open_store(board, StoreOptions(config=parse_pairs(store_option, "store option")))
        config = RelayConfig(
            max_cache_bytes=cache_mib << 20,
            max_object_bytes=max_object_mib << 20,
            hint_ttl_s=hint_ttl,
            listing_ttl_s=listing_ttl,
            negative_ttl_s=negative_ttl,
            watch_interval_s=watch_interval,
            fetch_ahead=fetch_ahead,
        )
        app = create_relay_app(RelayCache(store, config))
        typer.echo(f"flipsync relay: {store.url} on {host}:{port}")
        serve_until_signal(app, host, port)
    except FlipsyncError as e:
        raise command_error(e) from None
    finally:
        if store is not None:
            store.close()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    relay_app()
