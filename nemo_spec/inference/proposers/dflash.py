"""DFlash proposer: a block of up to B - 1 draft tokens per step from ONE draft forward, verified as a chain.

Per slot the draft KV cache holds the injected context: the keys/values (each draft layer's k/v projection and
k_norm of hidden_norm(fc(base features)), RoPE at its position) of every position whose base features are known;
slot p holds position p. After a prefill chunk its prompt positions are injected; after a verification the
accepted path's positions (root + accepted drafts, whose base features the verification computed) are. The row's
last emitted token (the first generated token / the bonus token) is the block's anchor at position
``lengths`` = the number of injected positions, as in z-lab dflash/model.py:107-143 (draft cache cropped to
``start`` after every block) and vLLM 0.33.0 (context K/V stored before the query pass, v1/spec_decode/dflash.py:
272-295; queries = [next token, mask x K], dflash.py:122-127).

The block [anchor, MASK x k] attends to the row's context and to itself (not causal); slot j >= 1 gives draft
token j by argmax, as the reference drafts (model.py:121, also when the target samples). Drafts are therefore
deterministic: the tree carries no q (one-hot q), under which the engine's rejection rule accepts draft x with
probability p(x) and resamples from p without x: lossless.

Under adaptive speculation a step at level 0 drafts nothing, so injecting its position is put off, as EAGLE's
catch-up is (``lazy_draft_steps``, :mod:`~.eagle`): each row's base features of such steps wait in a per-slot
buffer and are injected in one ``write_context`` when a later step drafts (or the buffer is full), so a level-0
step costs what an AR step costs; the controller is charged the deferred work at level 0. A prompt's injection
waits the same way for the row's first drafting step, and a row whose prompt still waits when the buffer fills
adds its buffered positions to it, so rows the controller never drafts for cost the draft nothing.

``dflash_tree`` (beyond the references, which verify the chain): the block's per-slot distributions expanded into
a static tree of top-k ranks (:class:`~.common.StaticTree`, option ``tree_choices``, default
:func:`~nemo_spec.inference.trees.parallel_tree_choices`), still one draft forward per step; distinct
deterministic siblings are verified losslessly by the same rule.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Dict, List, Optional, Tuple

import torch

from nemo_spec.inference.engine import DraftTree, PrefillChunk, StepResult, StepState
from nemo_spec.inference.sampling import SamplingError
from nemo_spec.inference.proposers.base import SpecModelProposer
from nemo_spec.inference.proposers.common import (DEFAULT_LAZY_DRAFT_STEPS, ParallelLevels, column_chunks, opt_int,
                                                  swap_rows, take_waiting)
from nemo_spec.inference.transfer import tensor
from nemo_spec.models import model_config

log = logging.getLogger(__name__)


class DFlashProposer(ParallelLevels, SpecModelProposer):
    """Block drafting with a DFlash draft: a chain of up to ``num_draft_tokens`` (default B - 1) per forward."""

    name = "dflash"
    defers_level0 = True

    def __init__(self, model: torch.nn.Module, options: Dict[str, Any], tree: bool = False) -> None:
        super().__init__(model, ("dflash",))
        draft = self.spec.eagle_module
        self.trained = trained = int(self.spec.spec_config.block_size) - 1
        self.depth = opt_int(options, "num_draft_tokens", trained)
        if self.depth > trained:
            log.warning("dflash: num_draft_tokens=%d exceeds the %d mask slots the draft was trained with (block "
                        "size %d); the extra slots are untrained (output stays exact, acceptance drops)",
                        self.depth, trained, trained + 1)
        self.lookahead = self.depth
        if tree:
            self.use_tree(options, model_config(self.spec).vocab_size)
        self.extra_slots = self.depth + 2  # a verified path (<= depth + 1 positions) is injected past the end
        self.mask_token_id = int(draft.mask_token_id)
        self.max_pos = model_config(self.spec).max_position_embeddings
        self.last_tok: Optional[torch.Tensor] = None
        self.lazy_steps = opt_int(options, "lazy_draft_steps", DEFAULT_LAZY_DRAFT_STEPS, lo=0)
        self.deferred_f: Optional[torch.Tensor] = None  # [slots, lazy_steps, F]: base features of level-0 steps
        self.deferred_n: List[int] = []  # per slot: level-0 positions waiting in deferred_f
        self._deferring = False  # this step drafts nothing (level 0): accepted() defers the injection
        self._deferred_cost: Tuple[float, int, float] = (0.0, 0, 0.0)  # catch-up seconds, level-0 steps, prefill s
        self.prompt_f: List[List[Tuple[torch.Tensor]]] = []  # per slot: (base features [c, F],) of prompt chunks
        self.chunk_tokens = 1 << 30

    def draft_forwards(self, level: int) -> int:
        """One block forward per step (none at level 0)."""
        return 1 if self.level_nodes(level) > 0 else 0

    def take_deferred_cost(self) -> Tuple[float, int, float]:
        """(seconds, level-0 steps, prefill seconds) of the deferred injections run since the last call."""
        out, self._deferred_cost = self._deferred_cost, (0.0, 0, 0.0)
        return out

    # ---- slots ---------------------------------------------------------------------------------------------
    def setup(self, sess: Any) -> None:
        """The draft KV cache of injected context and each slot's anchor token."""
        self.cache = sess.cache(("dflash", id(self.spec)), sess.slots, sess.slot_len + self.extra_slots,
                                lambda bb, ll: self.spec.new_draft_cache(bb, ll))
        self.slots = sess.slots
        self.last_tok = torch.zeros(sess.slots, dtype=torch.long, device=sess.device)
        self.deferred_f = None
        self.deferred_n = [0] * sess.slots
        self._deferring = False
        self._deferred_cost = (0.0, 0, 0.0)
        self.prompt_f = [[] for _ in range(sess.slots)]
        self.chunk_tokens = int(getattr(sess, "prefill_chunk_tokens", 1 << 30))  # positions one catch-up write takes

    def admit(self, sess: Any, slot: int, row: Any) -> None:
        """Empty the slot's injected context."""
        self.cache.lengths[slot] = 0
        self.cache.starts[slot] = 0
        self.deferred_n[slot] = 0
        self.prompt_f[slot] = []

    def release(self, sess: Any, slot: int, row: Any) -> None:
        """Forget the slot's deferred positions (the cache row is reset on admit)."""
        self.deferred_n[slot] = 0
        self.prompt_f[slot] = []

    def swap(self, i: int, j: int, used: int) -> None:
        """Exchange the two slots' context rows, anchors and deferred positions."""
        self.cache.swap_rows(i, j, used + self.extra_slots)
        swap_rows(self.last_tok, i, j)
        swap_rows(self.deferred_f, i, j)
        self.deferred_n[i], self.deferred_n[j] = self.deferred_n[j], self.deferred_n[i]
        self.prompt_f[i], self.prompt_f[j] = self.prompt_f[j], self.prompt_f[i]

    # ---- context injection -----------------------------------------------------------------------------------
    def prefill(self, sess: Any, ch: PrefillChunk) -> None:
        """Inject the chunk's prompt positions (under adaptive speculation: keep them for the row's first drafting
        step); a completed prompt's first generated token becomes its anchor."""
        if self.lazy_steps > 0 and getattr(sess, "adaptive", None) is not None:
            feats = self.spec.base_features(ch.out)
            for i, c in enumerate(ch.counts):
                if c:
                    self.prompt_f[ch.lo + i].append((feats[i, :c].clone(),))
        else:
            fused = self.features(ch.out)
            self.spec.eagle_module.write_context(self.cache.view(ch.lo, ch.hi), fused,
                                                 tensor(ch.counts, fused.device))
        for i, (f, c) in enumerate(zip(ch.final, ch.counts)):
            if f and c > 0:
                self.last_tok[ch.lo + i] = ch.next_ids[i, c - 1]

    def accepted(self, sess: Any, st: StepState, res: StepResult) -> None:
        """Inject the verified path's positions (root + accepted drafts); the bonus token becomes the anchor.
        After a level-0 step (every path is its root) the position's base features wait for a later injection."""
        b = st.b
        if self._deferring:
            self._defer(b, self.spec.base_features(res.out)[:, 0])
        else:
            path_feats = self.path_features(res)
            self.spec.eagle_module.write_context(self.cache.view(0, b), path_feats,
                                                 tensor([len(p) for p in res.paths], path_feats.device))
        self.last_tok[:b] = tensor([em[-1] for em in res.emitted], self.last_tok.device)

    def _defer(self, b: int, f: torch.Tensor) -> None:
        """Keep each decode row's base features [b, F] (before the draft's fc) of a level-0 step. Once the buffer
        is full, the rows whose prompt still waits (never drafted for) add their buffered positions to it, to be
        injected with the prompt when the row first drafts (never, if it never does: such a row costs an AR row;
        it holds at most the features of every position of its slot), and the other rows' are injected."""
        if self.deferred_f is None:
            self.deferred_f = f.new_zeros(self.slots, self.lazy_steps, f.shape[-1])
        if max(self.deferred_n[:b]) >= self.lazy_steps:
            for r in range(b):
                if self.prompt_f[r] and self.deferred_n[r]:
                    self.prompt_f[r].append((self.deferred_f[r, :self.deferred_n[r]].clone(),))
                    self.deferred_n[r] = 0
            self._catch_up(b, prompts=False)
        n = self.deferred_n[:b]
        self.deferred_f[torch.arange(b, device=f.device), tensor(n, f.device)] = f
        for r in range(b):
            self.deferred_n[r] += 1

    def _catch_up(self, b: int, prompts: bool = True) -> None:
        """Inject every decode row's deferred positions, in order: its waiting prompt (one write over the slots
        that have one), then its level-0 steps' (one write; they follow the row's injected context). ``prompts``
        False: the level-0 steps' only (of rows whose prompt does not wait: a full buffer's, see :meth:`_defer`)."""
        t0 = time.perf_counter()
        waiting = take_waiting(self.prompt_f, b) if prompts else None
        if waiting is not None:  # over the slots that have one, at most chunk_tokens positions per write
            lo, hi, prompt, rows = waiting
            for _, cj, (feats,) in column_chunks(rows, prompt, self.chunk_tokens):
                self.spec.eagle_module.write_context(self.cache.view(lo, hi), self.spec.fuse(feats),
                                                     tensor(cj, feats.device))
        # the prompts, with the level-0 positions a full buffer added to a waiting prompt (see _defer): draft
        # prefill, not level-0 work (injecting them is the price of a row's first drafting step)
        pre = time.perf_counter() - t0
        n = self.deferred_n[:b]
        K = max(n)
        if K:
            fused = self.spec.fuse(self.deferred_f[:b, :K])
            self.spec.eagle_module.write_context(self.cache.view(0, b), fused, tensor(n, fused.device))
            for r in range(b):
                self.deferred_n[r] = 0
        s, k, p = self._deferred_cost
        self._deferred_cost = (s + time.perf_counter() - t0 - pre, k + K, p + pre)

    # ---- the one forward ---------------------------------------------------------------------------------------
    def propose(self, sess: Any, st: StepState, level: Optional[int] = None) -> DraftTree:
        """One forward over the whole trained block [anchor, MASK x (B - 1)] per row (or longer, when more draft
        tokens were asked for); argmax of slots 1..k is the chain."""
        from nemo_spec.speculative.dflash import DFlashContext

        dev = sess.device
        b = st.b
        k = self.level_depth(level)
        self._deferring = k == 0 and self.lazy_steps > 0
        if k == 0:
            return DraftTree.empty(b, dev)
        if any(self.deferred_n[:b]) or any(self.prompt_f[:b]):
            self._catch_up(b)
        # The block is never shorter than the one the draft was trained with: its slots attend to each other
        # (bidirectionally), so [anchor, MASK x k] with k < B - 1 changes every slot's prediction (acceptance fell
        # from tau 4 to ~1.7 on the quickstart's draft). Fewer draft tokens = the same block, its first k slots.
        n = max(k, self.trained)
        view = self.cache.view(0, b)
        tok = torch.full((b, n + 1), self.mask_token_id, dtype=torch.long, device=dev)
        tok[:, 0] = self.last_tok[:b]
        pos = (view.lengths[:, None] + torch.arange(n + 1, device=dev)[None]).clamp(max=self.max_pos - 1)
        # every row's context is injected up to its target cache length (st.lengths, host-side): no device read
        ctx = DFlashContext(position_ids=pos, cache=view, kv_len=max(st.lengths[:b]))
        _, logits = self.spec.eagle_module(self.spec.gpt, tok, ctx, head_rows=slice(1, k + 1))
        st.count_draft(1)
        if self.tree is not None:
            return self.tree.draft(logits, self.level_nodes(level))
        tokens = logits.argmax(-1)
        return DraftTree.chains(tokens, torch.ones_like(tokens, dtype=torch.bool))

    def check_row(self, prompt, sp) -> None:
        """Any row the target serves."""
        if not prompt:
            raise SamplingError("dflash: empty prompt")
