"""Dynamic batching: a worker thread drains a bounded request queue into engine batches and streams tokens back.

Requests (each with one or more rows: prompts x n) wait in a bounded FIFO. The worker fills a batch with
queued rows, oldest request first (up to ``max_batch`` rows, waiting at most ``batch_wait_s`` for more to
arrive; a request with more rows than free slots is split over batches) and runs the engine once for the
whole batch with per-row sampling parameters. A batch that fails is rerun request by request, so one
request that cannot run fails alone.
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

from nemo_spec.inference.sampling import decode_text, text_context
from nemo_spec.serve.metrics import ServerMetrics

log = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """The request queue of a model is full."""


class BatcherClosedError(RuntimeError):
    """The model's batcher no longer accepts requests (model unloaded)."""


# Engine: (prompts, per-row params, on_tokens, on_finish) -> list of results with .tokens, .finish_reason, .stats;
# on_tokens(row, ids) streams tokens (False cancels the row), on_finish(row, "stop" | "length") ends a row early
EngineFn = Callable[[List[List[int]], List[Any], Callable[[int, List[int]], Optional[bool]],
                     Callable[[int, str], None]], List[Any]]


class IncrementalDecoder:
    """Token ids -> text deltas, robust to multi-token characters, with stop-string detection and hold-back."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = (), prompt: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.max_stop = max((len(s) for s in self.stop), default=0)
        # the prompt's last tokens, decoded ahead of the generated ones: the text continues the prompt (sampling.py)
        ctx, carried = text_context(tokenizer, prompt) if prompt else ([], [])
        self._ids: List[int] = ctx + carried  # then the generated tokens
        self._start = len(self._ids)
        self.text = ""  # decoded so far (may include held-back characters)
        self.emitted = 0  # characters of self.text already returned
        self._prefix = 0
        self._read = len(ctx)
        self.stopped = False

    @property
    def tokens(self) -> List[int]:
        """The generated tokens added so far."""
        return self._ids[self._start:]

    def _decode(self, ids: Sequence[int]) -> str:
        return decode_text(self.tokenizer, ids)

    def _advance(self) -> None:
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.text += new_text[len(prefix_text):]
            self._prefix, self._read = self._read, len(self._ids)

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
            self._ids.extend(int(t) for t in ids)
            self._advance()
            delta = self.text[self.emitted:]
            self.emitted = len(self.text)
            return delta
        for t in ids:  # one token at a time so a stop string is caught at the token that completes it
            self._ids.append(int(t))
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
        if not self.stopped and self._read < len(self._ids):
            full = self._decode(self._ids[self._prefix:])
            prefix_text = self._decode(self._ids[self._prefix:self._read])
            if len(full) > len(prefix_text):
                self.text += full[len(prefix_text):]
            self._read = len(self._ids)
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
    """A queued API request: rows to generate plus the channel back to the asyncio handler.

    A request's rows may run in several engine batches (``n`` larger than ``max_batch``, or a batch with only
    a few free slots); the request ends when every row has finished.
    """

    rows: List[RowSpec]
    stop: List[str]
    loop: asyncio.AbstractEventLoop
    prompt_tokens: int = 0  # for the prompt-token counter (counted once, when the request starts)
    events: "asyncio.Queue[Tuple]" = field(default_factory=asyncio.Queue)
    arrived: float = field(default_factory=time.monotonic)
    cancelled: bool = False
    started: Optional[float] = None
    first_token: Optional[float] = None
    aborted: Optional[str] = None  # set at server shutdown: unfinished rows end with a 503 error event
    failed: bool = False  # an error event was sent; remaining rows are not run
    next_row: int = 0  # rows[:next_row] have been handed to an engine batch
    rows_done: int = 0

    @property
    def num_rows(self) -> int:
        """Engine rows this request occupies."""
        return len(self.rows)

    @property
    def done(self) -> bool:
        """Every row has finished (or the request failed)."""
        return self.rows_done >= len(self.rows)

    @property
    def dropped(self) -> bool:
        """Its remaining rows should not run (client gone, failed or aborted)."""
        return self.cancelled or self.failed or self.aborted is not None

    def emit(self, event: Tuple) -> None:
        """Deliver an event to the handler (thread-safe; dropped if the loop is gone)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # event loop closed: the client is gone
            self.cancelled = True

    def fail(self, status: int, message: str, code: Optional[str] = None) -> None:
        """Send one error event (the request ends; its other rows are dropped)."""
        if not self.failed:
            self.failed = True
            self.emit(("error", status, message, code))


