"""A Lightning strategy that knows megatron-core tensor + data parallelism, and draft-only checkpoints.

* Single process by default; under ``torchrun`` it initialises torch.distributed and megatron ``parallel_state``
  via :func:`nemo_spec.parallel.initialize` (tensor-parallel size from the config; DP = world / TP).
* Each process holds one model replica shard (no DDP wrapper). After the last micro-batch of an optimizer step the
  gradients of trainable parameters are averaged over megatron's data-parallel group; TP-sharded parameters
  are never averaged across TP ranks (every TP rank already holds the gradient of its own shard, and most
  replicated parameters get identical gradients on every TP rank because their inputs are identical). The
  exception, per-head q/k norm weights (DFlash's Qwen3-style layers), whose gradient each TP rank holds only for
  its own heads, is first summed over TP, as megatron-core's ``finalize_model_grads`` does
  (:func:`nemo_spec.parallel.all_reduce_tp_partial_grads`).
* Checkpoints are Megatron distributed (``torch_dist``) checkpoint directories ``<name>/``: the trainable tensors
  (draft parameters + buffers, taken from the model's ``sharded_state_dict()`` so TP-sharded ones keep their real
  sharding) and the optimizer's per-parameter state (Adam ``exp_avg``/``exp_avg_sq``, sharded like their parameter)
  as ShardedTensors, written once per shard (replica ids make DP replicas and TP-replicated tensors write once);
  everything else Lightning puts in the checkpoint (loops / data position, LR schedulers, callbacks, global step,
  optimizer hyperparameters and scalar state) as common state from rank 0. ``nemo_spec_train.json`` is written
  last into a temporary directory that rank 0 renames into place (atomic). Resume works at any TP and DP size
  (tensors are resharded; the global batch stays constant via gradient accumulation).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, Mapping, Optional

import torch
import torch.distributed as dist
from lightning.fabric.utilities.optimizer import _optimizer_to_device
from lightning.pytorch.strategies import SingleDeviceStrategy

from nemo_spec import parallel
from nemo_spec._cpu import apply_cpu_workarounds
from nemo_spec.checkpoint.megatron import (DIST_METADATA, TRAIN_META_NAME, CheckpointError, _all_ok, _commit,
                                           _save_strategy, check_sharded_shapes, dcp_io)

log = logging.getLogger(__name__)

CKPT_FORMAT = "nemo_spec_train_ckpt_v2"
META_NAME = TRAIN_META_NAME  # nemo_spec_train.json: written last into the temporary dir, before the rename
V1_META_NAME = "meta.json"  # the older per-TP-rank torch.save format (refused with a clear message)


class TrainCheckpointError(CheckpointError, RuntimeError):
    """A training checkpoint is missing, incomplete, corrupt or incompatible with this run."""


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
                 expert_parallel_size: int = 1, **kwargs: Any) -> None:
        self.tensor_parallel_size = tensor_parallel_size
        self.expert_parallel_size = expert_parallel_size
        self.seed = seed
        self.run_settings: Optional[Dict[str, Any]] = None  # recorded in each checkpoint's nemo_spec_train.json
        if accelerator_kind == "gpu":
            if not torch.cuda.is_available():
                raise RuntimeError("trainer.accelerator=gpu but CUDA is not available (use trainer=cpu)")
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        else:
            device = torch.device("cpu")
        super().__init__(device=device, **kwargs)

    # ---- process group / ranks ----------------------------------------------------------------------------
    def setup_environment(self) -> None:
        """Initialise torch.distributed + megatron parallel state (TP and EP from the config)."""
        parallel.initialize(tensor_parallel_size=self.tensor_parallel_size, seed=self.seed,
                            expert_parallel_size=self.expert_parallel_size)
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
    def is_distributed(self) -> bool:
        """What Lightning asks before it syncs a metric logged with ``sync_dist=True`` (a strategy that is not one of
        its own distributed ones is asked for this property; without it, ``sync_dist`` is dropped). True once
        torch.distributed is up: epoch-level validation metrics, each DP rank's over its own share of the data, are
        then averaged over the data-parallel group by :meth:`reduce` (nothing to average in one process). Lightning
        injects no sampler (the Trainer runs with ``use_distributed_sampler=False``)."""
        return dist.is_initialized()

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
        """Sum the TP-partial gradients (q/k norms) over TP, then average trainable-parameter gradients over the
        data-parallel group."""
        from nemo_spec.parallel import all_reduce_coalesced, all_reduce_tp_partial_grads

        all_reduce_tp_partial_grads(self.lightning_module)
        rank, size = dp_rank_size()
        if size == 1:
            return
        grads = [p.grad for p in self.lightning_module.parameters() if p.requires_grad and p.grad is not None]
        if grads:
            all_reduce_coalesced(grads, _dp_group(), divide_by=size)

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """Run the closure (last micro-batch), all-reduce gradients over DP, then clip and step."""
        def closure_then_reduce() -> Any:
            out = closure()
            self.reduce_gradients()
            return out

        return super().optimizer_step(optimizer, closure_then_reduce, model, **kwargs)

    # ---- resume ---------------------------------------------------------------------------------------------
    def on_train_start(self) -> None:
        super().on_train_start()
        complete_batch_end_restart(self.lightning_module.trainer)

    # ---- checkpoints ------------------------------------------------------------------------------------------
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
        """Write ``checkpoint`` as a Megatron distributed checkpoint directory ``filepath/``, atomically.

        Collective: every rank calls it (Lightning does). Trainable tensors and the optimizer's per-parameter
        state are ShardedTensors written once per shard; the rest of the dict is common state from rank 0.
        """
        from megatron.core import dist_checkpointing

        apply_cpu_workarounds()
        final = Path(filepath).absolute()
        tmp = final.parent / f".{final.name}.tmp"
        sharded = dict(checkpoint)
        params = self.lightning_module.trainable_sharded_state_dict()
        sharded["state_dict"] = params
        sharded["optimizer_states"] = [_sharded_optimizer_state(i, opt, state, params) for i, (opt, state)
                                       in enumerate(zip(self.optimizers, checkpoint.get("optimizer_states", [])))]
        rank0 = self.is_global_zero
        err: Optional[BaseException] = None
        try:
            if rank0:
                if tmp.exists():
                    log.warning("removing %s left by an interrupted save", tmp)
                    shutil.rmtree(tmp)
                tmp.mkdir(parents=True)
        except BaseException as e:  # noqa: BLE001 - re-raised once every rank knows
            err = e
        if not _all_ok(err is None):
            raise TrainCheckpointError(f"could not create {tmp} ({err or 'failed on rank 0'})")
        try:
            with dcp_io():
                dist_checkpointing.save(sharded, str(tmp), sharded_strategy=_save_strategy())
            if rank0:
                meta = {"format": CKPT_FORMAT, "tensor_parallel_size": parallel.tp_size(),
                        "expert_parallel_size": parallel.ep_size(),
                        "data_parallel_size": dp_rank_size()[1], "global_step": checkpoint.get("global_step"),
                        "epoch": checkpoint.get("epoch"), "trainable_keys": sorted(params)}
                if self.run_settings is not None:  # what a resumed run must share (run.check_resume_settings)
                    meta["run_settings"] = self.run_settings
                (tmp / META_NAME).write_text(json.dumps(meta, indent=2))  # last file: marks the save complete
        except BaseException as e:  # noqa: BLE001
            err = e
        ok = _all_ok(err is None)
        if ok and rank0:
            try:
                _commit(tmp, final, overwrite=True)
            except BaseException as e:  # noqa: BLE001
                err = e
        if not _all_ok(ok and err is None):
            if rank0:
                shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(err, (KeyboardInterrupt, SystemExit)):
                raise err
            hint = ("; dist_checkpointing.save starts worker processes (multiprocessing spawn): call training from "
                    "a script guarded by `if __name__ == \"__main__\":`" if isinstance(err, EOFError) else "")
            raise TrainCheckpointError(f"saving training checkpoint {final} failed "
                                       f"({_short_error(err) if err else 'on another rank'}); the previous "
                                       f"checkpoints are untouched{hint}") from err
        if rank0:
            log.info("saved training checkpoint %s (step %s)", final, checkpoint.get("global_step"))

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        """Read a training checkpoint directory (``last`` links are followed) at this run's TP/DP sizes.

        Trainable tensors and optimizer state are resharded from whatever TP size they were saved with; the
        optimizer state is remapped onto this run's optimizer in :meth:`load_optimizer_state_dict`.
        """
        from megatron.core import dist_checkpointing

        apply_cpu_workarounds()
        path = Path(checkpoint_path).resolve()
        meta = read_train_checkpoint_meta(path)
        try:
            common = dist_checkpointing.load_common_state_dict(str(path))
        except _read_errors() as e:  # any reader failure means an unreadable checkpoint
            raise TrainCheckpointError(f"{path}: cannot read the common state ({_short_error(e)})") from e
        params = {k: _empty_like_sharded(v) for k, v in self.lightning_module.trainable_sharded_state_dict().items()}
        saved, want = set(meta.get("trainable_keys") or params), set(params)
        if saved != want:
            raise TrainCheckpointError(f"{path} holds the trainable state of a different model (algorithm / draft "
                                       f"config): only in the checkpoint {sorted(saved - want)[:4]}, only in this "
                                       f"run {sorted(want - saved)[:4]}")
        template: Dict[str, Any] = {"state_dict": params}
        if "optimizer_states" in common:
            template["optimizer_states"] = [_optimizer_template(i, state, params, path)
                                            for i, state in enumerate(common["optimizer_states"])]
        source = "this run's model (algorithm / draft / model config)"
        try:
            check_sharded_shapes(template, path, source)
        except CheckpointError as e:
            raise TrainCheckpointError(str(e)) from e
        if meta["tensor_parallel_size"] != parallel.tp_size():
            log.info("resharding training checkpoint %s from tensor_parallel_size=%d to %d", path,
                     meta["tensor_parallel_size"], parallel.tp_size())
        try:
            with dcp_io():
                loaded = dist_checkpointing.load(template, str(path))
        except _read_errors() as e:
            raise TrainCheckpointError(f"{path}: reading the sharded tensors failed, the checkpoint is incomplete "
                                       f"or corrupt ({_short_error(e)})") from e
        return loaded

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Restore each optimizer's state, matched to this run's parameters by key (not by position)."""
        states = checkpoint["optimizer_states"]
        if len(states) != len(self.optimizers):
            raise TrainCheckpointError(f"checkpoint holds {len(states)} optimizer state(s), this run has "
                                       f"{len(self.optimizers)} optimizer(s)")
        keys = _param_keys(self.lightning_module)
        for i, (opt, saved) in enumerate(zip(self.optimizers, states)):
            opt.load_state_dict(_index_optimizer_state(i, opt, saved, keys))
            _optimizer_to_device(opt, self.root_device)

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            shutil.rmtree(filepath, ignore_errors=True)


