"""``flipsync board ls|show|gc URL`` and ``flipsync keygen``: inspect and maintain a board from a shell.

``board_app`` is a Typer sub-application and ``keygen`` a plain function; ``flipsync.cli.main`` mounts both.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated
from urllib.parse import unquote, urlparse

import typer
from rich.console import Console
from rich.table import Table

from flipsync.board.catalog import Catalog
from flipsync.board.layout import RUNS
from flipsync.board.retention import RetentionPolicy, collect_garbage
from flipsync.board.signing import Verifier, write_keypair
from flipsync.domain.manifest import Kind, Manifest
from flipsync.errors import ConfigError, FlipsyncError, IntegrityError, NotFoundError
from flipsync.serving import parse_pairs
from flipsync.stores import ObstoreStore, StoreOptions, open_store

board_app = typer.Typer(
    name="board",
    help="Inspect and maintain a flipsync bulletin board (file://, s3://, gs://, az:// ...).",
    no_args_is_help=True,
)

UrlArg = Annotated[str, typer.Argument(help="Board URL or local path, e.g. s3://bucket/board or ./board")]
RunOpt = Annotated[str | None, typer.Option("--run", "-r", help="Run name (default: the board's only run)")]
StoreOpt = Annotated[
    list[str] | None,
    typer.Option("--store-option", "-o", help="Store setting key=value (endpoint, region, ...); repeatable"),
]


def output_console() -> Console:
    """The console for a command's results: when piped, wide enough that tables keep their figures whole
    (rich would assume 80 columns and cut them)."""
    console = Console()
    return console if console.is_terminal else Console(width=max(160, console.width))


def _fail(console: Console, e: Exception) -> typer.Exit:
    console.print(f"[bold red]error:[/] {e}")
    return typer.Exit(code=1)


def _open(url: str, options: list[str] | None) -> ObstoreStore:
    """Open a board to look at: a local one must exist (open_store creates folders, as publishers need)."""
    parsed = urlparse(url)
    if parsed.scheme in ("", "file"):
        local = Path(unquote(parsed.path) if parsed.scheme == "file" else url).expanduser()
        if not local.is_dir():
            raise NotFoundError(
                f"board {url} does not exist: check the path (a publisher creates it with its first version)"
            )
    return open_store(url, StoreOptions(config=parse_pairs(options, "store option")))


def _open_run(url: str, options: list[str] | None, run: str | None) -> tuple[ObstoreStore, str]:
    """Open a board to look at and pick the run: ``run`` if it exists there, else the board's only run."""
    store = _open(url, options)
    return store, _pick_run(store, run)


def _runs(store: ObstoreStore) -> list[str]:
    return store.list_dirs(RUNS)


def _pick_run(store: ObstoreStore, run: str | None) -> str:
    runs = _runs(store)
    if run:
        if run not in runs:
            known = f"its runs: {', '.join(runs[:20])}" if runs else "it holds no runs yet"
            raise NotFoundError(f"run {run!r} does not exist on {store.url} ({known}); check --run")
        return run
    if len(runs) == 1:
        return runs[0]
    if not runs:
        raise NotFoundError(f"{store.url} holds no runs: check the URL, or publish to it first")
    raise ConfigError(f"{store.url} holds several runs ({', '.join(runs)}): choose one with --run")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"


def _edge(m: Manifest) -> str:
    if m.kind is Kind.KEYFRAME:
        return f"-> v{m.target_version}"
    return f"v{m.base_version} -> v{m.target_version}"


@board_app.command("ls")
def ls(
    url: UrlArg,
    run: RunOpt = None,
    limit: Annotated[int, typer.Option(help="Show at most this many of the newest versions")] = 30,
    store_option: StoreOpt = None,
) -> None:
    """List the runs of a board, or the versions, keyframes and spans of one run."""
    console = output_console()
    try:
        store = _open(url, store_option)
        if run is None and len(_runs(store)) != 1:
            _list_runs(console, store)
            return
        _list_run(console, store, _pick_run(store, run), limit)
    except FlipsyncError as e:
        raise _fail(console, e) from None


