"""Draft proposers: autoregressive (none), prompt lookup, draft model, EAGLE chain, EAGLE-2 tree, Medusa
(P-EAGLE parallel drafting: inference/peagle.py; DFlash block drafting: inference/dflash.py; suffix decoding:
inference/suffix.py).

A proposer has ``name``, ``lookahead`` (max draft nodes per step), ``aux_layers`` (base layers whose
outputs it needs), ``levels`` (draft nodes per row at each speculation level it offers, ascending from 0 =
no draft) and hooks called by :class:`nemo_spec.inference.session.Session`, whose rows live in fixed KV slots:
``setup`` (allocate per-slot state), ``check_row`` / ``admit`` / ``release`` (a row is validated, takes a slot,
leaves it), ``prefill`` (after each target prefill chunk), ``propose`` (returns a :class:`DraftTree` for the
decode rows, at a level), ``accepted`` (after verification, to sync draft state/caches with the accepted
tokens) and ``swap`` (two slots exchange their rows). The decode rows of a step are slots ``[0, b)``.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Dict, List, Optional, Sequence

import torch

from nemo_spec.models import gpt_forward, model_config, new_kv_cache, unwrap, unwrap_speculative
from nemo_spec.inference.engine import DraftTree, Engine, PrefillChunk, StepResult, StepState
from nemo_spec.inference.sampling import SamplingError, SamplingParams, sample_from, warp_rows
from nemo_spec.inference.transfer import h2d, tensor
from nemo_spec.inference.trees import (DEFAULT_MEDUSA_CHOICES, block_context, chain_mask, select_tree,
                                       medusa_tree, pad_chains, validate_medusa_choices)

log = logging.getLogger(__name__)


def _opt_int(options: Dict[str, Any], key: str, default: int, lo: int = 1) -> int:
    v = options.get(key, default)
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise SamplingError(f"option {key!r} must be an int >= {lo}, got {v!r}")
    return v


def _opt_float(options: Dict[str, Any], key: str, default: float) -> float:
    v = options.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise SamplingError(f"option {key!r} must be a finite number > 0, got {v!r}")
    return float(v)


# Greedy rows rank EAGLE-2 tree candidates at this draft temperature (see EagleProposer._score_temperatures).
DEFAULT_SCORE_TEMPERATURE = 0.2

# Every option generate() understands: method knobs, then engine knobs. Anything else is a typo.
KNOWN_OPTIONS = ("num_draft_tokens", "depth", "top_k", "total_tokens", "score_temperature", "medusa_choices",
                 "max_ngram", "min_ngram", "max_depth", "spec_factor", "min_token_prob", "global_cache",
                 "global_update", "pad_id", "max_cache_len", "ignore_eos", "adaptive", "prefill_chunk_tokens",
                 "max_batch", "compile")


def check_options(options: Dict[str, Any]) -> None:
    """Reject unknown option names (a misspelt knob would otherwise be silently ignored)."""
    unknown = sorted(set(options) - set(KNOWN_OPTIONS))
    if unknown:
        raise SamplingError(f"unknown generation option(s) {unknown}; known options: {list(KNOWN_OPTIONS)}")


def _set_rows(buf: torch.Tensor, lo: int, hi: int, mask: torch.Tensor, value: torch.Tensor) -> None:
    """buf[lo:hi] = value where mask [hi-lo] is True (no host sync)."""
    view = buf[lo:hi]
    view.copy_(torch.where(mask.view(-1, *([1] * (view.dim() - 1))), value.to(view.dtype), view))


def _swap_rows(buf: Optional[torch.Tensor], i: int, j: int) -> None:
    if buf is None or i == j:
        return
    tmp = buf[i].clone()
    buf[i] = buf[j]
    buf[j] = tmp


class ARProposer:
    """No draft: plain autoregressive decoding."""

    name = "ar"
    lookahead = 0
    aux_layers: List[int] = []
    #: extra KV slots per row beyond prompt + new tokens + lookahead (EAGLE tree levels)
    extra_slots = 0

    @property
    def levels(self) -> List[int]:
        """Draft nodes per row at each speculation level (level 0: none)."""
        return [0]

    def draft_forwards(self, level: int) -> int:
        """Draft-model forwards one step costs at ``level`` (for the adaptive cost model)."""
        return 0

    def level_depth(self, level: int) -> int:
        """Deepest draft node at ``level`` (chains: its length)."""
        return self.levels[level]

    def setup(self, sess: Any) -> None:
        """Allocate per-slot state for ``sess.slots`` rows of ``sess.slot_len`` positions."""

    def check_row(self, prompt: Sequence[int], sp: SamplingParams) -> None:
        """Raise SamplingError when this proposer cannot serve the row."""

    def admit(self, sess: Any, slot: int, row: Any) -> None:
        """A new row took ``slot`` (its prefill has not run yet)."""

    def prefill(self, sess: Any, ch: PrefillChunk) -> None:
        """After a target prefill chunk over slots [ch.lo, ch.hi)."""

    def propose(self, sess: Any, st: StepState, level: Optional[int] = None) -> DraftTree:
        """Empty tree."""
        return DraftTree.empty(st.b, sess.device)

    def accepted(self, sess: Any, st: StepState, res: StepResult) -> None:
        """Nothing to sync."""

    def release(self, sess: Any, slot: int, row: Any) -> None:
        """The row in ``slot`` left the batch."""

    def swap(self, i: int, j: int, used: int) -> None:
        """Slots i and j exchange their rows (``used``: cache positions that matter)."""


def _level_index(levels: List[int], level: Optional[int]) -> int:
    return len(levels) - 1 if level is None else max(0, min(int(level), len(levels) - 1))


class PromptLookupProposer(ARProposer):
    """n-gram prompt lookup: copy the continuation of the latest earlier match of the last n tokens."""

    name = "prompt_lookup"

    def __init__(self, options: Dict[str, Any]) -> None:
        self.num_tokens = _opt_int(options, "num_draft_tokens", 10)
        self.max_ngram = _opt_int(options, "max_ngram", 3)
        self.min_ngram = _opt_int(options, "min_ngram", 1)
        if self.min_ngram > self.max_ngram:
            raise SamplingError(f"option min_ngram={self.min_ngram} > max_ngram={self.max_ngram}")
        self.lookahead = self.num_tokens

    @property
    def levels(self) -> List[int]:
        """0, 1, 2, 4, ... up to num_draft_tokens draft tokens."""
        out, k = [0], 1
        while k < self.num_tokens:
            out.append(k)
            k *= 2
        return out + [self.num_tokens]

    def lookup(self, seq: Sequence[int]) -> List[int]:
        """Draft tokens for one sequence (empty when no n-gram matches).

        Longest n-gram first; among its matches the latest one whose continuation has all ``num_tokens`` tokens,
        else the one with the longest continuation. (The very latest match of a repeating pattern sits right
        before the end, where only a token or two follow it; an earlier period of the same pattern gives a
        full draft.)
        """
        L = len(seq)
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            pat = list(seq[L - n:])
            best: List[int] = []
            for i in range(L - n - 1, -1, -1):
                if seq[i] == pat[0] and list(seq[i:i + n]) == pat:
                    cont = list(seq[i + n: i + n + self.num_tokens])
                    if len(cont) == self.num_tokens:
                        return cont
                    if len(cont) > len(best):
                        best = cont
            if best:
                return best
        return []

    def propose(self, sess: Any, st: StepState, level: Optional[int] = None) -> DraftTree:
        """A chain per row from the n-gram match (ragged)."""
        k = self.levels[_level_index(self.levels, level)]
        if k == 0:
            return DraftTree.empty(st.b, sess.device)
        chains = [self.lookup(st.seqs[r])[:k] for r in range(st.b)]
        tok, val = pad_chains(chains, device=sess.device)
        return DraftTree.chains(tok, val, sizes=[len(c) for c in chains])


def _chain_block(cache, tokens: torch.Tensor, valid: torch.Tensor, max_pos: int, prefix=None, depth0: int = 0,
                 max_length: Optional[int] = None, padded: bool = False):
    """Context for right-padded ragged chains [b, n] appended to ``cache`` (``padded``: see block_context)."""
    anc, depth = chain_mask(valid)
    return block_context(cache, anc, depth + depth0, max_pos, prefix, max_length=max_length,
                         single_decode=tokens.shape[1] == 1 and prefix is None, padded=padded)


def _last_valid(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x [b, n, ...] at index counts-1 per row (clamped to 0)."""
    idx = (counts - 1).clamp(min=0)
    return x[torch.arange(x.shape[0], device=x.device), idx]


