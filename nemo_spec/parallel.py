"""torch.distributed + megatron-core ``parallel_state`` set-up and tear-down (gloo on CPU, nccl on GPU)."""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
from typing import Any, Iterator, List, Optional

import torch
import torch.distributed as dist

from nemo_spec._cpu import apply_cpu_workarounds
from nemo_spec.config import ConfigError

log = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ParallelConfigError(ConfigError):
    """A tensor/expert-parallel layout that cannot run (the message names the size and what it must divide)."""


def check_sizes(world: int, tensor_parallel_size: int = 1, expert_parallel_size: int = 1) -> None:
    """Raise ParallelConfigError unless TP and EP are positive and TP x EP divides the world size.

    Experts are tensor-parallel inside each expert over the same TP ranks (megatron-core's
    ``expert_tensor_parallel_size`` defaults to the TP size), so one expert-model-parallel block spans TP x EP ranks.
    """
    for name, v in (("tensor_parallel_size", tensor_parallel_size), ("expert_parallel_size", expert_parallel_size)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ParallelConfigError(f"{name} must be a positive int, got {v!r}")
    if world % tensor_parallel_size != 0:
        raise ParallelConfigError(
            f"tensor_parallel_size={tensor_parallel_size} does not divide the world size {world}")
    if world % (tensor_parallel_size * expert_parallel_size) != 0:
        raise ParallelConfigError(
            f"expert_parallel_size={expert_parallel_size} x tensor_parallel_size={tensor_parallel_size} = "
            f"{tensor_parallel_size * expert_parallel_size} does not divide the world size {world}")


def initialize(tensor_parallel_size: int = 1, seed: int = 1234, backend: Optional[str] = None,
               expert_parallel_size: int = 1) -> None:
    """Initialise torch.distributed (from torchrun env vars, or a single local process) and megatron parallel state
    (TP, EP; data parallel = world / TP; experts: expert-data parallel = world / (TP x EP))."""
    from megatron.core import parallel_state, tensor_parallel

    apply_cpu_workarounds()
    if not dist.is_initialized():
        world_env = int(os.environ.get("WORLD_SIZE", "1"))
        check_sizes(world_env, tensor_parallel_size, expert_parallel_size)  # before a process group exists
        if "RANK" not in os.environ:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
            os.environ.setdefault("RANK", "0")
            os.environ.setdefault("WORLD_SIZE", "1")
            os.environ.setdefault("LOCAL_RANK", "0")
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend)
    world = dist.get_world_size()
    check_sizes(world, tensor_parallel_size, expert_parallel_size)
    if parallel_state.model_parallel_is_initialized():
        if (parallel_state.get_tensor_model_parallel_world_size() == tensor_parallel_size
                and parallel_state.get_expert_model_parallel_world_size() == expert_parallel_size):
            return
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel_size,
                                             expert_model_parallel_size=expert_parallel_size)
    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    log.info(
        "parallel state: world=%d tp=%d ep=%d dp=%d backend=%s",
        world, tensor_parallel_size, expert_parallel_size, world // tensor_parallel_size, dist.get_backend(),
    )


