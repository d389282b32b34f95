"""Draft proposers, one module per generation method, all behind the :class:`~.base.Proposer` protocol.

========================  =====================================================================================
``ar``                    :mod:`.ar` — no draft (plain autoregressive decoding)
``prompt_lookup``         :mod:`.prompt_lookup` — n-gram prompt lookup
``draft_model``           :mod:`.draft_model` — a smaller GPT with the same vocabulary
``eagle``, ``eagle_tree``  :mod:`.eagle` — EAGLE-1/3 chain, EAGLE-2 dynamic tree
``medusa``                :mod:`.medusa` — Medusa heads on a static tree
``suffix``                :mod:`.suffix` — suffix decoding over per-request and global suffix tries
``peagle``, ``peagle_tree``  :mod:`.peagle` — P-EAGLE parallel drafting (one draft forward per step): chain, or a
                          static top-k tree from the same forward
``dflash``, ``dflash_tree``  :mod:`.dflash` — DFlash block drafting with KV injection (one draft forward per step):
                          chain, or a static top-k tree from the same forward
========================  =====================================================================================

:mod:`.base` holds the protocol, the no-op :class:`~.base.BaseProposer` and the SpeculativeGPT plumbing;
:mod:`.common` the helpers the proposers share (options, per-slot rows, levels, draft-chain contexts).
:func:`make_proposer` builds a method's proposer from :data:`PROPOSERS`.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from nemo_spec.inference.engine import Engine
from nemo_spec.inference.proposers.ar import ARProposer
from nemo_spec.inference.proposers.base import HOOKS, BaseProposer, Proposer, SpecModelProposer
from nemo_spec.inference.proposers.common import DEFAULT_SCORE_TEMPERATURE, KNOWN_OPTIONS, check_options
from nemo_spec.inference.proposers.dflash import DFlashProposer
from nemo_spec.inference.proposers.draft_model import DraftModelProposer
from nemo_spec.inference.proposers.eagle import EagleProposer
from nemo_spec.inference.proposers.medusa import MedusaProposer
from nemo_spec.inference.proposers.peagle import PEagleProposer
from nemo_spec.inference.proposers.prompt_lookup import PromptLookupProposer
from nemo_spec.inference.proposers.suffix import SuffixProposer
from nemo_spec.inference.sampling import SamplingError

#: generation method -> its proposer class
PROPOSERS: Dict[str, type] = {
    "ar": ARProposer, "eagle": EagleProposer, "eagle_tree": EagleProposer, "medusa": MedusaProposer,
    "draft_model": DraftModelProposer, "prompt_lookup": PromptLookupProposer, "suffix": SuffixProposer,
    "peagle": PEagleProposer, "dflash": DFlashProposer, "peagle_tree": PEagleProposer, "dflash_tree": DFlashProposer,
}
METHODS = tuple(PROPOSERS)


def make_proposer(method: str, model: torch.nn.Module, engine: Engine, draft_model: Optional[torch.nn.Module],
                  options: Dict[str, Any]) -> Proposer:
    """The proposer for ``method`` (validated before any forward pass)."""
    check_options(options)
    if method not in PROPOSERS:
        raise SamplingError(f"unknown generation method {method!r}; choose one of {METHODS}")
    if method == "ar":
        return ARProposer()
    if method == "prompt_lookup":
        return PromptLookupProposer(options)
    if method == "draft_model":
        if draft_model is None:
            raise SamplingError("method 'draft_model' needs draft_model= (a smaller GPT with the same vocabulary)")
        return DraftModelProposer(draft_model, options, engine.cfg)
    if method.endswith("_tree"):  # eagle_tree, peagle_tree, dflash_tree: the method's proposer, drafting a tree
        return PROPOSERS[method](model, options, tree=True)
    return PROPOSERS[method](model, options)


__all__ = ["ARProposer", "BaseProposer", "DEFAULT_SCORE_TEMPERATURE", "DFlashProposer", "DraftModelProposer",
           "EagleProposer", "HOOKS", "KNOWN_OPTIONS", "MedusaProposer", "METHODS", "PEagleProposer", "PROPOSERS",
           "PromptLookupProposer", "Proposer", "SpecModelProposer", "SuffixProposer", "check_options",
           "make_proposer"]