# ---- Lightning < 2.5: restart from a checkpoint saved in on_train_batch_end -----------------------------------
def complete_batch_end_restart(trainer: Any) -> bool:
    """Count the batch a periodic checkpoint was saved in as completed, as Lightning >= 2.5 does on restart.

    ModelCheckpoint(every_n_train_steps) saves inside ``on_train_batch_end``, before the epoch loop counts that
    batch as completed (lightning 2.4.0 loops/training_epoch_loop.py:269-273), so the saved ``batch_progress`` is
    ready=started=processed=n, completed=n-1 and ``_batches_that_stepped`` is one short (bumped later, in
    ``on_advance_end``, :302-304). Lightning 2.6.6 repairs both when the loop restarts
    (loops/training_epoch_loop.py:193-204, ``restarted_on_train_batch_end``). Lightning 2.4.0 only rewinds to the
    completed count (training_epoch_loop.py:149-152 -> progress.py:69 ``ready = completed``): the resumed run's
    batch counter is one behind, so with gradient accumulation its first optimizer step comes one micro-batch
    early (batch_idx n-1 again: ``_accumulated_batches_reached`` at :329) and every later step straddles the
    saved step's accumulation boundary. The data itself is positioned by the sampler (consumed samples), so only
    the counters are off; this applies 2.6's repair on Lightning builds without it. Called from ``on_train_start``
    (fit_loop.py:329 in 2.4.0), after the loops are restored and the train dataloader is set up, before the epoch
    loop's ``reset`` rewinds ``current`` to ``completed``. Returns whether it changed anything.
    """
    loop = trainer.fit_loop.epoch_loop
    if hasattr(loop, "restarted_on_train_batch_end"):  # lightning >= 2.5 does this itself
        return False
    total = loop.batch_progress.total
    if not (loop.restarting and total.ready == total.started == total.processed == total.completed + 1):
        return False
    loop.batch_progress.increment_completed()  # total and current
    # 2.4 reruns the saved batch's validation when the restarted loop is at a validation batch
    # (training_epoch_loop.py:199-201) and then bumps _batches_that_stepped in on_advance_end itself (:302-304).
    reruns_val = loop._should_check_val_fx(trainer.fit_loop._data_fetcher)
    if not loop._should_accumulate() and not reruns_val:
        loop._batches_that_stepped += 1
    log.info("resume: the checkpoint's batch (saved in on_train_batch_end) counted as completed, %d in this epoch "
             "(Lightning < 2.5)", loop.batch_progress.current.completed)
    return True


