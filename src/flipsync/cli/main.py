"""The ``flipsync`` command line: assembles the commands each module of `flipsync.cli` defines.

Codec commands (view, diff, apply, squash, inspect): `local`; board and keygen: `board`; publish and watch:
`trainer`; sidecar: `sidecar`; relay: `relay`; gateway: `gateway`; fleet: `fleet`; model: `model`. The
applications (demo, analyze, bench) are a distribution of their own (``apps/`` in the repository) that adds its
commands through the ``flipsync.commands`` entry points; without it, those names say how to install it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.logging import RichHandler

from flipsync.cli import local
from flipsync.cli.board import board_app, keygen
from flipsync.cli.fleet import fleet_app
from flipsync.cli.gateway import gateway
from flipsync.cli.model import model as model_cmd
from flipsync.cli.relay import relay
from flipsync.cli.sidecar import sidecar
from flipsync.cli.trainer import publish as publish_cmd
from flipsync.cli.trainer import watch as watch_cmd

ENTRY_POINTS = "flipsync.commands"
# The applications' commands: what each does, for the help of a name whose application is not installed.
APPLICATIONS = {
    "demo": "the end-to-end RL run",
    "analyze": "how many served values change, per tensor and format",
    "bench": "the side-by-side benchmarks",
}
INSTALL_APPS = "pip install -e ./apps (from a checkout of the flipsync repository)"

app = typer.Typer(
    name="flipsync",
    help="Ship small lossless patches of an RL policy's served weights instead of checkpoints.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


@app.callback()
def _main(verbose: Annotated[bool, typer.Option("--verbose", "-v", help="log progress details")] = False) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        format="%(message)s",
        handlers=[RichHandler(console=Console(stderr=True), show_path=False)],
    )


app.command("view")(local.view)
app.command("diff")(local.diff)
app.command("apply")(local.apply)
app.command("squash")(local.squash_cmd)
app.command("inspect")(local.inspect)
app.add_typer(board_app, name="board")
app.add_typer(fleet_app, name="fleet")
app.command("keygen")(keygen)
app.command("sidecar")(sidecar)
app.command("relay")(relay)
app.command("gateway")(gateway)
app.command("model")(model_cmd)
app.command("watch")(watch_cmd)
app.command("publish")(publish_cmd)


def _not_installed(name: str, why: str) -> Callable[..., None]:
    def command(ctx: typer.Context) -> None:
        Console(stderr=True, soft_wrap=True).print(
            f"[bold red]error:[/] `flipsync {name}` is one of flipsync's applications, apart from the library, and "
            f"they are not installed here ({why}): {INSTALL_APPS}"
        )
        raise typer.Exit(2)

    return command


def add_applications(cli: typer.Typer) -> None:
    """Add the commands the installed applications declare; the others answer how to install them."""
    added: set[str] = set()
    failed: dict[str, str] = {}
    for ep in entry_points(group=ENTRY_POINTS):
        try:
            command: Any = ep.load()
        except ImportError as e:  # installed without what it needs: say so when the command is used
            failed[ep.name] = f"{ep.value} does not import: {e}"
            continue
        if isinstance(command, typer.Typer):
            cli.add_typer(command, name=ep.name)
        else:
            cli.command(ep.name)(command)
        added.add(ep.name)
    for name, what in APPLICATIONS.items():
        if name not in added:
            cli.command(
                name,
                help=f"{what} (an application: {INSTALL_APPS})",
                context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
                add_help_option=False,
            )(_not_installed(name, failed.get(name, "no flipsync-apps distribution")))


add_applications(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
