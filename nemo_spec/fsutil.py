"""Filesystem helpers shared by checkpoint saving, export and the benchmarks: atomic publication."""
from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path


_DISPLACED = ".old-"


def is_displaced_directory(path: Path) -> bool:
    """Whether ``path`` is a previous directory that publish_directory moved aside (not a real output)."""
    name = Path(path).name
    return name.startswith(".") and _DISPLACED in name


def current_umask() -> int:
    """The process's file mode creation mask (read without changing it where /proc says it)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def default_modes(root: Path) -> None:
    """Give ``root`` (a file, or a folder and everything below it) the modes a plain ``mkdir`` / ``open`` would: 0o777 / 0o666 less the
    umask (files with an execute bit keep one). ``tempfile.mkdtemp`` makes 0o700 folders and safetensors 0.8 writes
    0o600 files, which an engine or user reading the output under another account could not open."""
    mask = current_umask()
    root = Path(root)
    if root.is_file():
        os.chmod(root, (0o777 if root.stat().st_mode & 0o111 else 0o666) & ~mask)
        return
    for dirpath, dirnames, filenames in os.walk(root):
        os.chmod(dirpath, 0o777 & ~mask)
        for name in filenames:
            f = os.path.join(dirpath, name)
            if not os.path.islink(f):
                x = os.stat(f).st_mode & 0o111
                os.chmod(f, (0o777 if x else 0o666) & ~mask)


def publish_directory(tmp: Path, target: Path) -> None:
    """Move the finished ``tmp`` dir to ``target`` (with the modes of :func:`default_modes`); old content is
    removed only after the move succeeded.

    If the final rename fails, the previous ``target`` is put back under its own name.
    """
    default_modes(tmp)
    old = None
    if target.exists():
        old = target.parent / f".{target.name}{_DISPLACED}{uuid.uuid4().hex[:8]}"
        os.replace(target, old)
    try:
        os.replace(tmp, target)
    except BaseException:
        if old is not None:
            os.replace(old, target)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_text_atomic(path: Path, text: str) -> Path:
    """``text`` to ``path`` through a temporary name in the same folder, so no reader sees it half-written."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