# ---- training-checkpoint helpers -----------------------------------------------------------------------------
def read_train_checkpoint_meta(path: Path) -> Dict[str, Any]:
    """The checkpoint's nemo_spec_train.json, after checking it is a complete training checkpoint of this format."""
    if not path.exists():
        raise TrainCheckpointError(f"training checkpoint {path} does not exist")
    if not path.is_dir():
        raise TrainCheckpointError(f"training checkpoint {path} is not a directory")
    meta_file = path / META_NAME
    if not meta_file.is_file():
        old = path / V1_META_NAME
        if old.is_file():
            fmt = _json_or_none(old)
            fmt = fmt.get("format") if isinstance(fmt, dict) else None
            raise TrainCheckpointError(f"{path}: format {fmt!r} (per-TP-rank torch.save files from an older nemo_spec) "
                                       f"is no longer read; this version resumes {CKPT_FORMAT!r} (Megatron "
                                       f"distributed checkpoints): start the run afresh")
        if (path / DIST_METADATA).is_file() or path.name.endswith(".tmp"):
            raise TrainCheckpointError(f"{path} is incomplete: {META_NAME} (written last) is missing, so the save "
                                       f"was interrupted")
        raise TrainCheckpointError(f"{path}: not a training checkpoint (no {META_NAME}); found "
                                   f"{sorted(x.name for x in path.iterdir())[:8]}")
    meta = _json_or_none(meta_file)
    if not isinstance(meta, dict):
        raise TrainCheckpointError(f"{meta_file}: not a JSON object")
    if meta.get("format") != CKPT_FORMAT:
        raise TrainCheckpointError(f"{meta_file}: format {meta.get('format')!r}, expected {CKPT_FORMAT!r}")
    if not isinstance(meta.get("tensor_parallel_size"), int):
        raise TrainCheckpointError(f"{meta_file}: field 'tensor_parallel_size' is missing")
    for name in (DIST_METADATA, "common.pt", ".metadata"):
        if not (path / name).is_file():
            raise TrainCheckpointError(f"{path} is incomplete: {name} (written by dist_checkpointing) is missing")
    return meta


