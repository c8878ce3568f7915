"""Local boards that the operating system refuses to write: a read-only folder, an immutable one, a full disk.

Each is made with what this machine allows and checked before use; a test that cannot get one is skipped
with the reason. ``read_only`` takes mode 0555 where that stops this process (not root), else a read-only
bind mount (root, where ``mount`` is permitted), else ``chattr +i``. ``immutable`` takes ``chattr +i``
(root, on a filesystem with the attribute). ``full_filesystem`` mounts a small tmpfs (root, where ``mount``
is permitted). Everything is undone on exit.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest


def _blocks_writes(folder: Path) -> bool:
    probe = folder / f".probe-{uuid.uuid4().hex[:8]}"
    try:
        probe.write_bytes(b"x")
    except OSError:
        return True
    probe.unlink()
    return False


def _run(*cmd: str) -> bool:
    if shutil.which(cmd[0]) is None:
        return False
    return subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30).returncode == 0


def _dirs(root: Path) -> list[Path]:
    return [root, *(p for p in sorted(root.rglob("*")) if p.is_dir())]


@contextlib.contextmanager
def _mode_0555(root: Path) -> Iterator[bool]:
    folders = _dirs(root)
    for d in reversed(folders):
        d.chmod(0o555)
    try:
        yield _blocks_writes(root)
    finally:
        for d in folders:
            d.chmod(0o755)


@contextlib.contextmanager
def _read_only_mount(root: Path) -> Iterator[bool]:
    if not _run("mount", "--bind", str(root), str(root)):
        yield False
        return
    try:
        yield _run("mount", "-o", "remount,bind,ro", str(root)) and _blocks_writes(root)
    finally:
        _run("umount", str(root))


@contextlib.contextmanager
def _chattr_immutable(root: Path) -> Iterator[bool]:
    if not _run("chattr", "-R", "+i", str(root)):
        _run("chattr", "-R", "-i", str(root))
        yield False
        return
    try:
        yield _blocks_writes(root)
    finally:
        _run("chattr", "-R", "-i", str(root))


WAYS = {"mode 0555": _mode_0555, "read-only mount": _read_only_mount, "chattr +i": _chattr_immutable}


@contextlib.contextmanager
def read_only(root: Path, way: str | None = None) -> Iterator[str]:
    """Make the folder ``root`` (an existing board, all its sub-folders too) unwritable, the first of
    ``WAYS`` that works here (or ``way``); yields how it was done."""
    for how, make in WAYS.items():
        if way not in (None, how):
            continue
        with make(root) as blocked:
            if blocked:
                yield how
                return
    pytest.skip(f"cannot make a folder unwritable here with {way or ' or '.join(WAYS)} (root, without mount?)")


@contextlib.contextmanager
def immutable(*paths: Path) -> Iterator[None]:
    """``chattr +i`` on each path (a folder: recursively); skips where the attribute cannot be set."""
    done: list[Path] = []
    try:
        for p in paths:
            flag = ("-R", "+i") if p.is_dir() else ("+i",)
            if not _run("chattr", *flag, str(p)):
                pytest.skip("chattr +i does not work here (not root, or the filesystem lacks the attribute)")
            done.append(p)
        yield
    finally:
        for p in done:
            _run("chattr", *(("-R", "-i") if p.is_dir() else ("-i",)), str(p))


@contextlib.contextmanager
def full_filesystem(mount_point: Path, size: str = "512k") -> Iterator[Path]:
    """A tmpfs of ``size`` at ``mount_point``; skips where it cannot be mounted (not root, or not permitted)."""
    mount_point.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or not _run("mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)):
        pytest.skip("cannot mount a small tmpfs here (needs root and mount permission)")
    try:
        yield mount_point
    finally:
        _run("umount", "-l", str(mount_point))
