"""Medusa: heads on the last accepted base hidden state, expanded into a static candidate tree."""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from nemo_spec.models import model_config
from nemo_spec.inference.engine import DraftTree, PrefillChunk, StepResult, StepState
from nemo_spec.inference.proposers.base import SpecModelProposer
from nemo_spec.inference.proposers.common import StaticTree, last_valid, level_index, set_rows, swap_rows
from nemo_spec.inference.trees import DEFAULT_MEDUSA_CHOICES


class MedusaProposer(SpecModelProposer):
    """Medusa heads on the last accepted base hidden state, expanded into a static candidate tree."""

    name = "medusa"

    def __init__(self, model: torch.nn.Module, options: Dict[str, Any]) -> None:
        super().__init__(model, ("medusa",))
        heads = self.spec.spec_config.num_medusa_heads
        choices = options.get("medusa_choices")
        if choices is None:
            choices = [c for c in DEFAULT_MEDUSA_CHOICES if len(c) <= heads]
        self.tree = StaticTree(choices, heads, model_config(self.spec).vocab_size, "medusa_choices", "Medusa heads")
        self.choices = self.tree.choices
        self.lookahead = len(self.choices)
        self.h: Optional[torch.Tensor] = None

    @property
    def levels(self) -> List[int]:
        """0, then the tree cut at each depth."""
        return self.tree.levels

    def level_depth(self, level: int) -> int:
        """The level is the tree's depth."""
        return level

    def draft_forwards(self, level: int) -> int:
        """The heads (one small forward) whenever drafting."""
        return 1 if level_index(self.levels, level) > 0 else 0

    def setup(self, sess: Any) -> None:
        """Per-slot base hidden states (allocated at the first prefill)."""
        self.h = None
        self.slots = sess.slots

    def prefill(self, sess: Any, ch: PrefillChunk) -> None:
        """Remember the base hidden state at the last prompt token of rows whose prompt is complete."""
        if not any(ch.final):
            return
        last = last_valid(ch.out.hidden, ch.counts_dev)
        if self.h is None:
            self.h = last.new_zeros(self.slots, last.shape[-1])
        set_rows(self.h, ch.lo, ch.hi, ch.final_dev, last)

    def propose(self, sess: Any, st: StepState, level: Optional[int] = None) -> DraftTree:
        """Top-k tokens of each head placed on the static tree (cut at the level's depth)."""
        n = self.levels[level_index(self.levels, level)]
        if n == 0:
            return DraftTree.empty(st.b, sess.device)
        ml = self.spec.medusa_logits(self.h[:st.b, None])[:, :, 0]  # [K, b, V]
        st.count_draft(1)
        return self.tree.draft(ml.transpose(0, 1), n)

    def accepted(self, sess: Any, st: StepState, res: StepResult) -> None:
        """Keep the base hidden state of the last accepted node."""
        b = st.b
        rows = torch.arange(b, device=res.path.device)
        last = res.path[rows, res.accepted]
        self.h[:b] = res.out.hidden[rows, last]

    def swap(self, i: int, j: int, used: int) -> None:
        """Exchange the two slots' hidden states."""
        swap_rows(self.h, i, j)
