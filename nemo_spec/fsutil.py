"""Filesystem helpers shared by checkpoint saving, export and the benchmarks: atomic publication."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Iterator, TextIO


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


def _default_mode(path: str, mask: int) -> int:
    """0o666 (0o777 for a file with an execute bit, or a folder) less ``mask``."""
    st = os.stat(path)
    return (0o777 if os.path.isdir(path) or st.st_mode & 0o111 else 0o666) & ~mask


def default_modes(root: Path) -> None:
    """Give ``root`` (a file, or a folder and everything below it) the modes a plain ``mkdir`` / ``open`` would:
    0o777 / 0o666 less the umask (files with an execute bit keep one). ``tempfile.mkdtemp`` / ``mkstemp`` make
    0o700 / 0o600 and safetensors 0.8 writes 0o600 files, which an engine or user reading the output under
    another account could not open."""
    mask = current_umask()
    paths = [str(root)]
    if os.path.isdir(root):
        for dirpath, _, filenames in os.walk(root):
            paths += [dirpath] if dirpath != str(root) else []
            paths += [os.path.join(dirpath, n) for n in filenames]
    for f in paths:
        if not os.path.islink(f):
            os.chmod(f, _default_mode(f, mask))


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


@contextlib.contextmanager
def atomic_text_file(path: Path) -> Iterator[TextIO]:
    """A UTF-8 text file to write ``path`` through: a temporary file in the same folder (its parent is created),
    renamed onto ``path`` with the default modes (:func:`default_modes`) when the block ends, removed if it
    raises, so no reader sees a half-written ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            yield f
        default_modes(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_text_atomic(path: Path, text: str) -> Path:
    """``text`` to ``path`` through :func:`atomic_text_file`."""
    with atomic_text_file(path) as f:
        f.write(text)
    return Path(path)
