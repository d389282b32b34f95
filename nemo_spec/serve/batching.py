"""Dynamic batching: a worker thread drains a bounded request queue into engine batches and streams tokens back.

Requests (each with one or more rows: prompts x n) wait in a bounded FIFO. The worker takes the oldest
request, then keeps adding queued requests (up to ``max_batch`` rows, waiting at most ``batch_wait_s``
for more to arrive) and runs the engine once for the whole batch with per-row sampling parameters.
The engine calls ``on_tokens(row, ids)`` as tokens are accepted (several per call for speculative
steps); each row is detokenized incrementally, checked for stop strings, and its text deltas are
pushed to the request's asyncio queue on the event loop. A row whose client went away, or that hit a
stop string, is cancelled by returning False from ``on_tokens``.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

from nemo_spec.serve.metrics import ServerMetrics

log = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """The request queue of a model is full."""


class BatcherClosedError(RuntimeError):
    """The model's batcher no longer accepts requests (model unloaded)."""


# Engine: (prompts, per-row params, on_tokens) -> list of results with .tokens, .finish_reason, .stats
EngineFn = Callable[[List[List[int]], List[Any], Callable[[int, List[int]], Optional[bool]]], List[Any]]


class IncrementalDecoder:
    """Token ids -> text deltas, robust to multi-token characters, with stop-string detection and hold-back."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.max_stop = max((len(s) for s in self.stop), default=0)
        self.tokens: List[int] = []
        self.text = ""  # decoded so far (may include held-back characters)
        self.emitted = 0  # characters of self.text already returned
        self._prefix = 0
        self._read = 0
        self.stopped = False

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _advance(self) -> None:
        prefix_text = self._decode(self.tokens[self._prefix:self._read])
        new_text = self._decode(self.tokens[self._prefix:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.text += new_text[len(prefix_text):]
            self._prefix, self._read = self._read, len(self.tokens)

    def _held_back(self) -> int:
        """Characters at the end of text that could start a stop string."""
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text) - self.emitted), 0, -1):
                if self.text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        return hold

    def add(self, ids: Sequence[int]) -> str:
        """Append ids; return the new text that is safe to emit. Sets ``stopped`` when a stop string appears."""
        if self.stopped:
            return ""
        before_text = len(self.text)
        if not self.stop:  # no stop strings: one incremental decode for the whole chunk
            self.tokens.extend(int(t) for t in ids)
            self._advance()
            delta = self.text[self.emitted:]
            self.emitted = len(self.text)
            return delta
        for t in ids:  # one token at a time so a stop string is caught at the token that completes it
            self.tokens.append(int(t))
            self._advance()
            if self.stop and len(self.text) > before_text:
                start = max(0, before_text - self.max_stop + 1)
                hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
                if hits:
                    cut = min(hits)
                    self.text = self.text[:cut]
                    self.stopped = True
                    break
        end = len(self.text) if self.stopped else len(self.text) - self._held_back()
        end = max(end, self.emitted)
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta

    def flush(self) -> str:
        """At the end of generation: everything not yet emitted (incl. held-back text and partial characters)."""
        if not self.stopped and self._read < len(self.tokens):
            full = self._decode(self.tokens[self._prefix:])
            prefix_text = self._decode(self.tokens[self._prefix:self._read])
            if len(full) > len(prefix_text):
                self.text += full[len(prefix_text):]
            self._read = len(self.tokens)
        delta = self.text[self.emitted:]
        self.emitted = len(self.text)
        return delta


@dataclass
class RowSpec:
    """One sequence to generate: a prompt (token ids) with its sampling parameters."""

    prompt: List[int]
    params: Any
    choice: int


@dataclass
class GenRequest:
    """A queued API request: rows to generate plus the channel back to the asyncio handler."""

    rows: List[RowSpec]
    stop: List[str]
    loop: asyncio.AbstractEventLoop
    events: "asyncio.Queue[Tuple]" = field(default_factory=asyncio.Queue)
    arrived: float = field(default_factory=time.monotonic)
    cancelled: bool = False
    started: Optional[float] = None
    first_token: Optional[float] = None

    @property
    def num_rows(self) -> int:
        """Engine rows this request occupies."""
        return len(self.rows)

    def emit(self, event: Tuple) -> None:
        """Deliver an event to the handler (thread-safe; dropped if the loop is gone)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # event loop closed: the client is gone
            self.cancelled = True