def _choose(st: StepState, logits: torch.Tensor, rows_greedy: List[bool]):
    """Pick one draft token per row from logits [b, V]: argmax (greedy rows) or a sample of the warped dist.

    Returns (tokens [b], warped draft probs [b, V] — one-hot for greedy rows; None when every row is greedy,
    since greedy verification never reads q).
    """
    tok = logits.argmax(-1)
    if all(rows_greedy):
        return tok, None
    q = warp_rows(logits, st.params)
    samp = [r for r, g in enumerate(rows_greedy) if not g]
    if samp:
        u = torch.zeros(st.b)
        u[samp] = st.rng.uniform(1, samp)[:, 0]
        mask = torch.tensor([not g for g in rows_greedy])
        tok = torch.where(h2d(mask, q.device), sample_from(q, h2d(u, q.device)), tok)
    return tok, q


def _stack_q(qs: List[Optional[torch.Tensor]]) -> Optional[torch.Tensor]:
    """Per-node draft distributions [b, n+1, V] (the last node's children are never drafted: zeros), or None."""
    if qs[0] is None:
        return None
    return torch.stack(qs + [torch.zeros_like(qs[0])], 1)


def _chain_levels(n: int) -> List[int]:
    out, k = [0], 1
    while k < n:
        out.append(k)
        k += 1
    return out + [n]