#: a slice of one request's rows that runs in one engine batch
Slice = Tuple[GenRequest, List[RowSpec]]


@dataclass
class _SliceProgress:
    """How far one slice of a batch got: whether its request has received tokens, how many rows ended."""

    streamed: bool = False
    ended: int = 0


class _RequestQueue:
    """The producer side both schedulers share: the bounded FIFO of requests, closing, shutdown and aborts."""

    def _init_queue(self, tokenizer: Any, max_batch: int, max_queue: int, batch_wait_s: float,
                    metrics: Optional[ServerMetrics], name: str) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
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
        self._closed_reason = f"model {name!r} is being unloaded"
        self._abort_message: Optional[str] = None
        self.running_rows = 0
        self.batches_run = 0
        self._thread: threading.Thread

    def _running_requests(self) -> List[GenRequest]:
        """Requests with rows generating now."""
        raise NotImplementedError

    # ------------------------------------------------------------ producer side
    def queue_depth(self) -> int:
        """Requests waiting (not yet in a batch)."""
        return len(self._pending)

    def submit(self, req: GenRequest) -> None:
        """Enqueue a request; raises QueueFullError / BatcherClosedError instead of blocking."""
        if not req.rows:
            raise ValueError("a request needs at least one row")
        with self._cond:
            if self._closed:
                raise BatcherClosedError(self._closed_reason)
            if len(self._pending) >= self.max_queue:  # requests whose clients left do not hold places
                self._pending = collections.deque(r for r in self._pending if not r.cancelled)
            if len(self._pending) >= self.max_queue:
                raise QueueFullError(f"the request queue of model {self.name!r} is full ({self.max_queue} waiting)")
            self._pending.append(req)
            self._cond.notify()

    def close(self, drain: bool = True, timeout: Optional[float] = None, cancel_running: bool = False) -> None:
        """Stop accepting requests; with drain, finish queued ones first, else fail them; join the worker.
        ``cancel_running`` also stops the rows in progress at their next step (server shutdown)."""
        with self._cond:
            self._closed = True
            self._drain = drain
            if cancel_running:
                for req in self._running_requests():
                    req.cancelled = True
            if not drain:
                self._fail_pending(503, f"model {self.name!r} was unloaded before the request started",
                                   "model_unloaded")
            self._cond.notify_all()
        self._thread.join(timeout)

    def begin_shutdown(self, message: str = "the server is shutting down") -> None:
        """Server shutdown, first phase: refuse new requests and answer queued ones at once (503)."""
        with self._cond:
            self._closed = True
            self._closed_reason = message
            self._fail_pending(503, message, "server_shutdown")
            self._cond.notify_all()

    def abort_running(self, message: str = "the server is shutting down") -> None:
        """Server shutdown, after the drain time: end every row still generating, and every one not started
        yet (later slices of split requests, reruns), with a 503 error event."""
        with self._cond:
            self._abort_message = message
            for req in self._running_requests():
                req.aborted = message
            self._fail_pending(503, message, "server_shutdown", started_too=True)
            self._cond.notify_all()

    def _abort_of(self, req: GenRequest) -> Optional[str]:
        """Why ``req`` must end now (shutdown after the drain time), or None."""
        return req.aborted if req.aborted is not None else self._abort_message

    def _fail_pending(self, status: int, message: str, code: str, started_too: bool = False) -> None:
        """Answer queued requests with an error; a request whose first rows are already running (split over
        batches) stays queued unless ``started_too``, so it finishes (drain, unload) like other running ones."""
        keep = collections.deque()
        while self._pending:
            req = self._pending.popleft()
            if req.next_row > 0 and not started_too:
                keep.append(req)
            else:
                req.fail(status, message, code)
        self._pending = keep

    @property
    def alive(self) -> bool:
        """Whether the worker thread is running."""
        return self._thread.is_alive()

    def _end_rows(self, req: GenRequest, n: int) -> None:
        """Count ``n`` finished rows of ``req``; at its last row record its latency and TTFT (the same set of
        requests: those that received at least one token)."""
        was_done = req.done
        req.rows_done += n
        if req.done and not was_done and req.first_token is not None:
            self.metrics.ttft.observe(req.first_token - req.arrived)
            self.metrics.latency.observe(time.monotonic() - req.arrived)