def _read_errors() -> tuple:
    """Exceptions a checkpoint reader raises (torch DCP's CheckpointException is a BaseException)."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


def _short_error(e: BaseException) -> str:
    """One line for a reader error (torch DCP wraps per-rank failures with their whole tracebacks)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, f = next(iter(failures.items()))
        inner = f[0] if isinstance(f, tuple) and f else getattr(f, "exception", f)  # (exception, frames)
        return f"{type(inner).__name__} on rank {rank}: {str(inner).strip()[:300]}".rstrip(": ")
    return f"{type(e).__name__}: {str(e).strip()[:300]}"


def _json_or_none(f: Path) -> Any:
    try:
        return json.loads(f.read_text())
    except (OSError, ValueError):
        return None


def _optim_prefix(i: int) -> str:
    """Checkpoint key prefix of optimizer ``i``'s sharded state (megatron's ``optimizer.state.<name>.<param>``)."""
    return "optimizer" if i == 0 else f"optimizer_{i}"


def _param_keys(module: torch.nn.Module) -> Dict[int, str]:
    """id(parameter) -> its state-dict key in the LightningModule."""
    return {id(p): n for n, p in module.named_parameters()}


def _empty_like_sharded(v: Any) -> Any:
    """The same ShardedTensor/factory over a fresh buffer (loading never writes into live parameters)."""
    return dataclasses.replace(v, data=torch.empty_like(v.data))