class DraftModelProposer(ARProposer):
    """Speculative sampling with a smaller GPT: gamma drafted tokens per step, verified by one target forward."""

    name = "draft_model"

    def __init__(self, draft: torch.nn.Module, options: Dict[str, Any], target_cfg) -> None:
        self.draft = unwrap(draft)
        self.dcfg = model_config(draft)
        if self.dcfg.vocab_size != target_cfg.vocab_size:
            raise SamplingError(f"draft model vocab_size={self.dcfg.vocab_size} differs from the target's "
                                f"{target_cfg.vocab_size}; draft-model speculation needs a shared tokenizer")
        self.gamma = _opt_int(options, "num_draft_tokens", 4)
        self.lookahead = self.gamma
        self._step_gamma = self.gamma

    @property
    def levels(self) -> List[int]:
        """0 .. gamma draft tokens."""
        return _chain_levels(self.gamma)

    def draft_forwards(self, level: int) -> int:
        """A catch-up forward plus gamma - 1 drafting forwards."""
        k = self.levels[_level_index(self.levels, level)]
        return k

    def check_row(self, prompt: Sequence[int], sp: SamplingParams) -> None:
        """The draft's context must hold prompt + new tokens."""
        need_pos = len(prompt) + sp.max_new_tokens
        if need_pos > self.dcfg.max_position_embeddings:
            raise SamplingError(f"draft model context max_position_embeddings={self.dcfg.max_position_embeddings} "
                                f"is too short for prompt + max_new_tokens ({need_pos} positions)")

    def setup(self, sess: Any) -> None:
        """The draft's own KV cache, one row per slot."""
        self.cache = sess.engine.cache(("draft_model", id(self.draft)), sess.slots, sess.slot_len,
                                       lambda bb, ll: new_kv_cache(self.draft, bb, ll))
        self.count = [0] * sess.slots  # sequence tokens held in the draft cache, per slot

    def admit(self, sess: Any, slot: int, row: Any) -> None:
        """Empty the slot's draft cache row."""
        self.count[slot] = 0
        self.cache.lengths[slot] = 0
        self.cache.starts[slot] = 0

    def prefill(self, sess: Any, ch: PrefillChunk) -> None:
        """Prefill the draft's own cache with the same prompt chunk."""
        view = self.cache.view(ch.lo, ch.hi)
        ctx = _chain_block(view, ch.tokens, ch.valid, self.dcfg.max_position_embeddings,
                           max_length=max(self.count[ch.lo:ch.hi]), padded=True)
        gpt_forward(self.draft, ch.tokens, ctx, compute_logits=False)
        view.lengths += ch.counts_dev
        for i, c in enumerate(ch.counts):
            self.count[ch.lo + i] += c
        for r in ch.rows:
            if r is not None:
                r.draft_forwards += 1

    def propose(self, sess: Any, st: StepState, level: Optional[int] = None) -> DraftTree:
        """Catch the draft cache up (1-2 tokens), then draft gamma tokens autoregressively."""
        dev = sess.device
        gamma = self.levels[_level_index(self.levels, level)]
        self._step_gamma = gamma
        if gamma == 0:
            return DraftTree.empty(st.b, dev)
        b = st.b
        view = self.cache.view(0, b)
        missing = [st.seqs[r][self.count[r]:] for r in range(b)]
        tok, val = pad_chains(missing, device=dev)
        counts_h = [len(m) for m in missing]
        counts = tensor(counts_h, dev)
        mx = max(self.count[:b])
        ctx = _chain_block(view, tok, val, self.dcfg.max_position_embeddings, max_length=mx)
        logits = gpt_forward(self.draft, tok, ctx).logits
        view.lengths += counts
        for r in range(b):
            self.count[r] += counts_h[r]
        mx = max(self.count[:b])
        lg = _last_valid(logits, counts)
        greedy = [p.greedy for p in st.params]
        drafts, qs = [], []
        for i in range(gamma):
            d, q = _choose(st, lg, greedy)
            drafts.append(d)
            qs.append(q)
            if i < gamma - 1:
                ctx = _chain_block(view, d[:, None], torch.ones_like(d[:, None], dtype=torch.bool),
                                   self.dcfg.max_position_embeddings, max_length=mx + i)
                lg = gpt_forward(self.draft, d[:, None], ctx).logits[:, 0]
                view.lengths += 1
        st.count_draft(gamma)
        tokens = torch.stack(drafts, 1)
        valid = torch.ones_like(tokens, dtype=torch.bool)
        return DraftTree.chains(tokens, valid, q=_stack_q(qs))

    def accepted(self, sess: Any, st: StepState, res: StepResult) -> None:
        """Roll the draft cache back to the accepted drafts it already holds."""
        if self._step_gamma == 0:
            return
        b = st.b
        for r in range(b):
            m = len(res.paths[r]) - 1
            self.count[r] += min(m, self._step_gamma - 1)
        self.cache.lengths[:b].copy_(tensor(self.count[:b], sess.device))

    def swap(self, i: int, j: int, used: int) -> None:
        """Exchange the two slots' draft cache rows."""
        self.cache.swap_rows(i, j, used + self.gamma + 1)
        self.count[i], self.count[j] = self.count[j], self.count[i]


