"""``flipsync sidecar``.

``sidecar`` is a plain Typer command function; ``flipsync.cli.main`` mounts it with ``app.command("sidecar")(sidecar)``.
``sidecar_app`` holds it, so ``python -m flipsync.cli.sidecar sidecar ...`` works on its own too
(``flipsync relay`` lives in ``flipsync.cli.relay``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer

from flipsync.cli.terminal import StoreOpt, command_app, command_error, server_command
from flipsync.errors import FlipsyncError
from flipsync.sidecar.gate import CommitMode

# Everything heavy (torch, transformers, uvicorn, the board) is imported inside the commands, so that
# mounting them keeps ``flipsync --help`` and the other commands fast.

log = logging.getLogger(__name__)

sidecar_app = command_app(
    "flipsync-sidecar", "Keep an inference engine bitwise at a board's HEAD, behind a version-aware proxy."
)


BoardOpt = Annotated[
    str, typer.Option("--board", "-b", help="Board URL or path (s3://..., ./board), or a relay http://HOST:PORT")
]


@sidecar_app.command("sidecar")
@server_command
def sidecar(
    board: BoardOpt,
    listen: Annotated[str, typer.Option(help="Where the proxy listens, HOST:PORT")] = "127.0.0.1:8100",
    engine: Annotated[str, typer.Option(help="Inference engine: torch | vllm | sglang")] = "torch",
    run: Annotated[str | None, typer.Option(help="Run name on the board (default: its only run)")] = None,
    upstream: Annotated[
        str | None, typer.Option(help="The engine's OpenAI-compatible URL (vllm, sglang; torch serves its own)")
    ] = None,
    commit_mode: Annotated[CommitMode, typer.Option(help="in_place: pause and continue; quiesce: drain first")] = (
        CommitMode.IN_PLACE
    ),
    poll: Annotated[float, typer.Option(help="Seconds between board polls")] = 1.0,
    fetch_ahead: Annotated[
        float,
        typer.Option(
            help="Seconds between listings of the next version's folder, to download its parts while the trainer "
            "uploads them (0: off; each listing is one store request; behind a relay, the relay does this)"
        ),
    ] = 0.0,
    max_backoff: Annotated[float, typer.Option(help="Longest wait between retries after failures (s)")] = 30.0,
    drain_timeout: Annotated[
        float, typer.Option(help="Longest wait for in-flight requests before a commit (s)")
    ] = 30.0,
    adopt_search: Annotated[
        int, typer.Option(help="On boot, versions searched for the engine's current weights (0: always reload)")
    ] = 64,
    public_key: Annotated[
        list[Path] | None, typer.Option("--public-key", help="Accept only manifests signed by this key (repeatable)")
    ] = None,
    store_option: StoreOpt = None,
    model: Annotated[str, typer.Option(help="torch: model preset (tiny, small, base) or a config.json")] = "tiny",
    served_format: Annotated[
        str | None, typer.Option("--format", help="Served format; must match the board's (default: the board's)")
    ] = None,
    device: Annotated[str, typer.Option(help="torch: cpu or cuda[:N]")] = "cpu",
    engine_listen: Annotated[str, typer.Option(help="torch: where its OpenAI server listens")] = "127.0.0.1:0",
    threads: Annotated[int | None, typer.Option(help="torch: CPU threads for the model")] = None,
    max_concurrency: Annotated[int, typer.Option(help="torch: sequences generated at once")] = 8,
    engine_option: Annotated[
        list[str] | None, typer.Option("--engine-option", help="vllm/sglang: engine setting key=value")
    ] = None,
    wait_timeout: Annotated[
        float | None,
        typer.Option(
            help="Give up (exit 2) when the run has no version after this many seconds (default: wait for it)"
        ),
    ] = None,
    origin: Annotated[
        str | None,
        typer.Option(
            help="--board is a replicated copy of this origin board: objects the copy lacks after --mirror-wait "
            "are read from the origin (docs/integrations/mirrors.md)"
        ),
    ] = None,
    origin_option: Annotated[
        list[str] | None, typer.Option("--origin-option", help="Origin store setting key=value (endpoint, region)")
    ] = None,
    mirror_wait: Annotated[
        float | None,
        typer.Option(
            help="--board is a replicated copy: wait this many seconds for an object it lacks yet (default 30 with "
            "--origin; without --origin, objects still missing then fail the pass and are retried)"
        ),
    ] = None,
    public_url: Annotated[
        str | None,
        typer.Option(
            help="Join the fleet: the URL gateways reach this proxy at; the sidecar keeps a member record on the "
            "board (docs/fleet.md)"
        ),
    ] = None,
    replica_id: Annotated[
        str | None, typer.Option(help="Fleet: this replica's id on the board (default: host-port of --public-url)")
    ] = None,
    island: Annotated[str, typer.Option(help="Fleet: the island (region, cluster) this replica is in")] = "default",
    model_name: Annotated[
        str | None,
        typer.Option(
            help="The OpenAI model name served: torch answers with it (default flipsync-torch); fleet: the member "
            "record's (default: the engine's, or its first /v1/models)"
        ),
    ] = None,
    heartbeat: Annotated[float, typer.Option(help="Fleet: seconds between member record writes")] = 5.0,
    member_ttl: Annotated[
        float, typer.Option(help="Fleet: seconds a member record stays valid after its last write")
    ] = 15.0,
    member_key: Annotated[
        Path | None, typer.Option(help="Fleet: sign the member record with this Ed25519 key (a signed board)")
    ] = None,
    fleet_board: Annotated[
        str | None,
        typer.Option(help="Fleet: the board to keep the member record on (default: --board; a relay is read-only)"),
    ] = None,
    exit_timeout: Annotated[
        float,
        typer.Option(help="On SIGTERM, longest wait for the requests in flight before leaving the fleet (s)"),
    ] = 30.0,
    api_keys_file: Annotated[
        Path | None,
        typer.Option(
            help="Clients of the proxy's model API must send one of these keys (one a line; also "
            "FLIPSYNC_API_KEYS, comma-separated); /flipsync/* and /metrics stay open"
        ),
    ] = None,
) -> None:
    """Follow a board and keep one engine at its HEAD, behind a version-aware OpenAI-compatible proxy."""
    from flipsync.auth import ApiKeys
    from flipsync.serving import parse_pairs
    from flipsync.sidecar.settings import SidecarSettings

    # The settings first: a typo is answered in milliseconds, before the board and the engine are reached.
    try:
        settings = SidecarSettings(
            board=board,
            run=run,
            store_options=parse_pairs(store_option, "store option"),
            public_keys=tuple(public_key or ()),
            poll_s=poll,
            fetch_ahead_s=fetch_ahead,
            wait_timeout_s=wait_timeout,
            origin=origin,
            origin_options=parse_pairs(origin_option, "origin option"),
            mirror_wait_s=mirror_wait,
            engine=engine,
            upstream=upstream,
            engine_options=parse_pairs(engine_option, "engine option"),
            served_format=served_format,
            model=model,
            model_name=model_name,
            device=device,
            engine_listen=engine_listen,
            threads=threads,
            max_concurrency=max_concurrency,
            commit_mode=commit_mode,
            max_backoff_s=max_backoff,
            drain_timeout_s=drain_timeout,
            adopt_search=adopt_search,
            listen=listen,
            api_keys=ApiKeys.load(api_keys_file),
            exit_timeout_s=exit_timeout,
            public_url=public_url,
            replica_id=replica_id,
            island=island,
            heartbeat_s=heartbeat,
            member_ttl_s=member_ttl,
            member_key=member_key,
            fleet_board=fleet_board,
        )
    except FlipsyncError as e:
        raise command_error(e) from None
    from flipsync.sidecar.service import run_sidecar

    try:
        run_sidecar(settings, started=lambda line: typer.echo(f"flipsync sidecar: {line}"))
    except FlipsyncError as e:
        raise command_error(e) from None


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    sidecar_app()