def _sharded_optimizer_state(i: int, optimizer: Any, state: Dict[str, Any], params: Dict[str, Any]) -> Dict[str, Any]:
    """Optimizer ``state_dict()`` keyed by parameter name, per-parameter tensors as ShardedTensors.

    Tensors shaped like their parameter (Adam's exp_avg / exp_avg_sq) get the parameter's sharding and replica
    ids; anything else (Adam's scalar ``step``) and the param-group hyperparameters stay common state.
    ``sharded`` records which entries were sharded so that a load can build its template before any step.
    """
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    keys = _param_keys_from(params)
    flat = [p for g in optimizer.param_groups for p in g["params"]]
    try:
        idx_key = [keys[id(p)] for p in flat]
    except KeyError:
        raise TrainCheckpointError(f"optimizer {i} holds a parameter that is not part of the trainable state") from None
    out: Dict[str, Any] = {}
    sharded: Dict[str, list] = {}
    for idx, st in state["state"].items():
        key, p = idx_key[idx], flat[idx]
        entry = {}
        for name, val in st.items():
            if isinstance(val, torch.Tensor) and val.dim() > 0 and val.shape == p.shape:
                entry[name] = make_sharded_optimizer_tensor(params[key], val, prefix=f"{_optim_prefix(i)}.state.{name}")
                sharded.setdefault(key, []).append(name)
            else:
                entry[name] = val
        out[key] = entry
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [idx_key[j] for j in g["params"]]}
              for g in state["param_groups"]]
    return {"state": out, "param_groups": groups, "sharded": sharded}


def _param_keys_from(params: Dict[str, Any]) -> Dict[int, str]:
    """id(live tensor) -> key, for the entries of a trainable sharded state dict."""
    return {id(v.data): k for k, v in params.items()}


def _optimizer_template(i: int, saved: Dict[str, Any], params: Dict[str, Any], path: Path) -> Dict[str, Any]:
    """Load template for optimizer ``i``'s sharded state, shaped and sharded like this run's parameters."""
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    out: Dict[str, Any] = {}
    for key, names in (saved.get("sharded") or {}).items():
        if key not in params:
            raise TrainCheckpointError(f"{path}: optimizer state for {key!r}, which this run does not train "
                                       f"(different algorithm or draft config?)")
        out[key] = {name: make_sharded_optimizer_tensor(params[key], torch.empty_like(params[key].data),
                                                        prefix=f"{_optim_prefix(i)}.state.{name}")
                    for name in names}
    return {"state": out}


def _index_optimizer_state(i: int, optimizer: Any, saved: Dict[str, Any], keys: Dict[int, str]) -> Dict[str, Any]:
    """A torch ``optimizer.state_dict()`` for this run's optimizer from the name-keyed saved state."""
    saved_groups = saved["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise TrainCheckpointError(f"optimizer {i}: checkpoint has {len(saved_groups)} parameter groups, this run "
                                   f"has {len(optimizer.param_groups)}")
    key_to_idx: Dict[str, int] = {}
    groups = []
    for j, (cur, old) in enumerate(zip(optimizer.param_groups, saved_groups)):
        cur_keys = [keys[id(p)] for p in cur["params"]]
        if set(cur_keys) != set(old["params"]):
            diff = sorted(set(cur_keys) ^ set(old["params"]))
            raise TrainCheckpointError(f"optimizer {i} group {j}: the checkpoint's parameters differ from this run's "
                                       f"(e.g. {diff[:4]})")
        ids = list(range(len(key_to_idx), len(key_to_idx) + len(cur_keys)))
        key_to_idx.update(zip(cur_keys, ids))
        groups.append({**{k: v for k, v in old.items() if k != "params"}, "params": ids})
    state = {key_to_idx[k]: v for k, v in saved["state"].items()}
    return {"state": state, "param_groups": groups}
