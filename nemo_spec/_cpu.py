"""The one place that adapts megatron-core's CUDA assumptions to CPU-only machines.

megatron-core calls ``torch.cuda.current_device()`` while building layers (tensor-parallel
linear layers, embeddings) and ``torch.cuda.synchronize()`` while saving distributed
checkpoints. On a machine without CUDA both are redirected to CPU equivalents. On a machine
with CUDA nothing is touched.
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)
_APPLIED = False


def apply_cpu_workarounds() -> bool:
    """Redirect megatron-core's CUDA-only calls to CPU when CUDA is unavailable; returns True if applied."""
    global _APPLIED
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    _APPLIED = True
    log.debug("megatron-core CPU workarounds applied (no CUDA device)")
    return True


def default_device() -> torch.device:
    """The device models are placed on: the current CUDA device if present, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
