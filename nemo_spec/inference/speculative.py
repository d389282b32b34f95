"""Compatibility re-exports: the proposers now live one module per method in :mod:`nemo_spec.inference.proposers`."""
from nemo_spec.inference.proposers import (DEFAULT_SCORE_TEMPERATURE, KNOWN_OPTIONS, METHODS, ARProposer,
                                           DFlashProposer, DraftModelProposer, EagleProposer, MedusaProposer,
                                           PEagleProposer, PromptLookupProposer, SuffixProposer, check_options,
                                           make_proposer)

__all__ = ["ARProposer", "DEFAULT_SCORE_TEMPERATURE", "DFlashProposer", "DraftModelProposer", "EagleProposer",
           "KNOWN_OPTIONS", "METHODS", "MedusaProposer", "PEagleProposer", "PromptLookupProposer", "SuffixProposer",
           "check_options", "make_proposer"]
