"""torch.distributed + megatron-core ``parallel_state`` set-up and tear-down (gloo on CPU, nccl on GPU)."""
from __future__ import annotations

import contextlib
import logging
import os
import socket
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from nemo_spec._cpu import apply_cpu_workarounds

log = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def initialize(tensor_parallel_size: int = 1, seed: int = 1234, backend: Optional[str] = None) -> None:
    """Initialise torch.distributed (from torchrun env vars, or a single local process) and megatron parallel state."""
    from megatron.core import parallel_state, tensor_parallel

    apply_cpu_workarounds()
    if not dist.is_initialized():
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
    if tensor_parallel_size < 1 or world % tensor_parallel_size != 0:
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} does not divide the world size {world}"
        )
    if parallel_state.model_parallel_is_initialized():
        if parallel_state.get_tensor_model_parallel_world_size() == tensor_parallel_size:
            return
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel_size)
    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    log.info(
        "parallel state: world=%d tp=%d dp=%d backend=%s",
        world, tensor_parallel_size, world // tensor_parallel_size, dist.get_backend(),
    )


def destroy() -> None:
    """Tear down megatron parallel state and the process group."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def parallel_context(tensor_parallel_size: int = 1, seed: int = 1234) -> Iterator[None]:
    """Context manager around :func:`initialize` / :func:`destroy`."""
    initialize(tensor_parallel_size, seed)
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


def is_rank_zero() -> bool:
    """True on global rank 0 (or without torch.distributed)."""
    return not dist.is_initialized() or dist.get_rank() == 0
