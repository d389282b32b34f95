"""Helpers shared by the proposers: option parsing, per-slot row buffers, speculation levels, draft chains."""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from nemo_spec.inference.engine import DraftTree, StepState
from nemo_spec.inference.sampling import SamplingError, sample_from, warp_rows
from nemo_spec.inference.transfer import h2d, tensor
from nemo_spec.inference.trees import (block_context, chain_mask, medusa_tree, parallel_tree_choices,
                                      validate_medusa_choices)


def opt_int(options: Dict[str, Any], key: str, default: int, lo: int = 1) -> int:
    """Integer option ``key`` (>= ``lo``) or ``default``; SamplingError otherwise."""
    v = options.get(key, default)
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise SamplingError(f"option {key!r} must be an int >= {lo}, got {v!r}")
    return v


def opt_float(options: Dict[str, Any], key: str, default: float) -> float:
    """Finite positive number option ``key`` or ``default``; SamplingError otherwise."""
    v = options.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise SamplingError(f"option {key!r} must be a finite number > 0, got {v!r}")
    return float(v)


#: level-0 steps whose draft work (EAGLE's catch-up forward, DFlash's context injection) may wait to be done in
#: one go by the next drafting step (0: after every step)
DEFAULT_LAZY_DRAFT_STEPS = 32

# Greedy rows rank EAGLE-2 tree candidates at this draft temperature (see EagleProposer._score_temperatures).
DEFAULT_SCORE_TEMPERATURE = 0.2

# Every option generate() understands: method knobs, then engine knobs. Anything else is a typo.
KNOWN_OPTIONS = ("num_draft_tokens", "depth", "top_k", "total_tokens", "score_temperature", "medusa_choices",
                 "tree_choices", "max_ngram", "min_ngram", "max_depth", "spec_factor", "min_token_prob", "global_cache",
                 "global_update", "pad_id", "max_cache_len", "ignore_eos", "adaptive", "prefill_chunk_tokens",
                 "prefill_pad_tokens", "max_batch", "compile", "lazy_draft_steps", "draft_prompt_tokens")


def check_options(options: Dict[str, Any]) -> None:
    """Reject unknown option names (a misspelt knob would otherwise be silently ignored)."""
    unknown = sorted(set(options) - set(KNOWN_OPTIONS))
    if unknown:
        raise SamplingError(f"unknown generation option(s) {unknown}; known options: {list(KNOWN_OPTIONS)}")
    cap = options.get("max_cache_len")
    if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 2):
        raise SamplingError(f"max_cache_len must be an int >= 2 (positions per row's KV cache) or null, got {cap!r}")


def set_rows(buf: torch.Tensor, lo: int, hi: int, mask: torch.Tensor, value: torch.Tensor) -> None:
    """buf[lo:hi] = value where mask [hi-lo] is True (no host sync)."""
    view = buf[lo:hi]
    view.copy_(torch.where(mask.view(-1, *([1] * (view.dim() - 1))), value.to(view.dtype), view))


def swap_rows(buf: Optional[torch.Tensor], i: int, j: int) -> None:
    """Exchange rows i and j of a per-slot buffer (None: nothing to do)."""
    if buf is None or i == j:
        return
    tmp = buf[i].clone()
    buf[i] = buf[j]
    buf[j] = tmp


def take_waiting(waiting: List[list], b: int) -> Optional[Tuple[int, int, List[int], List[Optional[list]]]]:
    """Empty the first ``b`` slots' waiting prompt parts (per slot, in arrival order, tuples of tensors [c, ...]
    such as (features, tokens)) over the slots ``lo .. hi`` that hold any (rows that joined lately sit together at
    the end of the decode range): (lo, hi, entries per slot lo..hi, per slot lo..hi its parts joined per tuple
    element, or None); None when no slot holds any. Read them with :func:`column_chunks`."""
    counts = [sum(int(p[0].shape[0]) for p in w) for w in waiting[:b]]
    if not any(counts):
        return None
    lo = next(r for r in range(b) if counts[r])
    hi = max(r for r in range(b) if counts[r]) + 1
    rows = [[torch.cat([p[e] for p in w]) for e in range(len(w[0]))] if w else None for w in waiting[lo:hi]]
    for r in range(lo, hi):
        waiting[r] = []
    return lo, hi, counts[lo:hi], rows