class _SpecModelProposer(ARProposer):
    """Shared plumbing for proposers driven by a SpeculativeGPT (EAGLE / Medusa)."""

    def __init__(self, model: torch.nn.Module, algorithms: Sequence[str]) -> None:
        spec = unwrap_speculative(model)
        if spec is None:
            raise SamplingError(f"method {self.name!r} needs a SpeculativeGPT (base + draft); got "
                                f"{type(model).__name__} — apply SpeculativeTransform or load a speculative checkpoint")
        alg = spec.spec_config.algorithm
        if alg not in algorithms:
            raise SamplingError(f"method {self.name!r} needs a draft of type {list(algorithms)}, the model has {alg!r}")
        self.spec = spec
        self.aux_layers = list(spec.aux_layers)


class EagleProposer(_SpecModelProposer):
    """EAGLE-1/EAGLE-3 drafting: chain of depth K, or an EAGLE-2 dynamic tree (total tokens, depth, top-k)."""

    def __init__(self, model: torch.nn.Module, options: Dict[str, Any], tree: bool) -> None:
        self.name = "eagle_tree" if tree else "eagle"
        super().__init__(model, ("eagle1", "eagle3"))
        self.tree = tree
        if tree:
            self.depth = _opt_int(options, "depth", 5)
            self.top_k = _opt_int(options, "top_k", 8)
            self.total = _opt_int(options, "total_tokens", 48)
            cap = self.top_k + (self.depth - 1) * self.top_k * self.top_k
            self.total = min(self.total, cap)
            self.lookahead = self.total
            self.spec_slots = self.depth * self.top_k
            self.score_temperature = _opt_float(options, "score_temperature", DEFAULT_SCORE_TEMPERATURE)
        else:
            self.depth = _opt_int(options, "num_draft_tokens", options.get("depth", 4))
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

    def _tree_shape(self, level: int) -> "tuple[int, int]":
        """(depth, total nodes) of the tree at ``level`` (level = depth; the node budget shrinks with it)."""
        d = max(1, min(level, self.depth))
        total = min(self.total, max(1, round(self.total * d / self.depth)), self.top_k + (d - 1) * self.top_k ** 2)
        return d, total

    @property
    def levels(self) -> List[int]:
        """Chain: 0 .. depth tokens; tree: 0, then one tree per depth with a proportional node budget."""
        if not self.tree:
            return _chain_levels(self.depth)
        return [0] + [self._tree_shape(d)[1] for d in range(1, self.depth + 1)]

    def level_depth(self, level: int) -> int:
        """Chain: its length; tree: the level is the depth."""
        return self.levels[level] if not self.tree else level

    def draft_forwards(self, level: int) -> int:
        """A catch-up forward plus one per drafted level beyond the first."""
        i = _level_index(self.levels, level)
        return 1 + max(0, i - 1)

    def _features(self, out) -> torch.Tensor:
        return self.spec.fuse(self.spec.base_features(out))

    def setup(self, sess: Any) -> None:
        """The draft's KV cache, one row per slot (plus room for the drafted tree levels)."""
        self.cache = sess.engine.cache(("eagle", id(self.spec)), sess.slots, sess.slot_len + self.extra_slots,
                                       lambda bb, ll: self.spec.new_draft_cache(bb, ll))
        self.root_hidden = self.root_logits = None
        self.slots = sess.slots

    def admit(self, sess: Any, slot: int, row: Any) -> None:
        """Empty the slot's draft cache row."""
        self.cache.lengths[slot] = 0
        self.cache.starts[slot] = 0

    def _store_root(self, lo: int, hi: int, mask: Optional[torch.Tensor], hid: torch.Tensor,
                    logits: torch.Tensor) -> None:
        if self.root_hidden is None:
            self.root_hidden = hid.new_zeros(self.slots, hid.shape[-1])
            self.root_logits = logits.new_zeros(self.slots, logits.shape[-1])
        if mask is None:
            self.root_hidden[lo:hi] = hid
            self.root_logits[lo:hi] = logits
        else:
            _set_rows(self.root_hidden, lo, hi, mask, hid)
            _set_rows(self.root_logits, lo, hi, mask, logits)

    def prefill(self, sess: Any, ch: PrefillChunk) -> None:
        """Draft prefill: pairs (feature_t, token_{t+1}) over the chunk, the prompt's last pairing with the first
        new token; rows whose prompt is complete get their drafting root."""
        feats = self._features(ch.out)
        view = self.cache.view(ch.lo, ch.hi)
        ctx = _chain_block(view, ch.next_ids, ch.valid, self.max_pos, max_length=max(ch.before), padded=True)
        hid, logits = self.spec.draft_step(ch.next_ids, feats, ctx)
        view.lengths += ch.counts_dev
        if any(ch.final):
            self._store_root(ch.lo, ch.hi, ch.final_dev, _last_valid(hid, ch.counts_dev),
                             _last_valid(logits, ch.counts_dev))
        for r in ch.rows:
            if r is not None:
                r.draft_forwards += 1

    def accepted(self, sess: Any, st: StepState, res: StepResult) -> None:
        """Catch the draft up: the accepted path's base features paired with the emitted tokens."""
        feats = self._features(res.out)
        b = st.b
        dev = feats.device
        K = max(len(p) for p in res.paths)
        idx = res.path[:, :K]
        f = feats[torch.arange(b, device=dev)[:, None], idx]
        tok, val = pad_chains(res.emitted, n=K, device=dev)
        counts = res.accepted + 1
        view = self.cache.view(0, b)
        ctx = _chain_block(view, tok, val, self.max_pos, max_length=max(st.lengths))
        hid, logits = self.spec.draft_step(tok, f, ctx)
        view.lengths += counts
        self._store_root(0, b, None, _last_valid(hid, counts), _last_valid(logits, counts))
        st.count_draft(1)

    def swap(self, i: int, j: int, used: int) -> None:
        """Exchange the two slots' draft cache rows and roots."""
        self.cache.swap_rows(i, j, used + self.extra_slots)
        _swap_rows(self.root_hidden, i, j)
        _swap_rows(self.root_logits, i, j)

    def _to_base(self, q_draft: torch.Tensor) -> torch.Tensor:
        """Draft-vocab distribution [..., Vd] -> base-vocab [..., V] via d2t."""
        out = torch.zeros(*q_draft.shape[:-1], self.V, dtype=q_draft.dtype, device=q_draft.device)
        return out.index_add_(-1, self.d2t_ids.to(q_draft.device), q_draft)

    def propose(self, sess: Any, st: StepState, level: Optional[int] = None) -> DraftTree:
        """Draft a chain or an EAGLE-2 tree from the root (draft hidden/logits after the accepted tokens)."""
        i = _level_index(self.levels, level)
        if i == 0:
            return DraftTree.empty(st.b, sess.device)
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
            d, q = _choose(st, lg, greedy)
            d = self.d2t_ids[d]
            drafts.append(d)
            qs.append(None if q is None else self._to_base(q))
            if i < depth - 1:
                prefix = torch.ones(b, 1, i, dtype=torch.bool, device=dev)
                ctx = _chain_block(view, d[:, None], torch.ones(b, 1, dtype=torch.bool, device=dev),
                                   self.max_pos, prefix=prefix, depth0=i, max_length=mx)
                hid, logits = self.spec.draft_step(d[:, None], h[:, None], ctx)
                h, lg = hid[:, 0], logits[:, 0]
                st.count_draft(1)
        tokens = torch.stack(drafts, 1)
        valid = torch.ones_like(tokens, dtype=torch.bool)
        return DraftTree.chains(tokens, valid, q=_stack_q(qs))

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


