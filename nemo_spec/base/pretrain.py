"""Pretraining of the built-in base GPT with Lightning: packed sequences, AdamW, warm-up + cosine, held-out eval.

Self-contained (single process, TP=1). The model is the project's megatron-core GPTModel
(:func:`nemo_spec.models.build_gpt`), run through :func:`nemo_spec.models.gpt_forward`.
"""
from __future__ import annotations

import logging
import math
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, Sampler

from nemo_spec.base.presets import TrainConfig
from nemo_spec.config import ModelConfig

log = logging.getLogger(__name__)


def pack_documents(docs: Sequence[Sequence[int]]) -> torch.Tensor:
    """Concatenate token-id documents into one 1-D LongTensor stream."""
    total = sum(len(d) for d in docs)
    out = torch.empty(total, dtype=torch.long)
    pos = 0
    for d in docs:
        out[pos:pos + len(d)] = torch.as_tensor(d, dtype=torch.long)
        pos += len(d)
    return out


class PackedSequences(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` tokens of a packed stream (inputs and shifted labels)."""

    def __init__(self, stream: torch.Tensor, seq_len: int, max_sequences: Optional[int] = None) -> None:
        n = (stream.numel() - 1) // seq_len
        if max_sequences is not None:
            n = min(n, max_sequences)
        if n <= 0:
            raise ValueError(f"token stream of {stream.numel()} tokens is shorter than one sequence of {seq_len + 1}")
        self.stream, self.seq_len, self.n = stream, seq_len, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        s = i * self.seq_len
        window = self.stream[s:s + self.seq_len + 1]
        return {"input_ids": window[:-1], "labels": window[1:]}


class EpochShuffleSampler(Sampler[int]):
    """Exactly ``num_samples`` indices: seeded permutations of the dataset, one after another."""

    def __init__(self, dataset_len: int, num_samples: int, seed: int) -> None:
        self.dataset_len, self.num_samples, self.seed = dataset_len, num_samples, seed

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator().manual_seed(self.seed)
        left, epoch = self.num_samples, 0
        while left > 0:
            perm = torch.randperm(self.dataset_len, generator=g).tolist()
            yield from perm[:left]
            left -= len(perm[:left])
            epoch += 1


class StepLog(L.Callback):
    """Logs step, loss, throughput and ETA about ``times`` times per run (useful when stderr is not a terminal)."""

    def __init__(self, tokens_per_step: int, times: int = 10) -> None:
        self.tokens_per_step, self.times = tokens_per_step, times
        self.t0 = self.cpu0 = 0.0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.t0, self.cpu0 = time.time(), time.process_time()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        step, total = trainer.global_step, trainer.max_steps
        every = max(1, total // self.times)
        if step % every and step != total:
            return
        dt = time.time() - self.t0
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        log.info("step %d/%d loss %.4f | %.0f tok/s | elapsed %.0f s (cpu %.0f s), ETA %.0f s", step, total,
                 float(loss), step * self.tokens_per_step / max(dt, 1e-9), dt, time.process_time() - self.cpu0,
                 dt / max(step, 1) * (total - step))


def _progress_bar(refresh_rate: int) -> L.Callback:
    """Rich bar in a terminal, else tqdm (which still prints elapsed/ETA lines into a log file)."""
    from lightning.pytorch.callbacks import TQDMProgressBar

    if sys.stderr.isatty():
        try:
            from lightning.pytorch.callbacks import RichProgressBar

            return RichProgressBar()
        except (ImportError, ModuleNotFoundError):
            pass
    return TQDMProgressBar(refresh_rate=refresh_rate)


def lr_lambda(step: int, warmup: int, max_steps: int, min_ratio: float) -> float:
    """Linear warm-up then cosine decay to ``min_ratio`` of the peak learning rate."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class PretrainModule(L.LightningModule):
    """Next-token pretraining of a megatron-core GPT; ``heldout_loss`` is logged on validation."""

    def __init__(self, model_config: ModelConfig, train: TrainConfig, seed: int) -> None:
        super().__init__()
        from nemo_spec.models import build_gpt

        self.train_cfg = train
        torch.manual_seed(seed)  # deterministic initialisation
        self.model = build_gpt(model_config)

    def _loss(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        from nemo_spec.models import gpt_forward

        out = gpt_forward(self.model, batch["input_ids"])
        return F.cross_entropy(out.logits.float().reshape(-1, out.logits.shape[-1]), batch["labels"].reshape(-1))

    def training_step(self, batch: Dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("loss", loss, prog_bar=True, on_step=True, on_epoch=False, batch_size=batch["input_ids"].shape[0])
        self.log("lr", self.optimizers().param_groups[0]["lr"], prog_bar=False, on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch: Dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        # equal-length sequences: the batch-size-weighted mean over batches is the per-token mean
        self.log("heldout_loss", loss, prog_bar=True, on_step=False, on_epoch=True,
                 batch_size=batch["input_ids"].shape[0])
        return loss

    def configure_optimizers(self):
        t = self.train_cfg
        decay = [p for p in self.model.parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.requires_grad and p.dim() < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                                 {"params": no_decay, "weight_decay": 0.0}], lr=t.lr, betas=(0.9, 0.95), eps=1e-8)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: lr_lambda(s, t.warmup_steps, t.max_steps, t.min_lr_ratio))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def pretrain(model_config: ModelConfig, train: TrainConfig, train_stream: torch.Tensor,
             heldout_stream: torch.Tensor, seed: int, log_dir: Optional[Path] = None,
             progress: bool = True) -> Tuple[PretrainModule, Dict[str, Any]]:
    """Pretrain a fresh GPT on ``train_stream``; returns ``(module, metrics)`` with the held-out loss."""
    L.seed_everything(seed, workers=True, verbose=False)
    train_ds = PackedSequences(train_stream, train.seq_len)
    eval_ds = PackedSequences(heldout_stream, train.seq_len, max_sequences=max(1, train.eval_tokens // train.seq_len))
    num_samples = train.max_steps * train.micro_batch_size
    train_dl = DataLoader(train_ds, batch_size=train.micro_batch_size, drop_last=True,
                          sampler=EpochShuffleSampler(len(train_ds), num_samples, seed))
    eval_dl = DataLoader(eval_ds, batch_size=train.micro_batch_size, shuffle=False)
    module = PretrainModule(model_config, train, seed)
    loggers: List = []
    if log_dir is not None:
        from lightning.pytorch.loggers import CSVLogger

        loggers.append(CSVLogger(str(log_dir), name="", version=""))
    gpu = torch.cuda.is_available()
    callbacks: List[L.Callback] = [StepLog(train.micro_batch_size * train.seq_len)]
    if progress:
        callbacks.append(_progress_bar(max(1, train.max_steps // 20)))
    trainer = L.Trainer(callbacks=callbacks, 
        accelerator="gpu" if gpu else "cpu", devices=1, max_steps=train.max_steps, max_epochs=1,
        precision="bf16-mixed" if gpu else "32-true", gradient_clip_val=train.grad_clip or None,
        logger=loggers or False, enable_checkpointing=False, enable_progress_bar=progress,
        enable_model_summary=False, limit_val_batches=0, log_every_n_steps=max(1, min(10, train.max_steps // 10)),
        deterministic=True if not gpu else "warn", num_sanity_val_steps=0,
    )
    log.info("pretraining %d steps x %d x %d tokens = %.2fM tokens (%d train sequences available)",
             train.max_steps, train.micro_batch_size, train.seq_len, train.train_tokens / 1e6, len(train_ds))
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        trainer.fit(module, train_dataloaders=train_dl)
    finally:  # the Trainer switches deterministic algorithms on process-wide; restore the caller's setting
        torch.use_deterministic_algorithms(was_deterministic)
    final_train_loss = float(trainer.callback_metrics.get("loss", float("nan")))
    eval_trainer = L.Trainer(callbacks=[_progress_bar(1)] if progress else None, accelerator="gpu" if gpu else "cpu", devices=1, logger=False,
                             enable_checkpointing=False, enable_progress_bar=progress, enable_model_summary=False,
                             precision="bf16-mixed" if gpu else "32-true")
    res = eval_trainer.validate(module, dataloaders=eval_dl, verbose=False)
    heldout = float(res[0]["heldout_loss"])
    metrics = {
        "heldout_loss": heldout,
        "heldout_perplexity": math.exp(heldout) if heldout < 50 else float("inf"),
        "heldout_tokens": len(eval_ds) * train.seq_len,
        "final_train_loss": final_train_loss,
        "train_tokens": train.train_tokens,
        "train_steps": train.max_steps,
    }
    return module, metrics
