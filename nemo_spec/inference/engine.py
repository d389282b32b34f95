"""The generation engine: KV caches, tree/chain verification with lossless acceptance on the device.

One loop serves every method (:class:`nemo_spec.inference.session.Session`). Each step a *proposer* (see
:mod:`nemo_spec.inference.proposers`) returns a draft tree per row; the target verifies
``[last token, draft nodes]`` in ONE forward with a tree mask and tree positions, writing every candidate into
the cache; every row's accepted path is found at once on the device (:func:`sampling.tree_accept_rows`), kept
in the cache (``KVCache.keep``) and each row advances by its own accepted length (ragged batches). Only the
accepted token ids come back to the host. Plain autoregressive decoding is the empty tree.
"""
from __future__ import annotations

import logging
import resource
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from nemo_spec.models import GPTOutput, KVCache, fastpath, gpt_forward, model_config, unwrap
from nemo_spec.inference.sampling import (RowRNG, SamplingError, SamplingParams, sample_from, tree_accept_rows,
                                          warp_rows)
from nemo_spec.inference.transfer import allowed_sync, h2d
from nemo_spec.inference.trees import ancestor_mask, block_context, decode_context

log = logging.getLogger(__name__)

OnTokens = Callable[[int, List[int]], Optional[bool]]
#: called once when a row ends by itself: (row, "stop" | "length"), right after its last tokens were streamed
OnFinish = Callable[[int, str], None]


@dataclass
class GenerationResult:
    """Generated token ids of one request, why it stopped, its text (with a tokenizer) and stats."""

    tokens: List[int]
    finish_reason: str  # "stop" | "length" | "cancelled"
    stats: Dict[str, Any] = field(default_factory=dict)
    text: Optional[str] = None


