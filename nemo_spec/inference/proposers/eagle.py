"""EAGLE-1 / EAGLE-3 drafting: a chain of depth K, or an EAGLE-2 dynamic tree (total tokens, depth, top-k).

After each verification the draft reads the accepted tokens (paired with the target's features) into its KV cache
and computes the next step's root. A step at level 0 (adaptive speculation chose plain decoding) drafts nothing, so
that catch-up is deferred: the pairs are kept per slot and read in one draft forward when a later step drafts (or
``lazy_draft_steps`` level-0 steps have piled up), which is what makes a level-0 step cost what an AR step costs.
Under adaptive speculation the draft's prefill waits the same way: a prompt's pairs are read with the row's first
drafting step, and a row whose prompt still waits when the buffer fills adds its buffered pairs to it, so rows that
the controller never drafts for (large batches) cost the draft nothing.

With ``draft_prompt_tokens`` = W the draft reads only the last W of a prompt's pairs (its prefill costs W tokens,
not the prompt's length): the slot's draft cache starts at the first pair it reads, so positions and cache lengths
keep their meaning and every later pair (generated tokens) is read as before. Output stays exact (drafts are
verified); only what the draft can see, and so how much of it is accepted, changes. The default is the sequence
length the draft was trained on when its checkpoint records it (``SpeculativeGPT.trained_seq_len``), else the
whole prompt: a one-layer draft attends worse over contexts longer than it has seen (measured: README).
"""
from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Tuple

import torch

from nemo_spec.models import model_config
from nemo_spec.inference.engine import DraftTree, PrefillChunk, StepResult, StepState
from nemo_spec.inference.proposers.base import SpecModelProposer
from nemo_spec.inference.proposers.common import (DEFAULT_LAZY_DRAFT_STEPS, DEFAULT_SCORE_TEMPERATURE, PromptWindow,
                                                  chain_block, chain_levels, choose, last_valid, level_index,
                                                  column_chunks, opt_float, opt_int, set_rows, stack_q, swap_rows,
                                                  take_waiting)
from nemo_spec.inference.sampling import SamplingError
from nemo_spec.inference.transfer import tensor
from nemo_spec.inference.trees import block_context, pad_chains, select_tree