def _list_runs(console: Console, store: ObstoreStore) -> None:
    table = Table(title=f"runs on {store.url}")
    # versions that are keyframes (v0) count under versions; this column counts the extra ones
    for col in ("run", "HEAD", "versions", "extra keyframes", "spans", "last published"):
        numeric = col in ("HEAD", "versions", "extra keyframes", "spans")
        table.add_column(col, justify="right" if numeric else "left")
    for run in _runs(store):
        cat = Catalog(store, run)
        head = cat.discover_head()
        created = "-"
        if head is not None:
            try:
                created = cat.version(head).created
            except IntegrityError:
                created = "[red]unreadable[/]"
        table.add_row(
            run,
            "-" if head is None else f"v{head}",
            str(len(cat.list_versions())),
            str(len(cat.list_keyframes())),
            str(len(cat.list_spans())),
            created,
        )
    console.print(table)


def _list_run(console: Console, store: ObstoreStore, run: str, limit: int) -> None:
    cat = Catalog(store, run)
    head = cat.discover_head()
    if head is None:
        console.print(f"run [bold]{run}[/] on {store.url} has no published version")
        return
    table = Table(title=f"run {run} on {store.url} (HEAD v{head})")
    for col in ("version", "kind", "edge", "size", "parts", "format", "created", "publisher", "signed"):
        table.add_column(col, justify="right" if col in ("size", "parts") else "left")
    versions = [v for v in cat.list_versions() if v <= head][-limit:]
    for v in reversed(versions):
        try:
            m = cat.version(v)
        except NotFoundError:
            table.add_row(f"v{v}", "[yellow]no manifest[/]", "", "", "", "", "", "", "")
            continue
        except IntegrityError as e:
            table.add_row(f"v{v}", "[red]unreadable[/]", str(e)[:60], "", "", "", "", "", "")
            continue
        table.add_row(
            f"v{v}",
            m.kind.value,  # "keyframe" for a full view, as `board show` and the demo say
            _edge(m),
            _size(m.total_size),
            str(len(m.parts)),
            m.served_format,
            m.created,
            m.publisher,
            "yes" if m.signature else "no",
        )
    console.print(table)
    extra = Table(title="extra keyframes and spans")
    for col in ("kind", "edge", "size", "parts", "created"):
        extra.add_column(col)
    rows = 0
    for k in cat.list_keyframes():
        rows += 1
        try:
            m = cat.keyframe(k)
            extra.add_row("keyframe", _edge(m), _size(m.total_size), str(len(m.parts)), m.created)
        except (NotFoundError, IntegrityError) as e:
            extra.add_row("keyframe", f"v{k}", f"[red]{str(e)[:50]}[/]", "", "")
    for a, b in cat.list_spans():
        rows += 1
        try:
            m = cat.span(a, b)
            extra.add_row("span", _edge(m), _size(m.total_size), str(len(m.parts)), m.created)
        except (NotFoundError, IntegrityError) as e:
            extra.add_row("span", f"v{a} -> v{b}", f"[red]{str(e)[:50]}[/]", "", "")
    if rows:
        console.print(extra)


