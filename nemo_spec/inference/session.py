"""Iteration-level generation: rows join at the next step and leave when finished, in fixed KV slots.

A :class:`Session` owns one target KV cache of ``max_batch`` rows (slots) of ``slot_len`` positions, allocated
once, and a proposer (any method). ``add(prompt, params, on_tokens)`` queues a row and returns its handle;
each ``step()``:

1. admits queued rows into free slots;
2. runs ONE prefill forward over the rows still reading their prompts, at most ``prefill_chunk_tokens``
   prompt tokens in all (oldest row first; a long prompt is read over several steps, so decode steps are
   never blocked longer than that budget), and the rows whose prompt is complete get their first token;
3. runs ONE decode step for every generating row: the proposer drafts (at a level chosen by the adaptive
   cost model, when on), the target verifies every row's tree in one forward, acceptance runs on the device,
   and only the accepted ids come back to the host;
4. streams the accepted tokens (``on_tokens(handle, ids)``; returning False cancels the row) and frees the
   slots of finished rows.

Slots ``[0, n)`` always hold the generating rows (the decode step runs on that contiguous view of the caches,
no gather); a row that leaves is replaced by the last generating row (its cache row is moved), prompt readers
sit above. ``generate()`` is a loop over a session with every prompt added up front.
"""
from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, List, Optional, Sequence

import torch

from nemo_spec.models import compiled, fastpath, new_kv_cache
from nemo_spec.models.gpt import gather_vocab, gpt_forward, output_logits
from nemo_spec.inference.adaptive import AdaptiveSpeculation
from nemo_spec.inference.engine import (GenerationResult, OnFinish, OnTokens, PrefillChunk, StepState, pooled_cache,
                                        tau_of, peak_memory_bytes)
from nemo_spec.inference.sampling import (SamplingError, SamplingParams, continuation_text, decode_text,
                                          row_generators, token_id_list)
from nemo_spec.inference.proposers import METHODS, Proposer, make_proposer
from nemo_spec.inference.proposers.common import chain_block, last_valid
from nemo_spec.inference.transfer import allowed_sync, h2d, tensor
from nemo_spec.inference.trees import pad_chains

log = logging.getLogger(__name__)

#: prompt tokens read per step when the caller gives no budget (long prompts are read in chunks of this)
DEFAULT_PREFILL_CHUNK_TOKENS = 512
#: padding (prompt-piece tokens) one prefill forward may carry before the slots it reads are split over forwards
DEFAULT_PREFILL_PAD_TOKENS = 128


def prefill_groups(chosen: Dict[int, int], pad_tokens: int) -> List[Dict[int, int]]:
    """Split one step's prefill (slot -> prompt tokens read) into runs of consecutive slots, one forward each.

    A forward over slots ``[lo, hi)`` right-pads every piece to the longest one (and a slot in between that reads
    nothing is all padding), so a slot joins the current run only while the run's padded block ``(hi - lo) x
    longest`` stays within ``pad_tokens`` of the tokens it actually reads; otherwise it starts a new forward.
    """
    groups: List[Dict[int, int]] = []
    cur: Dict[int, int] = {}
    for s in sorted(chosen):
        if cur:
            lo, longest = min(cur), max(max(cur.values()), chosen[s])
            if (s - lo + 1) * longest - (sum(cur.values()) + chosen[s]) > pad_tokens:
                groups.append(cur)
                cur = {}
        cur[s] = chosen[s]
    if cur:
        groups.append(cur)
    return groups


@dataclass(eq=False)
class _Row:
    """One generating sequence and its bookkeeping (host side)."""

    handle: int
    prompt: List[int]
    params: SamplingParams
    on_tokens: Optional[OnTokens]
    on_finish: Optional[OnFinish]
    stops: set
    gen: torch.Generator
    seq: List[int] = field(default_factory=list)  # prompt + every accepted token (the last one pending)
    out: List[int] = field(default_factory=list)
    produced: int = 0
    finish: Optional[str] = None
    text: Optional[str] = None
    slot: Optional[int] = None
    prefilled: int = 0  # prompt tokens in the cache
    length: int = 0  # committed target cache entries
    target_forwards: int = 0
    draft_forwards: int = 0
    prefill_chunks: int = 0
    accept_hist: List[int] = field(default_factory=list)
    levels: Dict[int, int] = field(default_factory=dict)  # adaptive level -> steps at it
    t_add: float = 0.0
    t_first: Optional[float] = None
    t_end: Optional[float] = None
    first_step: Optional[int] = None  # session step that produced the first token


