"""SpeculativeLightningModule: builds the model (and applies ``model_transform``) in ``configure_model``, before the
optimizer exists, so the draft's new parameters are the ones being optimised.

With a SpeculativeGPT the loss is its ``training_losses`` (EAGLE-1 / EAGLE-3 TTT / Medusa); with a plain GPTModel
it is the language-model loss (vocab-parallel cross-entropy), which proves the stack on the base alone.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import lightning.pytorch as pl
import torch

from nemo_spec.config import ConfigError, ModelConfig
from nemo_spec.models.gpt import gpt_forward
from nemo_spec.training.config import LossConfig, OptimConfig

log = logging.getLogger(__name__)


def warmup_cosine(step: int, warmup: int, total: int, lr: float, min_lr: float) -> float:
    """Learning rate at ``step``: linear warm-up to ``lr`` then cosine decay to ``min_lr`` at ``total``."""
    if warmup > 0 and step < warmup:
        return lr * (step + 1) / warmup
    if total <= warmup:
        return lr
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * frac))


def tp_grad_norm(params: List[torch.nn.Parameter]) -> torch.Tensor:
    """Global L2 norm of gradients: TP-sharded parameters summed over the TP group, replicated ones counted once."""
    from megatron.core import parallel_state as ps

    dev = next((p.grad.device for p in params if p.grad is not None), torch.device("cpu"))
    sharded = torch.zeros((), dtype=torch.float32, device=dev)
    replicated = torch.zeros((), dtype=torch.float32, device=dev)
    for p in params:
        if p.grad is None:
            continue
        sq = p.grad.detach().float().pow(2).sum()
        if getattr(p, "tensor_model_parallel", False):
            sharded += sq
        else:
            replicated += sq
    if ps.model_parallel_is_initialized() and ps.get_tensor_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(sharded, group=ps.get_tensor_model_parallel_group())
    return (sharded + replicated).sqrt()


def pad_for_expert_parallel(batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Right-pad a [b, s] batch (pad id 0, loss_mask 0) to the largest b and s over the expert-parallel group.

    megatron-core's allgather token dispatcher all-gathers equal-sized token blocks over the TP x EP ranks
    (``token_dispatcher.py`` ``MoEAllGatherTokenDispatcher.token_dispatch``), and EP ranks are different
    data-parallel ranks with their own micro-batches; padding never changes a masked-mean loss or (causal
    attention) the real positions. A no-op at EP=1."""
    from nemo_spec import parallel

    if parallel.ep_size() == 1:
        return batch
    from megatron.core import parallel_state as ps

    ids = batch["input_ids"]
    b, s = ids.shape
    size = torch.tensor([b, s], dtype=torch.long, device=ids.device)
    torch.distributed.all_reduce(size, op=torch.distributed.ReduceOp.MAX, group=ps.get_expert_model_parallel_group())
    B, S = int(size[0]), int(size[1])
    if (B, S) == (b, s):
        return batch
    out: Dict[str, torch.Tensor] = {}
    for k, v in batch.items():
        if torch.is_tensor(v) and v.dim() >= 2 and tuple(v.shape[:2]) == (b, s):
            padded = v.new_zeros((B, S) + tuple(v.shape[2:]))
            padded[:b, :s] = v
        elif torch.is_tensor(v) and v.dim() >= 1 and v.shape[0] == b:
            padded = v.new_zeros((B,) + tuple(v.shape[1:]))
            padded[:b] = v
        else:
            padded = v
        out[k] = padded
    return out


