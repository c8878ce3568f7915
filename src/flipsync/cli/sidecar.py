"""``flipsync sidecar``.

``sidecar`` is a plain Typer command function; ``flipsync.cli.main`` mounts it with ``app.command("sidecar")(sidecar)``.
``sidecar_app`` holds it, so ``python -m flipsync.cli.sidecar sidecar ...`` works on its own too
(``flipsync relay`` lives in ``flipsync.cli.relay``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from flipsync.cli.terminal import StoreOpt, command_app, command_error
from flipsync.errors import ConfigError, FlipsyncError
from flipsync.sidecar.gate import CommitMode

if TYPE_CHECKING:
    from flipsync.engines.base import Engine
    from flipsync.engines.torch.openai_server import TorchEngineHandle

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
    from flipsync.engines.registry import EngineOptions, check_kind, load_engine
    from flipsync.serving import parse_listen, parse_pairs

    # The arguments first: a typo is answered in milliseconds, before torch and the engines are imported.
    try:
        host, port = parse_listen(listen)
        check_kind(engine)
        if engine == "torch":
            ehost, eport = parse_listen(engine_listen)
        elif not upstream:
            raise ConfigError(f"--upstream URL is required for the {engine} engine (its OpenAI server)")
        store_config = parse_pairs(store_option, "store option")
        engine_config = parse_pairs(engine_option, "engine option")
        if wait_timeout is not None and not wait_timeout >= 0:
            raise ConfigError(f"--wait-timeout must be a number of seconds >= 0, not {wait_timeout}")
        if not fetch_ahead >= 0:
            raise ConfigError(f"--fetch-ahead must be a number of seconds >= 0 (0: off), not {fetch_ahead}")
        if mirror_wait is not None and not mirror_wait >= 0:
            raise ConfigError(f"--mirror-wait must be a number of seconds >= 0, not {mirror_wait}")
        origin_config = parse_pairs(origin_option, "origin option")
        from flipsync.auth import ApiKeys  # light: no torch

        api_keys = ApiKeys.load(api_keys_file)
        if not exit_timeout >= 0:
            raise ConfigError(f"--exit-timeout must be a number of seconds >= 0, not {exit_timeout}")
        if model_name is not None:
            from flipsync.domain.fleet import check_model  # pure: no torch yet

            check_model(model_name)
        if public_url is not None:
            from flipsync.domain.fleet import check_url  # pure: no torch yet

            check_url(public_url)
            if not 0 < heartbeat < member_ttl:
                raise ConfigError(
                    f"--heartbeat ({heartbeat:g} s) must be positive and below --member-ttl ({member_ttl:g} s)"
                )
        elif replica_id is not None or member_key is not None or fleet_board is not None:
            raise ConfigError("--replica-id, --member-key and --fleet-board need --public-url (joining the fleet)")
    except FlipsyncError as e:
        raise command_error(e) from None

    from flipsync.board.ahead import FetchAhead
    from flipsync.board.reader import BoardReader
    from flipsync.board.signing import Verifier
    from flipsync.formats import get_format
    from flipsync.serving import exit_on_signals, serve_until_signal
    from flipsync.sidecar.proxy import ProxyConfig
    from flipsync.sidecar.replica import ReplicaConfig
    from flipsync.sidecar.service import (
        Sidecar,
        board_format,
        check_decodable,
        check_format,
        find_run,
        no_version_yet,
        wait_for_format,
    )
    from flipsync.stores import StoreOptions, is_relay_url, open_store

    torch_handle: TorchEngineHandle | None = None  # the in-process torch engine's server, when --engine torch
    service: Sidecar | None = None
    store = None
    try:
        if public_url is not None and fleet_board is None and is_relay_url(board):
            raise ConfigError(
                "--board is a relay, which is read-only: pass --fleet-board with the board itself (where the "
                "gateways read member records)"
            )
        if served_format is not None:
            get_format(served_format)  # an unknown name is refused before waiting for the board
        verifier = Verifier.from_pem(*public_key) if public_key else None
        store = open_store(board, StoreOptions(config=store_config))
        if origin is not None or mirror_wait is not None:
            from flipsync.board.mirror import MirrorPolicy, MirrorStore

            origin_store = open_store(origin, StoreOptions(config=origin_config)) if origin is not None else None
            store = MirrorStore(store, origin_store, MirrorPolicy(wait_s=30.0 if mirror_wait is None else mirror_wait))
        if fetch_ahead > 0:
            store = FetchAhead(store, interval_s=fetch_ahead)
        run_name = run or find_run(store)
        replica_config = ReplicaConfig(
            commit_mode=commit_mode,
            poll_interval_s=poll,
            max_backoff_s=max_backoff,
            drain_timeout_s=drain_timeout,
            adopt_search=adopt_search,
        )
        fmt = served_format
        if engine == "torch" or served_format is not None:
            # The torch engine is built in the board's format, and a --format is checked against it: both need
            # a version, so a run the trainer has not published yet is waited for (no guessing a format).
            reader = BoardReader(store, run_name, verifier=verifier)
            with exit_on_signals():
                board_fmt = wait_for_format(reader, poll_s=poll, timeout_s=wait_timeout)
            fmt = check_format(served_format, board_fmt, run_name)
        elif board_format(BoardReader(store, run_name, verifier=verifier)) is None:
            log.warning("%s; the sidecar waits for it", no_version_yet(store, run_name))
        if engine == "torch":
            from flipsync.engines.torch.openai_server import start_torch_engine  # the torch-engine extra

            if threads:
                import torch

                torch.set_num_threads(threads)
            assert fmt is not None
            # The name the engine answers with ("model", /v1/models) is the member record's: one name, one behaviour.
            torch_handle = start_torch_engine(
                model,
                fmt,
                device=device,
                host=ehost,
                port=eport,
                max_concurrency=max_concurrency,
                **({"model_name": model_name} if model_name is not None else {}),
            )
            the_engine: Engine = torch_handle.engine
            upstream_url = torch_handle.url
        else:
            assert upstream is not None
            the_engine = load_engine(engine, EngineOptions(upstream, fmt, device, engine_config))
            upstream_url = upstream
        check_decodable(BoardReader(store, run_name, verifier=verifier), the_engine)
        service = Sidecar(
            store,
            run_name,
            the_engine,
            upstream_url,
            verifier=verifier,
            replica_config=replica_config,
            proxy_config=ProxyConfig(upstream_url, retry_after_s=max(1, round(poll)), api_keys=api_keys),
        )
        service.replica.start()
        if public_url is not None:
            from flipsync.board.signing import Signer
            from flipsync.sidecar.heartbeat import MembershipConfig

            membership = MembershipConfig(
                public_url=public_url,
                replica_id=replica_id,
                island=island,
                model=model_name,
                interval_s=heartbeat,
                ttl_s=member_ttl,
            )
            signer = Signer.from_pem(member_key) if member_key is not None else None
            member_store = store
            if fleet_board is not None:
                member_store = open_store(fleet_board, StoreOptions(config=store_config))
            service.join(membership, store=member_store, signer=signer)
        typer.echo(f"flipsync sidecar: run {run_name!r} on {store.url}, {engine} engine, proxy on {host}:{port}")
        the_service = service
        # The proxy runs on the main thread so that SIGINT / SIGTERM stop it cleanly; the first one drains.
        serve_until_signal(service.app, host, port, before_exit=lambda: the_service.drain(exit_timeout))
    except FlipsyncError as e:
        raise command_error(e) from None
    finally:
        if service is not None:
            if service.heartbeat is not None:  # not drained (an error): leave the fleet all the same
                service.heartbeat.stop(deregister=True)
            service.replica.stop()
            service.replica.engine.close()
        if torch_handle is not None:
            torch_handle.stop()
        if store is not None:
            store.close()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    sidecar_app()