class Batcher:
    """Owns the bounded queue and the worker thread that runs the engine for one model."""

    def __init__(self, engine: EngineFn, tokenizer: Any, max_batch: int, max_queue: int,
                 batch_wait_s: float = 0.005, metrics: Optional[ServerMetrics] = None, name: str = "model") -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.engine = engine
        self.tokenizer = tokenizer
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.batch_wait_s = batch_wait_s
        self.metrics = metrics or ServerMetrics()
        self.name = name
        self._pending: Deque[GenRequest] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._drain = True
        self.running_rows = 0
        self.batches_run = 0
        self._current: List[GenRequest] = []
        self._thread = threading.Thread(target=self._loop, name=f"batcher-{name}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ producer side
    def queue_depth(self) -> int:
        """Requests waiting (not yet in a batch)."""
        return len(self._pending)

    def submit(self, req: GenRequest) -> None:
        """Enqueue a request; raises QueueFullError / BatcherClosedError instead of blocking."""
        if req.num_rows > self.max_batch:
            raise ValueError(f"request needs {req.num_rows} rows but max_batch is {self.max_batch}")
        with self._cond:
            if self._closed:
                raise BatcherClosedError(f"model {self.name!r} is being unloaded")
            if len(self._pending) >= self.max_queue:
                raise QueueFullError(f"the request queue of model {self.name!r} is full ({self.max_queue} waiting)")
            self._pending.append(req)
            self._cond.notify()

    def close(self, drain: bool = True, timeout: Optional[float] = None, cancel_running: bool = False) -> None:
        """Stop accepting requests; with drain, finish queued ones first, else fail them; join the worker.
        ``cancel_running`` also stops the batch in progress at its next step (server shutdown)."""
        with self._cond:
            self._closed = True
            self._drain = drain
            if cancel_running:
                for req in self._current:
                    req.cancelled = True
            if not drain:
                while self._pending:
                    req = self._pending.popleft()
                    req.emit(("error", 503, f"model {self.name!r} was unloaded before the request started"))
            self._cond.notify_all()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """Whether the worker thread is running."""
        return self._thread.is_alive()

    # ------------------------------------------------------------ worker side
    def _take_batch(self) -> Optional[List[GenRequest]]:
        with self._cond:
            while True:
                while self._pending and self._pending[0].cancelled:
                    self._pending.popleft()
                if self._pending:
                    break
                if self._closed:
                    return None
                self._cond.wait()
            batch = [self._pending.popleft()]
            rows = batch[0].num_rows
            deadline = time.monotonic() + self.batch_wait_s
            while rows < self.max_batch:
                if self._pending:
                    nxt = self._pending[0]
                    if nxt.cancelled:
                        self._pending.popleft()
                        continue
                    if rows + nxt.num_rows > self.max_batch:
                        break
                    batch.append(self._pending.popleft())
                    rows += nxt.num_rows
                    continue
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    break
                self._cond.wait(left)
            return batch

    def _loop(self) -> None:
        while True:
            batch = self._take_batch()
            if batch is None:
                return
            self._current = batch
            try:
                self._execute(batch)
            except Exception as e:  # never let the worker die: report to the requests and go on
                log.exception("engine batch failed")
                for req in batch:
                    req.emit(("error", 500, f"generation failed: {type(e).__name__}: {e}"))
            finally:
                self.running_rows = 0
                self._current = []

    def _execute(self, batch: List[GenRequest]) -> None:
        rows: List[Tuple[GenRequest, RowSpec, IncrementalDecoder]] = []
        for req in batch:
            for r in req.rows:
                rows.append((req, r, IncrementalDecoder(self.tokenizer, req.stop)))
        done = [False] * len(rows)
        reasons: List[Optional[str]] = [None] * len(rows)
        t0 = time.monotonic()
        for req in batch:
            req.started = t0
            self.metrics.queue_time.observe(t0 - req.arrived)
        self.running_rows = len(rows)
        self.metrics.batch_size.observe(len(rows))
        self.batches_run += 1
        log.debug("batch of %d rows from %d requests", len(rows), len(batch))

        def on_tokens(row: int, ids: List[int]) -> bool:
            if done[row]:
                return False
            req, spec, dec = rows[row]
            if req.cancelled:
                done[row] = True
                reasons[row] = "cancelled"
                self.metrics.cancelled.inc()
                req.emit(("finish", spec.choice, "cancelled", len(dec.tokens), {}))  # ends a stream still open
                return False
            if req.first_token is None and len(ids) > 0:
                req.first_token = time.monotonic()
                self.metrics.ttft.observe(req.first_token - req.arrived)
            delta = dec.add(ids)
            if delta:
                req.emit(("delta", spec.choice, delta))
            if dec.stopped:
                done[row] = True
                reasons[row] = "stop"
                req.emit(("finish", spec.choice, "stop", len(dec.tokens), {}))
                return False
            return True

        results = self.engine([r.prompt for _, r, _ in rows], [r.params for _, r, _ in rows], on_tokens)
        for i, (req, spec, dec) in enumerate(rows):
            res = results[i]
            stats = dict(getattr(res, "stats", {}) or {})
            if "tau" in stats and stats["tau"] is not None:
                try:
                    self.metrics.tau.observe(float(stats["tau"]))
                except (TypeError, ValueError):
                    pass
            if done[i]:
                continue
            done[i] = True
            tokens = [int(t) for t in res.tokens]
            if tokens[:len(dec.tokens)] != dec.tokens:
                log.warning("row %d: streamed tokens differ from the engine result; using the result", i)
            elif len(tokens) > len(dec.tokens):  # engine did not report every token through on_tokens
                delta = dec.add(tokens[len(dec.tokens):])
                if delta:
                    req.emit(("delta", spec.choice, delta))
            if dec.stopped:
                req.emit(("finish", spec.choice, "stop", len(dec.tokens), stats))
                continue
            delta = dec.flush()
            if delta:
                req.emit(("delta", spec.choice, delta))
            reason = res.finish_reason if res.finish_reason in ("stop", "length") else "stop"
            if req.cancelled or res.finish_reason == "cancelled":
                reason = "cancelled"
            # the engine drops the stop token (eos) from its output; usage counts it, as it was generated
            count = len(dec.tokens) + (1 if res.finish_reason == "stop" else 0)
            req.emit(("finish", spec.choice, reason, count, stats))