class MedusaProposer(_SpecModelProposer):
    """Medusa heads on the last accepted base hidden state, expanded into a static candidate tree."""

    name = "medusa"

    def __init__(self, model: torch.nn.Module, options: Dict[str, Any]) -> None:
        super().__init__(model, ("medusa",))
        heads = self.spec.spec_config.num_medusa_heads
        choices = options.get("medusa_choices")
        if choices is None:
            choices = [c for c in DEFAULT_MEDUSA_CHOICES if len(c) <= heads]
        self.choices = validate_medusa_choices(choices, heads)
        self.parents, self.heads, self.ranks = medusa_tree(self.choices)
        self.lookahead = len(self.choices)
        self.kmax = max(self.ranks) + 1
        V = model_config(self.spec).vocab_size
        if self.kmax > V:
            raise SamplingError(f"medusa_choices use rank {self.kmax - 1} >= vocab_size {V}")
        self.max_depth = max(len(c) for c in self.choices)
        self.h: Optional[torch.Tensor] = None
        self._dev_tables: Dict[Any, Any] = {}

    def _level_nodes(self, level: int) -> int:
        """Nodes of the choices of depth <= level (choices are sorted by depth: a prefix)."""
        return sum(1 for c in self.choices if len(c) <= level)

    @property
    def levels(self) -> List[int]:
        """0, then the tree cut at each depth."""
        return [0] + [self._level_nodes(d) for d in range(1, self.max_depth + 1)]

    def level_depth(self, level: int) -> int:
        """The level is the tree's depth."""
        return level

    def draft_forwards(self, level: int) -> int:
        """The heads (one small forward) whenever drafting."""
        return 1 if _level_index(self.levels, level) > 0 else 0

    def setup(self, sess: Any) -> None:
        """Per-slot base hidden states (allocated at the first prefill)."""
        self.h = None
        self.slots = sess.slots

    def prefill(self, sess: Any, ch: PrefillChunk) -> None:
        """Remember the base hidden state at the last prompt token of rows whose prompt is complete."""
        if not any(ch.final):
            return
        last = _last_valid(ch.out.hidden, ch.counts_dev)
        if self.h is None:
            self.h = last.new_zeros(self.slots, last.shape[-1])
        _set_rows(self.h, ch.lo, ch.hi, ch.final_dev, last)

    def _tables(self, n: int, dev: torch.device):
        key = (n, dev)
        if key not in self._dev_tables:
            self._dev_tables[key] = (tensor(self.heads[:n], dev), tensor(self.ranks[:n], dev),
                                     tensor(self.parents[:n], dev))
        return self._dev_tables[key]

    def propose(self, sess: Any, st: StepState, level: Optional[int] = None) -> DraftTree:
        """Top-k tokens of each head placed on the static tree (cut at the level's depth)."""
        dev = sess.device
        b = st.b
        i = _level_index(self.levels, level)
        n = self.levels[i]
        if n == 0:
            return DraftTree.empty(b, dev)
        ml = self.spec.medusa_logits(self.h[:b, None])[:, :, 0]  # [K, b, V]
        st.count_draft(1)
        top = ml.topk(self.kmax, -1).indices  # [K, b, kmax]
        heads, ranks, parents = self._tables(n, dev)
        tokens = top[heads, :, ranks].transpose(0, 1)  # [b, n]
        parents = parents[None].expand(b, -1).contiguous()
        valid = torch.ones(b, n, dtype=torch.bool, device=dev)
        kids = [0] * (n + 1)
        for p in self.parents[:n]:
            kids[p] += 1
        return DraftTree(tokens.contiguous(), parents, valid, max_depth=i, max_children=max(kids), sizes=[n] * b)

    def accepted(self, sess: Any, st: StepState, res: StepResult) -> None:
        """Keep the base hidden state of the last accepted node."""
        b = st.b
        rows = torch.arange(b, device=res.path.device)
        last = res.path[rows, res.accepted]
        self.h[:b] = res.out.hidden[rows, last]

    def swap(self, i: int, j: int, used: int) -> None:
        """Exchange the two slots' hidden states."""
        _swap_rows(self.h, i, j)