class Batcher(_RequestQueue):
    """Owns the bounded queue and the worker thread that runs the engine for one model."""

    def __init__(self, engine: EngineFn, tokenizer: Any, max_batch: int, max_queue: int,
                 batch_wait_s: float = 0.005, metrics: Optional[ServerMetrics] = None, name: str = "model") -> None:
        self._init_queue(tokenizer, max_batch, max_queue, batch_wait_s, metrics, name)
        self.engine = engine
        self._current: List[GenRequest] = []
        self._thread = threading.Thread(target=self._loop, name=f"batcher-{name}", daemon=True)
        self._thread.start()

    def _running_requests(self) -> List[GenRequest]:
        return list(self._current)

    # ------------------------------------------------------------ worker side
    def _take_batch(self) -> Optional[List[Slice]]:
        """Up to ``max_batch`` rows from the queue, oldest first; a request may be split over batches."""
        with self._cond:
            while True:
                while self._pending and self._pending[0].dropped:
                    self._drop_head()
                if self._pending:
                    break
                if self._closed:
                    return None
                self._cond.wait()
            batch: List[Slice] = []
            rows = 0
            deadline = time.monotonic() + self.batch_wait_s
            while rows < self.max_batch:
                if self._pending:
                    req = self._pending[0]
                    if req.dropped:
                        self._drop_head()
                        continue
                    k = min(self.max_batch - rows, req.num_rows - req.next_row)
                    batch.append((req, req.rows[req.next_row:req.next_row + k]))
                    req.next_row += k
                    rows += k
                    if req.next_row >= req.num_rows:
                        self._pending.popleft()
                    continue
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    break
                self._cond.wait(left)
            return batch

    def _drop_head(self) -> None:
        req = self._pending.popleft()
        self._end_rows(req, req.num_rows - req.next_row)
        req.next_row = req.num_rows

    def _loop(self) -> None:
        while True:
            batch = self._take_batch()
            if batch is None:
                return
            self._run(batch)

    def _run(self, batch: List[Slice]) -> None:
        """Run one batch; when it fails, rerun each request that has received nothing yet on its own, so a
        request that cannot run (a poison row) fails alone and never takes the others down with it."""
        self._current = [req for req, _ in batch]
        progress = [_SliceProgress() for _ in batch]
        try:
            self._execute(batch, progress)
            return
        except Exception as e:  # never let the worker die: report to the requests and go on
            error = e
        finally:
            self.running_rows = 0
            self._current = []
        message = f"generation failed: {type(error).__name__}: {error}"
        if len(batch) == 1:
            log.error("engine batch failed: %s: %s", type(error).__name__, error, exc_info=error)
        else:
            log.warning("engine batch of %d requests failed (%s: %s); rerunning them one by one", len(batch),
                        type(error).__name__, error)
        for (req, rows), prog in zip(batch, progress):
            if prog.ended == len(rows):  # this slice had finished before the failure
                continue
            if len(batch) == 1 or prog.streamed or req.dropped or self._abort_message is not None:
                # alone already, or events already went out for it (a rerun would send them twice)
                self._end_rows(req, len(rows) - prog.ended)
                req.fail(500, message)
            else:
                self._run([(req, rows)])

    def _execute(self, batch: List[Slice], progress: List[_SliceProgress]) -> None:
        rows: List[Tuple[GenRequest, RowSpec, IncrementalDecoder, _SliceProgress]] = []
        for (req, specs), prog in zip(batch, progress):
            for r in specs:
                rows.append((req, r, IncrementalDecoder(self.tokenizer, req.stop, r.prompt), prog))
        done = [False] * len(rows)

        def end_row(row: int, reason: Optional[str], count: int, stats: Dict[str, Any]) -> None:
            """Row ``row`` is over: count its tokens (here, as the handler may be gone) and tell the handler."""
            req, spec, _, prog = rows[row]
            done[row] = True
            prog.ended += 1
            prog.streamed = True  # an event went out for this slice
            self.metrics.completion_tokens.inc(count)
            if reason is None:  # aborted at shutdown, or its request failed elsewhere
                req.fail(503, self._abort_of(req) or "request failed", "server_shutdown")
            else:
                if reason == "cancelled":
                    self.metrics.cancelled.inc()
                req.emit(("finish", spec.choice, reason, count, stats))
            self._end_rows(req, 1)

        t0 = time.monotonic()
        for req, _ in batch:
            if req.started is None:
                req.started = t0
                self.metrics.queue_time.observe(t0 - req.arrived)
                self.metrics.prompt_tokens.inc(req.prompt_tokens)
        self.running_rows = len(rows)
        self.metrics.batch_size.observe(len(rows))
        self.batches_run += 1
        log.debug("batch of %d rows from %d requests", len(rows), len(batch))

        def on_tokens(row: int, ids: List[int]) -> bool:
            if done[row]:
                return False
            req, spec, dec, prog = rows[row]
            if self._abort_of(req) is not None or req.failed:
                end_row(row, None, len(dec.tokens), {})
                return False
            if req.cancelled:
                end_row(row, "cancelled", len(dec.tokens), {})  # ends a stream still open
                return False
            if ids:
                prog.streamed = True
                if req.first_token is None:
                    req.first_token = time.monotonic()
            delta = dec.add(ids)
            if delta:
                req.emit(("delta", spec.choice, delta))
            if dec.stopped:
                end_row(row, "stop", len(dec.tokens), {})
                return False
            return True

        def on_finish(row: int, reason: str) -> None:
            """A row ended by itself: answer it now, not when the whole batch ends."""
            if done[row]:
                return
            req, spec, dec, _ = rows[row]
            if self._abort_of(req) is not None or req.failed:
                end_row(row, None, len(dec.tokens), {})
                return
            if not dec.stopped:
                delta = dec.flush()
                if delta:
                    req.emit(("delta", spec.choice, delta))
            # the engine drops the stop token (eos) from its output; usage counts it, as it was generated
            end_row(row, "stop" if dec.stopped else reason,
                    len(dec.tokens) + (1 if reason == "stop" and not dec.stopped else 0), {})

        results = self.engine([r.prompt for _, r, _, _ in rows], [r.params for _, r, _, _ in rows], on_tokens,
                              on_finish)
        for i, (req, spec, dec, prog) in enumerate(rows):
            res = results[i]
            stats = dict(getattr(res, "stats", {}) or {})
            if "tau" in stats and stats["tau"] is not None:
                try:
                    self.metrics.tau.observe(float(stats["tau"]))
                except (TypeError, ValueError):
                    pass
            if done[i]:
                continue
            if self._abort_of(req) is not None or req.failed:
                end_row(i, None, len(res.tokens), {})
                continue
            tokens = [int(t) for t in res.tokens]
            if tokens[:len(dec.tokens)] != dec.tokens:
                log.warning("row %d: streamed tokens differ from the engine result; using the result", i)
            elif len(tokens) > len(dec.tokens):  # engine did not report every token through on_tokens
                prog.streamed = True
                if req.first_token is None:
                    req.first_token = time.monotonic()
                delta = dec.add(tokens[len(dec.tokens):])
                if delta:
                    req.emit(("delta", spec.choice, delta))
            if dec.stopped:
                end_row(i, "stop", len(dec.tokens), stats)
                continue
            delta = dec.flush()
            if delta:
                req.emit(("delta", spec.choice, delta))
            reason = res.finish_reason if res.finish_reason in ("stop", "length") else "stop"
            if req.cancelled or res.finish_reason == "cancelled":
                reason = "cancelled"
            # the engine drops the stop token (eos) from its output; usage counts it, as it was generated
            count = len(dec.tokens) + (1 if res.finish_reason == "stop" else 0)
            end_row(i, reason, count, stats)


