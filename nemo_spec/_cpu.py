"""The one place that adapts megatron-core's CUDA assumptions to CPU-only machines.

megatron-core calls ``torch.cuda.current_device()`` while building layers (tensor-parallel
linear layers, embeddings) and ``torch.cuda.synchronize()`` while saving distributed
checkpoints, and its local ``DotProductAttention`` enters ``get_cuda_rng_tracker().fork()`` on every
forward (for attention dropout; megatron/core/tensor_parallel/random.py ``CudaRNGStatesTracker.fork``
raises "cuda rng state model-parallel-rng is not added" unless a CUDA seed was registered). On a machine
without CUDA the first two are redirected to CPU equivalents and a fork of a state that was never added
runs on the default (CPU) generator. On a machine with CUDA nothing is touched, except the
Transformer-Engine-absent shim of :func:`apply_no_te_workarounds` (MoE router) and the CPU autocast state of
megatron's linears (:func:`_cpu_autocast_linears`), which both need. MoE layers on CPU also need
``moe_token_dispatcher_type="allgather"`` (the alltoall dispatcher creates a ``torch.cuda.Stream``); the layer
spec sets it (models/spec.py).
"""
from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger(__name__)
_APPLIED = False


def apply_cpu_workarounds() -> bool:
    """Redirect megatron-core's CUDA-only calls to CPU when CUDA is unavailable; returns True if applied."""
    global _APPLIED
    apply_no_te_workarounds()
    _cpu_autocast_linears()
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


def native_bf16() -> bool:
    """True when this CPU multiplies bf16 natively (AVX512-BF16 or AMX tiles, per torch's CPU feature probe):
    there bf16 autocast makes CPU training faster (README, Train); elsewhere bf16 is emulated (an earlier host
    without it ran bf16 draft steps no faster than fp32)."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in probes)


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


def _cpu_autocast_linears() -> None:
    """Let megatron's linear ``autograd.Function``s train under CPU autocast (Lightning's ``bf16-mixed`` on CPU, on
    any machine: the quickstart and ``trainer=cpu`` train on CPU also where CUDA exists).

    Their forward and backward carry ``torch.amp.custom_fwd/custom_bwd(device_type="cuda")`` (megatron-core 0.16.1
    tensor_parallel/layers.py:68-69, 447, 494; 0.15.3 the same at 66-67, 439, 486), which record and restore
    CUDA's autocast state only: under CPU autocast the forward's matmul runs in bf16 and the backward outside
    autocast, which fails ("expected m1 and m2 to have the same dtype"). Around megatron's own functions (left as
    they are, CUDA autocast stays theirs) the forward records the CPU autocast state in a ctx field of its own and
    the backward runs under it."""
    from megatron.core.tensor_parallel import layers

    for cls in (layers.LinearWithGradAccumulationAndAsyncCommunication, layers.LinearWithFrozenWeight):
        fwd, bwd = cls.__dict__["forward"].__func__, cls.__dict__["backward"].__func__
        if not getattr(fwd, "_nemo_spec_cpu_autocast", False):
            cls.forward, cls.backward = _with_cpu_autocast_state(fwd, bwd)  # type: ignore[assignment]


def _with_cpu_autocast_state(fwd, bwd):
    """(forward, backward) staticmethods around ``fwd`` / ``bwd``: the backward runs under the CPU autocast state
    (enabled, dtype) that the forward saw."""

    @functools.wraps(fwd)
    def forward(ctx, *args, **kwargs):
        ctx._nemo_spec_cpu_autocast = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
        return fwd(ctx, *args, **kwargs)

    @functools.wraps(bwd)
    def backward(ctx, *grads):
        enabled, dtype = ctx._nemo_spec_cpu_autocast
        with torch.autocast("cpu", enabled=enabled, dtype=dtype):
            return bwd(ctx, *grads)

    forward._nemo_spec_cpu_autocast = True  # type: ignore[attr-defined]
    return staticmethod(forward), staticmethod(backward)


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
