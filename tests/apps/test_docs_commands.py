"""Every ``flipsync ...`` command line in a fenced shell block of README.md and docs/*.md parses against the real CLI.

Doc lines are synopses: ``[...]`` is optional, ``a|b`` is a choice (``--x/--no-x`` too), ``...`` repeats and
UPPERCASE words are placeholders. Each line is expanded into concrete command lines (every optional group in,
every one out, and each choice of each alternative) and each is parsed by click's own parser down the command
tree: the subcommands must exist, every option must be known and get its value, no argument may be missing or
left over, and values must convert (choices, numbers). Nothing is executed; each command's ``--help`` is
run as well.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from flipsync.cli.main import app

try:  # typer >= 0.20 vendors click
    from typer._click.exceptions import ClickException
except ImportError:  # pragma: no cover
    from click.exceptions import ClickException

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_FENCES = {"", "bash", "sh", "shell", "console", "zsh"}
COMMAND_SEPARATORS = {"&&", "||", ";", "|", "&"}


@dataclass(frozen=True)
class DocCommand:
    where: str  # file:line
    words: list[str]  # after "flipsync", still in synopsis notation


def fenced_shell_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, logical line) of the shell blocks, with backslash continuations joined."""
    fence: str | None = None
    pending: tuple[int, str] | None = None
    for n, line in enumerate(path.read_text().splitlines(), 1):
        m = re.match(r"^\s*(```|~~~)\s*([\w-]*)", line)
        if m:
            fence = m.group(2).lower() if fence is None else None
            continue
        if fence not in SHELL_FENCES:
            continue
        start, text = pending if pending else (n, "")
        text += line.strip()
        if text.endswith("\\"):
            pending = (start, text[:-1] + " ")
            continue
        pending = None
        yield start, text


def doc_commands() -> list[DocCommand]:
    found = []
    for path in DOCS:
        for n, line in fenced_shell_lines(path):
            line = re.sub(r"^\$\s+", "", line)
            if not re.search(r"(^|[\s;&|/])flipsync(\s|$)", line):
                continue  # (other commands may hold quotes that open on one line and close on another)
            words = shlex.split(line, comments=True)
            segment: list[str] = []
            for w in [*words, ";"]:
                if w not in COMMAND_SEPARATORS:
                    segment.append(w)
                    continue
                if segment and Path(segment[0]).name == "flipsync":
                    found.append(DocCommand(f"{path.relative_to(ROOT)}:{n}", segment[1:]))
                segment = []
    return found


# -- synopsis notation -----------------------------------------------------------------------------------


def parse_synopsis(words: list[str]) -> list[str | list]:
    """Words and optional groups (nested lists), ``...`` dropped."""
    stack: list[list] = [[]]
    for w in words:
        opens = len(w) - len(w.lstrip("["))
        w = w.lstrip("[")
        closes = len(w) - len(w.rstrip("]"))
        w = w.rstrip("]")
        for _ in range(opens):
            stack.append([])
        if w and w != "...":
            stack[-1].append(w)
        for _ in range(closes):
            group = stack.pop()
            stack[-1].append(group)
    assert len(stack) == 1, f"unbalanced brackets in {words}"
    return stack[0]


def alternatives(word: str) -> list[str]:
    if word.startswith("--") and "/--" in word:
        return word.split("/")
    return word.split("|") if "|" in word else [word]


def render(tree: list[str | list], *, optional: bool, pick: dict[int, int], counter: list[int]) -> list[str]:
    out: list[str] = []
    for item in tree:
        if isinstance(item, list):
            inner = render(item, optional=optional, pick=pick, counter=counter)  # numbers alternatives either way
            if optional:
                out += inner
            continue
        alts = alternatives(item)
        i = counter[0]
        counter[0] += 1
        out.append(alts[pick.get(i, 0) % len(alts)])
    return out


