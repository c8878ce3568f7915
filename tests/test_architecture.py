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
    "stores": BASE,
    "codec": BASE | {"domain"},
    "board": BASE | {"domain", "checkpoint", "codec", "stores"},
    "trainer": BASE | {"domain", "formats", "checkpoint", "codec", "stores", "board"},
    "engines": BASE | {"domain", "formats", "checkpoint", "codec", "serving"},
    "relay": BASE | {"stores", "board", "serving"},
    "sidecar": BASE | {"domain", "formats", "checkpoint", "codec", "stores", "board", "engines", "serving"},
    "fleet": BASE | {"domain", "stores", "board", "sidecar", "serving"},
    "integrations": BASE | {"domain", "formats", "codec", "stores", "board", "trainer", "sidecar", "fleet"},
}
# Applications: they assemble everything below them, and nothing imports them but each other.
APPS = {"apps", "__init__", "__main__"}


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


def test_no_application_is_imported_by_a_library() -> None:
    for path in SOURCES:
        if package_of(path) in APPS:
            continue
        assert not imports_of(path) & APPS, f"{path.relative_to(SRC)} imports an application module"


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
