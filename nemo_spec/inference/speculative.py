"""Draft proposers: autoregressive (none), prompt lookup, draft model, EAGLE chain, EAGLE-2 tree, Medusa.

A proposer has ``name``, ``lookahead`` (max draft nodes per step), ``aux_layers`` (base layers whose
outputs it needs), and three hooks called by :func:`nemo_spec.inference.engine.run_generation`:
``prefill`` (after the target's prompt forward), ``propose`` (returns a :class:`DraftTree`) and
``accepted`` (after verification, to sync draft state/caches with the accepted tokens).
"""
from __future__ import annotations

import logging
import math
from typing import Any, Dict, List, Optional, Sequence

import torch

from nemo_spec.models import gpt_forward, model_config, new_kv_cache, unwrap, unwrap_speculative
from nemo_spec.inference.engine import BatchState, DraftTree, Engine, StepResult
from nemo_spec.inference.sampling import SamplingError, sample_from, warp_rows
from nemo_spec.inference.trees import (DEFAULT_MEDUSA_CHOICES, block_context, chain_mask, chain_parents, select_tree,
                                       medusa_tree, pad_chains, prefill_context, validate_medusa_choices)

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
                 "global_update", "pad_id", "max_cache_len", "ignore_eos")


def check_options(options: Dict[str, Any]) -> None:
    """Reject unknown option names (a misspelt knob would otherwise be silently ignored)."""
    unknown = sorted(set(options) - set(KNOWN_OPTIONS))
    if unknown:
        raise SamplingError(f"unknown generation option(s) {unknown}; known options: {list(KNOWN_OPTIONS)}")


class ARProposer:
    """No draft: plain autoregressive decoding."""

    name = "ar"
    lookahead = 0
    aux_layers: List[int] = []

    def prefill(self, eng: Engine, st: BatchState, tokens, lens, out, need) -> None:
        """Nothing to prepare."""

    def propose(self, eng: Engine, st: BatchState) -> DraftTree:
        """Empty tree."""
        return DraftTree.empty(st.b, eng.device)

    def accepted(self, eng: Engine, st: BatchState, res: StepResult) -> None:
        """Nothing to sync."""

    def retire(self, r: int) -> None:
        """Release a finished row's draft cache entries."""
        cache = getattr(self, "cache", None)
        if cache is not None:
            cache.lengths[r] = cache.starts[r]


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

    def propose(self, eng: Engine, st: BatchState) -> DraftTree:
        """A chain per row from the n-gram match (ragged)."""
        act = st.active
        chains = [self.lookup(st.seqs[r]) if act[r] else [] for r in range(st.b)]
        tok, val = pad_chains(chains, device=eng.device)
        return DraftTree(tok, chain_parents(st.b, tok.shape[1], eng.device) + 1, val)


def _chain_block(cache, tokens: torch.Tensor, valid: torch.Tensor, max_pos: int, prefix=None, depth0: int = 0):
    """Context for right-padded ragged chains [b, n] appended to ``cache``."""
    anc, depth = chain_mask(valid)
    return block_context(cache, anc, depth + depth0, max_pos, prefix)