class EagleProposer(PromptWindow, SpecModelProposer):
    """EAGLE-1/EAGLE-3 drafting: chain of depth K, or an EAGLE-2 dynamic tree (total tokens, depth, top-k)."""

    defers_level0 = True

    def __init__(self, model: torch.nn.Module, options: Dict[str, Any], tree: bool = False) -> None:
        self.name = "eagle_tree" if tree else "eagle"
        super().__init__(model, ("eagle1", "eagle3"))
        self.tree = tree
        if tree:
            self.depth = opt_int(options, "depth", 5)
            self.top_k = opt_int(options, "top_k", 8)
            self.total = opt_int(options, "total_tokens", 48)
            cap = self.top_k + (self.depth - 1) * self.top_k * self.top_k
            self.total = min(self.total, cap)
            self.lookahead = self.total
            self.spec_slots = self.depth * self.top_k
            self.score_temperature = opt_float(options, "score_temperature", DEFAULT_SCORE_TEMPERATURE)
        else:
            self.depth = opt_int(options, "num_draft_tokens", options.get("depth", 4))
            self.lookahead = self.depth
            self.spec_slots = self.depth
        self.extra_slots = self.spec_slots + 1
        vd = int(self.spec.d2t.numel())
        if tree and self.top_k > vd:
            raise SamplingError(f"option top_k={self.top_k} exceeds the draft vocabulary size {vd}")
        d2t_in = torch.arange(vd, device=self.spec.d2t.device)
        self.d2t_ids = self.spec.draft_to_base_ids(d2t_in).long()
        self.V = model_config(self.spec).vocab_size
        self.max_pos = model_config(self.spec).max_position_embeddings
        self.root_hidden: Optional[torch.Tensor] = None
        self.root_logits: Optional[torch.Tensor] = None
        self.lazy_steps = opt_int(options, "lazy_draft_steps", DEFAULT_LAZY_DRAFT_STEPS, lo=0)
        self.init_window(options)  # the draft reads at most this many prompt pairs (0: all)
        self.deferred_f: Optional[torch.Tensor] = None  # [slots, lazy_steps, F]: base features of deferred pairs
        self.deferred_tok: List[List[int]] = []  # per slot: the tokens of its deferred pairs
        self._deferring = False  # this step drafts nothing (level 0): accepted() defers the catch-up
        self._deferred_cost: Tuple[float, int, float] = (0.0, 0, 0.0)  # catch-up seconds, level-0 steps, prefill s
        self.prompt_pairs: List[List[Tuple[torch.Tensor, torch.Tensor]]] = []  # per slot: (features [c, F], tokens [c])
        self.chunk_tokens = 1 << 30  # pairs one catch-up forward may read (the session's prefill chunk budget)
        self.device = torch.device("cpu")

    def _tree_shape(self, level: int) -> "tuple[int, int]":
        """(depth, total nodes) of the tree at ``level`` (level = depth; the node budget shrinks with it)."""
        d = max(1, min(level, self.depth))
        total = min(self.total, max(1, round(self.total * d / self.depth)), self.top_k + (d - 1) * self.top_k ** 2)
        return d, total

    @property
    def levels(self) -> List[int]:
        """Chain: 0 .. depth tokens; tree: 0, then one tree per depth with a proportional node budget."""
        if not self.tree:
            return chain_levels(self.depth)
        return [0] + [self._tree_shape(d)[1] for d in range(1, self.depth + 1)]

    def level_depth(self, level: int) -> int:
        """Chain: its length; tree: the level is the depth."""
        return self.levels[level] if not self.tree else level

    def draft_forwards(self, level: int) -> int:
        """A catch-up forward plus one per drafted level beyond the first; none at level 0 when the catch-up is
        deferred (its cost is reported by :meth:`take_deferred_cost`)."""
        i = level_index(self.levels, level)
        if i == 0 and self.lazy_steps > 0:
            return 0
        return 1 + max(0, i - 1)

    def take_deferred_cost(self) -> Tuple[float, int, float]:
        """(seconds, level-0 steps, prefill seconds) of the deferred catch-ups run since the last call."""
        out, self._deferred_cost = self._deferred_cost, (0.0, 0, 0.0)
        return out

    def setup(self, sess: Any) -> None:
        """The draft's KV cache, one row per slot (plus room for the drafted tree levels)."""
        self.cache = sess.cache(("eagle", id(self.spec)), sess.slots, sess.slot_len + self.extra_slots,
                                lambda bb, ll: self.spec.new_draft_cache(bb, ll))
        self.root_hidden = self.root_logits = None
        self.slots = sess.slots
        self.deferred_f = None
        self.deferred_tok = [[] for _ in range(sess.slots)]
        self._deferring = False
        self._deferred_cost = (0.0, 0, 0.0)
        self.prompt_pairs = [[] for _ in range(sess.slots)]
        self.window_setup(sess.slots)
        self.chunk_tokens = int(getattr(sess, "prefill_chunk_tokens", 1 << 30))
        self.device = sess.device

    def admit(self, sess: Any, slot: int, row: Any) -> None:
        """Empty the slot's draft cache row (it starts at the draft's window of the prompt)."""
        self.window_admit(slot, row.prompt)
        self.deferred_tok[slot] = []
        self.prompt_pairs[slot] = []

    def release(self, sess: Any, slot: int, row: Any) -> None:
        """Forget the slot's deferred pairs."""
        self.deferred_tok[slot] = []
        self.prompt_pairs[slot] = []

    def _store_root(self, lo: int, hi: int, mask: Optional[torch.Tensor], hid: torch.Tensor,
                    logits: torch.Tensor) -> None:
        if self.root_hidden is None:
            self.root_hidden = hid.new_zeros(self.slots, hid.shape[-1])
            self.root_logits = logits.new_zeros(self.slots, logits.shape[-1])
        if mask is None:
            self.root_hidden[lo:hi] = hid
            self.root_logits[lo:hi] = logits
        else:
            set_rows(self.root_hidden, lo, hi, mask, hid)
            set_rows(self.root_logits, lo, hi, mask, logits)

    def prefill(self, sess: Any, ch: PrefillChunk) -> None:
        """Draft prefill: pairs (feature_t, token_{t+1}) over the chunk (those in the draft's window), the prompt's
        last pairing with the first new token; rows whose prompt is complete get their drafting root. Under
        adaptive speculation the pairs (base features before fc) are kept for the row's first drafting step."""
        tok, f, val, counts, counts_dev, lengths = self.window_pairs(ch, self.spec.base_features(ch.out))
        if self.lazy_steps > 0 and getattr(sess, "adaptive", None) is not None:  # the pairs wait (see above)
            for i, c in enumerate(counts):
                if c:
                    self.prompt_pairs[ch.lo + i].append((f[i, :c].clone(), tok[i, :c].clone()))
            return
        if not any(counts):  # the whole chunk lies before the rows' windows
            return
        view = self.cache.view(ch.lo, ch.hi)
        ctx = chain_block(view, tok, val, self.max_pos, max_length=max(lengths), padded=True,
                          unpadded=self.unpadded)
        hid, _ = self.spec.draft_step(tok, self.spec.fuse(f), ctx, head=False)  # logits: the roots' rows only
        view.lengths += counts_dev
        if any(ch.final):
            h = last_valid(hid, counts_dev)
            self._store_root(ch.lo, ch.hi, ch.final_dev, h, self.spec.draft_logits(h))
        ch.count_draft(1)

    def accepted(self, sess: Any, st: StepState, res: StepResult) -> None:
        """Catch the draft up: the accepted path's base features paired with the emitted tokens (after a level-0
        step: kept for a later joint catch-up)."""
        if self._deferring:  # every row emitted one token (nothing was drafted); fc runs at the catch-up
            self._defer(st, self.spec.base_features(res.out)[:, 0], [e[0] for e in res.emitted])
            return
        self._read_pairs(st, res.emitted, self.path_features(res), res.accepted + 1, max(st.lengths))

    def _read_pairs(self, st: StepState, tokens: List[List[int]], feats: torch.Tensor, counts: torch.Tensor,
                    max_length: int, mask: Optional[torch.Tensor] = None, padded: bool = False) -> None:
        """One draft forward appending each decode row's pairs (feature [b, K, h], token) to its draft cache;
        the rows (``mask``: those marked) get the root after their last pair. ``counts`` [b]: pairs per row."""
        tok, val = pad_chains(tokens, n=feats.shape[1], device=feats.device)
        self._read_block(st, tok, val, feats, counts, max_length, mask, padded)

    def _read_block(self, st: StepState, tok: torch.Tensor, val: torch.Tensor, feats: torch.Tensor,
                    counts: torch.Tensor, max_length: int, mask: Optional[torch.Tensor], padded: bool,
                    lo: int = 0) -> None:
        """:meth:`_read_pairs` on padded tokens / valid [m, K] of the decode rows (slots) ``lo .. lo + m``."""
        hi = lo + tok.shape[0]
        view = self.cache.view(lo, hi)
        ctx = chain_block(view, tok, val, self.max_pos, max_length=max_length, padded=padded,
                          unpadded=self.unpadded)
        hid, _ = self.spec.draft_step(tok, feats, ctx, head=False)  # logits: the new roots' rows only
        view.lengths += counts
        h = last_valid(hid, counts)
        self._store_root(lo, hi, mask, h, self.spec.draft_logits(h))
        st.count_draft(1)

    def _defer(self, st: StepState, f: torch.Tensor, toks: List[int]) -> None:
        """Keep each row's (base feature [b, F] before the draft's fc, token) pair of a level-0 step; once the
        buffer is full, the rows whose prompt still waits (never drafted for) add their buffered pairs to it, to be
        read with the prompt when the row first drafts (never, if it never does: such a row costs an AR row; it
        holds at most one pair per position of its slot), and the other rows catch up."""
        b = st.b
        if self.deferred_f is None:
            self.deferred_f = f.new_zeros(self.slots, self.lazy_steps, f.shape[-1])
        n = [len(self.deferred_tok[r]) for r in range(b)]
        if max(n) >= self.lazy_steps:  # full: rows whose prompt waits hold on; the others' pairs are read now
            for r in range(b):
                if self.prompt_pairs[r] and n[r]:
                    self.prompt_pairs[r].append((self.deferred_f[r, :n[r]].clone(),
                                                 tensor(self.deferred_tok[r], f.device)))
                    self.deferred_tok[r] = []
            if any(self.deferred_tok[:b]):
                self._catch_up(st, prompts=False)  # empties every row's deferred pairs
            n = [0] * b
        rows = torch.arange(b, device=f.device)
        self.deferred_f[rows, tensor(n, f.device)] = f
        for r in range(b):
            self.deferred_tok[r].append(toks[r])

    def _catch_up(self, st: StepState, prompts: bool = True) -> None:
        """Draft forwards over every decode row's deferred pairs (its prompt's, then its level-0 steps'); rows that
        had any get their new root. Prompt pairs are read only over the slots that have some (rows that joined
        lately sit together at the end of the decode range), in column chunks of at most ``chunk_tokens`` tokens
        per forward; then the level-0 steps' pairs of every row in one forward. ``prompts`` False: the level-0
        steps' pairs only (of rows whose prompt does not wait: a full buffer's, see :meth:`_defer`).

        The pairs end where the step's target cache starts (``st.lengths``): the draft cache is that many behind."""
        t0 = time.perf_counter()
        b = st.b
        steps = [len(x) for x in self.deferred_tok[:b]]
        dev = self.device
        waiting = take_waiting(self.prompt_pairs, b) if prompts else None
        if waiting is not None:
            lo, hi, prompt, rows = waiting
            for j, cj, (feats, tok) in column_chunks(rows, prompt, self.chunk_tokens):
                n_dev = tensor(cj, dev)
                val = torch.arange(tok.shape[1], device=dev)[None] < n_dev[:, None]
                before = max(ln - s - c + min(j, c) for ln, s, c in zip(st.lengths[lo:hi], steps[lo:hi], prompt))
                self._read_block(st, tok, val, self.spec.fuse(feats), n_dev, before,
                                 mask=tensor([c > 0 for c in cj], dev, torch.bool), padded=True, lo=lo)
        # the prompts' pairs, with the level-0 pairs a full buffer added to a waiting prompt (see _defer): draft
        # prefill, not level-0 work (reading them is the price of a row's first drafting step)
        pre = time.perf_counter() - t0
        if any(steps):  # the level-0 steps' pairs: one forward over the step buffer
            K = max(steps)
            self._read_pairs(st, self.deferred_tok[:b], self.spec.fuse(self.deferred_f[:b, :K]), tensor(steps, dev),
                             max(ln - c for ln, c in zip(st.lengths, steps)),
                             mask=tensor([c > 0 for c in steps], dev, torch.bool), padded=True)
        for r in range(b):
            self.deferred_tok[r] = []
        dt = time.perf_counter() - t0
        s, k, p = self._deferred_cost
        self._deferred_cost = (s + dt - pre, k + max(steps), p + pre)

    def swap(self, i: int, j: int, used: int) -> None:
        """Exchange the two slots' draft cache rows, roots and deferred pairs."""
        self.cache.swap_rows(i, j, used + self.extra_slots)
        swap_rows(self.root_hidden, i, j)
        swap_rows(self.root_logits, i, j)
        swap_rows(self.deferred_f, i, j)
        self.deferred_tok[i], self.deferred_tok[j] = self.deferred_tok[j], self.deferred_tok[i]
        self.prompt_pairs[i], self.prompt_pairs[j] = self.prompt_pairs[j], self.prompt_pairs[i]
        self.window_swap(i, j)

    def _to_base(self, q_draft: torch.Tensor) -> torch.Tensor:
        """Draft-vocab distribution [..., Vd] -> base-vocab [..., V] via d2t."""
        out = torch.zeros(*q_draft.shape[:-1], self.V, dtype=q_draft.dtype, device=q_draft.device)
        return out.index_add_(-1, self.d2t_ids.to(q_draft.device), q_draft)

    def propose(self, sess: Any, st: StepState, level: Optional[int] = None) -> DraftTree:
        """Draft a chain or an EAGLE-2 tree from the root (draft hidden/logits after the accepted tokens)."""
        i = level_index(self.levels, level)
        self._deferring = i == 0 and self.lazy_steps > 0
        if i == 0:
            return DraftTree.empty(st.b, sess.device)
        if any(self.deferred_tok[:st.b]) or any(self.prompt_pairs[:st.b]):
            self._catch_up(st)
        view = self.cache.view(0, st.b)
        if self.tree:
            d, total = self._tree_shape(i)
            return self._tree(sess, st, view, d, total)
        return self._chain(sess, st, view, self.levels[i])

    def _chain(self, sess: Any, st: StepState, view, depth: int) -> DraftTree:
        dev = sess.device
        b = st.b
        h, lg = self.root_hidden[:b], self.root_logits[:b]
        greedy = [p.greedy for p in st.params]
        drafts, qs = [], []
        mx = max(st.lengths)
        for i in range(depth):
            d, q = choose(st, lg, greedy)
            d = self.d2t_ids[d]
            drafts.append(d)
            qs.append(None if q is None else self._to_base(q))
            if i < depth - 1:
                prefix = torch.ones(b, 1, i, dtype=torch.bool, device=dev)
                ctx = chain_block(view, d[:, None], torch.ones(b, 1, dtype=torch.bool, device=dev),
                                   self.max_pos, prefix=prefix, depth0=i, max_length=mx)
                hid, logits = self.spec.draft_step(d[:, None], h[:, None], ctx)
                h, lg = hid[:, 0], logits[:, 0]
                st.count_draft(1)
        tokens = torch.stack(drafts, 1)
        valid = torch.ones_like(tokens, dtype=torch.bool)
        return DraftTree.chains(tokens, valid, q=stack_q(qs))

    def _score_temperatures(self, st: StepState, dev: torch.device) -> torch.Tensor:
        """Per-row temperature [b, 1] for ranking tree candidates.

        EAGLE-2 ranks nodes by the draft's path probability, a proxy for the chance the target accepts them.
        A sampling row accepts by the target's warped distribution, so its own temperature is the right
        sharpening. A greedy row accepts exactly the target's argmax, which a draft that has learned the
        target's (often flat) distribution predicts far more often than its probabilities say: ranked at
        temperature 1 the deep top-1 chain loses to shallow siblings. ``score_temperature`` (< 1) sharpens
        greedy rows' scores so the tree keeps its depth. Only the tree's shape changes; output is unaffected.
        """
        t = [self.score_temperature if p.greedy else float(p.temperature) for p in st.params]
        return tensor(t, dev, torch.float32)[:, None]

    def _tree(self, sess: Any, st: StepState, view, depth_max: int, total: int) -> DraftTree:
        dev = sess.device
        b, k = st.b, self.top_k
        rows = torch.arange(b, device=dev)[:, None]
        temp = self._score_temperatures(st, dev)
        lp = torch.log_softmax(self.root_logits[:b].float() / temp, -1).clamp(min=-1e4)
        s, t = lp.topk(k, -1)
        cand_tok, cand_score, cand_par, cand_depth = [self.d2t_ids[t]], [s], [torch.full((b, k), -1, device=dev)], [
            torch.ones(b, k, device=dev)]
        exp_idx = torch.arange(k, device=dev)[None].expand(b, k)  # global candidate index of expanded nodes
        exp_tok, exp_score = self.d2t_ids[t], s
        exp_h = self.root_hidden[:b, None].expand(b, k, -1)
        prefix = torch.zeros(b, k, 0, dtype=torch.bool, device=dev)
        base = k
        eye = torch.eye(k, dtype=torch.bool, device=dev)[None].expand(b, k, k)
        mx = max(st.lengths)
        for d in range(1, depth_max):
            depth = torch.full((b, k), d - 1, dtype=torch.long, device=dev)
            ctx = block_context(view, eye, depth, self.max_pos, prefix, max_length=mx)
            hid, logits = self.spec.draft_step(exp_tok, exp_h, ctx)
            st.count_draft(1)
            S = prefix.shape[-1]
            lp = torch.log_softmax(logits.float() / temp[:, None], -1).clamp(min=-1e4)
            s2, t2 = lp.topk(k, -1)  # [b, k, k]
            cum = (exp_score[:, :, None] + s2).reshape(b, k * k)
            par = exp_idx[:, :, None].expand(b, k, k).reshape(b, k * k)
            toks = self.d2t_ids[t2].reshape(b, k * k)
            cand_tok.append(toks)
            cand_score.append(cum)
            cand_par.append(par)
            cand_depth.append(torch.full((b, k * k), d + 1, device=dev))
            if d == depth_max - 1:
                break
            best = cum.topk(k, -1).indices  # [b, k] within this level
            pj = best // k  # which expanded node is the parent
            own = torch.zeros(b, k, S + k, dtype=torch.bool, device=dev)
            own[rows.expand(b, k), torch.arange(k, device=dev)[None].expand(b, k), S + pj] = True
            prefix = torch.cat([prefix, torch.zeros(b, k, k, dtype=torch.bool, device=dev)], -1)
            prefix = prefix[rows, pj] | own
            exp_idx = base + best
            exp_tok = toks[rows, best]
            exp_score = cum[rows, best]
            exp_h = hid[rows, pj]
            base += k * k
        tokens, parents = select_tree(torch.cat(cand_tok, 1), torch.cat(cand_score, 1), torch.cat(cand_par, 1).long(),
                                      torch.cat(cand_depth, 1), total)
        valid = torch.ones_like(tokens, dtype=torch.bool)
        n = tokens.shape[1]
        return DraftTree(tokens, parents, valid, max_depth=min(depth_max, n), max_children=min(k, n), sizes=[n] * b)