def destroy() -> None:
    """Tear down megatron parallel state and the process group."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def parallel_context(tensor_parallel_size: int = 1, seed: int = 1234,
                     expert_parallel_size: int = 1) -> Iterator[None]:
    """Context manager around :func:`initialize` / :func:`destroy`."""
    initialize(tensor_parallel_size, seed, expert_parallel_size=expert_parallel_size)
    try:
        yield
    finally:
        destroy()


def tp_rank() -> int:
    """Tensor-parallel rank of this process (0 when not initialised)."""
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_rank() if parallel_state.model_parallel_is_initialized() else 0


def tp_size() -> int:
    """Tensor-parallel world size (1 when not initialised)."""
    from megatron.core import parallel_state

    return (
        parallel_state.get_tensor_model_parallel_world_size()
        if parallel_state.model_parallel_is_initialized()
        else 1
    )


def ep_rank() -> int:
    """Expert-parallel rank of this process (0 when not initialised)."""
    from megatron.core import parallel_state

    return parallel_state.get_expert_model_parallel_rank() if parallel_state.model_parallel_is_initialized() else 0


def ep_size() -> int:
    """Expert-parallel world size (1 when not initialised)."""
    from megatron.core import parallel_state

    return (
        parallel_state.get_expert_model_parallel_world_size()
        if parallel_state.model_parallel_is_initialized()
        else 1
    )


def drop_inference_buffers() -> None:
    """Forget megatron's global memory buffers that were allocated under ``torch.inference_mode``.

    megatron-core reuses one buffer per name (``utils.GlobalMemoryBuffer.get_tensor``; e.g. the MoE allgather
    dispatcher gathers tokens into it at TP x EP > 1). Allocated first inside inference mode (our generation
    session, Lightning's validation loop) it is an inference tensor, and the next forward outside inference mode
    fails writing into it ("Inplace update to inference tensor outside InferenceMode"); dropping it lets that
    forward allocate a normal one. Cheap: a handful of dict entries."""
    from megatron.core import parallel_state

    buf = getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None)
    store = getattr(buf, "buffer", None)
    if not store:
        return
    for key in [k for k, t in store.items() if torch.is_tensor(t) and t.is_inference()]:
        del store[key]


def all_reduce_coalesced(tensors: List[torch.Tensor], group: Any, divide_by: int = 1) -> None:
    """All-reduce (sum) ``tensors`` over ``group`` in one fp32 buffer, divide by ``divide_by``, write back in place."""
    flat = torch._utils._flatten_dense_tensors([t.float() for t in tensors])
    dist.all_reduce(flat, group=group)
    if divide_by != 1:
        flat /= divide_by
    for t, r in zip(tensors, torch._utils._unflatten_dense_tensors(flat, tensors)):
        t.copy_(r)


def tp_partial_grad_params(module: torch.nn.Module) -> List[torch.nn.Parameter]:
    """Trainable parameters that every TP rank holds in full but whose gradient each rank computes only in part:
    the per-head q/k norms (``q_layernorm`` / ``k_layernorm``; each rank normalises only its own heads with the one
    shared weight). megatron-core sums exactly these over the TP group before the optimizer step
    (distributed/finalize_model_grads.py:353-356 at 0.16.1, by name); every other replicated parameter sees the
    same full input on each TP rank and so gets the same full gradient."""
    return [p for n, p in module.named_parameters()
            if p.requires_grad and ("q_layernorm" in n or "k_layernorm" in n)]


def all_reduce_tp_partial_grads(module: torch.nn.Module) -> int:
    """Sum the gradients of :func:`tp_partial_grad_params` over the tensor-parallel group (in place; one
    coalesced all-reduce): ``main_grad`` where megatron's DDP keeps them (NeMo), else ``grad``. Returns how many
    gradients were reduced; a no-op at TP=1."""
    from megatron.core import parallel_state

    if tp_size() <= 1:
        return 0
    grads = [g for g in (getattr(p, "main_grad", p.grad) for p in tp_partial_grad_params(module)) if g is not None]
    if grads:
        all_reduce_coalesced(grads, parallel_state.get_tensor_model_parallel_group())
    return len(grads)


def sum_tp_partial_grads_in_finalize(pl_module: Any, spec: torch.nn.Module) -> bool:
    """Make NeMo's gradient finalisation also sum the draft's q/k-norm gradients over TP (DFlash); called by
    :class:`nemo_spec.integrations.nemo.SpeculativeTransform` when it attaches the draft.

    megatron-core's ``finalize_model_grads`` sums q/k-norm gradients over TP only when the config it reads says
    ``qk_layernorm`` (distributed/finalize_model_grads.py:353-356 at 0.16.1), and in NeMo's loop that config is
    the LightningModule's own ``config`` (``get_model_config`` stops at it), which is the base's: for a base
    without q/k norms each TP rank would keep only its own heads' part of the draft's q/k-norm gradients. NeMo
    calls ``MegatronOptimizerModule.finalize_model_grads`` through the config's ``finalize_model_grads_func``
    (nemo/lightning/pytorch/optim/megatron.py ``on_fit_start``), so that method is wrapped: after NeMo's
    finalisation, :func:`all_reduce_tp_partial_grads` sums them (``main_grad``). Returns
    whether it wrapped (nothing to do when the draft has no q/k norms or megatron already sums them)."""
    optim = getattr(pl_module, "optim", None)
    original = getattr(optim, "finalize_model_grads", None)
    if (original is None or getattr(original, "_nemo_spec_qk_sum", False) or not tp_partial_grad_params(spec)
            or getattr(getattr(pl_module, "config", None), "qk_layernorm", False)):
        return False

    @functools.wraps(original)
    def finalize_model_grads(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        all_reduce_tp_partial_grads(spec)
        return out

    finalize_model_grads._nemo_spec_qk_sum = True  # type: ignore[attr-defined]
    optim.finalize_model_grads = finalize_model_grads
    return True


def is_rank_zero() -> bool:
    """True on global rank 0 (or without torch.distributed)."""
    return not dist.is_initialized() or dist.get_rank() == 0


def same_on_generation_ranks(values: List[int]) -> List[int]:
    """``values`` broadcast from the first rank of the ranks that run one generation together, so they all take
    the same host-side choice (sampling seeds, a draft length): the tensor-parallel group, and under expert
    parallelism every rank (the MoE dispatcher gathers equal-shaped token blocks over the expert group, so the EP
    ranks' forwards must agree in shape). A no-op on one process."""
    from megatron.core import parallel_state

    if not values or not dist.is_initialized() or (tp_size() <= 1 and ep_size() <= 1):
        return list(values)
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor(list(values), dtype=torch.long, device=dev)
    if ep_size() > 1:
        dist.broadcast(t, src=0)
    else:
        dist.broadcast(t, src=parallel_state.get_tensor_model_parallel_src_rank(),
                       group=parallel_state.get_tensor_model_parallel_group())
    return [int(x) for x in t.tolist()]
