"""``flipsync fleet up|scale|status|down|warmup``: a fleet of replicas on a Ray cluster (`flipsync.fleet.ray_pool`).

``fleet_app`` is mounted by ``flipsync.cli.main`` with ``app.add_typer(fleet_app, name="fleet")``; ``python -m
flipsync.cli.fleet up ...`` works on its own too. The fleet lives in the cluster (detached actors named
``FLEET/replica-N``), so every command attaches to it again: ``up`` in one shell, ``scale`` in another.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from flipsync.cli.terminal import command_error
from flipsync.errors import ConfigError, FlipsyncError

if TYPE_CHECKING:
    from flipsync.fleet.ray_pool import RayPool, ReplicaSpec

# Ray, torch and the board are imported inside the commands, so that mounting them keeps ``flipsync --help`` fast.

log = logging.getLogger(__name__)

fleet_app = typer.Typer(
    name="fleet",
    help="A fleet of flipsync replicas (engine + sidecar) that Ray places, scales and replaces.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)

RayOpt = Annotated[
    str, typer.Option("--ray", help="The Ray cluster: auto, HOST:6379 or ray://HOST:10001 (`ray start --head`)")
]
NameOpt = Annotated[str, typer.Option("--name", help="The fleet (one per region, model or format on a cluster)")]
NamespaceOpt = Annotated[str, typer.Option(help="The Ray namespace of the fleet's actors")]
TimeoutOpt = Annotated[float, typer.Option("--timeout", help="Longest wait for new replicas to enter rotation (s)")]


def parse_resources(items: list[str] | None) -> dict[str, float]:
    """``region:us-east=1`` (repeatable) -> ``{"region:us-east": 1.0}``; a name alone means 1."""
    out: dict[str, float] = {}
    for item in items or ():
        name, _, amount = item.partition("=")
        if not name:
            raise ConfigError(f"--resource wants NAME[=AMOUNT] (region:us-east=1), not {item!r}")
        try:
            out[name] = float(amount) if amount else 1.0
        except ValueError:
            raise ConfigError(f"--resource {item!r}: {amount!r} is not a number") from None
    return out


def attach(ray_address: str, name: str, namespace: str, spec: ReplicaSpec | None = None) -> RayPool:
    from flipsync.fleet.ray_pool import RayPool, import_ray

    ray = import_ray()
    if not ray.is_initialized():  # embedded (tests, a notebook): the connection there is the one to use
        ray.init(address=ray_address, namespace=namespace, log_to_driver=False, logging_level=logging.WARNING)
    return RayPool(spec, name=name, namespace=namespace)


def status_table(pool: RayPool) -> Table:
    table = Table(title=f"fleet {pool.name}: {pool.spec.engine} replicas of {pool.spec.board}")
    for col in ("slot", "replica", "url", "node", "process", "restarts", "version", "state", "in rotation"):
        table.add_column(col)
    for r in pool.replicas():
        info, rec = r.info or {}, r.record or {}
        table.add_row(
            str(r.slot),
            str(info.get("replica", "(restarting or dead)")),
            str(info.get("url", "")),
            str(info.get("node_id") or "")[:12],
            "up" if info.get("alive") else ("gave up" if info.get("gave_up") else "down"),
            str(info.get("restarts", "")),
            str(rec.get("version", "")),
            str(rec.get("state", "no record")),
            "yes" if rec.get("ready") else "no",
        )
    return table


def describe(pool: RayPool) -> list[dict[str, Any]]:
    return [{"slot": r.slot, "actor": r.info, "record": r.record} for r in pool.replicas()]


def scale_with_progress(pool: RayPool, n: int, timeout_s: float, console: Console) -> None:
    with console.status(f"scaling fleet {pool.name} to {n} replica(s)") as status:

        def say(msg: str) -> None:
            status.update(msg)
            console.log(msg)

        result = pool.scale_to(n, timeout_s=timeout_s, progress=say)
    for slot, s in sorted(result.to_rotation_s.items()):
        console.print(f"slot {slot}: in rotation {s:.1f} s after scale")
    if result.removed:
        console.print(f"drained and removed slot(s) {', '.join(map(str, result.removed))} in {result.took_s:.1f} s")


@fleet_app.command("up")
def up(
    board: Annotated[str, typer.Option("--board", "-b", help="The board the replicas follow (s3://..., a path)")],
    ray_address: RayOpt = "auto",
    name: NameOpt = "flipsync",
    replicas: Annotated[int, typer.Option(help="Replicas to place")] = 1,
    run: Annotated[str | None, typer.Option(help="Run name on the board (default: its only run)")] = None,
    engine: Annotated[str, typer.Option(help="The sidecar's engine (torch runs in the sidecar's process)")] = "torch",
    model: Annotated[str, typer.Option(help="torch: model preset (tiny, small, base) or a config.json")] = "tiny",
    num_cpus: Annotated[float, typer.Option(help="Ray CPUs per replica (torch threads: this, at least 1)")] = 1.0,
    num_gpus: Annotated[float, typer.Option(help="Ray GPUs per replica")] = 0.0,
    resource: Annotated[
        list[str] | None,
        typer.Option("--resource", help="A Ray custom resource per replica, NAME[=AMOUNT]: region:us-east=1"),
    ] = None,
    island: Annotated[str | None, typer.Option(help="The records' island (default: the resource's region)")] = None,
    scheduling: Annotated[str, typer.Option(help="SPREAD (over nodes first) or DEFAULT")] = "SPREAD",
    heartbeat: Annotated[float, typer.Option(help="Seconds between member record writes")] = 5.0,
    member_ttl: Annotated[float, typer.Option(help="Seconds a member record stays valid")] = 15.0,
    exit_timeout: Annotated[float, typer.Option(help="On removal, longest drain of requests in flight (s)")] = 30.0,
    sidecar_arg: Annotated[
        list[str] | None,
        typer.Option("--sidecar-arg", help="One more `flipsync sidecar` argument, e.g. --sidecar-arg=--fetch-ahead"),
    ] = None,
    gateway: Annotated[bool, typer.Option(help="Also run `flipsync gateway` on the cluster")] = False,
    gateway_port: Annotated[int, typer.Option(help="The gateway's port on its node")] = 8300,
    gateway_resource: Annotated[
        list[str] | None,
        typer.Option(
            "--gateway-resource",
            help="A Ray resource the gateway's node must have, NAME[=AMOUNT] (node:__internal_head__=0.01: the head)",
        ),
    ] = None,
    gateway_arg: Annotated[
        list[str] | None, typer.Option("--gateway-arg", help="One more `flipsync gateway` argument")
    ] = None,
    namespace: NamespaceOpt = "flipsync",
    timeout: TimeoutOpt = 600.0,
) -> None:
    """Place a fleet on a Ray cluster and wait until its replicas are in rotation (caught up, ready)."""
    console = Console(stderr=True)
    try:
        from flipsync.fleet.ray_pool import ReplicaSpec

        if replicas < 0:
            raise ConfigError(f"--replicas must be >= 0, not {replicas}")
        spec = ReplicaSpec(
            board=board,
            run=run,
            engine=engine,
            model=model,
            island=island,
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            resources=parse_resources(resource),
            scheduling=scheduling,
            heartbeat_s=heartbeat,
            member_ttl_s=member_ttl,
            exit_timeout_s=exit_timeout,
            sidecar_args=tuple(sidecar_arg or ()),
        )
        pool = attach(ray_address, name, namespace, spec)
        try:
            scale_with_progress(pool, max(replicas, len(pool.slots())), timeout, console)
            if gateway:
                url = pool.start_gateway(
                    port=gateway_port, args=gateway_arg or (), resources=parse_resources(gateway_resource)
                )
                console.print(f"gateway: {url}/v1")
            console.print(status_table(pool))
        finally:
            pool.close()
    except FlipsyncError as e:
        raise command_error(e) from None


@fleet_app.command("scale")
def scale(
    replicas: Annotated[int, typer.Argument(help="The replica count to reach")],
    ray_address: RayOpt = "auto",
    name: NameOpt = "flipsync",
    namespace: NamespaceOpt = "flipsync",
    timeout: TimeoutOpt = 600.0,
) -> None:
    """Add replicas (in rotation once caught up) or remove them (drained first) to reach REPLICAS."""
    console = Console(stderr=True)
    try:
        if replicas < 0:
            raise ConfigError(f"a fleet cannot have {replicas} replicas")
        pool = attach(ray_address, name, namespace)
        try:
            scale_with_progress(pool, replicas, timeout, console)
        finally:
            pool.close()
    except FlipsyncError as e:
        raise command_error(e) from None


@fleet_app.command("status")
def status(
    ray_address: RayOpt = "auto",
    name: NameOpt = "flipsync",
    namespace: NamespaceOpt = "flipsync",
    as_json: Annotated[bool, typer.Option("--json", help="One JSON document instead of a table")] = False,
) -> None:
    """Each replica: its actor (node, process, restarts) and its member record (version, state, in rotation)."""
    try:
        pool = attach(ray_address, name, namespace)
        try:
            if as_json:
                typer.echo(json.dumps({"fleet": name, "gateway": pool.gateway_url(), "replicas": describe(pool)}))
            else:
                console = Console()
                console.print(status_table(pool))
                if (url := pool.gateway_url()) is not None:
                    console.print(f"gateway: {url}/v1")
        finally:
            pool.close()
    except FlipsyncError as e:
        raise command_error(e) from None


@fleet_app.command("down")
def down(
    ray_address: RayOpt = "auto",
    name: NameOpt = "flipsync",
    namespace: NamespaceOpt = "flipsync",
) -> None:
    """Drain every replica of the fleet (requests in flight finish, records deleted) and stop its gateway."""
    console = Console(stderr=True)
    try:
        pool = attach(ray_address, name, namespace)
        try:
            with console.status(f"draining fleet {name}"):
                result = pool.down()
            console.print(f"fleet {name}: {len(result.removed)} replica(s) drained in {result.took_s:.1f} s")
        finally:
            pool.close()
    except FlipsyncError as e:
        raise command_error(e) from None


@fleet_app.command("warmup")
def warmup(
    served_format: Annotated[str, typer.Option("--format", help="The served format the replicas will hold")] = "bf16",
) -> None:
    """Compile the codec kernels into numba's on-disk cache (an image build step: replicas then load them)."""
    try:
        from flipsync.formats import get_format
        from flipsync.sidecar.warmup import warm_codec_kernels

        get_format(served_format)
        typer.echo(f"codec kernels for {served_format}: {warm_codec_kernels(served_format):.2f} s")
    except FlipsyncError as e:
        raise command_error(e) from None


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    fleet_app()