@dataclass
class DraftTree:
    """Draft nodes per row: tokens [b, n], parents [b, n] as block indices (0 = root), valid [b, n].

    ``q`` [b, n+1, V] optionally holds, for every block node, the (warped, base-vocab) distribution its
    children were sampled from; None means deterministic candidates (one-hot q).
    Host-side shape facts let verification run without reading the tree back: ``max_depth`` (deepest node),
    ``max_children`` (most children of one node) and ``sizes`` (valid nodes per row); None = worst case / read.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    valid: torch.Tensor
    q: Optional[torch.Tensor] = None
    max_depth: Optional[int] = None
    max_children: Optional[int] = None
    sizes: Optional[List[int]] = None

    @staticmethod
    def empty(b: int, device: torch.device) -> "DraftTree":
        """No draft (plain autoregressive step)."""
        z = torch.zeros(b, 0, dtype=torch.long, device=device)
        return DraftTree(z, z.clone(), z.bool(), max_depth=0, max_children=0, sizes=[0] * b)

    @staticmethod
    def chains(tokens: torch.Tensor, valid: torch.Tensor, sizes: Optional[List[int]] = None,
               q: Optional[torch.Tensor] = None) -> "DraftTree":
        """Right-padded chains [b, n] (node i's parent is node i - 1)."""
        from nemo_spec.inference.trees import chain_parents

        b, n = tokens.shape
        return DraftTree(tokens, chain_parents(b, n, tokens.device) + 1, valid, q, max_depth=n,
                         max_children=1 if n else 0, sizes=sizes if sizes is not None else [n] * b)


@dataclass
class StepResult:
    """What verification accepted: per row block indices kept (root first) and emitted tokens (host lists),
    the same on the device (path [b, D+1], count m [b] of accepted drafts) and the target output."""

    out: GPTOutput
    paths: List[List[int]]
    emitted: List[List[int]]
    path: Optional[torch.Tensor] = None
    accepted: Optional[torch.Tensor] = None


def tau_of(accepted: Sequence[int]) -> float:
    """Acceptance length: tokens per decoding step (accepted drafts + the target's token), prefill excluded,
    as the EAGLE / Medusa papers and reference code report it; 1.0 when there was no decoding step."""
    return (sum(accepted) + len(accepted)) / len(accepted) if accepted else 1.0


@dataclass
class PrefillChunk:
    """One target prefill forward over cache slots [lo, hi): right-padded prompt pieces and what came out.

    ``rows`` (None for a free slot in the span), ``counts`` prompt tokens of each row in this chunk, ``before``
    tokens each row had in the cache already, ``final`` whether its prompt is complete with this chunk;
    ``next_ids`` [m, c] the token after each position (the next prompt token, or the first generated one).
    """

    lo: int
    hi: int
    rows: List[Any]
    tokens: torch.Tensor
    valid: torch.Tensor
    counts: List[int]
    counts_dev: torch.Tensor
    before: List[int]
    final: List[bool]
    final_dev: torch.Tensor
    next_ids: Optional[torch.Tensor] = None
    out: Optional[GPTOutput] = None

    def count_draft(self, n: int = 1) -> None:
        """Charge n draft forwards to every row of the chunk."""
        for r in self.rows:
            if r is not None:
                r.draft_forwards += n


class StepState:
    """The rows of one decode step as the proposers see them (row i = cache row i of the step's view)."""

    def __init__(self, rows: Sequence[Any], max_pos: int) -> None:
        self.rows = list(rows)
        self.b = len(self.rows)
        self.max_pos = max_pos
        self.prompts = [r.prompt for r in self.rows]
        self.params: List[SamplingParams] = [r.params for r in self.rows]
        self.seqs: List[List[int]] = [r.seq for r in self.rows]
        self.lengths: List[int] = [r.length for r in self.rows]  # committed target cache entries (host)
        self.rng = RowRNG(gens=[r.gen for r in self.rows])
        self.pending: Optional[torch.Tensor] = None

    @property
    def active(self) -> List[bool]:
        """Every row of a step is generating."""
        return [True] * self.b

    def active_rows(self) -> List[int]:
        """Indices of the rows."""
        return list(range(self.b))

    def count_draft(self, n: int = 1) -> None:
        """Charge n draft forwards to every row."""
        for r in self.rows:
            r.draft_forwards += n

    def active_tensor(self, device: torch.device) -> torch.Tensor:
        """Bool [b] of active rows (all)."""
        return torch.ones(self.b, dtype=torch.bool, device=device)


#: kept for importers of the old name
BatchState = StepState


def pooled_cache(pool: Dict[Any, KVCache], key: Any, batch_size: int, max_len: int,
                 factory: Callable[[int, int], KVCache]) -> KVCache:
    """A reset cache for (key, batch, >= max_len) from ``pool``; a new one (replacing it in the pool) when batch
    size, length, layout, dtype or device change."""
    c = pool.get(key)
    if c is not None and c.batch_size == batch_size and c.max_len >= max_len:
        probe = factory(1, 1)  # what the model needs now (layers, heads, head dim, dtype, device)
        if (c.k.shape[0] == probe.k.shape[0] and c.k.shape[3:] == probe.k.shape[3:]
                and c.k.dtype == probe.k.dtype and c.k.device == probe.k.device):
            c.reset()
            return c
    if c is not None:
        log.debug("re-creating KV cache %s: batch %d->%d, length %d->%d", key, c.batch_size, batch_size,
                  c.max_len, max_len)
    pool.pop(key, None)
    c = factory(batch_size, max_len)
    pool[key] = c
    return c


class Engine:
    """Runs the target model and owns the KV caches reused across calls (reset on reuse, re-created on shape change).

    The engine refers to its model weakly: it is cached per model (``generate.get_engine``) and must not keep
    an unloaded model, or its caches, alive.
    """

    #: plain decode steps (empty trees) take :meth:`decode_one`; False runs them through the tree machinery
    plain_decode = True

    def __init__(self, model: torch.nn.Module) -> None:
        from nemo_spec.models.foreign import require_project_spec

        require_project_spec(unwrap(model), "generation")  # up front: never a silently wrong forward
        fastpath.register(model)  # its small-row CPU kernels are timed over all its weights (draft included)
        self._model = weakref.ref(model)
        self._target = weakref.ref(unwrap(model))
        self.cfg = model_config(model)
        self.caches: Dict[Any, KVCache] = {}

    @staticmethod
    def _alive(ref: "weakref.ReferenceType[torch.nn.Module]") -> torch.nn.Module:
        m = ref()
        if m is None:
            raise RuntimeError("the engine's model has been freed")
        return m

    @property
    def model(self) -> torch.nn.Module:
        """The model this engine generates with (as passed in, possibly a wrapper)."""
        return self._alive(self._model)

    @property
    def target(self) -> torch.nn.Module:
        """The unwrapped megatron GPTModel of :attr:`model`."""
        return self._alive(self._target)

    @property
    def device(self) -> torch.device:
        """Where the target model lives now (read on every use: the model may have been moved)."""
        return next(self.target.parameters()).device

    def cache(self, key: Any, batch_size: int, max_len: int, factory: Callable[[int, int], KVCache]) -> KVCache:
        """The engine's shared cache for ``key`` (see :func:`pooled_cache`): generate() calls on one model reuse
        it, one call after the other."""
        return pooled_cache(self.caches, key, batch_size, max_len, factory)

    # -- validation -------------------------------------------------------------------------------

    def check_row(self, r: int, prompt: Sequence[int], sp: SamplingParams, lookahead: int, slot_len: Optional[int],
                  max_cache_len: Optional[int], tokenizer: Any) -> None:
        """Raise SamplingError for an empty/oversized prompt, bad token ids, a budget over the context or cache."""
        V, ctx = self.cfg.vocab_size, self.cfg.max_position_embeddings
        if len(prompt) == 0:
            raise SamplingError(f"prompt {r} is empty; give at least one token (e.g. BOS)")
        if len(prompt) >= ctx:
            raise SamplingError(f"prompt {r} has {len(prompt)} tokens, longer than the model context "
                                f"(max_position_embeddings={ctx}) minus one generated token")
        bad = [t for t in prompt if not 0 <= int(t) < V]
        if bad:
            raise SamplingError(f"prompt {r} has token ids outside [0, {V}): {bad[:5]}")
        if len(prompt) + sp.max_new_tokens > ctx:
            raise SamplingError(f"prompt {r}: {len(prompt)} prompt tokens + max_new_tokens={sp.max_new_tokens} "
                                f"exceeds the model context max_position_embeddings={ctx}")
        if sp.stop_strings and tokenizer is None:
            raise SamplingError(f"request {r} has stop_strings {sp.stop_strings!r} but no tokenizer was given")
        tokens = len(prompt) + sp.max_new_tokens
        extra = lookahead + 1  # a step writes its drafts (and the bonus token) past the row's tokens
        what = f"prompt {r}: {len(prompt)} prompt tokens + max_new_tokens={sp.max_new_tokens} = {tokens} tokens"
        if max_cache_len is not None and tokens + extra > max_cache_len:
            raise SamplingError(f"{what} do not fit the KV cache (max_cache_len={max_cache_len} holds "
                                f"{max_cache_len - extra} beside the {extra} slots a step's drafts use)")
        if slot_len is not None and tokens + extra > slot_len:  # slot_len = max_seq_len + extra (Session)
            raise SamplingError(f"{what} do not fit the session's KV cache (max_seq_len={slot_len - extra})")

    # -- forward passes ----------------------------------------------------------------------------

    def pick(self, st: StepState, logits: torch.Tensor, draws: int = 1) -> torch.Tensor:
        """Choose one token per row from logits [b, V] (argmax for greedy rows, seeded sampling otherwise);
        each sampled row draws ``draws`` uniforms from its generator and samples with the first."""
        tok = logits.argmax(-1)
        samp = [r for r, p in enumerate(st.params) if not p.greedy]
        if samp:
            probs = warp_rows(logits, st.params)
            u = torch.zeros(st.b)
            u[samp] = st.rng.uniform(draws, samp)[:, 0]
            smp = sample_from(probs, h2d(u, logits.device))
            mask = torch.zeros(st.b, dtype=torch.bool)
            mask[samp] = True
            tok = torch.where(h2d(mask, logits.device), smp, tok)
        return tok

    def verify(self, st: StepState, tree: DraftTree, aux_layers: Sequence[int], kv: KVCache,
               pending: torch.Tensor) -> StepResult:
        """One target forward over [pending, draft nodes]; accept every row on the device; keep the accepted
        path in the cache; one device -> host read of the accepted tokens."""
        b, dev = st.b, self.device
        n = tree.tokens.shape[1]
        if n == 0 and self.plain_decode:
            return self.decode_one(st, aux_layers, kv, pending)
        blk_tok = torch.cat([pending[:, None], tree.tokens.to(dev)], 1)
        blk_par = torch.cat([torch.full((b, 1), -1, dtype=torch.long, device=dev), tree.parents.to(dev)], 1)
        blk_val = torch.cat([torch.ones(b, 1, dtype=torch.bool, device=dev), tree.valid.to(dev)], 1)
        anc, depth = ancestor_mask(blk_par, blk_val)
        ctx = block_context(kv, anc, depth, self.cfg.max_position_embeddings, max_length=max(st.lengths))
        out = gpt_forward(self.target, blk_tok, ctx, aux_layers=aux_layers)
        m, path, nxt = accept_block(st, tree, out.logits, blk_tok, blk_par, blk_val, anc, depth)
        D = path.shape[1] - 1
        kv.keep(kv.lengths[:, None] + path, m + 1)
        emitted = torch.cat([blk_tok.gather(1, path[:, 1:]), torch.zeros(b, 1, dtype=torch.long, device=dev)], 1)
        emitted.scatter_(1, m[:, None], nxt[:, None])
        with allowed_sync():
            host = torch.cat([m[:, None], path, emitted], 1).tolist()  # the step's one device -> host read
        paths: List[List[int]] = []
        emits: List[List[int]] = []
        for r, h in enumerate(host):
            k = h[0]
            paths.append(h[1:2 + k])
            emits.append(h[2 + D: 3 + D + k])
            row = st.rows[r]
            row.target_forwards += 1
            row.accept_hist.append(k)
        return StepResult(out=out, paths=paths, emitted=emits, path=path, accepted=m)

    def decode_one(self, st: StepState, aux_layers: Sequence[int], kv: KVCache,
                   pending: torch.Tensor) -> StepResult:
        """The empty tree (a plain autoregressive step) without the tree machinery: the same tokens as
        :meth:`verify` of an empty tree (the same uniforms are drawn: the tree rule takes two per sampled row and
        samples the target's token with the first), in a fraction of its tensor ops. Session rows have no left
        padding (cache starts are 0)."""
        b, dev = st.b, self.device
        ctx = decode_context(kv, max(st.lengths), self.cfg.max_position_embeddings, unpadded=True)
        out = gpt_forward(self.target, pending[:, None], ctx, aux_layers=aux_layers)
        nxt = self.pick(st, out.logits[:, 0], draws=2)
        kv.lengths += 1
        with allowed_sync():
            toks = nxt.tolist()  # the step's one device -> host read
        for row in st.rows:
            row.target_forwards += 1
            row.accept_hist.append(0)
        zero = torch.zeros(b, dtype=torch.long, device=dev)
        return StepResult(out=out, paths=[[0] for _ in range(b)], emitted=[[t] for t in toks], path=zero[:, None],
                          accepted=zero)


def accept_block(st: StepState, tree: DraftTree, logits: torch.Tensor, blk_tok: torch.Tensor,
                 blk_par: torch.Tensor, blk_val: torch.Tensor, anc: torch.Tensor,
                 depth: torch.Tensor) -> "tuple[torch.Tensor, torch.Tensor, torch.Tensor]":
    """Accepted count [b], path [b, D+1] and next token [b] of every row, on the device (see tree_accept_rows)."""
    b, N = blk_tok.shape
    dev = blk_tok.device
    D = tree.max_depth if tree.max_depth is not None else N - 1
    K = tree.max_children if tree.max_children is not None else N - 1
    argmax = logits.argmax(-1)
    samp = [r for r, p in enumerate(st.params) if not p.greedy]
    if not samp:
        return greedy_accept(argmax, blk_tok, blk_par, blk_val, anc, depth, D)
    sizes = tree.sizes if tree.sizes is not None else (blk_val.sum(1) - 1).tolist()
    p = warp_rows(logits, st.params)  # greedy rows: one-hot argmax
    q = None if tree.q is None else tree.q.to(dev)
    u = torch.zeros(b, N + 1)
    for r in samp:
        # each row draws uniforms for its own draft size only, so a seeded row does not depend on its batch
        k = int(sizes[r]) + 2
        u[r, :k] = st.rng.uniform(k, [r])[0][: N + 1]
    mask = torch.zeros(b, dtype=torch.bool)
    mask[samp] = True
    return tree_accept_rows(blk_tok, blk_par, blk_val, D, K, argmax=argmax, p=p, q=q, u=h2d(u, dev),
                            sampled=h2d(mask, dev))


def greedy_accept(argmax: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor,
                  anc: torch.Tensor, depth: torch.Tensor,
                  max_depth: int) -> "tuple[torch.Tensor, torch.Tensor, torch.Tensor]":
    """Greedy matching of every row at once (a fixed number of tensor ops, no loop over nodes): a node is kept
    when it and all its ancestors are the first child matching their parent's target argmax."""
    b, N = tokens.shape
    dev = tokens.device
    rows = torch.arange(b, device=dev)
    has = valid & (parents >= 0)
    match = has & (tokens == argmax.gather(1, parents.clamp(min=0)))
    earlier = torch.ones(N, N, dtype=torch.bool, device=dev).tril(-1)
    dup = ((parents[:, :, None] == parents[:, None, :]) & match[:, None, :] & earlier[None]).any(-1)
    ok = match & ~dup
    ok[:, 0] = True
    good = ~(anc & ~ok[:, None, :]).any(-1)
    gd = torch.where(good, depth, torch.full_like(depth, -1))
    m = gd.max(-1).values
    last = gd.argmax(-1)
    node = torch.arange(N, device=dev)[None].expand(b, N)
    col = torch.where(good & (depth <= max_depth), depth, torch.full_like(depth, max_depth + 1))
    path = torch.zeros(b, max_depth + 2, dtype=torch.long, device=dev)
    path.scatter_(1, col, torch.where(good, node, torch.zeros_like(node)))
    return m, path[:, : max_depth + 1], argmax[rows, last]


def peak_memory_bytes(device: torch.device) -> int:
    """Peak accelerator memory (CUDA) or peak resident set size of this process (CPU)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