def column_chunks(rows: List[Optional[list]], counts: List[int], chunk_tokens: int):
    """Read :func:`take_waiting`'s rows in column chunks of ``max(1, chunk_tokens // len(rows))`` entries per row
    (so about ``chunk_tokens`` in all): yields (first column j, entries per row in the chunk, one zero-padded
    [rows, n, ...] block per tuple element, row i holding its entries j .. j + n_i). Only a chunk is padded."""
    width = max(1, chunk_tokens // max(1, len(rows)))
    first = next(r for r in rows if r is not None)
    for j in range(0, max(counts), width):
        cj = [min(max(c - j, 0), width) for c in counts]
        blocks = [t.new_zeros((len(rows), max(cj)) + tuple(t.shape[1:])) for t in first]
        for i, r in enumerate(rows):
            if cj[i]:
                for blk, t in zip(blocks, r):
                    blk[i, :cj[i]] = t[j:j + cj[i]]
        yield j, cj, blocks


def level_index(levels: List[int], level: Optional[int]) -> int:
    """Index of ``level`` in ``levels`` (None: the top one), clamped."""
    return len(levels) - 1 if level is None else max(0, min(int(level), len(levels) - 1))


def chain_block(cache, tokens: torch.Tensor, valid: torch.Tensor, max_pos: int, prefix=None, depth0: int = 0,
                 max_length: Optional[int] = None, padded: bool = False, unpadded: bool = True):
    """Context for right-padded ragged chains [b, n] appended to ``cache`` (``padded``: see block_context).
    ``unpadded``: no row of the cache starts after slot 0 (then one new entry of one row attends unmasked)."""
    anc, depth = chain_mask(valid)
    return block_context(cache, anc, depth + depth0, max_pos, prefix, max_length=max_length,
                         single_decode=unpadded and tokens.shape[1] == 1 and prefix is None, padded=padded)


def last_valid(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x [b, n, ...] at index counts-1 per row (clamped to 0)."""
    idx = (counts - 1).clamp(min=0)
    return x[torch.arange(x.shape[0], device=x.device), idx]


def choose(st: StepState, logits: torch.Tensor, rows_greedy: List[bool]):
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


def stack_q(qs: List[Optional[torch.Tensor]]) -> Optional[torch.Tensor]:
    """Per-node draft distributions [b, n+1, V] (the last node's children are never drafted: zeros), or None."""
    if qs[0] is None:
        return None
    return torch.stack(qs + [torch.zeros_like(qs[0])], 1)


def chain_levels(n: int) -> List[int]:
    """Chain speculation levels 0, 1, ..., n draft tokens."""
    out, k = [0], 1
    while k < n:
        out.append(k)
        k += 1
    return out + [n]


class StaticTree:
    """A static candidate tree over per-depth top-k ranks (Medusa's rank paths): node ``i`` is the
    ``ranks[i]``-th most likely token of the distribution at depth ``depths[i]``, its parent ``parents[i]``.
    Drafted in one gather from logits that predict every depth at once (Medusa heads, the single forward of a
    P-EAGLE or DFlash draft). Candidates are deterministic (one-hot q): distinct siblings, verified losslessly by
    the engine's multi-candidate rule at any temperature. Cut at each depth, the tree gives the proposer's
    speculation levels."""

    def __init__(self, choices, num_depths: int, vocab: int, option: str, depths: str) -> None:
        self.choices = validate_medusa_choices(choices, num_depths, option, depths)
        self.parents, self.depths, self.ranks = medusa_tree(self.choices)
        self.kmax = max(self.ranks) + 1
        if self.kmax > vocab:
            raise SamplingError(f"{option} use rank {self.kmax - 1} >= vocab_size {vocab}")
        self.max_depth = max(len(c) for c in self.choices)
        self._dev: Dict[Any, Any] = {}

    def nodes(self, depth: int) -> int:
        """Nodes of depth <= ``depth`` (the choices are sorted by depth: a prefix)."""
        return sum(1 for c in self.choices if len(c) <= depth)

    @property
    def levels(self) -> List[int]:
        """0, then the tree cut at each depth."""
        return [0] + [self.nodes(d) for d in range(1, self.max_depth + 1)]

    def draft(self, logits: torch.Tensor, n: int, to_ids: Optional[torch.Tensor] = None) -> DraftTree:
        """The first ``n`` nodes from ``logits`` [b, D, V] (depth d's distribution at [:, d]); ``to_ids`` maps
        the logits' vocabulary to base token ids (a draft vocabulary)."""
        b, dev = logits.shape[0], logits.device
        if n == 0:
            return DraftTree.empty(b, dev)
        key = (n, dev)
        if key not in self._dev:  # the cut tree's device tables and its most children of one node, built once
            kids = [0] * (n + 1)
            for p in self.parents[:n]:
                kids[p] += 1
            self._dev[key] = (tensor(self.depths[:n], dev), tensor(self.ranks[:n], dev),
                              tensor(self.parents[:n], dev), max(kids))
        depths, ranks, parents, max_children = self._dev[key]
        top = logits.topk(self.kmax, -1).indices  # [b, D, kmax]
        tokens = top[:, depths, ranks]  # [b, n]
        if to_ids is not None:
            tokens = to_ids[tokens]
        return DraftTree(tokens.contiguous(), parents[None].expand(b, -1).contiguous(),
                         torch.ones(b, n, dtype=torch.bool, device=dev), max_depth=len(self.choices[n - 1]),
                         max_children=max_children, sizes=[n] * b)


class ParallelLevels:
    """Speculation levels of a proposer whose draft predicts ``depth`` positions in one forward (P-EAGLE, DFlash):
    a chain of 0 .. depth tokens, or after :meth:`use_tree` (method ``<name>_tree``) a :class:`StaticTree` of the
    per-position top-k cut at each depth."""

    name: str
    depth: int
    lookahead: int
    tree: Optional[StaticTree] = None

    def use_tree(self, options: Dict[str, Any], vocab: int) -> None:
        """Draft the static tree of option ``tree_choices`` (default
        :func:`~nemo_spec.inference.trees.parallel_tree_choices`) instead of the chain."""
        choices = options.get("tree_choices")
        self.tree = StaticTree(parallel_tree_choices(self.depth) if choices is None else choices, self.depth, vocab,
                               "tree_choices", "draft positions (num_draft_tokens)")
        self.name = f"{self.name}_tree"
        self.lookahead = len(self.tree.choices)

    @property
    def levels(self) -> List[int]:
        """0 .. depth draft tokens (tree: 0, then the tree cut at each depth)."""
        return self.tree.levels if self.tree is not None else chain_levels(self.depth)

    def level_depth(self, level: int) -> int:
        """Deepest draft node at ``level``: the positions the one forward must predict."""
        i = level_index(self.levels, level)
        return i if self.tree is not None else self.levels[i]

    def level_nodes(self, level: Optional[int]) -> int:
        """Draft nodes at ``level`` (None: the top one)."""
        return self.levels[level_index(self.levels, level)]


class PromptWindow:
    """The draft reads only the last ``window`` (option ``draft_prompt_tokens``) of a prompt's (feature, token)
    pairs; 0 = the whole prompt. The default is the sequence length the draft was trained on when its checkpoint
    records it (``SpeculativeGPT.trained_seq_len``), else the whole prompt. A slot's draft cache starts at the first
    pair it reads (``starts`` = ``lengths`` = the pairs skipped), so positions count from the window's start, as in
    training, and cache lengths keep the target's meaning. For proposers whose draft keeps (feature, token) pairs in
    a cache of the target's layout (EAGLE-1/3, P-EAGLE)."""

    spec: Any
    cache: Any

    def init_window(self, options: Dict[str, Any]) -> None:
        """Read the option (validated) or the draft's training length."""
        self.window = (self.spec.trained_seq_len or 0) if options.get("draft_prompt_tokens") is None \
            else opt_int(options, "draft_prompt_tokens", 0, lo=0)
        self.skip: List[int] = []  # per slot: prompt pairs before the draft's window (not read)

    @property
    def unpadded(self) -> bool:
        """No slot's draft cache starts after entry 0 (see :func:`chain_block`)."""
        return self.window == 0

    def window_setup(self, slots: int) -> None:
        """Per-slot skips for a new session."""
        self.skip = [0] * slots

    def window_admit(self, slot: int, prompt: Sequence[int]) -> None:
        """The slot's draft cache row starts at the window of ``prompt`` (empty)."""
        skip = max(0, len(prompt) - self.window) if self.window else 0
        self.skip[slot] = skip
        self.cache.lengths[slot] = skip
        self.cache.starts[slot] = skip

    def window_swap(self, i: int, j: int) -> None:
        """Exchange two slots' skips (their cache rows are swapped by the caller)."""
        self.skip[i], self.skip[j] = self.skip[j], self.skip[i]

    def window_pairs(self, ch: Any, f: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, List[int],
                                                            torch.Tensor, List[int]]:
        """A prefill chunk's pairs inside each row's window, left-aligned per row: (tokens [m, c], features f
        [m, c, F] gathered alike, valid [m, c], pairs per row on the host and the device, draft cache length per
        row before them). Unchanged tensors when no row drops any."""
        skips = [self.skip[ch.lo + i] if r is not None else 0 for i, r in enumerate(ch.rows)]
        drop = [min(max(s - b, 0), c) for s, b, c in zip(skips, ch.before, ch.counts)]
        lengths = [max(b, s) for b, s in zip(ch.before, skips)]
        if not any(drop):
            return ch.next_ids, f, ch.valid, list(ch.counts), ch.counts_dev, lengths
        counts = [c - d for c, d in zip(ch.counts, drop)]
        n = max(max(counts), 1)
        dev = ch.next_ids.device
        idx = (torch.arange(n, device=dev)[None] + tensor(drop, dev)[:, None]).clamp(max=ch.next_ids.shape[1] - 1)
        tok = ch.next_ids.gather(1, idx)
        f = f.gather(1, idx[:, :, None].expand(-1, -1, f.shape[-1]))
        counts_dev = tensor(counts, dev)
        val = torch.arange(n, device=dev)[None] < counts_dev[:, None]
        return tok, f, val, counts, counts_dev, lengths