def lm_loss(model: torch.nn.Module, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> Dict[str, Any]:
    """Next-token cross-entropy of a plain GPTModel (vocab-parallel, correct at any TP size)."""
    from megatron.core import tensor_parallel

    out = gpt_forward(model, input_ids, gather=False)
    logits = out.logits[:, :-1].float()  # [b, s-1, V/tp]
    target = input_ids[:, 1:]
    mask = loss_mask[:, 1:].float()
    ce = tensor_parallel.vocab_parallel_cross_entropy(logits.transpose(0, 1).contiguous(),
                                                      target.transpose(0, 1).contiguous()).transpose(0, 1)
    loss = (ce * mask).sum() / mask.sum().clamp(min=1.0)
    return {"loss": loss, "step_losses": [loss.detach()], "step_acc": []}


def check_data_fits(samples: Sequence[Any], cfg: Any) -> None:
    """ConfigError when tokenised ``samples`` hold a token id outside the model's vocabulary (a tokenizer that is
    not the base's) or, for learned positions, are longer than the model's positions (both were IndexErrors inside
    torch's embedding at the first such batch)."""
    ids = [s.input_ids for s in samples if s.input_ids.numel()]
    lo, hi = min((int(x.min()) for x in ids), default=0), max((int(x.max()) for x in ids), default=-1)
    if lo < 0 or hi >= cfg.vocab_size:
        bad = hi if hi >= cfg.vocab_size else lo
        raise ConfigError(f"the training data holds token id {bad}, outside the base model's vocabulary [0, "
                          f"{cfg.vocab_size}): the tokenizer (tokenizer_path, or the checkpoint's tokenizer/) does "
                          f"not match the base model")
    longest = max((int(x.numel()) for x in ids), default=0)
    if cfg.position_embedding == "learned" and longest > cfg.max_position_embeddings:
        raise ConfigError(f"training samples are up to {longest} tokens (data.max_seq_len) but the base model has "
                          f"{cfg.max_position_embeddings} learned positions (max_position_embeddings); lower "
                          f"data.max_seq_len")


class SpeculativeLightningModule(pl.LightningModule):
    """Draft (or plain LM) training around a megatron-core model built in ``configure_model``.

    Give ``model_config`` (random base, for tests), ``model_path`` (loaded with nemo_spec.checkpoint.load_model)
    or ``model_factory`` (a callable returning the model). ``model_transform`` (e.g. a SpeculativeTransform) is
    applied right after the model is built, before ``configure_optimizers``.
    """

    def __init__(self, model_config: Optional[ModelConfig] = None, model_path: Optional[str] = None,
                 model_transform: Optional[Callable[[torch.nn.Module], torch.nn.Module]] = None,
                 optim: Optional[OptimConfig] = None, loss: Optional[LossConfig] = None, max_steps: int = 100,
                 model_factory: Optional[Callable[[], torch.nn.Module]] = None,
                 draft_vocab_counts: Optional[Callable[[int], torch.Tensor] | torch.Tensor] = None, seed: int = 1234,
                 params_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if sum(x is not None for x in (model_config, model_path, model_factory)) != 1:
            raise ValueError("give exactly one of model_config, model_path, model_factory")
        self.model_config = model_config
        self.model_path = model_path
        self.model_factory = model_factory
        self.model_transform = model_transform
        self.optim = (optim or OptimConfig()).validate()
        self.loss_cfg = loss or LossConfig()
        self.max_steps = max_steps
        self.draft_vocab_counts = draft_vocab_counts
        self.seed = seed
        self.params_dtype = params_dtype
        self.model: Optional[torch.nn.Module] = None
        self._consumed_in_epoch = 0  # global samples of the current data epoch trained on
        # The data epoch (the sampler's shuffle) is Lightning's epoch + this offset: a checkpoint Lightning saves when
        # training ends mid-epoch (max_steps, max_time_s) counts that epoch as finished, so the resumed run finishes
        # the data epoch in Lightning's next one.
        self._data_epoch = 0
        self._epoch_offset = 0
        self._resume_position: Optional[Dict[str, int]] = None
        self._resumed_epoch: Optional[int] = None  # epoch whose data position on_train_start restored
        self.samples_per_batch = 0  # global samples per micro-batch step (train_bs x DP), set by the runner

    # ---- model ------------------------------------------------------------------------------------------
    def configure_model(self) -> None:
        """Build the model and apply ``model_transform`` (before optimizers are created)."""
        if self.model is not None:
            return
        torch.manual_seed(self.seed)
        if self.model_factory is not None:
            model = self.model_factory()
        elif self.model_path is not None:
            from nemo_spec.checkpoint import load_model

            model = load_model(self.model_path)
        else:
            from nemo_spec.models import build_gpt

            model = build_gpt(self.model_config, params_dtype=self.params_dtype)
        if self.model_transform is not None:
            model = self.model_transform(model)
        if self.draft_vocab_counts is not None and getattr(model, "algorithm", None) in ("eagle3", "peagle"):
            counts = self.draft_vocab_counts
            if callable(counts):
                counts = counts(model.model_config.vocab_size)
            model.set_draft_vocab(counts.to(next(model.parameters()).device))
        self.model = model
        n_train = sum(p.numel() for p in self.trainable_parameters())
        n_all = sum(p.numel() for p in model.parameters())
        log.info("model ready: %d trainable / %d parameters on this rank", n_train, n_all)

    @property
    def is_speculative(self) -> bool:
        """Whether the model carries a draft (SpeculativeGPT)."""
        return hasattr(self.model, "training_losses") and hasattr(self.model, "draft")

    def trainable_parameters(self) -> Iterator[torch.nn.Parameter]:
        """Parameters with requires_grad (the draft, or everything for a plain GPT)."""
        return (p for p in self.model.parameters() if p.requires_grad)

    def trainable_state_dict(self) -> Dict[str, torch.Tensor]:
        """State-dict entries of the trainable part (draft params + buffers such as d2t; all for a plain GPT)."""
        if self.is_speculative:
            prefix = "model." + self.model.draft_prefix
            return {f"{prefix}{k}": v for k, v in self.model.draft.state_dict().items()
                    if isinstance(v, torch.Tensor)}
        return {k: v for k, v in self.state_dict().items() if isinstance(v, torch.Tensor)}

    def trainable_sharded_state_dict(self) -> Dict[str, Any]:
        """The trainable state as megatron ShardedTensors (or factories), keyed like :meth:`trainable_state_dict`.

        Taken from the model's own ``sharded_state_dict()``, so TP-sharded parameters carry their real sharding
        and replica ids (DP replicas and TP-replicated tensors are written once); ``.data`` is the live tensor.
        """
        from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

        prefix = "model."
        want = set(self.trainable_state_dict())
        out = {prefix + k: v for k, v in self.model.sharded_state_dict().items()
               if prefix + k in want and isinstance(v, (ShardedTensor, ShardedTensorFactory))}
        missing = sorted(want - set(out))
        if missing:
            raise RuntimeError(f"trainable tensors without a sharded_state_dict entry: {missing[:6]}")
        return out

    # ---- steps ------------------------------------------------------------------------------------------
    def compute_losses(self, batch: Dict[str, torch.Tensor],
                       generator: Optional[torch.Generator] = None) -> Dict[str, Any]:
        """Loss dict for a batch (draft losses, or LM loss for a plain GPT); ``generator``: the draft objective's
        sampling (P-EAGLE COD, DFlash anchors)."""
        if "base_hidden" not in batch:  # the base runs: its MoE layers need equal token counts over EP
            batch = pad_for_expert_parallel(batch)
        ids, mask = batch["input_ids"], batch["loss_mask"]
        if not self.is_speculative:
            return lm_loss(self.model, ids, mask)
        base_out = None
        if "base_hidden" in batch:  # offline mode: stored base states, targets through the frozen head
            from nemo_spec.training.offline import base_output_from_batch

            base_out = base_output_from_batch(self.model, batch)
        return self.model.training_losses(ids, mask.bool(), base_out=base_out, decay=self.loss_cfg.decay,
                                          eagle1_ce_weight=self.loss_cfg.eagle1_ce_weight, generator=generator)

    def sampling_generator(self, stage: str, batch_idx: int) -> torch.Generator:
        """The draft objective's RNG for one micro-batch: seeded from the run seed, the stage, the data epoch and the
        batch's place in it (restored exactly on resume; the same on every TP rank, which see the same batch)."""
        try:
            epoch = self.trainer.current_epoch + self._epoch_offset
        except RuntimeError:  # not attached to a Trainer (a step called directly)
            epoch = 0
        if stage == "train" and self.samples_per_batch:  # the data position, not Lightning's batch counter
            batch_idx = self._consumed_in_epoch // self.samples_per_batch
        key = (int(self.seed) * 1_000_003 + {"train": 0, "val": 1}[stage] * 7919 + epoch * 104_729 + batch_idx)
        return torch.Generator().manual_seed(key % (2 ** 63))

    def _log_losses(self, out: Dict[str, Any], stage: str, batch_size: int) -> None:
        on_step = stage == "train"
        self.log(f"{stage}_loss", out["loss"].detach(), prog_bar=True, on_step=on_step, on_epoch=not on_step,
                 batch_size=batch_size, sync_dist=not on_step)
        for i, v in enumerate(out.get("step_losses", [])):
            self.log(f"{stage}_loss_step{i}", torch.as_tensor(v, dtype=torch.float32), on_step=on_step,
                     on_epoch=not on_step, batch_size=batch_size, sync_dist=not on_step)
        for i, v in enumerate(out.get("step_acc", [])):
            self.log(f"{stage}_acc_step{i}", torch.as_tensor(v, dtype=torch.float32), on_step=on_step,
                     on_epoch=not on_step, prog_bar=(i == 0), batch_size=batch_size, sync_dist=not on_step)

    def training_step(self, batch: Dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.is_speculative:
            self.model.train_step = self.trainer.global_step  # the draft objective's schedules (restored on resume)
        out = self.compute_losses(batch, self.sampling_generator("train", batch_idx))
        self._consumed_in_epoch += self.samples_per_batch or batch["input_ids"].shape[0]
        self._log_losses(out, "train", batch["input_ids"].shape[0])
        self.log("lr", self.trainer.optimizers[0].param_groups[0]["lr"], on_step=True, batch_size=1)
        return out["loss"]

    def validation_step(self, batch: Dict[str, torch.Tensor], batch_idx: int) -> None:
        out = self.compute_losses(batch, self.sampling_generator("val", batch_idx))
        self._log_losses(out, "val", batch["input_ids"].shape[0])

    # ---- optimisation -----------------------------------------------------------------------------------
    def configure_optimizers(self) -> Dict[str, Any]:
        """AdamW over trainable parameters only (no decay on biases/norms) + warm-up/cosine schedule per step."""
        decay, no_decay = [], []
        for n, p in self.model.named_parameters():
            if not p.requires_grad:
                continue
            (no_decay if p.ndim < 2 or "norm" in n else decay).append(p)
        if not decay and not no_decay:
            raise RuntimeError("the model has no trainable parameters (did model_transform freeze everything?)")
        o = self.optim
        groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=o.lr, betas=tuple(o.betas), eps=o.eps)
        # max_steps < 1 (trainer.max_epochs bounds the run): decay over the steps Lightning computes for the epochs
        total = self.max_steps if self.max_steps > 0 else int(self.trainer.estimated_stepping_batches)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda step: warmup_cosine(step, o.warmup_steps, total, o.lr, o.min_lr) / o.lr)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": 1}}

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Optional[float] = None,
                                    gradient_clip_algorithm: Optional[str] = None) -> None:
        """Clip to ``optim.grad_clip`` by the global (TP-aware) gradient norm, identical on every rank; logs grad_norm.

        The Trainer's own gradient_clip_val is left unset (Lightning's norm would be per TP rank).
        """
        params = list(self.trainable_parameters())
        norm = tp_grad_norm(params)
        self.log("grad_norm", norm, on_step=True, batch_size=1)
        if gradient_clip_val is None:
            gradient_clip_val = self.optim.grad_clip
        if gradient_clip_val and gradient_clip_val > 0:
            coef = (gradient_clip_val / (norm + 1e-6)).clamp(max=1.0)  # no host sync
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(coef.to(p.grad.device, p.grad.dtype))

    # ---- data position for exact resume -----------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: Dict[str, Any]) -> None:
        checkpoint["data_position"] = {"epoch": int(self._data_epoch), "consumed_in_epoch": self._consumed_in_epoch,
                                       "epoch_offset": int(self._epoch_offset)}

    def on_load_checkpoint(self, checkpoint: Dict[str, Any]) -> None:
        self._resume_position = checkpoint.get("data_position")

    def on_fit_start(self) -> None:
        """Before the first step: the data must fit the model (token ids inside its vocabulary, samples within its
        learned positions); offline, the stored base states must come from this model (offline.check_model)."""
        from nemo_spec.models.gpt import unwrap
        from nemo_spec.speculative.transform import model_config_from_megatron

        dm = getattr(self.trainer, "datamodule", None)
        gpt = unwrap(self.model)  # another layer spec's GPTModel trained as it is (train_base) has no ModelConfig
        cfg = getattr(gpt, "nemo_spec_config", None) or model_config_from_megatron(gpt)
        for name in ("train_set", "val_set"):
            samples = getattr(getattr(dm, name, None), "samples", None)
            if samples:
                check_data_fits(samples, cfg)
        full = getattr(dm, "full", None)
        if full is not None and hasattr(full, "index") and hasattr(self.model, "base_forward"):
            from nemo_spec.training.offline import check_model

            check_model(full.index, self.model, full.dir)

    def on_train_start(self) -> None:
        """Mid-epoch resume: position the sampler here, as Lightning >= 2.5 does not call on_train_epoch_start for
        the restarted epoch (lightning 2.6.6 loops/fit_loop.py:447-452)."""
        self._resumed_epoch = self.current_epoch if self._apply_resume_position() else None
        loop = self.trainer.fit_loop
        if self._resumed_epoch is not None:
            self._rebase_batch_progress()
        if self._resumed_epoch is not None and self._epoch_offset < 0 and loop.max_epochs not in (None, -1):
            # Lightning counted the unfinished data epoch of a checkpoint saved when training ended as done: the
            # resumed run finishes it in a training epoch of its own, which max_epochs must not take from the data
            loop.max_epochs += -self._epoch_offset
        # A resume restores the optimizer's learning rate as the checkpoint's schedule set it; with another
        # trainer.max_steps the schedule (warm-up + cosine to max_steps) is another one: its rate from the first step
        # on (the restored rate was the old schedule's for one step: min_lr after a run that had reached its end)
        for cfg in getattr(self.trainer, "lr_scheduler_configs", None) or []:
            sched = cfg.scheduler
            if isinstance(sched, torch.optim.lr_scheduler.LambdaLR) and sched.last_epoch > 0:
                for group, base, fn in zip(sched.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas):
                    group["lr"] = base * fn(sched.last_epoch)

    def _rebase_batch_progress(self) -> None:
        """Count the restored epoch's micro-batches in this run's layout. Lightning restores its batch counters as the
        checkpoint's run counted them, in micro-batches of that run's size, and decides with them when to step the
        optimizer (``ready % accumulate_grad_batches``), when an epoch ends and when to validate: a resume with
        another split of the optimizer step (DP size, train_bs, accumulation) stepped on part of a step's samples,
        ended epochs early and trained samples twice or never (training review). The data position (whole
        optimizer steps, in samples) says how many of this run's micro-batches the epoch and the run have had; every
        counter moves by the same amount, so Lightning's restart bookkeeping (ready / started / processed /
        completed) keeps its shape."""
        if not self.samples_per_batch:
            return
        progress = self.trainer.fit_loop.epoch_loop.batch_progress
        acc = self.trainer.accumulate_grad_batches
        for counts, want in ((progress.current, self._consumed_in_epoch // self.samples_per_batch),
                             (progress.total, self.trainer.global_step * acc)):
            shift = want - counts.ready
            if shift:
                for field in ("ready", "started", "processed", "completed"):
                    setattr(counts, field, getattr(counts, field) + shift)

    def on_train_epoch_start(self) -> None:
        # Lightning 2.4 does call it for the restarted epoch, after on_train_start (2.4.0 loops/fit_loop.py:345-346):
        # keep the restored count there (resetting it made the next checkpoint's data position wrong).
        resumed, self._resumed_epoch = getattr(self, "_resumed_epoch", None), None
        if not self._apply_resume_position() and resumed != self.current_epoch:
            self._consumed_in_epoch = 0
            self._data_epoch = self.current_epoch + self._epoch_offset
            sampler = getattr(getattr(self.trainer, "datamodule", None), "train_sampler", None)
            if sampler is not None:  # each epoch its own shuffle (Lightning cannot find a batch sampler's set_epoch)
                sampler.set_epoch(self._data_epoch)

    def _apply_resume_position(self) -> bool:
        pos, self._resume_position = self._resume_position, None
        dm = getattr(self.trainer, "datamodule", None)
        sampler = getattr(dm, "train_sampler", None)
        if pos is None or sampler is None:
            return False
        epoch, consumed = int(pos["epoch"]), int(pos["consumed_in_epoch"])
        # a finished data epoch goes on with the next one where Lightning has left the training epoch it was read in
        # (2.6 restarts a checkpoint of an epoch's last step in the next epoch); Lightning 2.4 restarts that epoch
        # itself, whose remaining batches are then none
        if consumed >= sampler.samples_per_epoch() and self.current_epoch > epoch - int(pos.get("epoch_offset", 0)):
            epoch, consumed = epoch + 1, 0
        self._data_epoch, self._epoch_offset = epoch, epoch - self.current_epoch
        sampler.set_epoch(epoch)
        sampler.skip_samples(consumed)
        self._consumed_in_epoch = consumed
        log.info("resuming data epoch %d after %d consumed samples%s", epoch, consumed,
                 f" (in training epoch {self.current_epoch})" if self._epoch_offset else "")
        return True
