"""Where things live on a board: the folders of runs, versions, keyframes and spans (and which a manifest lives
in), fresh attempt ids, the HEAD hint and member records. See docs/board.md ("Layout")."""

from __future__ import annotations

import re
import secrets

from flipsync.domain.manifest import Kind, Manifest, check_name
from flipsync.errors import BoardError

RUNS = "runs"
MEMBERS = "members"
MANIFEST = "manifest.json"
LATEST = "latest.json"
VERSION_DIGITS = 12
MAX_VERSION = 10**VERSION_DIGITS - 1
_VERSION_RE = re.compile(rf"\d{{{VERSION_DIGITS}}}")
_SPAN_RE = re.compile(rf"(\d{{{VERSION_DIGITS}}})-(\d{{{VERSION_DIGITS}}})")


def version_name(v: int) -> str:
    if not 0 <= v <= MAX_VERSION:
        raise BoardError(f"version {v} is out of range 0..{MAX_VERSION}")
    return f"{v:0{VERSION_DIGITS}d}"


def parse_version_name(name: str) -> int | None:
    return int(name) if _VERSION_RE.fullmatch(name) else None


def parse_span_name(name: str) -> tuple[int, int] | None:
    m = _SPAN_RE.fullmatch(name)
    if not m:
        return None
    a, b = int(m.group(1)), int(m.group(2))
    return (a, b) if a < b else None


def part_name(index: int) -> str:
    """The file name of a version's part ``index`` (a rank's part of a sharded version, or the i-th part)."""
    return f"patch-{index:05d}.safetensors"


def new_attempt_id() -> str:
    """A fresh folder name for one publish attempt (unguessable, so racing publishers never collide)."""
    return secrets.token_hex(8)


class RunLayout:
    """Paths of one run on a board (relative to the store root)."""

    def __init__(self, run: str) -> None:
        self.run = check_name(run, "run name")
        self.root = f"{RUNS}/{run}"
        self.versions_dir = f"{self.root}/versions"
        self.keyframes_dir = f"{self.root}/keyframes"
        self.spans_dir = f"{self.root}/spans"
        self.latest = f"{self.root}/{LATEST}"
        self.members_dir = f"{self.root}/{MEMBERS}"

    def member_path(self, replica: str) -> str:
        return f"{self.members_dir}/{check_name(replica, 'replica id')}.json"

    def version_dir(self, v: int) -> str:
        return f"{self.versions_dir}/{version_name(v)}"

    def keyframe_dir(self, v: int) -> str:
        return f"{self.keyframes_dir}/{version_name(v)}"

    def span_dir(self, base: int, target: int) -> str:
        return f"{self.spans_dir}/{version_name(base)}-{version_name(target)}"

    def version_manifest(self, v: int) -> str:
        return f"{self.version_dir(v)}/{MANIFEST}"

    def keyframe_manifest(self, v: int) -> str:
        return f"{self.keyframe_dir(v)}/{MANIFEST}"

    def span_manifest(self, base: int, target: int) -> str:
        return f"{self.span_dir(base, target)}/{MANIFEST}"

    def artifact_dir(self, m: Manifest, *, in_versions: bool) -> str:
        """The folder a manifest lives in: the version folder, or the keyframe / span folder."""
        if in_versions:
            return self.version_dir(m.version)
        if m.kind is Kind.KEYFRAME:
            return self.keyframe_dir(m.version)
        if m.kind is Kind.SPAN:
            assert m.base_version is not None
            return self.span_dir(m.base_version, m.target_version)
        raise BoardError(f"a {m.kind.value} manifest lives in the versions folder")
