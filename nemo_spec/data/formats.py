"""Readers and writers for chat/text training data.

Record shape (what every reader returns)::

    {"id": str, "system": str | None, "turns": [{"role": "user" | "assistant", "content": str}, ...]}

Plain-text records have ``turns == []`` and the document in ``"text"``.

Formats:
- ``daring_anteater``: JSONL, ``{"system": "...", "conversations": [{"from": "User"|"Assistant", "value": "..."}]}``
- ``sharegpt``: JSONL or a JSON list, ``{"conversations": [{"from": "human"|"gpt"|"system", "value": "..."}]}``
- ``messages``: JSONL or a JSON list, OpenAI style ``{"messages": [{"role": "system"|"user"|"assistant", "content": "..."}]}``
- ``text``: a text file, or a directory of text files (``.txt``, ``.md``, ``.py``, ``.rst`` by default)
- ``auto``: chosen from the first valid record's keys (text for non-JSON files)
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

from nemo_spec.fsutil import atomic_text_file

log = logging.getLogger(__name__)

FORMATS = ("daring_anteater", "sharegpt", "messages", "text", "auto")
TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst")
JSON_SUFFIXES = (".jsonl", ".json")

_ROLE_ALIASES = {
    "user": "user", "human": "user", "prompter": "user",
    "assistant": "assistant", "gpt": "assistant", "model": "assistant", "bot": "assistant", "chatgpt": "assistant",
    "system": "system",
}


class DataFormatError(ValueError):
    """A data file is malformed; the message names the file (and line) and the problem."""


class EmptyDatasetError(DataFormatError):
    """No usable sample was found in the given data path(s)."""


@dataclass
class ReadStats:
    """Counts gathered while reading: records kept, malformed records skipped, and the first error."""

    kept: int = 0
    skipped: int = 0
    first_error: Optional[str] = None
    files: List[str] = field(default_factory=list)

    def note_error(self, where: str, msg: str) -> None:
        """Count one skipped record, remembering the first error message."""
        self.skipped += 1
        if self.first_error is None:
            self.first_error = f"{where}: {msg}"


def _role(raw: Any, where: str) -> str:
    if not isinstance(raw, str):
        raise DataFormatError(f"{where}: role must be a string, got {raw!r}")
    r = _ROLE_ALIASES.get(raw.strip().lower())
    if r is None:
        raise DataFormatError(f"{where}: unknown role {raw!r} (expected one of user/human, assistant/gpt, system)")
    return r


def _turns_from(items: Any, role_key: str, content_key: str, where: str,
                system: Optional[str]) -> Tuple[Optional[str], List[Dict[str, str]]]:
    if not isinstance(items, list) or not items:
        raise DataFormatError(f"{where}: expected a non-empty list of turns, got {type(items).__name__}")
    turns: List[Dict[str, str]] = []
    for j, t in enumerate(items):
        if not isinstance(t, dict):
            raise DataFormatError(f"{where}: turn {j} is {type(t).__name__}, expected an object")
        if role_key not in t or content_key not in t:
            raise DataFormatError(f"{where}: turn {j} lacks {role_key!r} or {content_key!r} (keys: {sorted(t)})")
        role = _role(t[role_key], f"{where}: turn {j}")
        content = t[content_key]
        if not isinstance(content, str):
            raise DataFormatError(f"{where}: turn {j} {content_key!r} must be a string, got {type(content).__name__}")
        if role == "system":
            if turns:
                raise DataFormatError(f"{where}: a system turn may only come first (turn {j})")
            system = content if not system else system + "\n" + content
            continue
        turns.append({"role": role, "content": content})
    if not turns:
        raise DataFormatError(f"{where}: no user/assistant turns")
    if not any(t["role"] == "assistant" for t in turns):
        raise DataFormatError(f"{where}: no assistant turn")
    return system, turns


def parse_record(obj: Any, fmt: str, where: str) -> Dict[str, Any]:
    """Normalise one JSON object of format ``fmt`` into a record; raises DataFormatError naming ``where``."""
    if not isinstance(obj, dict):
        raise DataFormatError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if fmt == "auto":
        fmt = detect_format(obj)
    system = obj.get("system")
    if system is not None and not isinstance(system, str):
        raise DataFormatError(f"{where}: 'system' must be a string, got {type(system).__name__}")
    system = system or None
    if fmt in ("daring_anteater", "sharegpt"):
        if "conversations" not in obj:
            raise DataFormatError(f"{where}: missing 'conversations' (keys: {sorted(obj)})")
        system, turns = _turns_from(obj["conversations"], "from", "value", where, system)
    elif fmt == "messages":
        if "messages" not in obj:
            raise DataFormatError(f"{where}: missing 'messages' (keys: {sorted(obj)})")
        system, turns = _turns_from(obj["messages"], "role", "content", where, system)
    else:
        raise DataFormatError(f"{where}: format {fmt!r} is not a JSON chat format")
    rid = obj.get("id", obj.get("uuid"))
    return {"id": str(rid) if rid is not None else where, "system": system, "turns": turns}


def detect_format(obj: Dict[str, Any]) -> str:
    """Guess the chat format of one JSON object from its keys."""
    if "messages" in obj:
        return "messages"
    if "conversations" in obj:
        convs = obj["conversations"]
        if isinstance(convs, list) and convs and isinstance(convs[0], dict):
            if str(convs[0].get("from", "")).lower() in ("human", "gpt", "system"):
                return "sharegpt"
        return "daring_anteater"
    raise DataFormatError(f"cannot detect the chat format of an object with keys {sorted(obj)}")


_COMPRESSED = {b"\x1f\x8b": "gzip", b"BZh": "bzip2", b"\xfd7zXZ": "xz", b"\x28\xb5\x2f\xfd": "zstd"}


def _compression(file: Path) -> Optional[str]:
    with open(file, "rb") as f:
        head = f.read(6)
    return next((kind for magic, kind in _COMPRESSED.items() if head.startswith(magic)), None)


def _iter_files(path: Path, suffixes: Sequence[str]) -> List[Path]:
    if path.is_file():
        kind = _compression(path)
        if kind:  # read as text it was one "invalid UTF-8" record per line
            raise DataFormatError(f"{path} is {kind}-compressed: decompress it first (e.g. gunzip -k {path.name})")
        return [path]
    if path.is_dir():  # hidden files and directories (.git, .cache/huggingface, ...) are not data
        every = sorted(p for p in path.rglob("*")
                       if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts))
        files = [p for p in every if p.suffix in suffixes]
        left = [p for p in every if p.suffix not in suffixes]
        if left:  # e.g. a .jsonl.gz next to the data: was left out without a word
            log.warning("%s: %d file(s) not read (suffix not in %s), e.g. %s", path, len(left), list(suffixes),
                        left[0].relative_to(path))
        if not files:
            raise EmptyDatasetError(f"{path}: directory has no files with suffix {list(suffixes)}")
        return files
    raise FileNotFoundError(f"data path {path} does not exist")


def data_files(path: Path, fmt: str) -> List[Path]:
    """The files ``read_conversations`` reads for ``path`` (a file, or a directory's files of the format's suffixes;
    ``auto``: a directory may mix chat JSONL and text files, each read as what its suffix says)."""
    suffixes = TEXT_SUFFIXES if fmt == "text" else JSON_SUFFIXES + TEXT_SUFFIXES if fmt == "auto" else JSON_SUFFIXES
    return _iter_files(Path(path), suffixes)


def _iter_json_objects(file: Path) -> Iterator[Tuple[str, Any, Optional[str]]]:
    """Yield (where, object or None, error) for each JSONL line or JSON-list item of ``file``; a line that is
    not valid UTF-8 is a malformed record like invalid JSON."""
    with open(file, "rb") as fb:
        head = fb.read(4096).decode("utf-8", errors="replace").lstrip("\ufeff \t\r\n")  # a UTF-8 BOM too
    if file.suffix == ".json" and head.startswith("{"):  # one (pretty-printed) object: one record, not one per line
        try:
            obj = json.loads(file.read_bytes().decode("utf-8-sig"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            obj = None  # JSON lines after all: read line by line below
        if isinstance(obj, dict):
            yield f"{file}:1", obj, None
            return
    if head.startswith("["):
        raw = file.read_bytes()
        try:
            items = json.loads(raw.decode("utf-8-sig"))
        except UnicodeDecodeError as e:
            line_no = raw.count(b"\n", 0, e.start) + 1
            yield f"{file}:{line_no}", None, f"invalid UTF-8 at byte {e.start}: {e.reason}"
            return
        except json.JSONDecodeError as e:
            yield f"{file}:{e.lineno}", None, f"invalid JSON: {e.msg}"
            return
        for i, item in enumerate(items):
            yield f"{file}:item {i}", item, None
        return
    with open(file, "rb") as f:
        for lineno, raw_line in enumerate(f, 1):
            try:
                line = raw_line.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                yield f"{file}:{lineno}", None, f"invalid UTF-8 at column {e.start + 1}: {e.reason}"
                continue
            if not line.strip():
                continue
            try:
                yield f"{file}:{lineno}", json.loads(line), None
            except json.JSONDecodeError as e:
                yield f"{file}:{lineno}", None, f"invalid JSON: {e.msg} (column {e.colno})"


def read_conversations(path: str | os.PathLike | Sequence[str | os.PathLike], fmt: str = "auto",
                       strict: bool = False, stats: Optional[ReadStats] = None) -> List[Dict[str, Any]]:
    """Read chat records (or text documents for ``fmt='text'``) from files/directories.

    Malformed records are skipped and counted (the first error is logged), or with ``strict=True`` the
    first one raises DataFormatError naming file and line. No usable record raises EmptyDatasetError. Keys that
    start with "_" are the reader's notes (``_where``: file:line, for messages about the record).
    """
    if fmt not in FORMATS:
        raise DataFormatError(f"unknown data format {fmt!r}; choose one of {FORMATS}")
    paths = [path] if isinstance(path, (str, os.PathLike)) else list(path)
    if not paths:
        raise EmptyDatasetError("no data path given")
    stats = stats if stats is not None else ReadStats()
    records: List[Dict[str, Any]] = []
    for p in map(Path, paths):
        for file in data_files(p, fmt):
            stats.files.append(str(file))
            if fmt == "text" or (fmt == "auto" and file.suffix not in JSON_SUFFIXES):
                text = file.read_text(encoding="utf-8", errors="replace")
                if text.strip():
                    records.append({"id": str(file), "system": None, "turns": [], "text": text})
                    stats.kept += 1
                continue
            # a record without an id is named by its file relative to the path given (a file: its name) and its
            # line: the same however the path is spelt or wherever it is read from, and no home directory in it
            name = file.relative_to(p).as_posix() if p.is_dir() else file.name
            for where, obj, err in _iter_json_objects(file):
                try:
                    if err is not None:
                        raise DataFormatError(f"{where}: {err}")
                    rec = parse_record(obj, fmt, where)
                    at = where[len(str(file)) + 1:]
                    rec["_where"] = f"{name}:{at}"  # for messages about the record (its id may be its own)
                    if rec["id"] == where:
                        rec["id"], rec["_source"] = f"{name}:{at}", f"{file.resolve()}:{at}"
                    records.append(rec)
                    stats.kept += 1
                except DataFormatError as e:
                    if strict:
                        raise
                    msg = str(e)
                    stats.note_error(where, msg[len(where) + 2:] if msg.startswith(where) else msg)
    if stats.skipped:
        log.warning("skipped %d malformed record(s) of %d; first error: %s", stats.skipped,
                    stats.skipped + stats.kept, stats.first_error)
    if not records:
        extra = f"; first error: {stats.first_error}" if stats.first_error else ""
        raise EmptyDatasetError(f"no usable records in {', '.join(map(str, paths))} "
                                f"(format={fmt}, skipped={stats.skipped}){extra}")
    log.info("read %d record(s) from %d file(s) (format=%s)", len(records), len(stats.files), fmt)
    return records


def to_daring_anteater(record: Dict[str, Any]) -> Dict[str, Any]:
    """Convert a normalised record into a Daring-Anteater JSON object."""
    out: Dict[str, Any] = {"id": record.get("id"), "system": record.get("system") or "",
                           "conversations": [{"from": "User" if t["role"] == "user" else "Assistant",
                                              "value": t["content"]} for t in record["turns"]]}
    return out


def _atomic_write_lines(lines: Iterable[str], path: Path) -> Path:
    with atomic_text_file(path) as f:
        for line in lines:
            f.write(line + "\n")
    return path


def write_daring_anteater(records: Iterable[Dict[str, Any]], path: str | os.PathLike) -> Path:
    """Write records as Daring-Anteater JSONL, atomically (temp file then rename)."""
    return _atomic_write_lines((json.dumps(to_daring_anteater(r), ensure_ascii=False) for r in records), Path(path))


def write_messages(records: Iterable[Dict[str, Any]], path: str | os.PathLike) -> Path:
    """Write records as OpenAI-messages JSONL, atomically."""
    def conv(r: Dict[str, Any]) -> str:
        msgs = ([{"role": "system", "content": r["system"]}] if r.get("system") else []) + list(r["turns"])
        return json.dumps({"id": r.get("id"), "messages": msgs}, ensure_ascii=False)
    return _atomic_write_lines((conv(r) for r in records), Path(path))