# ====================================================================================================== continuous

@dataclass(eq=False)
class _Live:
    """A row handed to the session: its request, spec, decoder and how many tokens its request still wants."""

    req: GenRequest
    spec: RowSpec
    dec: IncrementalDecoder
    handle: int = -1
    ended: bool = False


class SessionBatcher(_RequestQueue):
    """Continuous batching: one worker thread steps a :class:`nemo_spec.inference.session.Session`; queued rows
    join the running batch at the next step, finished rows leave it at once.

    Same contract as :class:`Batcher` (bounded FIFO, streaming events, cancellation, per-row sampling,
    drain/abort at shutdown). Failure isolation: a request the session refuses (``add`` raises: too long for
    the KV cache, bad ids) fails alone before it joins; when a step raises, the session is reset and every row
    that was running is resumed (prompt + the tokens it has streamed, the rest of its budget) one request at
    a time on its own, so only a request that fails alone gets the error. ``batches_run`` counts admission
    rounds (steps at which rows joined).
    """

    def __init__(self, session: Any, tokenizer: Any, max_batch: int, max_queue: int, batch_wait_s: float = 0.005,
                 metrics: Optional[ServerMetrics] = None, name: str = "model") -> None:
        self._init_queue(tokenizer, max_batch, max_queue, batch_wait_s, metrics, name)
        self.session = session
        self.engine = session  # released by ServedModel.close
        self._resume: Deque[List[_Live]] = collections.deque()  # after a failed step: one request's rows each
        self._isolated: Optional[GenRequest] = None  # running alone after a failed step
        self._live: Dict[int, _Live] = {}
        self.steps_run = 0
        self.step_failures = 0
        self._thread = threading.Thread(target=self._loop, name=f"session-{name}", daemon=True)
        self._thread.start()


    def _running_requests(self) -> List[GenRequest]:
        reqs: List[GenRequest] = []
        for lv in list(self._live.values()):
            if lv.req not in reqs:
                reqs.append(lv.req)
        return reqs

    # ------------------------------------------------------------ worker side
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._resume and not self._live and not self._closed:
                    self._cond.wait()
                if not self._pending and not self._resume and not self._live and self._closed:
                    return
                if not self._live and self._pending and self.batch_wait_s > 0 and not self._closed:
                    # idle: give requests sent together a moment to arrive together
                    deadline = time.monotonic() + self.batch_wait_s
                    while (left := deadline - time.monotonic()) > 0 and not self._closed:
                        self._cond.wait(left)
                joined = self._admit()
            if joined:
                self.batches_run += 1
                self.metrics.batch_size.observe(len(self._live))
            self._check_dropped()
            if not self._live:
                continue
            try:
                self.session.step()
                self.steps_run += 1
            except Exception as e:  # never let the worker die: isolate the failure and go on
                self._step_failed(e)
                continue
            self._collect()

    def _admit(self) -> int:
        """Hand queued rows to the session while it has free slots (called with the lock held)."""
        sess = self.session
        added = 0
        if self._isolated is not None:
            return 0
        if self._resume:
            if self._live:
                return 0  # a resumed request runs alone, once the batch is empty
            rows = self._resume.popleft()
            self._isolated = rows[0].req
            for lv in rows:
                added += self._add_row(lv, resume=True)
            return added
        while self._pending and sess.free_slots() > 0:
            req = self._pending[0]
            if req.dropped:
                self._pending.popleft()
                self._end_rows(req, req.num_rows - req.next_row)
                req.next_row = req.num_rows
                continue
            if req.started is None:
                req.started = time.monotonic()
                self.metrics.queue_time.observe(req.started - req.arrived)
                self.metrics.prompt_tokens.inc(req.prompt_tokens)
            spec = req.rows[req.next_row]
            req.next_row += 1
            if req.next_row >= req.num_rows:
                self._pending.popleft()
            added += self._add_row(_Live(req, spec, IncrementalDecoder(self.tokenizer, req.stop, spec.prompt)))
        return added

    def _add_row(self, lv: _Live, resume: bool = False) -> int:
        """Add one row to the session; a row the session refuses fails its request (500) alone."""
        prompt, params = lv.spec.prompt, lv.spec.params
        if resume and lv.dec.tokens:  # continue after the tokens already streamed
            import dataclasses as _dc

            prompt = prompt + lv.dec.tokens
            params = _dc.replace(params, max_new_tokens=max(1, params.max_new_tokens - len(lv.dec.tokens)))
        try:
            lv.handle = self.session.add(prompt, params, self._on_tokens, self._on_finish)
        except Exception as e:
            log.warning("request refused by the session: %s: %s", type(e).__name__, e)
            self._fail_request(lv.req, f"generation failed: {type(e).__name__}: {e}")
            self._end_rows(lv.req, 1)
            lv.ended = True
            return 0
        self._live[lv.handle] = lv
        self.running_rows = len(self._live)
        return 1

    def _fail_request(self, req: GenRequest, message: str) -> None:
        """Fail a request: an error event, its live rows cancelled, its queued rows dropped."""
        req.fail(500, message)
        for lv in list(self._live.values()):
            if lv.req is req and not lv.ended:
                self.session.cancel(lv.handle)
                self._end(lv, None)

    def _check_dropped(self) -> None:
        """Cancel rows whose client left, whose request failed, or that shutdown aborts."""
        for lv in list(self._live.values()):
            if lv.ended:
                continue
            req = lv.req
            if self._abort_of(req) is not None or req.failed:
                self.session.cancel(lv.handle)
                self._end(lv, None)
            elif req.cancelled:
                self.session.cancel(lv.handle)
                self._end(lv, "cancelled")

    def _end(self, lv: _Live, reason: Optional[str], count: Optional[int] = None,
             stats: Optional[Dict[str, Any]] = None) -> None:
        """A row is over: count its tokens and tell the handler (once)."""
        if lv.ended:
            return
        lv.ended = True
        req, spec, dec = lv.req, lv.spec, lv.dec
        n = len(dec.tokens) if count is None else count
        self.metrics.completion_tokens.inc(n)
        if reason is None:  # aborted at shutdown, or its request failed elsewhere
            req.fail(503, self._abort_of(req) or "request failed", "server_shutdown")
        else:
            if reason == "cancelled":
                self.metrics.cancelled.inc()
            req.emit(("finish", spec.choice, reason, n, stats or {}))
        self._end_rows(req, 1)

    def _on_tokens(self, handle: int, ids: List[int]) -> bool:
        lv = self._live.get(handle)
        if lv is None or lv.ended:
            return False
        req = lv.req
        if self._abort_of(req) is not None or req.failed:
            self._end(lv, None)
            return False
        if req.cancelled:
            self._end(lv, "cancelled")
            return False
        if ids and req.first_token is None:
            req.first_token = time.monotonic()
        delta = lv.dec.add(ids)
        if delta:
            req.emit(("delta", lv.spec.choice, delta))
        if lv.dec.stopped:
            self._end(lv, "stop")
            return False
        return True

    def _on_finish(self, handle: int, reason: str) -> None:
        lv = self._live.get(handle)
        if lv is None or lv.ended:
            return
        if self._abort_of(lv.req) is not None or lv.req.failed:
            self._end(lv, None)
            return
        if not lv.dec.stopped:
            delta = lv.dec.flush()
            if delta:
                lv.req.emit(("delta", lv.spec.choice, delta))
        # the engine drops the stop token (eos) from its output; usage counts it, as it was generated
        self._end(lv, "stop" if lv.dec.stopped else reason,
                  len(lv.dec.tokens) + (1 if reason == "stop" and not lv.dec.stopped else 0))

    def _collect(self) -> None:
        """Forget the rows the session finished; record their acceptance."""
        for h, lv in list(self._live.items()):
            if not self.session.done(h):
                continue
            res = self.session.result(h)
            tau = res.stats.get("tau")
            if tau is not None and res.stats.get("target_forwards", 0) > 1:
                self.metrics.tau.observe(float(tau))
            if not lv.ended:  # cancelled by the session itself (callbacks returned False)
                self._end(lv, "cancelled" if lv.req.cancelled else "stop")
            del self._live[h]
        if self._isolated is not None and not any(lv.req is self._isolated for lv in self._live.values()):
            self._isolated = None
        self.running_rows = len(self._live)

    def _step_failed(self, error: Exception) -> None:
        """A step raised: reset the session; resume each running request alone (a lone failure fails it)."""
        self.step_failures += 1
        message = f"generation failed: {type(error).__name__}: {error}"
        rows = [lv for lv in self._live.values() if not lv.ended]
        self._live.clear()
        self.running_rows = 0
        try:
            self.session.reset()
        except Exception as e:  # pragma: no cover - a session that cannot even reset
            log.error("session reset failed: %s", e)
        alone = self._isolated
        self._isolated = None
        by_req: Dict[int, List[_Live]] = {}
        order: List[GenRequest] = []
        for lv in rows:
            if id(lv.req) not in by_req:
                by_req[id(lv.req)] = []
                order.append(lv.req)
            by_req[id(lv.req)].append(lv)
        if alone is not None or len(order) == 1:
            log.error("generation step failed: %s: %s", type(error).__name__, error, exc_info=error)
            for req in order:
                req.fail(500, message)
                for lv in by_req[id(req)]:
                    self._end(lv, None)
            return
        log.warning("generation step with %d requests failed (%s: %s); resuming them one by one", len(order),
                    type(error).__name__, error)
        with self._cond:
            for req in order:
                if req.dropped or self._abort_message is not None:
                    for lv in by_req[id(req)]:
                        self._end(lv, None if not req.cancelled else "cancelled")
                    continue
                self._resume.append([_Live(lv.req, lv.spec, lv.dec) for lv in by_req[id(req)]])
