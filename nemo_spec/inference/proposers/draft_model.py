"""Draft-model speculative sampling: a smaller GPT with the target's vocabulary drafts gamma tokens a step."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch

from nemo_spec.models import gpt_forward, model_config, new_kv_cache, unwrap
from nemo_spec.inference.engine import DraftTree, PrefillChunk, StepResult, StepState
from nemo_spec.inference.proposers.base import BaseProposer
from nemo_spec.inference.proposers.common import (chain_block, chain_levels, choose, last_valid, level_index,
                                                  opt_int, stack_q)
from nemo_spec.inference.sampling import SamplingError, SamplingParams
from nemo_spec.inference.transfer import tensor
from nemo_spec.inference.trees import pad_chains


class DraftModelProposer(BaseProposer):
    """Speculative sampling with a smaller GPT: gamma drafted tokens per step, verified by one target forward."""

    name = "draft_model"

    def __init__(self, draft: torch.nn.Module, options: Dict[str, Any], target_cfg) -> None:
        self.draft = unwrap(draft)
        self.dcfg = model_config(draft)
        if self.dcfg.vocab_size != target_cfg.vocab_size:
            raise SamplingError(f"draft model vocab_size={self.dcfg.vocab_size} differs from the target's "
                                f"{target_cfg.vocab_size}; draft-model speculation needs a shared tokenizer")
        self.gamma = opt_int(options, "num_draft_tokens", 4)
        self.lookahead = self.gamma
        self._step_gamma = self.gamma

    @property
    def levels(self) -> List[int]:
        """0 .. gamma draft tokens."""
        return chain_levels(self.gamma)

    def draft_forwards(self, level: int) -> int:
        """A catch-up forward plus gamma - 1 drafting forwards."""
        k = self.levels[level_index(self.levels, level)]
        return k

    def check_row(self, prompt: Sequence[int], sp: SamplingParams) -> None:
        """The draft's context must hold prompt + new tokens."""
        need_pos = len(prompt) + sp.max_new_tokens
        if need_pos > self.dcfg.max_position_embeddings:
            raise SamplingError(f"draft model context max_position_embeddings={self.dcfg.max_position_embeddings} "
                                f"is too short for prompt + max_new_tokens ({need_pos} positions)")

    def setup(self, sess: Any) -> None:
        """The draft's own KV cache, one row per slot."""
        self.cache = sess.cache(("draft_model", id(self.draft)), sess.slots, sess.slot_len,
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
        ctx = chain_block(view, ch.tokens, ch.valid, self.dcfg.max_position_embeddings,
                           max_length=max(self.count[ch.lo:ch.hi]), padded=True)
        gpt_forward(self.draft, ch.tokens, ctx, compute_logits=False)
        view.lengths += ch.counts_dev
        for i, c in enumerate(ch.counts):
            self.count[ch.lo + i] += c
        ch.count_draft(1)

    def propose(self, sess: Any, st: StepState, level: Optional[int] = None) -> DraftTree:
        """Catch the draft cache up (1-2 tokens), then draft gamma tokens autoregressively."""
        dev = sess.device
        gamma = self.levels[level_index(self.levels, level)]
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
        ctx = chain_block(view, tok, val, self.dcfg.max_position_embeddings, max_length=mx)
        logits = gpt_forward(self.draft, tok, ctx).logits
        view.lengths += counts
        for r in range(b):
            self.count[r] += counts_h[r]
        mx = max(self.count[:b])
        lg = last_valid(logits, counts)
        greedy = [p.greedy for p in st.params]
        drafts, qs = [], []
        for i in range(gamma):
            d, q = choose(st, lg, greedy)
            drafts.append(d)
            qs.append(q)
            if i < gamma - 1:
                ctx = chain_block(view, d[:, None], torch.ones_like(d[:, None], dtype=torch.bool),
                                   self.dcfg.max_position_embeddings, max_length=mx + i)
                lg = gpt_forward(self.draft, d[:, None], ctx).logits[:, 0]
                view.lengths += 1
        st.count_draft(gamma)
        tokens = torch.stack(drafts, 1)
        valid = torch.ones_like(tokens, dtype=torch.bool)
        return DraftTree.chains(tokens, valid, q=stack_q(qs))

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
