"""The generation engine: KV caches, left-padded prefill, tree/chain verification with lossless acceptance.

One loop serves every method. Each step a *proposer* (see :mod:`nemo_spec.inference.speculative`) returns
a draft tree per row; the target verifies ``[last token, draft nodes]`` in ONE forward with a tree mask and
tree positions, writing every candidate into the cache; the accepted path is kept (``KVCache.keep``) and
each row advances by its own accepted length (ragged batches). Plain autoregressive decoding is the
empty tree.
"""
from __future__ import annotations

import logging
import resource
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from nemo_spec.models import GPTOutput, KVCache, gpt_forward, model_config, new_kv_cache, unwrap
from nemo_spec.inference.sampling import (RowRNG, SamplingError, SamplingParams, greedy_tree_accept, sample_from,
                                          tree_accept, warp_rows)
from nemo_spec.inference.trees import ancestor_mask, block_context, children_lists, prefill_context

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
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    valid: torch.Tensor
    q: Optional[torch.Tensor] = None

    @staticmethod
    def empty(b: int, device: torch.device) -> "DraftTree":
        """No draft (plain autoregressive step)."""
        z = torch.zeros(b, 0, dtype=torch.long, device=device)
        return DraftTree(z, z.clone(), z.bool())


@dataclass
class StepResult:
    """What verification accepted: per row block indices kept (root first), emitted tokens, and the target output."""

    out: GPTOutput
    paths: List[List[int]]
    emitted: List[List[int]]


def tau_of(accepted: Sequence[int]) -> float:
    """Acceptance length: tokens per decoding step (accepted drafts + the target's token), prefill excluded,
    as the EAGLE / Medusa papers and reference code report it; 1.0 when there was no decoding step."""
    return (sum(accepted) + len(accepted)) / len(accepted) if accepted else 1.0


class BatchState:
    """Per-call state shared by the engine and its proposer."""

    def __init__(self, prompts: List[List[int]], params: List[SamplingParams], max_pos: int) -> None:
        self.prompts = prompts
        self.params = params
        self.b = len(prompts)
        self.max_pos = max_pos
        self.seqs: List[List[int]] = [list(p) for p in prompts]  # prompt + every accepted token (incl. pending)
        self.out: List[List[int]] = [[] for _ in prompts]
        self.produced = [0] * self.b
        self.finish: List[Optional[str]] = [None] * self.b
        self.rng = RowRNG([p.seed for p in params])
        self.target_forwards = [0] * self.b
        self.draft_forwards = [0] * self.b
        self.accept_hist: List[List[int]] = [[] for _ in prompts]
        self.pending: Optional[torch.Tensor] = None
        self.text: List[Optional[str]] = [None] * self.b

    @property
    def active(self) -> List[bool]:
        """Rows still generating."""
        return [f is None for f in self.finish]

    def active_rows(self) -> List[int]:
        """Indices of rows still generating."""
        return [r for r, f in enumerate(self.finish) if f is None]

    def count_draft(self, n: int = 1) -> None:
        """Charge n draft forwards to every active row."""
        for r in self.active_rows():
            self.draft_forwards[r] += n

    def active_tensor(self, device: torch.device) -> torch.Tensor:
        """Bool [b] of active rows."""
        return torch.tensor(self.active, dtype=torch.bool, device=device)


