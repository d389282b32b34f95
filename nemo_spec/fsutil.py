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


def publish_directory(tmp: Path, target: Path) -> None:
    """Move the finished ``tmp`` dir to ``target``; old content is removed only after the move succeeded.

    If the final rename fails, the previous ``target`` is put back under its own name.
    """
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
