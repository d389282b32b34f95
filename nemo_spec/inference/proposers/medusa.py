"""Medusa: heads on the last accepted base hidden state, expanded into a static candidate tree."""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from nemo_spec.models import model_config
from nemo_spec.inference.engine import DraftTree, PrefillChunk, StepResult, StepState
from nemo_spec.inference.proposers.base import SpecModelProposer
from nemo_spec.inference.proposers.common import last_valid, level_index, set_rows, swap_rows
from nemo_spec.inference.sampling import SamplingError
from nemo_spec.inference.transfer import tensor
from nemo_spec.inference.trees import DEFAULT_MEDUSA_CHOICES, medusa_tree, validate_medusa_choices


class MedusaProposer(SpecModelProposer):
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
        i = level_index(self.levels, level)
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
        swap_rows(self.h, i, j)
