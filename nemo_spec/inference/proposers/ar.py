"""Plain autoregressive decoding: the proposer that never drafts."""
from __future__ import annotations

from nemo_spec.inference.proposers.base import BaseProposer


class ARProposer(BaseProposer):
    """No draft: plain autoregressive decoding (every hook is :class:`BaseProposer`'s no-op)."""

    name = "ar"