@board_app.command("show")
def show(
    url: UrlArg,
    version: Annotated[int | None, typer.Argument(help="Version to show (default: HEAD)")] = None,
    run: RunOpt = None,
    keyframe: Annotated[bool, typer.Option("--keyframe", help="Show the extra keyframe of VERSION")] = False,
    span: Annotated[str | None, typer.Option("--span", help="Show the span A-B instead")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the manifest as JSON")] = False,
    public_key: Annotated[
        Path | None, typer.Option("--public-key", help="Verify the signature with this public key")
    ] = None,
    store_option: StoreOpt = None,
) -> None:
    """Show one manifest: what it carries, every part with its size and hash."""
    console = output_console()
    try:
        store, run_name = _open_run(url, store_option, run)
        verifier = Verifier.from_pem(public_key) if public_key else None
        cat = Catalog(store, run_name, verifier=verifier)
        if span:
            a, _, b = span.partition("-")
            try:
                m = cat.span(int(a), int(b))
            except ValueError:
                raise ConfigError(f"--span takes A-B (two version numbers), got {span!r}") from None
            except NotFoundError:
                raise NotFoundError(
                    f"run {run_name!r} has no span v{a} -> v{b}; `flipsync board ls` lists them"
                ) from None
        else:
            head = cat.discover_head()
            v = version if version is not None else head
            if v is None:
                raise NotFoundError(f"run {run_name!r} has no published version")
            try:
                m = cat.keyframe(v) if keyframe else cat.version(v)
            except NotFoundError:
                # the user asked for a version, not a manifest path
                what = "extra keyframe at v" if keyframe else "v"
                newest = "no published version" if head is None else f"HEAD v{head}"
                raise NotFoundError(
                    f"run {run_name!r} has no {what}{v} ({newest}); `flipsync board ls` lists what it has"
                ) from None
        if as_json:
            console.print_json(json.dumps(m.to_dict()))
            return
        info = Table.grid(padding=(0, 2))
        info.add_column(style="bold")
        info.add_column()
        info.add_row("run", m.run)
        info.add_row("kind", m.kind.value)
        info.add_row("edge", _edge(m))
        info.add_row("base view", m.base_view_fp or "-")
        info.add_row("target view", m.target_view_fp)
        info.add_row("served format", m.served_format)
        info.add_row("size", f"{_size(m.total_size)} in {len(m.parts)} parts")
        info.add_row("created", m.created)
        info.add_row("publisher", m.publisher)
        sig = "unsigned" if m.signature is None else f"{m.signature.alg} key {m.signature.key_id}"
        if verifier is not None:
            sig += " [green](verified)[/]"
        info.add_row("signature", sig)
        for k, val in sorted(m.meta.items()):
            info.add_row(f"meta.{k}", str(val))
        console.print(info)
        parts = Table(title="parts")
        parts.add_column("path")
        parts.add_column("size", justify="right")
        parts.add_column("blake3")
        for p in m.parts:
            chunks = f" (+{len(p.chunks)} chunks)" if p.chunks else ""
            parts.add_row(p.path + chunks, _size(p.size), p.hash)
        console.print(parts)
    except FlipsyncError as e:
        raise _fail(console, e) from None


@board_app.command("gc")
def gc(
    url: UrlArg,
    run: RunOpt = None,
    keep: Annotated[int, typer.Option(help="Keep the newest KEEP versions reachable by patches")] = 100,
    keep_seconds: Annotated[
        float | None, typer.Option(help="Also keep every version younger than this many seconds")
    ] = None,
    grace: Annotated[float, typer.Option(help="Leave unreferenced parts younger than this (seconds)")] = 3600.0,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Only report what would be deleted")] = False,
    store_option: StoreOpt = None,
) -> None:
    """Delete old versions, keyframes and spans outside the retention window, and stale orphan parts."""
    console = output_console()
    try:
        store, run_name = _open_run(url, store_option, run)
        policy = RetentionPolicy(keep_versions=keep, keep_seconds=keep_seconds, orphan_grace_s=grace)
        r = collect_garbage(store, run_name, policy, dry_run=dry_run)
    except FlipsyncError as e:
        raise _fail(console, e) from None
    if r.head is None:
        console.print(f"run [bold]{run_name}[/] has no published version: nothing to do")
        return
    title = f"gc of run {run_name}{' (dry run: nothing deleted)' if dry_run else ''}"
    table = Table(title=title, show_header=False)
    table.add_column("")
    table.add_column("", justify="right")
    table.add_row("HEAD", f"v{r.head}")
    table.add_row("newest keyframe", "-" if r.newest_keyframe is None else f"v{r.newest_keyframe}")
    table.add_row("oldest kept version", f"v{r.cutoff}")
    table.add_row("versions deleted", str(len(r.deleted_versions)))
    table.add_row("keyframes deleted", str(len(r.deleted_keyframes)))
    table.add_row("spans deleted", str(len(r.deleted_spans)))
    table.add_row("orphan objects deleted", str(r.deleted_orphans))
    table.add_row("member records of long-gone replicas deleted", str(r.deleted_members))
    table.add_row("bytes freed", _size(r.deleted_bytes))
    console.print(table)
    for folder in r.kept_unreadable:
        console.print(f"[yellow]kept untouched (unreadable manifest):[/] {folder}")


def keygen(
    out: Annotated[
        Path | None,
        typer.Argument(
            help="Private key file to write; the public key goes to OUT.pub (or use -o)", show_default=False
        ),
    ] = None,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Private key file to write (same as OUT)", show_default=False)
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite existing key files")] = False,
) -> None:
    """Create an Ed25519 key pair for signing manifests: `flipsync keygen -o KEY` (or `flipsync keygen KEY`)."""
    if out is not None and output is not None and out != output:
        raise typer.BadParameter(f"two key files given ({out} and -o {output}); give one", param_hint="OUT / -o")
    out = out or output
    if out is None:
        raise typer.BadParameter("say where to write the private key: flipsync keygen -o KEY", param_hint="-o")
    console = output_console()
    try:
        private, public, kid = write_keypair(out, force=force)
    except FlipsyncError as e:
        raise _fail(console, e) from None
    console.print(f"private key: {private} (keep it secret; publishers sign with it)")
    console.print(f"public key:  {public} (give it to readers)")
    console.print(f"key id:      {kid}")