def _last_valid(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x [b, n, ...] at index counts-1 per row (clamped to 0)."""
    idx = (counts - 1).clamp(min=0)
    return x[torch.arange(x.shape[0], device=x.device), idx]


def _choose(st: BatchState, logits: torch.Tensor, rows_greedy: List[bool]):
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
        idx = torch.tensor(samp, device=logits.device)
        u = st.rng.uniform(1, samp)[:, 0]
        tok[idx] = sample_from(q[idx], u.to(q.device))
    return tok, q


def _stack_q(qs: List[Optional[torch.Tensor]]) -> Optional[torch.Tensor]:
    """Per-node draft distributions [b, n+1, V] (the last node's children are never drafted: zeros), or None."""
    if qs[0] is None:
        return None
    return torch.stack(qs + [torch.zeros_like(qs[0])], 1)


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

    def prefill(self, eng: Engine, st: BatchState, tokens, lens, out, need) -> None:
        """Prefill the draft's own cache with the prompts (same left padding)."""
        need_pos = max(len(p) + sp.max_new_tokens for p, sp in zip(st.prompts, st.params))
        if need_pos > self.dcfg.max_position_embeddings:
            raise SamplingError(f"draft model context max_position_embeddings={self.dcfg.max_position_embeddings} "
                                f"is too short for prompt + max_new_tokens ({need_pos} positions)")
        self.cache = eng.cache(("draft_model", id(self.draft)), st.b, need,
                               lambda bb, ll: new_kv_cache(self.draft, bb, ll))
        ctx = prefill_context(self.cache, lens, tokens.shape[1])
        gpt_forward(self.draft, tokens, ctx, compute_logits=False)
        self.cache.lengths.fill_(tokens.shape[1])
        self.count = [len(p) for p in st.prompts]  # sequence tokens held in the draft cache
        st.count_draft(1)

    def propose(self, eng: Engine, st: BatchState) -> DraftTree:
        """Catch the draft cache up (1-2 tokens), then draft gamma tokens autoregressively."""
        act = st.active
        dev = eng.device
        missing = [st.seqs[r][self.count[r]:] if act[r] else [] for r in range(st.b)]
        tok, val = pad_chains(missing, device=dev)
        counts = val.sum(1)
        ctx = _chain_block(self.cache, tok, val, self.dcfg.max_position_embeddings)
        logits = gpt_forward(self.draft, tok, ctx).logits
        self.cache.lengths += counts
        for r in range(st.b):
            self.count[r] += int(counts[r])
        lg = _last_valid(logits, counts)
        greedy = [p.greedy for p in st.params]
        drafts, qs = [], []
        actt = st.active_tensor(dev).long()
        for i in range(self.gamma):
            d, q = _choose(st, lg, greedy)
            drafts.append(d)
            qs.append(q)
            if i < self.gamma - 1:
                ctx = _chain_block(self.cache, d[:, None], torch.ones_like(d[:, None], dtype=torch.bool),
                                   self.dcfg.max_position_embeddings)
                lg = gpt_forward(self.draft, d[:, None], ctx).logits[:, 0]
                self.cache.lengths += actt
        st.count_draft(self.gamma)
        tokens = torch.stack(drafts, 1)
        valid = st.active_tensor(dev)[:, None].expand_as(tokens).contiguous()
        return DraftTree(tokens, chain_parents(st.b, self.gamma, dev) + 1, valid, _stack_q(qs))

    def accepted(self, eng: Engine, st: BatchState, res: StepResult) -> None:
        """Roll the draft cache back to the accepted drafts it already holds."""
        for r in st.active_rows():
            m = len(res.paths[r]) - 1
            keep = self.count[r] + min(m, self.gamma - 1)
            self.count[r] = keep
            self.cache.lengths[r] = self.cache.starts[r] + keep


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
        vd = int(self.spec.d2t.numel())
        if tree and self.top_k > vd:
            raise SamplingError(f"option top_k={self.top_k} exceeds the draft vocabulary size {vd}")
        d2t_in = torch.arange(vd, device=self.spec.d2t.device)
        self.d2t_ids = self.spec.draft_to_base_ids(d2t_in).long()
        self.V = model_config(self.spec).vocab_size
        self.max_pos = model_config(self.spec).max_position_embeddings

    def _features(self, out) -> torch.Tensor:
        return self.spec.fuse(self.spec.base_features(out))

    def prefill(self, eng: Engine, st: BatchState, tokens, lens, out, need) -> None:
        """Draft prefill: pairs (feature_t, token_{t+1}) over the prompt, the last pairing with the first new token."""
        b, P = tokens.shape
        self.cache = eng.cache(("eagle", id(self.spec)), b, need + self.spec_slots + 1,
                               lambda bb, ll: self.spec.new_draft_cache(bb, ll))
        feats = self._features(out)
        ids = torch.cat([tokens[:, 1:], st.pending[:, None]], 1)
        ctx = prefill_context(self.cache, lens, P)
        hid, logits = self.spec.draft_step(ids, feats, ctx)
        self.cache.lengths.fill_(P)
        self.root_hidden, self.root_logits = hid[:, -1], logits[:, -1]
        self.catchup = None
        st.count_draft(1)

    def accepted(self, eng: Engine, st: BatchState, res: StepResult) -> None:
        """Queue the accepted path's base features paired with the next tokens for the draft cache."""
        feats = self._features(res.out)
        b = st.b
        K = max(len(p) for p in res.paths)
        idx = torch.zeros(b, K, dtype=torch.long, device=feats.device)
        for r in st.active_rows():
            idx[r, : len(res.paths[r])] = torch.tensor(res.paths[r], device=feats.device)
        f = feats[torch.arange(b, device=feats.device)[:, None], idx]
        act = st.active
        tok, val = pad_chains([res.emitted[r] if act[r] else [] for r in range(b)], n=K, device=feats.device)
        self.catchup = (tok, val, f)

    def _catch_up(self, st: BatchState) -> None:
        tok, val, f = self.catchup
        counts = val.sum(1)
        ctx = _chain_block(self.cache, tok, val, self.max_pos)
        hid, logits = self.spec.draft_step(tok, f, ctx)
        self.cache.lengths += counts
        self.root_hidden, self.root_logits = _last_valid(hid, counts), _last_valid(logits, counts)
        self.catchup = None

    def _to_base(self, q_draft: torch.Tensor) -> torch.Tensor:
        """Draft-vocab distribution [..., Vd] -> base-vocab [..., V] via d2t."""
        out = torch.zeros(*q_draft.shape[:-1], self.V, dtype=q_draft.dtype, device=q_draft.device)
        return out.index_add_(-1, self.d2t_ids.to(q_draft.device), q_draft)

    def propose(self, eng: Engine, st: BatchState) -> DraftTree:
        """Draft a chain or an EAGLE-2 tree from the root (draft hidden/logits after the accepted tokens)."""
        if self.catchup is not None:
            self._catch_up(st)
            st.count_draft(1)
        return self._tree(eng, st) if self.tree else self._chain(eng, st)

    def _chain(self, eng: Engine, st: BatchState) -> DraftTree:
        dev = eng.device
        b = st.b
        h, lg = self.root_hidden, self.root_logits
        greedy = [p.greedy for p in st.params]
        drafts, qs = [], []
        for i in range(self.depth):
            d, q = _choose(st, lg, greedy)
            d = self.d2t_ids[d]
            drafts.append(d)
            qs.append(None if q is None else self._to_base(q))
            if i < self.depth - 1:
                prefix = torch.ones(b, 1, i, dtype=torch.bool, device=dev)
                ctx = _chain_block(self.cache, d[:, None], torch.ones(b, 1, dtype=torch.bool, device=dev),
                                   self.max_pos, prefix=prefix, depth0=i)
                hid, logits = self.spec.draft_step(d[:, None], h[:, None], ctx)
                h, lg = hid[:, 0], logits[:, 0]
                st.count_draft(1)
        tokens = torch.stack(drafts, 1)
        valid = st.active_tensor(dev)[:, None].expand_as(tokens).contiguous()
        return DraftTree(tokens, chain_parents(b, self.depth, dev) + 1, valid, _stack_q(qs))

    def _score_temperatures(self, st: BatchState, dev: torch.device) -> torch.Tensor:
        """Per-row temperature [b, 1] for ranking tree candidates.

        EAGLE-2 ranks nodes by the draft's path probability, a proxy for the chance the target accepts them.
        A sampling row accepts by the target's warped distribution, so its own temperature is the right
        sharpening. A greedy row accepts exactly the target's argmax, which a draft that has learned the
        target's (often flat) distribution predicts far more often than its probabilities say: ranked at
        temperature 1 the deep top-1 chain loses to shallow siblings. ``score_temperature`` (< 1) sharpens
        greedy rows' scores so the tree keeps its depth. Only the tree's shape changes; output is unaffected.
        """
        t = [self.score_temperature if p.greedy else float(p.temperature) for p in st.params]
        return torch.tensor(t, dtype=torch.float32, device=dev)[:, None]

    def _tree(self, eng: Engine, st: BatchState) -> DraftTree:
        dev = eng.device
        b, k = st.b, self.top_k
        rows = torch.arange(b, device=dev)[:, None]
        temp = self._score_temperatures(st, dev)
        lp = torch.log_softmax(self.root_logits.float() / temp, -1).clamp(min=-1e4)
        s, t = lp.topk(k, -1)
        cand_tok, cand_score, cand_par, cand_depth = [self.d2t_ids[t]], [s], [torch.full((b, k), -1, device=dev)], [
            torch.ones(b, k, device=dev)]
        exp_idx = torch.arange(k, device=dev)[None].expand(b, k)  # global candidate index of expanded nodes
        exp_tok, exp_score = self.d2t_ids[t], s
        exp_h = self.root_hidden[:, None].expand(b, k, -1)
        prefix = torch.zeros(b, k, 0, dtype=torch.bool, device=dev)
        base = k
        eye = torch.eye(k, dtype=torch.bool, device=dev)[None].expand(b, k, k)
        for d in range(1, self.depth):
            depth = torch.full((b, k), d - 1, dtype=torch.long, device=dev)
            ctx = block_context(self.cache, eye, depth, self.max_pos, prefix)
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
            if d == self.depth - 1:
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
                                      torch.cat(cand_depth, 1), self.total)
        valid = st.active_tensor(dev)[:, None].expand_as(tokens).contiguous()
        return DraftTree(tokens, parents, valid)


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

    def prefill(self, eng: Engine, st: BatchState, tokens, lens, out, need) -> None:
        """Remember the base hidden state at the last prompt token."""
        self.h = out.hidden[:, -1]

    def propose(self, eng: Engine, st: BatchState) -> DraftTree:
        """Top-k tokens of each head placed on the static tree."""
        dev = eng.device
        b = st.b
        ml = self.spec.medusa_logits(self.h[:, None])[:, :, 0]  # [K, b, V]
        st.count_draft(1)
        top = ml.topk(self.kmax, -1).indices  # [K, b, kmax]
        heads = torch.tensor(self.heads, device=dev)
        ranks = torch.tensor(self.ranks, device=dev)
        tokens = top[heads, :, ranks].transpose(0, 1)  # [b, n]
        parents = torch.tensor(self.parents, device=dev)[None].expand(b, -1).contiguous()
        valid = st.active_tensor(dev)[:, None].expand_as(tokens).contiguous()
        return DraftTree(tokens.contiguous(), parents, valid)

    def accepted(self, eng: Engine, st: BatchState, res: StepResult) -> None:
        """Keep the base hidden state of the last accepted node."""
        last = torch.tensor([p[-1] if p else 0 for p in res.paths], device=eng.device)
        self.h = res.out.hidden[torch.arange(st.b, device=eng.device), last]


METHODS = ("ar", "eagle", "eagle_tree", "medusa", "draft_model", "prompt_lookup", "suffix")


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
    raise SamplingError(f"unknown generation method {method!r}; choose one of {METHODS}")