class Engine:
    """Runs the target model and owns the KV caches reused across calls (reset on reuse, re-created on shape change).

    The engine refers to its model weakly: it is cached per model (``generate.get_engine``) and must not keep
    an unloaded model, or its caches, alive.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        from nemo_spec.models.foreign import require_project_spec

        require_project_spec(unwrap(model), "generation")  # up front: never a silently wrong forward
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
        """A reset cache for (key, batch, >= max_len); a new one when batch size, length, layout, dtype or device change."""
        c = self.caches.get(key)
        if c is not None and c.batch_size == batch_size and c.max_len >= max_len:
            probe = factory(1, 1)  # what the model needs now (layers, heads, head dim, dtype, device)
            if (c.k.shape[0] == probe.k.shape[0] and c.k.shape[3:] == probe.k.shape[3:]
                    and c.k.dtype == probe.k.dtype and c.k.device == probe.k.device):
                c.reset()
                return c
        if c is not None:
            log.debug("re-creating KV cache %s: batch %d->%d, length %d->%d", key, c.batch_size, batch_size,
                      c.max_len, max_len)
        self.caches.pop(key, None)
        c = factory(batch_size, max_len)
        self.caches[key] = c
        return c

    # -- validation -------------------------------------------------------------------------------

    def check_inputs(self, prompts: Sequence[Sequence[int]], params: List[SamplingParams], lookahead: int,
                     max_cache_len: Optional[int], tokenizer: Any) -> None:
        """Raise SamplingError for empty/oversized prompts, bad token ids, budgets over the context or cache."""
        if not prompts:
            raise SamplingError("prompts must be a non-empty list of token-id lists")
        V, ctx = self.cfg.vocab_size, self.cfg.max_position_embeddings
        for r, (pr, sp) in enumerate(zip(prompts, params)):
            if len(pr) == 0:
                raise SamplingError(f"prompt {r} is empty; give at least one token (e.g. BOS)")
            if len(pr) >= ctx:
                raise SamplingError(f"prompt {r} has {len(pr)} tokens, longer than the model context "
                                    f"(max_position_embeddings={ctx}) minus one generated token")
            bad = [t for t in pr if not 0 <= int(t) < V]
            if bad:
                raise SamplingError(f"prompt {r} has token ids outside [0, {V}): {bad[:5]}")
            if len(pr) + sp.max_new_tokens > ctx:
                raise SamplingError(f"prompt {r}: {len(pr)} prompt tokens + max_new_tokens={sp.max_new_tokens} "
                                    f"exceeds the model context max_position_embeddings={ctx}")
            if sp.stop_strings and tokenizer is None:
                raise SamplingError(f"request {r} has stop_strings {sp.stop_strings!r} but no tokenizer was given")
        if max_cache_len is not None:
            need = max(len(p) for p in prompts) + max(p.max_new_tokens for p in params) + lookahead + 1
            if need > max_cache_len:
                raise SamplingError(f"max_new_tokens={max(p.max_new_tokens for p in params)} does not fit the KV "
                                    f"cache: needs {need} slots (prompt + new tokens + {lookahead} draft slots), "
                                    f"max_cache_len={max_cache_len}")

    # -- forward passes ----------------------------------------------------------------------------

    def prefill(self, st: BatchState, pad_id: int, extra_len: int, aux_layers: Sequence[int]):
        """Left-padded prefill of all prompts; returns (tokens [b, P], lengths [b], output)."""
        b, dev = st.b, self.device
        P = max(len(p) for p in st.prompts)
        lens = torch.tensor([len(p) for p in st.prompts], dtype=torch.long, device=dev)
        tokens = torch.full((b, P), pad_id, dtype=torch.long, device=dev)
        for r, p in enumerate(st.prompts):
            tokens[r, P - len(p):] = torch.tensor(p, dtype=torch.long, device=dev)
        need = P + max(p.max_new_tokens for p in st.params) + extra_len + 1
        cache = self.cache("target", b, need, lambda bb, ll: new_kv_cache(self.model, bb, ll))
        self.kv = cache
        ctx = prefill_context(cache, lens, P)
        out = gpt_forward(self.target, tokens, ctx, aux_layers=aux_layers, last_logits_only=True)
        cache.lengths.fill_(P)
        for r in range(b):
            st.target_forwards[r] += 1
        return tokens, lens, out, need

    def pick(self, st: BatchState, logits: torch.Tensor) -> torch.Tensor:
        """Choose one token per row from logits [b, V] (argmax for greedy rows, seeded sampling otherwise)."""
        tok = logits.argmax(-1)
        samp = [r for r, p in enumerate(st.params) if not p.greedy]
        if samp:
            idx = torch.tensor(samp, device=logits.device)
            probs = warp_rows(logits[idx], [st.params[r] for r in samp])
            u = st.rng.uniform(1, samp)[:, 0]
            tok[idx] = sample_from(probs, u.to(probs.device))
        return tok

    def verify(self, st: BatchState, tree: DraftTree, aux_layers: Sequence[int]) -> StepResult:
        """One target forward over [pending, draft nodes]; accept per row; keep the accepted path in the cache."""
        b, dev = st.b, self.device
        n = tree.tokens.shape[1]
        blk_tok = torch.cat([st.pending[:, None], tree.tokens.to(dev)], 1)
        blk_par = torch.cat([torch.full((b, 1), -1, dtype=torch.long, device=dev), tree.parents.to(dev)], 1)
        blk_val = torch.cat([torch.ones(b, 1, dtype=torch.bool, device=dev), tree.valid.to(dev)], 1)
        anc, depth = ancestor_mask(blk_par, blk_val)
        ctx = block_context(self.kv, anc, depth, self.cfg.max_position_embeddings)
        out = gpt_forward(self.target, blk_tok, ctx, aux_layers=aux_layers)
        logits = out.logits
        active = st.active_rows()
        tok_l, par_l, val_l = blk_tok.tolist(), blk_par.tolist(), blk_val.tolist()
        greedy_rows = [r for r in active if st.params[r].greedy]
        samp_rows = [r for r in active if not st.params[r].greedy]
        argmax = logits.argmax(-1).tolist() if greedy_rows else None
        if samp_rows:
            sidx = torch.tensor(samp_rows, device=dev)
            probs = warp_rows(logits[sidx], [st.params[r] for r in samp_rows]).cpu()
            qs = None if tree.q is None else tree.q[sidx].float().cpu()
            # each row draws uniforms for its own draft size only, so a seeded row does not depend on its batch
            us = {r: st.rng.uniform(sum(val_l[r]) + 1, [r])[0].tolist() for r in samp_rows}
            srow = {r: i for i, r in enumerate(samp_rows)}
        paths: List[List[int]] = [[] for _ in range(b)]
        emitted: List[List[int]] = [[] for _ in range(b)]
        for r in active:
            kids = children_lists(par_l[r], val_l[r])
            if st.params[r].greedy:
                path, nxt = greedy_tree_accept(argmax[r], tok_l[r], kids)
            else:
                i = srow[r]
                path, nxt = tree_accept(probs[i], tok_l[r], kids, None if qs is None else qs[i], iter(us[r]))
            paths[r] = [0] + path
            emitted[r] = [tok_l[r][i] for i in path] + [nxt]
            st.target_forwards[r] += 1
            st.accept_hist[r].append(len(path))
        kmax = max(len(p) for p in paths)
        src = torch.zeros(b, max(kmax, 1), dtype=torch.long, device=dev)
        num = torch.zeros(b, dtype=torch.long, device=dev)
        for r in active:
            src[r, : len(paths[r])] = torch.tensor(paths[r], device=dev)
            num[r] = len(paths[r])
        self.kv.keep(self.kv.lengths[:, None] + src, num)
        return StepResult(out=out, paths=paths, emitted=emitted)

    def retire(self, r: int) -> None:
        """Drop a finished row's cache entries so it no longer widens the attention window."""
        self.kv.lengths[r] = self.kv.starts[r]

    # -- bookkeeping --------------------------------------------------------------------------------

    def emit(self, st: BatchState, r: int, toks: List[int], tokenizer: Any, on_tokens: Optional[OnTokens],
             stops: List[set], on_finish: Optional[OnFinish] = None) -> None:
        """Append accepted tokens to row r, applying stop tokens/strings, budgets and the streaming callbacks."""
        sp = st.params[r]
        new: List[int] = []
        for t in toks:
            st.produced[r] += 1
            if t in stops[r]:
                st.finish[r] = "stop"
                break
            st.out[r].append(t)
            new.append(t)
            if len(st.out[r]) >= sp.max_new_tokens or len(st.prompts[r]) + len(st.out[r]) >= st.max_pos:
                st.finish[r] = "length"
                break
        st.seqs[r].extend(toks)
        if sp.stop_strings and tokenizer is not None and new:
            text = tokenizer.decode(st.out[r])
            if any(s in text for s in sp.stop_strings):
                # keep tokens only up to the one completing the stop string (same result as one-token steps)
                first = len(st.out[r]) - len(new)
                for k in range(first + 1, len(st.out[r]) + 1):
                    text = tokenizer.decode(st.out[r][:k])
                    if any(s in text for s in sp.stop_strings):
                        break
                del new[len(new) - (len(st.out[r]) - k):]
                del st.out[r][k:]
                st.finish[r] = "stop"
                st.text[r] = text[: min(text.find(s) for s in sp.stop_strings if s in text)]
        if on_tokens is not None and new:
            if on_tokens(r, new) is False and st.finish[r] is None:
                st.finish[r] = "cancelled"
        if on_finish is not None and st.finish[r] in ("stop", "length"):
            on_finish(r, st.finish[r])


