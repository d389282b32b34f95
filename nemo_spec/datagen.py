"""Self-distillation data: regenerate the assistant turns of a chat dataset with any OpenAI-compatible server.

Each conversation (Daring-Anteater / ShareGPT / OpenAI-messages JSONL, read by :func:`nemo_spec.data.read_conversations`)
is replayed turn by turn: every assistant turn is replaced by the server's ``chat.completions`` reply to the
conversation so far (with the previously regenerated replies), so the draft model later learns the served
model's own distribution. Records are written as Daring-Anteater JSONL, one line per finished conversation,
appended and fsync'ed as they complete; a rerun skips ids already in the output (resumable). A partial last
line (crash mid-write) is dropped on resume. The resolved settings are written next to the output
(``<output>.config.json``, without the API key).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Set

from nemo_spec.fsutil import atomic_text_file

log = logging.getLogger(__name__)


class DatagenError(RuntimeError):
    """Data generation cannot start or continue (message names the file/setting)."""


@dataclass
class DatagenConfig:
    """Settings of one data-generation run."""

    input: str  # dataset file or directory
    output: str  # Daring-Anteater JSONL (appended; resumable)
    model: str  # model id on the server
    base_url: str = "http://127.0.0.1:8000/v1"
    api_key: str = "EMPTY"
    fmt: str = "auto"  # auto | daring_anteater | sharegpt | messages
    system_prompt: Optional[str] = None  # used for records without a system prompt (or for all: override_system)
    override_system: bool = False
    concurrency: int = 8
    max_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    seed: Optional[int] = None
    limit: Optional[int] = None  # only the first N input records
    timeout: float = 600.0
    max_retries: int = 3
    extra_body: Dict[str, Any] = field(default_factory=dict)  # e.g. {"top_k": 20}

    def validate(self) -> "DatagenConfig":
        """Raise DatagenError naming the invalid setting; returns self."""
        if not Path(self.input).exists():
            raise DatagenError(f"input {self.input} does not exist")
        if self.fmt not in ("auto", "daring_anteater", "sharegpt", "messages"):
            raise DatagenError(f"fmt must be auto, daring_anteater, sharegpt or messages, got {self.fmt!r}")
        if self.concurrency < 1:
            raise DatagenError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.max_tokens < 1:
            raise DatagenError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            raise DatagenError(f"temperature must be in [0, 2], got {self.temperature}")
        if self.limit is not None and self.limit < 1:
            raise DatagenError(f"limit must be >= 1 or None, got {self.limit}")
        out, inp = Path(self.output).resolve(), Path(self.input).resolve()
        if out == inp:
            raise DatagenError(f"output {self.output} must differ from the input")
        if inp.is_dir() and inp in out.parents:
            raise DatagenError(f"output {self.output} is inside the input directory {self.input}: a rerun would read "
                               f"its own output (and its .config.json) as input; write it elsewhere")
        return self

    def public_dict(self) -> Dict[str, Any]:
        """The settings without secrets (written next to the output)."""
        d = dataclasses.asdict(self)
        d["api_key"] = "***" if self.api_key and self.api_key != "EMPTY" else self.api_key
        return d


@dataclass
class DatagenStats:
    """What a run did."""

    total: int = 0
    skipped_existing: int = 0
    written: int = 0
    failed: int = 0
    requests: int = 0
    completion_tokens: int = 0
    failures: List[str] = field(default_factory=list)


def finished_ids(path: Path) -> Set[str]:
    """Ids already written to ``path``; a trailing partial line is cut off (the file is repaired in place)."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        log.warning("%s: dropping a partial last line (%d bytes) left by an interrupted run", path, len(data) - end)
        with open(path, "r+b") as f:
            f.truncate(end)
    ids: Set[str] = set()
    for lineno, line in enumerate(data[:end].decode("utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rid = json.loads(line).get("id")
        except (json.JSONDecodeError, AttributeError) as e:
            raise DatagenError(f"{path}:{lineno}: not a JSON object ({e}); refusing to append to it") from e
        if rid is not None:
            ids.add(str(rid))
    return ids


def _write_json_atomic(obj: Dict[str, Any], path: Path) -> None:
    with atomic_text_file(path) as f:
        json.dump(obj, f, indent=2, sort_keys=True)


def make_client(cfg: DatagenConfig) -> Any:
    """The official OpenAI client pointed at ``cfg.base_url``."""
    import openai

    return openai.OpenAI(base_url=cfg.base_url, api_key=cfg.api_key, timeout=cfg.timeout, max_retries=cfg.max_retries)


def regenerate(client: Any, record: Dict[str, Any], cfg: DatagenConfig) -> tuple[Dict[str, Any], int, int]:
    """Replace every assistant turn of ``record`` by the server's reply; returns (record, requests, completion tokens)."""
    system = record.get("system")
    if cfg.system_prompt is not None and (cfg.override_system or not system):
        system = cfg.system_prompt
    messages: List[Dict[str, str]] = [{"role": "system", "content": system}] if system else []
    turns: List[Dict[str, str]] = []
    n_req = n_tok = 0
    kw: Dict[str, Any] = dict(model=cfg.model, max_tokens=cfg.max_tokens, temperature=cfg.temperature,
                              top_p=cfg.top_p)
    if cfg.seed is not None:
        kw["seed"] = cfg.seed
    if cfg.extra_body:
        kw["extra_body"] = dict(cfg.extra_body)
    for t in record["turns"]:
        if t["role"] != "assistant":
            messages.append({"role": t["role"], "content": t["content"]})
            turns.append(dict(t))
            continue
        resp = client.chat.completions.create(messages=list(messages), **kw)
        reply = resp.choices[0].message.content or ""
        n_req += 1
        n_tok += resp.usage.completion_tokens if resp.usage is not None else 0
        messages.append({"role": "assistant", "content": reply})
        turns.append({"role": "assistant", "content": reply})
    return {"id": record["id"], "system": system, "turns": turns}, n_req, n_tok


def _records(cfg: DatagenConfig) -> List[Dict[str, Any]]:
    from nemo_spec.data import read_conversations

    recs = read_conversations(cfg.input, fmt=cfg.fmt)
    recs = [r for r in recs if r.get("turns")]
    return recs[: cfg.limit] if cfg.limit else recs


def _earlier_spellings(done: Set[str]) -> Set[str]:
    """Finished ids written by versions that named an id-less record '<input path as typed>:<line>', as
    '<resolved path>:<line>' (what read_conversations records as ``_source``): a run started before the ids
    became path-independent resumes instead of writing every such record again."""
    out = set()
    for rid in done:
        path, sep, at = rid.rpartition(":")
        if sep and (at.isdigit() or at.startswith("item ")) and Path(path).is_file():
            out.add(f"{Path(path).resolve()}:{at}")
    return out


def generate_data(cfg: DatagenConfig, client: Any = None) -> DatagenStats:
    """Regenerate the dataset ``cfg.input`` into ``cfg.output`` (resumable); returns run statistics."""

    cfg.validate()
    out = Path(cfg.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = finished_ids(out)
    records = _records(cfg)
    dup = sorted(i for i, n in Counter(str(r["id"]) for r in records).items() if n > 1)
    if dup:
        raise DatagenError(f"{cfg.input}: duplicate record ids {dup[:5]}; ids must be unique to resume")
    stats = DatagenStats(total=len(records))
    earlier = _earlier_spellings(done)
    todo = [r for r in records if str(r["id"]) not in done and r.get("_source") not in earlier]
    stats.skipped_existing = len(records) - len(todo)
    _write_json_atomic({**cfg.public_dict(), "records": len(records)}, out.with_name(out.name + ".config.json"))
    log.info("generate_data: %d records, %d already in %s, %d to do (concurrency %d)", len(records),
             stats.skipped_existing, out, len(todo), cfg.concurrency)
    client = client or make_client(cfg)
    lock = threading.Lock()
    from tqdm import tqdm

    with open(out, "a", encoding="utf-8") as f, ThreadPoolExecutor(cfg.concurrency) as ex, \
            tqdm(total=len(todo), desc="generate_data", disable=None) as bar:
        pending: Dict[Future, str] = {}
        it: Iterator[Dict[str, Any]] = iter(todo)

        def fill() -> None:
            while len(pending) < 2 * cfg.concurrency:
                rec = next(it, None)
                if rec is None:
                    return
                pending[ex.submit(regenerate, client, rec, cfg)] = str(rec["id"])

        fill()
        try:
            _drain(pending, fill, f, lock, stats, bar)
        except KeyboardInterrupt:
            # queued conversations must not start, and the running ones' requests end with the client; what was
            # written stays (one complete line per record), a rerun resumes after it
            ex.shutdown(wait=False, cancel_futures=True)
            close = getattr(client, "close", None)
            if callable(close):
                close()
            log.warning("generate_data: interrupted after writing %d record(s) to %s; run the same command again "
                        "to resume", stats.written, out)
            raise
    log.info("generate_data: wrote %d, skipped %d, failed %d (%d requests, %d completion tokens) -> %s",
             stats.written, stats.skipped_existing, stats.failed, stats.requests, stats.completion_tokens, out)
    return stats


def _drain(pending: Dict[Future, str], fill: Any, f: Any, lock: threading.Lock, stats: DatagenStats, bar: Any) -> None:
    """Write each finished conversation as it completes (refilling the queue) until none is pending."""
    from nemo_spec.data import to_daring_anteater

    while pending:
        finished, _ = wait(list(pending), return_when=FIRST_COMPLETED)
        for fut in finished:
            rid = pending.pop(fut)
            try:
                rec, n_req, n_tok = fut.result()
            except Exception as e:  # one bad conversation must not stop the run; it is retried on resume
                stats.failed += 1
                stats.failures.append(f"{rid}: {type(e).__name__}: {e}")
                log.warning("record %s failed: %s", rid, e)
                bar.update(1)
                continue
            line = json.dumps(to_daring_anteater(rec), ensure_ascii=False)
            with lock:
                f.write(line + "\n")
                f.flush()
                os.fsync(f.fileno())
            stats.written += 1
            stats.requests += n_req
            stats.completion_tokens += n_tok
            bar.update(1)
        fill()
