"""The proposer interface: what :class:`~nemo_spec.inference.session.Session` (and the adaptive speculation
controller) call on a generation method, and the no-op base every proposer builds on.

A Session keeps its rows in fixed KV slots; the decode rows of a step are slots ``[0, b)``. Over a row's life it
calls, in order: ``check_row`` (before the row is queued), ``admit`` (it took a slot), ``prefill`` (after each
target prefill chunk), then each step ``propose`` and ``accepted``, and ``release`` when it leaves; ``swap`` when
two slots exchange their rows (compaction), ``setup`` when the session is built or reset. A proposer owns all of
its per-slot state (draft KV caches, roots, counters) as explicit attributes allocated in ``setup``.
"""
from __future__ import annotations

from typing import Any, List, Optional, Protocol, Sequence, Tuple, runtime_checkable

import torch

from nemo_spec.models import unwrap_speculative
from nemo_spec.inference.engine import DraftTree, PrefillChunk, StepResult, StepState
from nemo_spec.inference.sampling import SamplingError, SamplingParams

#: the hooks of :class:`Proposer`, in the order a row meets them (tests check every proposer has them)
HOOKS = ("setup", "check_row", "admit", "prefill", "propose", "accepted", "release", "swap", "level_depth",
         "draft_forwards", "take_deferred_cost")


@runtime_checkable
class Proposer(Protocol):
    """A generation method as the Session drives it."""

    #: the method name (``generate(method=...)``)
    name: str
    #: the most draft nodes one step proposes per row (the Session reserves that many KV slots per row)
    lookahead: int
    #: base layers whose outputs the proposer reads (``GPTOutput.aux_hidden``)
    aux_layers: List[int]

    @property
    def levels(self) -> List[int]:
        """Draft nodes per row at each speculation level it offers, ascending from level 0 = no draft."""

    def level_depth(self, level: int) -> int:
        """Deepest draft node at ``level`` (chains: their length)."""

    def draft_forwards(self, level: int) -> int:
        """Draft-model forwards one step costs at ``level`` (the adaptive controller's cost model)."""

    def take_deferred_cost(self) -> Tuple[float, int, float]:
        """(seconds, level-0 steps, prefill seconds) of draft work put off and run by a later step, since the last
        call: the adaptive controller charges the first to level 0; the last (draft prefills that waited for a
        row's first drafting step) to no level, as an undeferred draft prefill is not a decode step's cost."""

    def setup(self, sess: Any) -> None:
        """(Re)allocate per-slot state for ``sess.slots`` rows of ``sess.slot_len`` positions; drops all rows."""

    def check_row(self, prompt: Sequence[int], sp: SamplingParams) -> None:
        """Raise SamplingError when this proposer cannot serve the row (before it is queued)."""

    def admit(self, sess: Any, slot: int, row: Any) -> None:
        """A new row took ``slot`` (its prefill has not run yet): reset the slot's state."""

    def prefill(self, sess: Any, ch: PrefillChunk) -> None:
        """After a target prefill chunk over slots ``[ch.lo, ch.hi)`` (``ch.out``: the target's outputs)."""

    def propose(self, sess: Any, st: StepState, level: Optional[int] = None) -> DraftTree:
        """The draft tree of each decode row at ``level`` (None: the top level)."""

    def accepted(self, sess: Any, st: StepState, res: StepResult) -> None:
        """After verification: sync draft state/caches with each row's accepted path."""

    def release(self, sess: Any, slot: int, row: Any) -> None:
        """The row in ``slot`` left the batch (finished or cancelled)."""

    def swap(self, i: int, j: int, used: int) -> None:
        """Slots ``i`` and ``j`` exchange their rows (``used``: cache positions that matter)."""


class BaseProposer:
    """Every :class:`Proposer` hook as a no-op: a proposer that never drafts (override what a method needs)."""

    name = "base"
    lookahead = 0
    aux_layers: List[int] = []
    #: a level-0 step's draft work waits for a later drafting step (option ``lazy_draft_steps``)
    defers_level0 = False

    @property
    def levels(self) -> List[int]:
        """Only level 0 (no draft)."""
        return [0]

    def level_depth(self, level: int) -> int:
        """The level's node count (chains)."""
        return self.levels[level]

    def draft_forwards(self, level: int) -> int:
        """No draft forwards."""
        return 0

    def take_deferred_cost(self) -> Tuple[float, int, float]:
        """Nothing is deferred."""
        return 0.0, 0, 0.0

    def setup(self, sess: Any) -> None:
        """No per-slot state."""

    def check_row(self, prompt: Sequence[int], sp: SamplingParams) -> None:
        """Every row is fine."""

    def admit(self, sess: Any, slot: int, row: Any) -> None:
        """Nothing to reset."""

    def prefill(self, sess: Any, ch: PrefillChunk) -> None:
        """Nothing to prefill."""

    def propose(self, sess: Any, st: StepState, level: Optional[int] = None) -> DraftTree:
        """The empty tree."""
        return DraftTree.empty(st.b, sess.device)

    def accepted(self, sess: Any, st: StepState, res: StepResult) -> None:
        """Nothing to sync."""

    def release(self, sess: Any, slot: int, row: Any) -> None:
        """Nothing to free."""

    def swap(self, i: int, j: int, used: int) -> None:
        """No per-slot state to exchange."""


class SpecModelProposer(BaseProposer):
    """Shared plumbing for proposers driven by a SpeculativeGPT (EAGLE, Medusa, P-EAGLE, DFlash)."""

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

    def features(self, out) -> torch.Tensor:
        """The draft's input features from a target output: the fused base hidden states [b, s, h]."""
        return self.spec.fuse(self.spec.base_features(out))

    def path_features(self, res) -> torch.Tensor:
        """Features at each row's verified path (root + accepted drafts): [b, K, h], K the longest path."""
        feats = self.features(res.out)
        K = max(len(p) for p in res.paths)
        rows = torch.arange(feats.shape[0], device=feats.device)[:, None]
        return feats[rows, res.path[:, :K]]
