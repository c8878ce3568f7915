"""The package layering of docs/architecture.md, checked on the source: arrows only point down.

Each package (or top-level module) of ``flipsync`` may import only the packages listed for it here. The table
is the one in docs/architecture.md; a new arrow means changing both, on purpose.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "flipsync"

BASE = {"errors"}
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "domain": BASE,
    "formats": BASE | {"codec"},
    "checkpoint": BASE,
    "serving": BASE,
    "auth": BASE,
    "stores": BASE,
    "codec": BASE | {"domain"},
    "board": BASE | {"domain", "checkpoint", "codec", "stores"},
    "trainer": BASE | {"domain", "formats", "checkpoint", "codec", "stores", "board"},  # board writes: through board
    "engines": BASE | {"domain", "formats", "checkpoint", "codec", "serving"},
    "relay": BASE | {"stores", "board", "serving"},
    "sidecar": BASE | {"domain", "formats", "checkpoint", "codec", "stores", "board", "engines", "serving", "auth"},
    # The gateway speaks the request protocol of domain.requests; it never imports the sidecar.
    "fleet": BASE | {"domain", "stores", "board", "serving", "auth"},
    "integrations": BASE | {"domain", "formats", "codec", "stores", "board", "trainer", "fleet"},
    # The operational commands assemble everything below them; nothing in the library imports them.
    "cli": BASE
    | {"domain", "formats", "checkpoint", "codec", "stores", "board", "trainer", "engines", "relay", "sidecar"}
    | {"fleet", "integrations", "serving", "auth"},
}
# The package's face: no arrows.
APPS = {"__init__", "__main__"}


def imports_of(path: Path) -> set[str]:
    """The ``flipsync.X`` packages a file imports (at any depth: imports inside functions count too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "flipsync" and len(parts) > 1:
                found.add(parts[1])
    return found


def package_of(path: Path) -> str:
    return path.relative_to(SRC).with_suffix("").parts[0]


SOURCES = sorted(SRC.rglob("*.py"))


def test_every_package_is_in_the_table() -> None:
    packages = {package_of(p) for p in SOURCES}
    assert packages <= set(ALLOWED) | APPS, f"add {sorted(packages - set(ALLOWED) - APPS)} to the layering"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(SRC)))
def test_imports_point_down(path: Path) -> None:
    pkg = package_of(path)
    if pkg in APPS:
        return
    wrong = imports_of(path) - ALLOWED[pkg] - {pkg, "errors"}
    wrong -= {m for m in wrong if m not in ALLOWED and m not in APPS}  # submodule names of flipsync itself
    assert not wrong, f"{path.relative_to(SRC)} ({pkg}) imports {sorted(wrong)}, which {pkg} may not depend on"


def test_no_command_module_is_imported_by_the_library() -> None:
    for path in SOURCES:
        if package_of(path) == "cli":
            continue
        assert "cli" not in imports_of(path), f"{path.relative_to(SRC)} imports the command line"


ROOT = SRC.parent.parent
APPLICATIONS = ROOT / "apps" / "src" / "flipsync_apps"


def _imports_the_applications(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules = [node.module]
        elif isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        else:
            continue
        if any(m == "flipsync_apps" or m.startswith("flipsync_apps.") for m in modules):
            return True
    return False


def test_the_applications_stand_apart_from_the_library() -> None:
    """The demo, benchmarks and analyze are a distribution of their own (apps/): the library never imports them,
    and the library's tests (all but tests/apps/) test the library without them."""
    assert APPLICATIONS.is_dir()
    assert not (SRC / "apps").exists()
    library = [p for p in SOURCES if _imports_the_applications(p)]
    assert not library, f"library modules import the applications: {library}"
    tests = ROOT / "tests"
    library_tests = [p for p in tests.rglob("*.py") if tests / "apps" not in p.parents]
    importing = [str(p.relative_to(ROOT)) for p in library_tests if _imports_the_applications(p)]
    assert not importing, f"library tests import the applications (move them under tests/apps/): {importing}"


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_import_circle() -> None:
    """No two modules import each other, directly or around a circle (imports for type checking count too: a
    circle there is a design that needs one of its halves moved)."""
    modules = {_module_name(p): p for p in SOURCES}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # ``from package import submodule`` is an arrow to the submodule, not to the package's face
                subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules]
                edges |= set(subs) if subs else {node.module}
            elif isinstance(node, ast.Import):
                edges |= {a.name for a in node.names}
        graph[name] = {e for e in edges if e in modules and e != name}
    # Depth-first search for a back edge: the first circle found, printed whole.
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return [*stack[stack.index(n) :], n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            circle = visit(m)
            assert circle is None, "import circle: " + " -> ".join(circle)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(SRC)))
def test_no_private_name_crosses_a_module(path: Path) -> None:
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("flipsync"):
            private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
            assert not private, f"{path.relative_to(SRC)} imports {private} from {node.module}"


def test_every_package_says_its_job() -> None:
    for init in SRC.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc, f"{init.relative_to(SRC)} has no docstring saying what the package is for"


# What the library sees of the codec: its package, its two vocabulary modules and its kernel decorator.
# Applications (the benchmarks measure the coders one by one) may look inside.
CODEC_FACES = {"flipsync.codec", "flipsync.codec.bits", "flipsync.codec.fingerprint", "flipsync.codec.jit"}
CODEC_API_NAMES = 16


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(SRC)))
def test_the_codec_is_used_through_its_public_api(path: Path) -> None:
    if package_of(path) in {"codec"} | APPS:
        return
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules = [node.module]
        elif isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        else:
            continue
        inside = [m for m in modules if m.startswith("flipsync.codec.") and m not in CODEC_FACES]
        assert not inside, f"{path.relative_to(SRC)} imports {inside}: use {sorted(CODEC_FACES)}"


def test_the_codec_api_is_small() -> None:
    tree = ast.parse((SRC / "codec" / "__init__.py").read_text())
    names = next(
        ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "__all__"
    )
    assert len(names) <= CODEC_API_NAMES, f"the codec exports {len(names)} names: {names}"
