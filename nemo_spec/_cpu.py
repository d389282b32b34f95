"""The one place that adapts megatron-core's CUDA assumptions to CPU-only machines.

megatron-core calls ``torch.cuda.current_device()`` while building layers (tensor-parallel
linear layers, embeddings) and ``torch.cuda.synchronize()`` while saving distributed
checkpoints, and its local ``DotProductAttention`` enters ``get_cuda_rng_tracker().fork()`` on every
forward (for attention dropout; megatron/core/tensor_parallel/random.py ``CudaRNGStatesTracker.fork``
raises "cuda rng state model-parallel-rng is not added" unless a CUDA seed was registered). On a machine
without CUDA the first two are redirected to CPU equivalents and a fork of a state that was never added
runs on the default (CPU) generator. On a machine with CUDA nothing is touched, except the Transformer-Engine-
absent shim of :func:`apply_no_te_workarounds` (MoE router), which both need. MoE layers on CPU also need
``moe_token_dispatcher_type="allgather"`` (the alltoall dispatcher creates a ``torch.cuda.Stream``); the layer
spec sets it (models/spec.py).
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)
_APPLIED = False


def apply_cpu_workarounds() -> bool:
    """Redirect megatron-core's CUDA-only calls to CPU when CUDA is unavailable; returns True if applied."""
    global _APPLIED
    apply_no_te_workarounds()
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    _cpu_rng_fork()
    _APPLIED = True
    log.debug("megatron-core CPU workarounds applied (no CUDA device)")
    return True


def default_device() -> torch.device:
    """The device models are placed on: the current CUDA device if present, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _cpu_rng_fork() -> None:
    """``CudaRNGStatesTracker.fork(name)`` of a never-added state: run on the default generator (CPU only)."""
    import contextlib

    from megatron.core.tensor_parallel import random as mrandom

    tracker = mrandom.CudaRNGStatesTracker
    original = tracker.fork
    if getattr(original, "_nemo_spec_cpu", False):
        return

    def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name in self.states_:
            return original(self, name)
        return contextlib.nullcontext()

    fork._nemo_spec_cpu = True  # type: ignore[attr-defined]
    tracker.fork = fork  # type: ignore[assignment]


def apply_no_te_workarounds() -> bool:
    """Without Transformer Engine, give megatron-core's MoE utilities the ``te_general_gemm = None`` they test
    (moe_utils.py only defines it inside its TE import ``try``; the router's gating function then raises
    NameError, moe_utils.py:1192). Applies on CPU and GPU alike; returns True if it set the name."""
    try:
        from megatron.core.transformer.moe import moe_utils
    except ImportError:  # pragma: no cover - megatron without MoE
        return False
    if hasattr(moe_utils, "te_general_gemm"):
        return False
    moe_utils.te_general_gemm = None  # type: ignore[attr-defined]
    log.debug("megatron-core MoE: te_general_gemm = None (Transformer Engine absent)")
    return True