def expand(words: list[str]) -> list[list[str]]:
    """Concrete command lines for a synopsis: all optional groups in and out, and every alternative."""
    tree = parse_synopsis(words)
    slots = [alternatives(w) for w in _flat(tree)]
    variants = [render(tree, optional=o, pick={}, counter=[0]) for o in (True, False)]
    for i, alts in enumerate(slots):
        for k in range(1, len(alts)):
            variants.append(render(tree, optional=True, pick={i: k}, counter=[0]))
    unique: list[list[str]] = []
    for v in variants:
        if v not in unique:
            unique.append(v)
    return unique


def _flat(tree: list[str | list]) -> list[str]:
    return [w for item in tree for w in (_flat(item) if isinstance(item, list) else [item])]


# -- parsing against the CLI ------------------------------------------------------------------------------

# Placeholders of numeric options stand for numbers; a new one in the docs must be added here (or the docs
# must show a number), else its line fails to parse. Other placeholders (paths, URLs, names) stay as written.
NUMBERS = {"N": "2", "S": "1.5", "SECONDS": "1.5", "MIB": "64"}


def check_parses(args: list[str]) -> list[str]:
    """Parse ``flipsync ARGS`` as the real CLI does, down the command tree, without running any command.

    ``make_context`` is what ``flipsync`` does before it calls a command: options and arguments are
    matched, missing or extra ones refused, and values converted (choices, numbers). Raises click's
    usage errors; returns the command path."""
    args = [NUMBERS.get(a, a) for a in args]
    cmd = typer.main.get_command(app)
    path = ["flipsync"]
    ctx = cmd.make_context("flipsync", args)
    while hasattr(cmd, "resolve_command"):  # a group: resolve and parse its subcommand, as its invoke() does
        rest = [*getattr(ctx, "_protected_args", []), *ctx.args]
        name, sub, rest = cmd.resolve_command(ctx, rest)
        assert name is not None and sub is not None
        path.append(name)
        cmd, ctx = sub, sub.make_context(name, rest, parent=ctx)
    return path


COMMANDS = doc_commands()


def test_the_docs_have_flipsync_commands() -> None:
    wheres = {c.where.split(":")[0] for c in COMMANDS}
    assert "README.md" in wheres and "docs/sidecar.md" in wheres and len(COMMANDS) >= 15


@pytest.mark.parametrize("command", COMMANDS, ids=[c.where for c in COMMANDS])
def test_every_documented_command_line_parses(command: DocCommand) -> None:
    runner = CliRunner()
    for args in expand(command.words):
        try:
            path = check_parses(args)
        except ClickException as e:
            pytest.fail(f"{command.where}: `flipsync {' '.join(args)}` is refused by the CLI: {e.format_message()}")
        res = runner.invoke(app, [*path[1:], "--help"])
        assert res.exit_code == 0, f"{command.where}: `{' '.join(path)} --help` failed: {res.output}"


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("flipsync keygen --out KEY", "No such option"),
        ("flipsync board lss URL", "No such command"),
        ("flipsync diff OLD NEW --mode sideways -o PATCH", "sideways"),
        ("flipsync sidecar --board URL --poll soon", "--poll"),
        ("flipsync inspect", "Missing argument"),
        ("flipsync inspect P1 P2", "unexpected extra argument"),
        ("flipsync view MASTER --format", "requires an argument"),
    ],
)
def test_the_checker_refuses_what_the_cli_refuses(line: str, says: str) -> None:
    with pytest.raises(ClickException) as e:
        check_parses(shlex.split(line)[1:])
    assert says in e.value.format_message()


def test_synopsis_notation_expands_to_concrete_lines() -> None:
    lines = expand(shlex.split("board ls|show URL [--run R] [--x/--no-x] [-o k=v ...]"))
    assert ["board", "ls", "URL", "--run", "R", "--x", "-o", "k=v"] in lines
    assert ["board", "ls", "URL"] in lines
    assert ["board", "show", "URL", "--run", "R", "--x", "-o", "k=v"] in lines
    assert ["board", "ls", "URL", "--run", "R", "--no-x", "-o", "k=v"] in lines
