"""A Lightning strategy that knows megatron-core tensor + data parallelism, and draft-only checkpoints.

* Single process by default; under ``torchrun`` it initialises torch.distributed and megatron ``parallel_state``
  via :func:`nemo_spec.parallel.initialize` (tensor-parallel size from the config; DP = world / TP).
* Each process holds one model replica shard (no DDP wrapper). After the last micro-batch of an optimizer step the
  gradients of trainable parameters are averaged over megatron's data-parallel group only; TP-sharded parameters
  are never averaged across TP ranks (every TP rank already holds the gradient of its own shard, and replicated
  parameters get identical gradients on every TP rank because their inputs are identical).
* Checkpoints are directories ``<name>/`` holding ``model_tp{r}.pt`` (trainable state, optimizer, LR scheduler,
  loop/data position; written by the DP-rank-0 process of each TP rank) and ``meta.json``; they are written into a
  temporary directory and renamed by rank 0 after a barrier (atomic). Resume requires the same TP size; the DP
  size may change (the global batch stays constant via gradient accumulation).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, Mapping, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import SingleDeviceStrategy

from nemo_spec import parallel

log = logging.getLogger(__name__)

CKPT_FORMAT = "nemo_spec_train_ckpt_v1"


class TrainCheckpointError(RuntimeError):
    """A training checkpoint is missing, incomplete or incompatible with this run."""


def _dp_group() -> Any:
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_group() if ps.model_parallel_is_initialized() else None


def dp_rank_size() -> tuple[int, int]:
    """(rank, size) in megatron's data-parallel group ((0, 1) when not initialised)."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        return ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    return 0, 1


class MegatronStrategy(SingleDeviceStrategy):
    """Per-process model (one TP shard of one DP replica); DP gradient all-reduce; draft-only sharded checkpoints."""

    strategy_name = "nemo_spec_megatron"

    def __init__(self, tensor_parallel_size: int = 1, seed: int = 1234, accelerator_kind: str = "cpu",
                 **kwargs: Any) -> None:
        self.tensor_parallel_size = tensor_parallel_size
        self.seed = seed
        if accelerator_kind == "gpu":
            if not torch.cuda.is_available():
                raise RuntimeError("trainer.accelerator=gpu but CUDA is not available (use trainer=cpu)")
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        else:
            device = torch.device("cpu")
        super().__init__(device=device, **kwargs)

    # ---- process group / ranks ----------------------------------------------------------------------------
    def setup_environment(self) -> None:
        """Initialise torch.distributed + megatron parallel state (TP from the config)."""
        parallel.initialize(tensor_parallel_size=self.tensor_parallel_size, seed=self.seed)
        self.global_rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if self.root_device.type == "cuda":
            torch.cuda.set_device(self.root_device)
        super().setup_environment()

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    @property
    def distributed(self) -> bool:
        """Whether more than one process takes part."""
        return dist.is_initialized() and dist.get_world_size() > 1

    def barrier(self, name: Optional[str] = None) -> None:
        if self.distributed:
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """Average (or sum) a logged tensor over the data-parallel group."""
        if not isinstance(tensor, torch.Tensor) or not self.distributed:
            return tensor
        t = tensor.detach().clone().float()
        dist.all_reduce(t, group=group or _dp_group())
        if reduce_op in ("mean", "avg", None) or str(reduce_op).lower().endswith("mean"):
            t /= dp_rank_size()[1]
        return t

    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        if not self.distributed:
            return tensor
        out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, tensor.contiguous(), group=group)
        return torch.stack(out)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        if not self.distributed:
            return decision
        t = torch.tensor(int(decision), device=self.root_device)
        dist.all_reduce(t)
        return bool(t.item() == dist.get_world_size()) if all else bool(t.item() > 0)

    # ---- gradients ----------------------------------------------------------------------------------------
    def reduce_gradients(self) -> None:
        """Average trainable-parameter gradients over the data-parallel group (never over TP)."""
        rank, size = dp_rank_size()
        if size == 1:
            return
        grads = [p.grad for p in self.lightning_module.parameters() if p.requires_grad and p.grad is not None]
        if not grads:
            return
        flat = torch._utils._flatten_dense_tensors([g.float() for g in grads])
        dist.all_reduce(flat, group=_dp_group())
        flat /= size
        for g, r in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            g.copy_(r)

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """Run the closure (last micro-batch), all-reduce gradients over DP, then clip and step."""
        def closure_then_reduce() -> Any:
            out = closure()
            self.reduce_gradients()
            return out

        return super().optimizer_step(optimizer, closure_then_reduce, model, **kwargs)

    # ---- checkpoints --------------------------------------------------------------------------------------
    def lightning_module_state_dict(self) -> Dict[str, Any]:
        """Only the trainable state (draft parameters and buffers; the whole model when nothing is frozen)."""
        return self.lightning_module.trainable_state_dict()

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Load the trainable state; every trainable key must be present."""
        sd = checkpoint["state_dict"]
        expected = set(self.lightning_module.trainable_state_dict())
        missing = sorted(expected - set(sd))
        unexpected = sorted(set(sd) - expected)
        if missing or unexpected:
            raise TrainCheckpointError(f"checkpoint does not match the model: missing {missing[:5]} "
                                       f"unexpected {unexpected[:5]}")
        self.lightning_module.load_state_dict(sd, strict=False)

    def save_checkpoint(self, checkpoint: Dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Write this TP rank's trainable state + optimizer/scheduler/loops into ``filepath/`` atomically."""
        from megatron.core import parallel_state as ps

        final = Path(filepath)
        tmp = final.parent / f".{final.name}.tmp"
        tp_rank, tp = parallel.tp_rank(), parallel.tp_size()
        dp_rank, dp = dp_rank_size()
        if self.is_global_zero:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        self.barrier()
        if dp_rank == 0:
            torch.save(checkpoint, tmp / f"model_tp{tp_rank}.pt")
        self.barrier()
        if self.is_global_zero:
            meta = {"format": CKPT_FORMAT, "tensor_parallel_size": tp, "data_parallel_size": dp,
                    "global_step": checkpoint.get("global_step"), "epoch": checkpoint.get("epoch")}
            (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
            if final.exists() or final.is_symlink():
                old = final.parent / f".{final.name}.old"
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
                os.replace(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, final)
            log.info("saved training checkpoint %s (step %s)", final, checkpoint.get("global_step"))
        self.barrier()

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        """Read this TP rank's shard of a checkpoint directory (``last`` links are followed)."""
        path = Path(checkpoint_path).resolve()
        meta_file = path / "meta.json"
        if not meta_file.exists():
            raise TrainCheckpointError(f"{path}: not a training checkpoint (no meta.json)")
        meta = json.loads(meta_file.read_text())
        if meta.get("format") != CKPT_FORMAT:
            raise TrainCheckpointError(f"{meta_file}: format {meta.get('format')!r}, expected {CKPT_FORMAT!r}")
        if meta["tensor_parallel_size"] != parallel.tp_size():
            raise TrainCheckpointError(f"{path}: saved with tensor_parallel_size={meta['tensor_parallel_size']}, "
                                       f"this run uses {parallel.tp_size()}; resume with the same TP size")
        shard = path / f"model_tp{parallel.tp_rank()}.pt"
        if not shard.exists():
            raise TrainCheckpointError(f"{shard} is missing (incomplete checkpoint)")
        return torch.load(shard, map_location=self.root_device, weights_only=False)

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            shutil.rmtree(filepath, ignore_errors=True)