class Session:
    """Continuous batching over fixed KV slots for one model and method (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, method: str = "ar", draft_model: Optional[torch.nn.Module] = None,
                 options: Optional[Dict[str, Any]] = None, tokenizer: Any = None, max_batch: Optional[int] = None,
                 max_seq_len: Optional[int] = None, prefill_chunk_tokens: Optional[int] = None,
                 adaptive: Optional[bool] = None, shared_caches: bool = False) -> None:
        from nemo_spec.inference.generate import get_engine

        if method not in METHODS:
            raise SamplingError(f"unknown generation method {method!r}; choose one of {METHODS}")
        options = dict(options or {})
        max_batch = options.get("max_batch", 8) if max_batch is None else max_batch
        chunk = options.get("prefill_chunk_tokens", DEFAULT_PREFILL_CHUNK_TOKENS) \
            if prefill_chunk_tokens is None else prefill_chunk_tokens
        pad_tokens = options.get("prefill_pad_tokens", DEFAULT_PREFILL_PAD_TOKENS)
        adaptive = bool(options.get("adaptive", False)) if adaptive is None else adaptive
        for key, v, least in (("max_batch", max_batch, 1), ("prefill_chunk_tokens", chunk, 1),
                              ("prefill_pad_tokens", pad_tokens, 0), ("max_seq_len", max_seq_len, 1)):
            if v is None:  # max_seq_len: the model context
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < least:
                raise SamplingError(f"option {key!r} must be an int >= {least}, got {v!r}")
        for key in ("adaptive", "ignore_eos"):
            if not isinstance(options.get(key, False), bool):
                raise SamplingError(f"option {key!r} must be true or false, got {options[key]!r}")
        try:
            compile_mode = compiled.resolve_mode(options.get("compile", False))
        except ValueError as err:
            raise SamplingError(str(err)) from None
        self.model = model
        self.engine = get_engine(model)
        # KV caches: a session of its own has its own (sessions on one model, and generate() calls while one
        # runs, never write into each other's); generate()'s sessions, which run one after the other, share the
        # engine's
        self._caches: Optional[Dict[Any, Any]] = None if shared_caches else {}
        for m in (model, draft_model):  # (again: the model may have moved since its engine was made; else a no-op)
            if m is not None:
                fastpath.register(m)
        self.proposer: Proposer = make_proposer(method, model, self.engine, draft_model, options)
        self.method = method
        self.tokenizer = tokenizer
        cfg = self.engine.cfg
        pad_id = options.get("pad_id", cfg.pad_token_id if cfg.pad_token_id is not None else 0)
        if not isinstance(pad_id, int) or not 0 <= int(pad_id) < cfg.vocab_size:
            raise SamplingError(f"pad_id={pad_id} is outside the vocabulary [0, {cfg.vocab_size})")
        self.pad_id = int(pad_id)
        self.eos = [] if options.get("ignore_eos") else cfg.stop_token_ids()
        self.max_cache_len = options.get("max_cache_len")
        self.max_pos = cfg.max_position_embeddings
        self.slots = int(max_batch)
        # positions per slot: prompt + new tokens (max_seq_len, default the model context) + one step's drafts
        seq = self.max_pos if max_seq_len is None else min(int(max_seq_len), self.max_pos)
        self.slot_len = seq + self.proposer.lookahead + 1
        self.prefill_chunk_tokens = int(chunk)
        self.prefill_pad_tokens = int(pad_tokens)
        self.aux = self.proposer.aux_layers
        for m in (model, draft_model):
            if m is not None:
                m.eval()
                compiled.compile_layers(m, compile_mode)  # the option governs: off makes the layers eager again
        self.compile_mode = compile_mode
        self.kv = self.cache("target", self.slots, self.slot_len, lambda bb, ll: new_kv_cache(self.model, bb, ll))
        self.proposer.setup(self)
        self.pending = torch.zeros(self.slots, dtype=torch.long, device=self.device)
        self.slot_rows: List[Optional[_Row]] = [None] * self.slots
        self.n_dec = 0
        self.prefilling: List[_Row] = []
        self.waiting: Deque[_Row] = collections.deque()
        self.rows: Dict[int, _Row] = {}
        self._next_handle = 0
        self._in_step = False
        self._reset_pending = False  # reset() was called inside a step (from a callback): done when it returns
        self.steps = 0
        self.adaptive: Optional[AdaptiveSpeculation] = None
        if adaptive:  # one cost model per model and method configuration, kept across sessions
            store = self.engine.__dict__.setdefault("adaptive", {})
            key = (self.proposer.name, tuple(self.proposer.levels), self.slots)
            self.adaptive = store.get(key) or store.setdefault(key, AdaptiveSpeculation(self.proposer))
        self.level_hist: Dict[int, int] = {}
        self.prefill_forwards = 0
        self.prefill_s = 0.0  # wall time of the prefill steps (target forwards + the draft's prefill when not deferred)
        # wall time of the decode steps, split
        self.decode_s = {"draft": 0.0, "verify": 0.0, "steps": 0, "draft_prefill": 0.0}
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    # ------------------------------------------------------------------ public API
    @property
    def device(self) -> torch.device:
        """The target model's device."""
        return self.engine.device

    def cache(self, key: Any, batch_size: int, max_len: int, factory: Any) -> Any:
        """A reset KV cache for ``key`` (the target's, a proposer's draft cache): this session's own, or the
        engine's shared one (``shared_caches``)."""
        if self._caches is None:
            return self.engine.cache(key, batch_size, max_len, factory)
        return pooled_cache(self._caches, key, batch_size, max_len, factory)

    def add(self, prompt: Sequence[int], params: Optional[SamplingParams] = None,
            on_tokens: Optional[OnTokens] = None, on_finish: Optional[OnFinish] = None) -> int:
        """Queue a row (validated now); it joins the batch at the next step. Returns its handle."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise SamplingError(f"params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, (str, bytes)):
            raise SamplingError("prompts must be token-id lists (tokenize text first)")
        prompt = token_id_list(prompt, "prompt")
        h = self._next_handle
        self.engine.check_row(h, prompt, params, self.proposer.lookahead, self.slot_len, self.max_cache_len,
                              self.tokenizer)
        self.proposer.check_row(prompt, params)
        self._next_handle += 1
        row = _Row(handle=h, prompt=prompt, params=params, on_tokens=on_tokens, on_finish=on_finish,
                   stops=set(params.stop_token_ids) | set(self.eos), gen=row_generators([params.seed])[0],
                   seq=list(prompt), t_add=time.perf_counter())
        self.rows[h] = row
        self.waiting.append(row)
        return h

    def cancel(self, handle: int) -> None:
        """End a row now (finish reason "cancelled"); its slot is free from the next step on."""
        row = self.rows.get(handle)
        if row is None or row.finish is not None:
            return
        row.finish = "cancelled"
        row.t_end = time.perf_counter()
        if not self._in_step:  # the slot buffers moved here were made in a step's inference mode
            with torch.inference_mode():
                self._drop_finished()

    def step(self) -> bool:
        """One iteration: admit, one prefill chunk, one decode step, stream; returns whether rows remain."""
        self._in_step = True
        try:
            with torch.inference_mode():
                self._drop_finished()
                self._admit()
                if self.prefilling:
                    t0 = time.perf_counter()
                    self._prefill()
                    self.prefill_s += time.perf_counter() - t0
                if self.n_dec:
                    self._decode()
                self.steps += 1
        finally:
            self._in_step = False
            if self._reset_pending:
                self.reset()
        return self.busy

    def run(self) -> None:
        """Step until every row has finished."""
        while self.step():
            pass

    @property
    def busy(self) -> bool:
        """Rows are queued or in the batch."""
        return bool(self.waiting) or any(r is not None for r in self.slot_rows)

    def num_active(self) -> int:
        """Rows queued or in the batch."""
        return len(self.waiting) + sum(r is not None for r in self.slot_rows)

    def free_slots(self) -> int:
        """Slots a new row could take at the next step (queued rows count as taken)."""
        return max(0, sum(r is None for r in self.slot_rows) - len(self.waiting))

    def _row(self, handle: int) -> _Row:
        row = self.rows.get(handle)
        if row is None:
            raise KeyError(f"unknown row handle {handle!r}: never added to this session, or its result was already "
                           f"taken (result(forget=True)) or dropped by reset()")
        return row

    def done(self, handle: int) -> bool:
        """Whether the row has finished."""
        return self._row(handle).finish is not None

    def result(self, handle: int, forget: bool = True) -> GenerationResult:
        """The finished row's tokens, finish reason, text and stats (``forget`` drops the session's record)."""
        row = self._row(handle)
        if row.finish is None:
            raise RuntimeError(f"row {handle} has not finished")
        if forget:
            del self.rows[handle]
        return self._result(row)

    def reset(self) -> None:
        """Drop every row (after a failure: the caches' state is not trusted); slots are reused. Called from a
        callback inside a step, the rows end at once (no more tokens) and the rest is done when the step returns."""
        for row in list(self.waiting) + [r for r in self.slot_rows if r is not None]:
            if row.finish is None:
                row.finish = "cancelled"
        if self._in_step:
            self._reset_pending = True
            return
        self._reset_pending = False
        self.waiting.clear()
        self.prefilling = []
        self.slot_rows = [None] * self.slots
        self.n_dec = 0
        self.rows.clear()
        self.kv.reset()
        self.proposer.setup(self)

    def stats(self) -> Dict[str, Any]:
        """Session-wide counters: steps, and how often each adaptive speculation level was chosen."""
        k = max(self.decode_s["steps"], 1)
        out: Dict[str, Any] = {"steps": self.steps, "prefill_forwards": self.prefill_forwards,
                               "levels": dict(self.level_hist),
                               "draft_nodes_per_level": list(self.proposer.levels),
                               "decode_steps": self.decode_s["steps"],
                               # per decode step: proposing (+ the proposer's post-acceptance update) vs
                               # verifying; draft prefills that waited for a row's first drafting step ran inside
                               # decode steps but count as prompt reading (draft_prefill_s, prefill_s), not here,
                               # so that prefill_s + decode_steps x (draft + verify) adds up
                               "draft_ms_per_step": 1e3 * (self.decode_s["draft"] - self.decode_s["draft_prefill"]) / k,
                               "verify_ms_per_step": 1e3 * self.decode_s["verify"] / k,
                               "draft_prefill_s": self.decode_s["draft_prefill"],
                               # reading prompts in all: target prefill + the draft's, deferred or not
                               "prefill_s": self.prefill_s + self.decode_s["draft_prefill"]}
        if self.adaptive is not None:
            out["adaptive"] = self.adaptive.describe()
        return out

    # ------------------------------------------------------------------ slots
    def _swap(self, i: int, j: int) -> None:
        """Exchange the rows of slots i and j in every cache and per-slot state."""
        if i == j:
            return
        a, b = self.slot_rows[i], self.slot_rows[j]
        used = max(a.length if a else 0, b.length if b else 0) + self.proposer.lookahead + 1
        self.kv.swap_rows(i, j, used)
        tmp = self.pending[i].clone()
        self.pending[i] = self.pending[j]
        self.pending[j] = tmp
        self.proposer.swap(i, j, used)
        self.slot_rows[i], self.slot_rows[j] = b, a
        if a is not None:
            a.slot = j
        if b is not None:
            b.slot = i

    def _admit(self) -> None:
        while self.waiting:
            row = self.waiting[0]
            if row.finish is not None:  # cancelled while queued
                self.waiting.popleft()
                continue
            free = next((s for s in range(self.n_dec, self.slots) if self.slot_rows[s] is None), None)
            if free is None:
                return
            self.waiting.popleft()
            self.slot_rows[free] = row
            row.slot = free
            self.kv.lengths[free] = 0
            self.kv.starts[free] = 0
            self.proposer.admit(self, free, row)
            self.prefilling.append(row)

    def _drop_finished(self) -> None:
        """Free the slots of finished rows (the last generating row moves into a generating row's hole)."""
        for s in range(self.n_dec - 1, -1, -1):
            row = self.slot_rows[s]
            if row is not None and row.finish is not None:
                last = self.n_dec - 1
                self._swap(s, last)
                self.slot_rows[last] = None
                self.n_dec -= 1
                row.slot = None
                self.proposer.release(self, last, row)
        keep = []
        for row in self.prefilling:
            if row.finish is not None:
                self.slot_rows[row.slot] = None
                self.proposer.release(self, row.slot, row)
                row.slot = None
            else:
                keep.append(row)
        self.prefilling = keep

    # ------------------------------------------------------------------ prefill
    def _prefill(self) -> None:
        """Target forwards over a chunk of the oldest prompts still being read (one per group of slots)."""
        left = self.prefill_chunk_tokens
        chosen: Dict[int, int] = {}
        for row in self.prefilling:
            c = min(len(row.prompt) - row.prefilled, left)
            if c <= 0:
                break
            chosen[row.slot] = c
            left -= c
        chosen = self._sort_prefill_slots(chosen)
        done: List[_Row] = []
        firsts: List[torch.Tensor] = []
        for group in prefill_groups(chosen, self.prefill_pad_tokens):
            d, f = self._prefill_group(group)
            done += d
            if f is not None:
                firsts.append(f)
        if not done:
            return
        with allowed_sync():
            first_ids = torch.cat(firsts).tolist()
        now = time.perf_counter()
        self.prefilling = [r for r in self.prefilling if r not in done]
        for row, t in zip(done, first_ids):
            row.target_forwards += 1
            row.t_first = now
            row.first_step = self.steps
            self._swap(row.slot, self.n_dec)  # into the generating range
            self.n_dec += 1
            self._emit(row, [t])
        self._drop_finished()

    def _sort_prefill_slots(self, chosen: Dict[int, int]) -> Dict[int, int]:
        """Move the rows being read into the same slots ordered by piece length (shortest first), so that
        consecutive slots read similar lengths and pad little in one forward; returns the new slot -> tokens."""
        slots = sorted(chosen)
        by_len = [self.slot_rows[s] for s in sorted(slots, key=lambda s: chosen[s])]
        counts = {id(r): chosen[r.slot] for r in by_len}
        for s, row in zip(slots, by_len):
            self._swap(row.slot, s)
        return {row.slot: counts[id(row)] for row in by_len}

    def _prefill_group(self, chosen: Dict[int, int]):
        """One target forward over slots [min(chosen), max(chosen)] reading ``chosen[slot]`` prompt tokens each;
        returns the rows whose prompt is now complete and their first tokens (on the device)."""
        lo, hi = min(chosen), max(chosen) + 1
        span = self.slot_rows[lo:hi]
        dev = self.device
        pieces, nxt, counts, before, final = [], [], [], [], []
        for s, row in zip(range(lo, hi), span):
            c = chosen.get(s, 0)
            if row is None or c == 0:
                pieces.append([])
                nxt.append([])
                counts.append(0)
                before.append(row.length if row is not None else 0)
                final.append(False)
                continue
            a = row.prefilled
            pieces.append(row.prompt[a:a + c])
            nxt.append(row.prompt[a + 1:a + c + 1] + ([0] if a + c >= len(row.prompt) else []))
            counts.append(c)
            before.append(row.length)
            final.append(a + c >= len(row.prompt))
        tok, val = pad_chains(pieces, pad=self.pad_id, device=dev)
        nxt_t, _ = pad_chains(nxt, n=tok.shape[1], pad=self.pad_id, device=dev)
        view = self.kv.view(lo, hi)
        ctx = chain_block(view, tok, val, self.max_pos, max_length=max(before), padded=True)
        out = gpt_forward(self.engine.target, tok, ctx, aux_layers=self.aux, compute_logits=False)
        self.prefill_forwards += 1
        counts_dev = tensor(counts, dev)
        view.lengths += counts_dev
        final_idx = [i for i, f in enumerate(final) if f]
        first_dev = None
        if final_idx:
            fi = tensor(final_idx, dev)
            h_last = last_valid(out.hidden, counts_dev)[fi]  # [f, h]
            logits = gather_vocab(output_logits(self.engine.target, h_last[None], fast=True))[0]
            fst = StepState([span[i] for i in final_idx], self.max_pos)
            first_dev = self.engine.pick(fst, logits)
            nxt_t[fi, (counts_dev[fi] - 1).clamp(min=0)] = first_dev  # the prompt's last pairing: the first token
            self.pending[fi + lo] = first_dev
        ch = PrefillChunk(lo=lo, hi=hi, rows=list(span), tokens=tok, valid=val, counts=counts, counts_dev=counts_dev,
                          before=before, final=final, final_dev=h2d(torch.tensor(final), dev), next_ids=nxt_t,
                          out=out)
        self.proposer.prefill(self, ch)
        for row, c in zip(span, counts):
            if row is not None and c:
                row.prefilled += c
                row.length += c
                row.prefill_chunks += 1
        return [span[i] for i in final_idx], first_dev

    # ------------------------------------------------------------------ decode
    def _decode(self) -> None:
        """One draft + verify step for every generating row (slots [0, n))."""
        n = self.n_dec
        rows = self.slot_rows[:n]
        st = StepState(rows, self.max_pos)
        level = self.adaptive.choose(n) if self.adaptive is not None else None
        k0 = fastpath.tuning_seconds()
        t0 = time.perf_counter()
        tree = self.proposer.propose(self, st, level)
        t1 = time.perf_counter()
        res = self.engine.verify(st, tree, self.aux, self.kv.view(0, n), self.pending[:n])
        t2 = time.perf_counter()
        self.pending[:n].copy_(tensor([e[-1] for e in res.emitted], self.device))
        self.proposer.accepted(self, st, res)
        t3 = time.perf_counter()
        lv = len(self.proposer.levels) - 1 if level is None else level
        self.level_hist[lv] = self.level_hist.get(lv, 0) + 1
        draft_s = (t1 - t0) + (t3 - t2)
        self.decode_s["draft"] += draft_s
        self.decode_s["verify"] += t2 - t1
        self.decode_s["steps"] += 1
        # earlier level-0 steps' draft work, and draft prefills put off until this step, run now
        lazy_s, lazy_steps, prefill_s = self.proposer.take_deferred_cost()
        self.decode_s["draft_prefill"] += prefill_s
        if self.adaptive is not None:
            # a one-off timing of CPU kernels (a row count's first use) inside the step is not what the step costs
            timed = fastpath.tuning_seconds() == k0
            self.adaptive.observe(n, lv, tree, res, draft_s=draft_s - lazy_s - prefill_s, verify_s=t2 - t1,
                                  timed=timed)
            if timed:
                self.adaptive.observe_deferred(lazy_s, lazy_steps)
        for r, row in enumerate(rows):
            row.length += len(res.paths[r])
            row.levels[lv] = row.levels.get(lv, 0) + 1
            self._emit(row, res.emitted[r])
        self._drop_finished()

    # ------------------------------------------------------------------ bookkeeping
    def _emit(self, row: _Row, toks: List[int]) -> None:
        """Append accepted tokens to a row, applying stop tokens/strings, budgets and the streaming callbacks; a
        row that has finished (cancelled by a callback earlier in this step) gets nothing."""
        if row.finish is not None:
            return
        sp = row.params
        new: List[int] = []
        for t in toks:
            row.produced += 1
            if t in row.stops:
                row.finish = "stop"
                break
            row.out.append(t)
            new.append(t)
            if len(row.out) >= sp.max_new_tokens or len(row.prompt) + len(row.out) >= self.max_pos:
                row.finish = "length"
                break
        row.seq.extend(toks)
        tk = self.tokenizer
        if sp.stop_strings and tk is not None and new:
            # every prefix a one-token step would have decoded, in order: a decode is not always prefix-stable, so the
            # whole chunk's text may no longer hold a stop string that one of its prefixes held, where AR stopped. A
            # prefix's last tokens are decoded first (a stop string that appears at token k ends in the text token k
            # changed; each character takes at most 4 tokens), and only a hit there decodes the whole prefix
            first = len(row.out) - len(new)
            window = 16 + 4 * max(len(s) for s in sp.stop_strings)
            for k in range(first + 1, len(row.out) + 1):
                if k > window and not any(s in decode_text(tk, row.out[k - window:k]) for s in sp.stop_strings):
                    continue
                text = continuation_text(tk, row.prompt, row.out[:k])
                if any(s in text for s in sp.stop_strings):
                    # keep tokens only up to the one completing the stop string
                    del new[len(new) - (len(row.out) - k):]
                    del row.out[k:]
                    row.finish = "stop"
                    row.text = text[: min(text.find(s) for s in sp.stop_strings if s in text)]
                    break
        if row.on_tokens is not None and new:
            if row.on_tokens(row.handle, new) is False and row.finish is None:
                row.finish = "cancelled"
        if row.finish is not None:
            row.t_end = time.perf_counter()
        if row.on_finish is not None and row.finish in ("stop", "length"):
            row.on_finish(row.handle, row.finish)

    def _result(self, row: _Row) -> GenerationResult:
        hist: List[int] = [0] * (max(row.accept_hist, default=0) + 1)
        for m in row.accept_hist:
            hist[m] += 1
        end = row.t_end if row.t_end is not None else time.perf_counter()
        elapsed = end - row.t_add
        stats = {
            "method": self.proposer.name,
            "prompt_tokens": len(row.prompt),
            "new_tokens": len(row.out),
            "target_forwards": row.target_forwards,
            "draft_forwards": row.draft_forwards,
            "prefill_chunks": row.prefill_chunks,
            "decode_steps": len(row.accept_hist),
            "tau": tau_of(row.accept_hist),
            "accept_hist": hist,
            "speculation_levels": dict(row.levels),
            "time_s": elapsed,
            "time_to_first_token_s": (row.t_first - row.t_add) if row.t_first is not None else None,
            "tokens_per_s": len(row.out) / elapsed if elapsed > 0 else 0.0,
            "peak_memory_bytes": peak_memory_bytes(self.device),
        }
        text = row.text
        if text is None and self.tokenizer is not None:
            text = continuation_text(self.tokenizer, row.prompt, row.out)
        return GenerationResult(tokens=row.out, finish_reason=row.finish or "length", stats=stats, text=text)


def run_session(model: torch.nn.Module, prompts: List[List[int]], params: List[SamplingParams], method: str,
                draft_model: Optional[torch.nn.Module], options: Dict[str, Any], tokenizer: Any = None,
                on_tokens: Optional[OnTokens] = None, on_finish: Optional[OnFinish] = None) -> List[GenerationResult]:
    """Generate every prompt through one session (all rows added up front; option ``max_batch`` slots, default
    one per prompt, so rows beyond it join as others finish)."""
    if not prompts:
        raise SamplingError("prompts must be a non-empty list of token-id lists")
    opts = dict(options)
    slots = opts.pop("max_batch", None)
    slots = len(prompts) if slots is None else slots  # 0 or a non-int: Session names it
    need = max(len(p) + sp.max_new_tokens for p, sp in zip(prompts, params))
    sess = Session(model, method, draft_model, opts, tokenizer, max_batch=slots, max_seq_len=need,
                   prefill_chunk_tokens=opts.get("prefill_chunk_tokens", 1 << 30), shared_caches=True)
    dev = sess.device
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    handles = [sess.add(p, sp, on_tokens, on_finish) for p, sp in zip(prompts, params)]
    sess.run()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    elapsed = time.perf_counter() - t0
    results = [sess.result(h) for h in handles]
    total = sum(len(r.tokens) for r in results)
    summary = sess.stats()
    for r in results:  # call-level timing, as a fixed batch reports it
        r.stats["time_s"] = elapsed
        r.stats["tokens_per_s"] = len(r.tokens) / elapsed if elapsed > 0 else 0.0
        r.stats["batch_tokens_per_s"] = total / elapsed if elapsed > 0 else 0.0
        r.stats["session"] = summary
    return results
