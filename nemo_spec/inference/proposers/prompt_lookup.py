"""Prompt lookup (n-gram) drafting: copy the continuation of an earlier match of the last n tokens."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from nemo_spec.inference.engine import DraftTree, StepState
from nemo_spec.inference.proposers.base import BaseProposer
from nemo_spec.inference.proposers.common import level_index, opt_int
from nemo_spec.inference.sampling import SamplingError
from nemo_spec.inference.trees import pad_chains


class PromptLookupProposer(BaseProposer):
    """n-gram prompt lookup: copy the continuation of the latest earlier match of the last n tokens."""

    name = "prompt_lookup"

    def __init__(self, options: Dict[str, Any]) -> None:
        self.num_tokens = opt_int(options, "num_draft_tokens", 10)
        self.max_ngram = opt_int(options, "max_ngram", 3)
        self.min_ngram = opt_int(options, "min_ngram", 1)
        if self.min_ngram > self.max_ngram:
            raise SamplingError(f"option min_ngram={self.min_ngram} > max_ngram={self.max_ngram}")
        self.lookahead = self.num_tokens

    @property
    def levels(self) -> List[int]:
        """0, 1, 2, 4, ... up to num_draft_tokens draft tokens."""
        out, k = [0], 1
        while k < self.num_tokens:
            out.append(k)
            k *= 2
        return out + [self.num_tokens]

    def lookup(self, seq: Sequence[int]) -> List[int]:
        """Draft tokens for one sequence (empty when no n-gram matches).

        Longest n-gram first; among its matches the latest one whose continuation has all ``num_tokens`` tokens,
        else the one with the longest continuation. (The very latest match of a repeating pattern sits right
        before the end, where only a token or two follow it; an earlier period of the same pattern gives a
        full draft.)
        """
        L = len(seq)
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            pat = list(seq[L - n:])
            best: List[int] = []
            for i in range(L - n - 1, -1, -1):
                if seq[i] == pat[0] and list(seq[i:i + n]) == pat:
                    cont = list(seq[i + n: i + n + self.num_tokens])
                    if len(cont) == self.num_tokens:
                        return cont
                    if len(cont) > len(best):
                        best = cont
            if best:
                return best
        return []

    def propose(self, sess: Any, st: StepState, level: Optional[int] = None) -> DraftTree:
        """A chain per row from the n-gram match (ragged)."""
        k = self.levels[level_index(self.levels, level)]
        if k == 0:
            return DraftTree.empty(st.b, sess.device)
        chains = [self.lookup(st.seqs[r])[:k] for r in range(st.b)]
        tok, val = pad_chains(chains, device=sess.device)
        return DraftTree.chains(tok, val, sizes=[len(c) for c in chains])
