"""P-EAGLE proposer: K draft tokens per step from ONE draft forward (parallel drafting, vLLM's layout).

Per slot the draft KV cache holds the committed pairs (f_t, x_{t+1}) of EAGLE. The pairs a step still owes the
draft (the accepted path of the last verification, whose last pair carries the bonus token; after prefill the
prompt's last pair with the first generated token) are kept *pending* and run in the next step's single forward,
followed by K-1 mask slots (feature fc(mask_hidden), token mask_token_id) at positions anchor+1..anchor+K-1, as
vLLM 0.33.0 lays them out (v1/spec_decode/utils.py:490-536). The forward is causal over the block; the bonus
pair's output gives draft token 1, mask slot d gives token d+1. The pairs become committed, the mask slots stay
uncommitted (the next block overwrites them). Each slot's next block lives in a persistent buffer whose entries
past the pending pairs always hold the mask slot (reset after every forward and on admission), so a step builds
no input tensors: the forward reads the buffer's first ``pending + K - 1`` entries as they are, and the draft
head runs on the K rows that draft only. With ``draft_prompt_tokens`` the draft reads only a prompt's last pairs
(:class:`~.common.PromptWindow`; by default the length it was trained on, when its checkpoint records it).

Each drafted token is drawn from its own distribution q_d (which does not depend on the tokens drafted before
it); verification by the shared rejection rule is lossless for any such q (speculative sampling needs only
that token d was drawn from the q_d it reports).

Under adaptive speculation a step at level 0 drafts nothing, so its pair joins the row's pending pairs instead of
being read by a forward of its own (``lazy_draft_steps``, as EAGLE's catch-up): a run of such steps is read by
the next drafting step's one forward (or by one forward once the buffer is full: it holds ``lazy_draft_steps``
pairs beyond a verification's depth + 1), so a level-0 step costs what an AR step costs. The deferred pairs ride
in the drafting forward, whose time the controller charges to the drafting level. The draft's prefill waits the
same way (as EAGLE's and DFlash's): a prompt's pairs are read before the row's first forward, over the slots that
have any and in column chunks of ``prefill_chunk_tokens``, and a row whose prompt still waits when the buffer fills
adds its pending pairs to it, so rows the controller never drafts for cost the draft nothing; that time is reported
as draft prefill (:meth:`take_deferred_cost`), not charged to a level.

``peagle_tree`` (beyond the references, which verify the chain): the same single forward's per-depth
distributions expanded into a static tree of top-k ranks (:class:`~.common.StaticTree`, option
``tree_choices``, default :func:`~nemo_spec.inference.trees.parallel_tree_choices`): deterministic candidates,
verified by the shared tree machinery, still one draft forward per step.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Dict, List, Optional, Tuple

import torch

from nemo_spec.models import model_config
from nemo_spec.inference.engine import DraftTree, PrefillChunk, StepResult, StepState
from nemo_spec.inference.sampling import SamplingError
from nemo_spec.inference.proposers.base import SpecModelProposer
from nemo_spec.inference.proposers.common import (DEFAULT_LAZY_DRAFT_STEPS, ParallelLevels, PromptWindow,
                                                  chain_block, choose, column_chunks, level_index, opt_int, stack_q,
                                                  swap_rows, take_waiting)
from nemo_spec.inference.transfer import tensor
from nemo_spec.inference.trees import pad_chains

log = logging.getLogger(__name__)


class PEagleProposer(ParallelLevels, PromptWindow, SpecModelProposer):
    """Parallel drafting with a P-EAGLE draft: a chain of up to ``num_draft_tokens`` tokens per forward."""

    name = "peagle"
    defers_level0 = True

    def __init__(self, model: torch.nn.Module, options: Dict[str, Any], tree: bool = False) -> None:
        super().__init__(model, ("peagle",))
        draft = self.spec.eagle_module
        trained = int(self.spec.spec_config.parallel_depth)
        self.depth = opt_int(options, "num_draft_tokens", trained)
        if self.depth > trained:
            log.warning("peagle: num_draft_tokens=%d exceeds the %d depths the draft was trained for; the deeper "
                        "slots are untrained (output stays exact, acceptance drops)", self.depth, trained)
        self.lookahead = self.depth
        # the mask slots past a row's end (pending pairs, deferred ones too, lie within the row's own positions)
        self.extra_slots = self.depth + 2
        self.mask_token_id = int(draft.mask_token_id)
        vd = int(self.spec.d2t.numel())
        self.d2t_ids = self.spec.draft_to_base_ids(torch.arange(vd, device=self.spec.d2t.device)).long()
        self.V = model_config(self.spec).vocab_size
        if tree:
            self.use_tree(options, vd)
        self.max_pos = model_config(self.spec).max_position_embeddings
        self.lazy_steps = opt_int(options, "lazy_draft_steps", DEFAULT_LAZY_DRAFT_STEPS, lo=0)
        # pending pairs (<= depth + 1 after a verification, + one per deferred level-0 step) + mask slots (<= depth - 1)
        self.width = 2 * self.depth + self.lazy_steps
        self._deferring = False  # this step drafts nothing and reads nothing (level 0): accepted() appends its pair
        self.blk_feat: Optional[torch.Tensor] = None  # [slots, width, h]: pending features, then fc(mask_hidden)
        self.blk_tok: Optional[torch.Tensor] = None  # [slots, width]: pending tokens, then mask_token_id
        self.mask_feat: Optional[torch.Tensor] = None
        self.pend_n: List[int] = []
        self.prompt_pairs: List[List[Tuple[torch.Tensor, torch.Tensor]]] = []  # per slot: (features, tokens) waiting
        self.unread: List[bool] = []  # per slot: the draft has read none of the row's pairs yet
        self.chunk_tokens = 1 << 30
        self._prefill_s = 0.0  # prompt pairs read by this step's forward (draft prefill, not the level's cost)
        self.init_window(options)  # the draft reads at most this many prompt pairs (0: all)

    def draft_forwards(self, level: int) -> int:
        """One forward per drafting step; at level 0 none while its pair can wait (one per step with
        ``lazy_draft_steps`` 0: the draft is caught up)."""
        return 0 if level_index(self.levels, level) == 0 and self.lazy_steps > 0 else 1

    def take_deferred_cost(self) -> Tuple[float, int, float]:
        """(0, 0, seconds of waiting prompt pairs read since the last call): deferred level-0 pairs ride in the
        drafting forward and are charged to its level."""
        out, self._prefill_s = (0.0, 0, self._prefill_s), 0.0
        return out

    # ---- slots ---------------------------------------------------------------------------------------------
    def setup(self, sess: Any) -> None:
        """The draft KV cache and the per-slot pending pairs."""
        self.cache = sess.cache(("peagle", id(self.spec)), sess.slots, sess.slot_len + self.extra_slots,
                                lambda bb, ll: self.spec.new_draft_cache(bb, ll))
        self.slots = sess.slots
        self.blk_feat = self.blk_tok = self.mask_feat = None
        self.pend_n = [0] * sess.slots
        self.prompt_pairs = [[] for _ in range(sess.slots)]
        self.unread = [False] * sess.slots
        self.chunk_tokens = int(getattr(sess, "prefill_chunk_tokens", 1 << 30))  # pairs one prompt read takes
        self._prefill_s = 0.0
        self.window_setup(sess.slots)

    def _ensure_blocks(self, h: int, dtype: torch.dtype, dev: torch.device) -> None:
        """The per-slot block buffers, all mask slots; fc(mask_hidden) evaluated once (the draft is frozen while
        it generates)."""
        if self.blk_feat is None:
            with torch.no_grad():
                self.mask_feat = self.spec.eagle_module.mask_feature().to(dtype).detach()
            self.blk_feat = self.mask_feat[None, None].expand(self.slots, self.width, h).clone()
            self.blk_tok = torch.full((self.slots, self.width), self.mask_token_id, dtype=torch.long, device=dev)

    def _reset_blocks(self, rows: slice, n: int) -> None:
        """Slots ``rows``, entries [0, n) back to mask slots."""
        self.blk_feat[rows, :n] = self.mask_feat
        self.blk_tok[rows, :n] = self.mask_token_id

    def admit(self, sess: Any, slot: int, row: Any) -> None:
        """Empty the slot's draft cache row (it starts at the draft's window of the prompt) and pending pairs."""
        self.window_admit(slot, row.prompt)
        self.pend_n[slot] = 0
        self.prompt_pairs[slot] = []
        self.unread[slot] = True
        if self.blk_feat is not None:  # a previous occupant may have left pending pairs in the block
            self._reset_blocks(slice(slot, slot + 1), self.width)

    def release(self, sess: Any, slot: int, row: Any) -> None:
        """The slot's pending pairs (and waiting prompt pairs) are dropped with its row."""
        self.pend_n[slot] = 0
        self.prompt_pairs[slot] = []
        self.unread[slot] = False

    def swap(self, i: int, j: int, used: int) -> None:
        """Exchange the two slots' draft cache rows and pending pairs."""
        self.cache.swap_rows(i, j, used + self.extra_slots)
        swap_rows(self.blk_feat, i, j)
        swap_rows(self.blk_tok, i, j)
        self.pend_n[i], self.pend_n[j] = self.pend_n[j], self.pend_n[i]
        self.prompt_pairs[i], self.prompt_pairs[j] = self.prompt_pairs[j], self.prompt_pairs[i]
        self.unread[i], self.unread[j] = self.unread[j], self.unread[i]
        self.window_swap(i, j)

    # ---- prefill / accepted: pairs the draft owes ------------------------------------------------------------
    def prefill(self, sess: Any, ch: PrefillChunk) -> None:
        """Draft prefill over the chunk's pairs (those in the draft's window; under adaptive speculation they wait
        for the row's first forward); a completed prompt's last pair (with the first generated token) is kept
        pending: it anchors the first drafted block."""
        f = self.features(ch.out)
        dev = f.device
        self._ensure_blocks(f.shape[-1], f.dtype, dev)
        tok, feats, _, counts, _, lengths = self.window_pairs(ch, f)
        final_h = [bool(fin) and c > 0 for fin, c in zip(ch.final, counts)]
        run = [c - int(fin) for c, fin in zip(counts, final_h)]
        valid = torch.arange(tok.shape[1], device=dev)[None] < tensor(run, dev)[:, None]
        lazy = self.lazy_steps > 0 and getattr(sess, "adaptive", None) is not None
        view = self.cache.view(ch.lo, ch.hi)
        if lazy:  # the pairs wait (see above)
            for i, c in enumerate(run):
                if c > 0:
                    self.prompt_pairs[ch.lo + i].append((feats[i, :c].clone(), tok[i, :c].clone()))
        elif max(run) > 0:
            ctx = chain_block(view, tok, valid, self.max_pos, max_length=max(lengths), padded=True,
                              unpadded=self.unpadded)
            self.spec.draft_step(tok, feats, ctx, head=False)
            view.lengths += tensor(run, dev)
            for i, c in enumerate(run):
                if c > 0:
                    self.unread[ch.lo + i] = False
        for i, fin in enumerate(final_h):
            if fin:
                s = ch.lo + i
                last = counts[i] - 1
                self.blk_feat[s, 0] = feats[i, last]
                self.blk_tok[s, 0] = tok[i, last]
                self.pend_n[s] = 1
        if not lazy:
            ch.count_draft(1)

    def accepted(self, sess: Any, st: StepState, res: StepResult) -> None:
        """The accepted path's base features paired with the emitted tokens become the rows' pending pairs (after a
        deferred level-0 step: its one pair is appended to them)."""
        f = self.path_features(res)
        b, K, dev = st.b, f.shape[1], f.device
        if self._deferring:  # every path is its root: one pair per row, after the row's pending ones
            at = (torch.arange(b, device=dev), tensor(self.pend_n[:b], dev))
            self.blk_tok[at] = tensor([e[0] for e in res.emitted], dev)
            self.blk_feat[at] = f[:, 0]
            self.pend_n[:b] = [n + 1 for n in self.pend_n[:b]]
            return
        tok, val = pad_chains(res.emitted, n=K, pad=self.mask_token_id, device=dev)
        self.blk_tok[:b, :K] = tok
        if all(len(e) == K for e in res.emitted):
            self.blk_feat[:b, :K] = f
        else:  # shorter paths keep their mask slots
            self.blk_feat[:b, :K] = torch.where(val[..., None], f, self.mask_feat)
        self.pend_n[:b] = [len(p) for p in res.paths]

    # ---- the one forward ---------------------------------------------------------------------------------------
    def propose(self, sess: Any, st: StepState, level: Optional[int] = None) -> DraftTree:
        """Run the pending pairs plus K-1 mask slots in one draft forward; draft K tokens as a chain."""
        dev = sess.device
        b = st.b
        k = self.level_depth(level)
        n_pend = self.pend_n[:b]
        # level 0: the pending pairs wait while one more fits before the mask slots a drafting step needs
        self._deferring = k == 0 and self.lazy_steps > 0 and max(n_pend) < self.width - max(self.depth - 1, 0)
        if self._deferring:
            return DraftTree.empty(b, dev)
        if k == 0 and self.lazy_steps > 0:  # full: rows whose prompt waits hold on, the others' pairs are read
            self._hold_pending(b)
            n_pend = self.pend_n[:b]
        elif any(self.prompt_pairs[:b]):
            self._read_prompts(st)
        masks = max(k - 1, 0)
        lens = [p + masks for p in n_pend]
        width = max(lens)
        if width == 0:
            return DraftTree.empty(b, dev)
        npend = tensor(n_pend, dev)
        ragged = len(set(lens)) > 1
        valid = (torch.arange(width, device=dev)[None] < tensor(lens, dev)[:, None] if ragged
                 else torch.ones(b, width, dtype=torch.bool, device=dev))
        tok, feat = self.blk_tok[:b, :width], self.blk_feat[:b, :width]
        view = self.cache.view(0, b)
        # padded: a ragged block's padding past a row's end goes to the cache's last slot, so a row near the end
        # of its slot next to one with many (deferred) pending pairs does not overflow the cache
        ctx = chain_block(view, tok, valid, self.max_pos, unpadded=self.unpadded, padded=ragged,
                          max_length=max(n - p for n, p in zip(st.lengths, n_pend)))  # draft committed
        hid, _ = self.spec.draft_step(tok, feat, ctx, head=False)
        view.lengths += npend
        for r, n in enumerate(n_pend):
            if n:
                self.unread[r] = False
        self._reset_blocks(slice(0, b), width)
        self.pend_n[:b] = [0] * b
        st.count_draft(1)
        if k == 0:
            return DraftTree.empty(b, dev)
        if ragged or n_pend[0] != 1:  # rows [bonus pair, masks...] start at each row's last pending pair
            at = (npend[:, None] - 1).clamp(min=0) + torch.arange(k, device=dev)[None]  # [b, k]
            hid = hid[torch.arange(b, device=dev)[:, None], at]
        else:
            hid = hid[:, :k]
        lg = self.spec.draft_logits(hid)  # [b, k, Vd]: only the rows that draft
        if self.tree is not None:
            return self.tree.draft(lg, self.level_nodes(level), self.d2t_ids)
        greedy = [p.greedy for p in st.params]
        if all(greedy):  # one argmax for the whole chain; greedy verification reads no q
            tokens = self.d2t_ids[lg.argmax(-1)]
            return DraftTree.chains(tokens, torch.ones_like(tokens, dtype=torch.bool))
        drafts, qs = [], []
        for d in range(k):
            t, q = choose(st, lg[:, d], greedy)
            drafts.append(self.d2t_ids[t])
            qs.append(None if q is None else self._to_base(q))
        tokens = torch.stack(drafts, 1)
        return DraftTree.chains(tokens, torch.ones_like(tokens, dtype=torch.bool), q=stack_q(qs))

    def _hold_pending(self, b: int) -> None:
        """The decode rows the draft has read nothing of (never drafted for) add their pending pairs to their
        waiting prompt pairs (there are none for a 1-token prompt or a 1-pair window: the prompt's last pair is
        pending), to be read with the prompt when the row first drafts (never, if it never does: such a row costs
        an AR row; it holds at most one pair per position of its slot); their block slots go back to mask
        slots."""
        for r in range(b):
            n = self.pend_n[r]
            if self.unread[r] and n:
                self.prompt_pairs[r].append((self.blk_feat[r, :n].clone(), self.blk_tok[r, :n].clone()))
                self._reset_blocks(slice(r, r + 1), n)
                self.pend_n[r] = 0

    def _read_prompts(self, st: StepState) -> None:
        """Read the decode rows' waiting prompt pairs into the draft cache (they precede the rows' pending pairs):
        over the slots that have any, at most ``chunk_tokens`` pairs per forward."""
        t0 = time.perf_counter()
        lo, hi, counts, rows = take_waiting(self.prompt_pairs, st.b)
        view = self.cache.view(lo, hi)
        for j, cj, (feats, tok) in column_chunks(rows, counts, self.chunk_tokens):
            # the draft holds a row's target length minus its pending pairs minus the prompt pairs still unread
            before = max(n - p - c + min(j, c) for n, p, c in zip(st.lengths[lo:hi], self.pend_n[lo:hi], counts))
            n_dev = tensor(cj, tok.device)
            valid = torch.arange(tok.shape[1], device=tok.device)[None] < n_dev[:, None]
            ctx = chain_block(view, tok, valid, self.max_pos, max_length=before, padded=True, unpadded=self.unpadded)
            self.spec.draft_step(tok, feats, ctx, head=False)
            view.lengths += n_dev
            st.count_draft(1)
        self._prefill_s += time.perf_counter() - t0

    def _to_base(self, q_draft: torch.Tensor) -> torch.Tensor:
        """Draft-vocab distribution [..., Vd] -> base-vocab [..., V] via d2t."""
        out = torch.zeros(*q_draft.shape[:-1], self.V, dtype=q_draft.dtype, device=q_draft.device)
        return out.index_add_(-1, self.d2t_ids.to(q_draft.device), q_draft)

    def check_row(self, prompt, sp) -> None:
        """Any row the target serves."""
        if not prompt:
            raise SamplingError("peagle: empty prompt")