METHODS = ("ar", "eagle", "eagle_tree", "medusa", "draft_model", "prompt_lookup", "suffix", "peagle", "dflash")


def make_proposer(method: str, model: torch.nn.Module, engine: Engine, draft_model: Optional[torch.nn.Module],
                  options: Dict[str, Any]):
    """The proposer for ``method`` (validated before any forward pass)."""
    check_options(options)
    if method == "ar":
        return ARProposer()
    if method == "prompt_lookup":
        return PromptLookupProposer(options)
    if method == "draft_model":
        if draft_model is None:
            raise SamplingError("method 'draft_model' needs draft_model= (a smaller GPT with the same vocabulary)")
        return DraftModelProposer(draft_model, options, engine.cfg)
    if method in ("eagle", "eagle_tree"):
        return EagleProposer(model, options, tree=method == "eagle_tree")
    if method == "medusa":
        return MedusaProposer(model, options)
    if method == "suffix":
        from nemo_spec.inference.suffix import SuffixProposer

        return SuffixProposer(model, options)
    if method == "peagle":
        from nemo_spec.inference.peagle import PEagleProposer

        return PEagleProposer(model, options)
    if method == "dflash":
        from nemo_spec.inference.dflash import DFlashProposer

        return DFlashProposer(model, options)
    raise SamplingError(f"unknown generation method {method!r}; choose one of {METHODS}")