def peak_memory_bytes(device: torch.device) -> int:
    """Peak accelerator memory (CUDA) or peak resident set size of this process (CPU)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def run_generation(engine: Engine, proposer: Any, prompts: List[List[int]], params: List[SamplingParams],
                   options: Dict[str, Any], tokenizer: Any = None,
                   on_tokens: Optional[OnTokens] = None,
                   on_finish: Optional[OnFinish] = None) -> List[GenerationResult]:
    """Generate for a batch with the given proposer (one loop for every method)."""
    cfg = engine.cfg
    engine.check_inputs(prompts, params, proposer.lookahead, options.get("max_cache_len"), tokenizer)
    pad_id = options.get("pad_id", cfg.pad_token_id if cfg.pad_token_id is not None else 0)
    if not 0 <= int(pad_id) < cfg.vocab_size:
        raise SamplingError(f"pad_id={pad_id} is outside the vocabulary [0, {cfg.vocab_size})")
    eos = [] if options.get("ignore_eos") or cfg.eos_token_id is None else [cfg.eos_token_id]
    stops = [set(p.stop_token_ids) | set(eos) for p in params]
    st = BatchState(prompts, params, cfg.max_position_embeddings)
    dev = engine.device
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
        torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    aux = proposer.aux_layers
    with torch.inference_mode():
        tokens, lens, out, need = engine.prefill(st, int(pad_id), proposer.lookahead, aux)
        first = engine.pick(st, out.logits[:, -1])
        st.pending = first
        proposer.prefill(engine, st, tokens, lens, out, need)
        t_first = time.perf_counter()
        for r, t in enumerate(first.tolist()):
            engine.emit(st, r, [t], tokenizer, on_tokens, stops, on_finish)
        while st.active_rows():
            tree = proposer.propose(engine, st)
            res = engine.verify(st, tree, aux)
            nxt = st.pending.clone()
            for r in st.active_rows():
                nxt[r] = res.emitted[r][-1]
            proposer.accepted(engine, st, res)
            st.pending = nxt
            for r in st.active_rows():
                engine.emit(st, r, res.emitted[r], tokenizer, on_tokens, stops, on_finish)
                if st.finish[r] is not None:
                    engine.retire(r)
                    proposer.retire(r)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    elapsed = time.perf_counter() - t0
    peak = peak_memory_bytes(dev)
    results = []
    for r in range(st.b):
        hist: List[int] = [0] * (max(st.accept_hist[r], default=0) + 1)
        for m in st.accept_hist[r]:
            hist[m] += 1
        stats = {
            "method": proposer.name,
            "prompt_tokens": len(prompts[r]),
            "new_tokens": len(st.out[r]),
            "target_forwards": st.target_forwards[r],
            "draft_forwards": st.draft_forwards[r],
            "decode_steps": len(st.accept_hist[r]),
            "tau": tau_of(st.accept_hist[r]),
            "accept_hist": hist,
            "time_s": elapsed,
            "time_to_first_token_s": t_first - t0,
            "tokens_per_s": len(st.out[r]) / elapsed if elapsed > 0 else 0.0,
            "batch_tokens_per_s": sum(len(o) for o in st.out) / elapsed if elapsed > 0 else 0.0,
            "peak_memory_bytes": peak,
        }
        text = st.text[r]
        if text is None and tokenizer is not None:
            text = tokenizer.decode(st.out[r])
        results.append(GenerationResult(tokens=st.out[r], finish_reason=st.finish[r] or "length", stats=stats,
                                        text=text))
    return results
