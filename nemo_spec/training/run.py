"""The draft-training recipe: config -> data -> model (+ SpeculativeTransform) -> Lightning Trainer -> checkpoints."""
from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, Timer, TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from nemo_spec.config import ConfigError, dump_json, setting_differences
from nemo_spec.training.callbacks import AcceptanceLengthCallback
from nemo_spec.training.config import TrainConfig, TrainerConfig, train_config_to_dict
from nemo_spec.training.module import SpeculativeLightningModule
from nemo_spec.training.strategy import MegatronStrategy, TrainCheckpointError

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    """What a finished run produced."""

    module: SpeculativeLightningModule
    trainer: pl.Trainer
    run_dir: Path
    final_checkpoint: Optional[Path] = None
    tau_history: List[Tuple[int, float]] = field(default_factory=list)  # (step, tau), first = untrained


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _writes_run_files() -> bool:
    """Whether this process writes the run directory's own files (global rank 0, before or after the process
    groups exist)."""
    from nemo_spec.parallel import is_rank_zero

    return is_rank_zero() and int(os.environ.get("RANK", "0")) == 0


def save_resolved_config(cfg: TrainConfig, run_dir: Path, yaml_text: Optional[str] = None) -> Path:
    """Write the resolved config into the run directory (config.json, and config.yaml when given); rank 0 only."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if _writes_run_files():
        _atomic_write(run_dir / "config.json", dump_json(train_config_to_dict(cfg)))
        if yaml_text is not None:
            _atomic_write(run_dir / "config.yaml", yaml_text)
    return run_dir / "config.json"


def planned_dp_size(tp: int, ep: int = 1) -> int:
    """Data-parallel size this process will run with (from torchrun's WORLD_SIZE)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world % tp:
        raise ConfigError(f"trainer.tensor_parallel_size={tp} does not divide the world size {world}")
    if world % (tp * ep):
        raise ConfigError(f"trainer.expert_parallel_size={ep} x trainer.tensor_parallel_size={tp} = {tp * ep} does "
                          f"not divide the world size {world}")
    return world // tp


#: Lightning decides ``last`` at a validation as below from 2.6.0 on (2.5.3 added only the train-end save)
_LIGHTNING_2_6 = tuple(int(x) for x in pl.__version__.split(".")[:2]) >= (2, 6)


class AtomicLinkCheckpoint(ModelCheckpoint):
    """ModelCheckpoint whose ``last`` link is swapped atomically: a fresh symlink is renamed over the old one, so a
    crash never leaves a run without ``last`` (Lightning's own version removes the link first)."""

    @staticmethod
    def _link_checkpoint(trainer: pl.Trainer, filepath: str, linkpath: str) -> None:
        if trainer.is_global_zero and os.path.abspath(filepath) != os.path.abspath(linkpath):
            tmp = f"{linkpath}.link-tmp"
            if os.path.lexists(tmp):
                os.remove(tmp)
            os.symlink(os.path.relpath(filepath, os.path.dirname(linkpath)), tmp)
            if os.path.isdir(linkpath) and not os.path.islink(linkpath):
                shutil.rmtree(linkpath)
            os.replace(tmp, linkpath)
        trainer.strategy.barrier()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """``last`` when training ends before any checkpoint of this process (max_time_s, a stop, a run shorter than
        ckpt_every_n_steps), as Lightning >= 2.5.3 saves it (callbacks/model_checkpoint.py ``on_train_end``); 2.4,
        NeMo 2.7's pin, saved nothing, so such a run left nothing to resume."""
        if "on_train_end" in ModelCheckpoint.__dict__:
            super().on_train_end(trainer, pl_module)
        elif self.save_last and not self._last_checkpoint_saved:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """``last`` at a validation only where a checkpoint of this step exists or ``last`` already links one, as
        Lightning >= 2.6 decides (callbacks/model_checkpoint.py ``on_validation_end``, Lightning#21244). Before 2.6
        (2.4 is NeMo 2.7's pin) ``last`` was written at every validation, so the train-end save above saw a
        checkpoint and skipped: a run with no periodic checkpoint after its last validation left ``last`` at that
        validation's step, and a resume redid the steps after it. As in 2.6, a run killed after a validation but
        before its next periodic checkpoint now resumes from that checkpoint, not from the validation."""
        if _LIGHTNING_2_6:
            return super().on_validation_end(trainer, pl_module)
        if self._should_skip_saving_checkpoint(trainer) or self._should_save_on_train_epoch_end(trainer):
            return
        candidates = self._monitor_candidates(trainer)
        if getattr(self, "_defer_save_until_validation", False):  # 2.5.x: a save waiting for a monitored metric
            self._save_topk_checkpoint(trainer, candidates)
            self._save_last_checkpoint(trainer, candidates)
            self._defer_save_until_validation = False
            return
        if self._every_n_epochs >= 1 and (trainer.current_epoch + 1) % self._every_n_epochs == 0:
            self._save_topk_checkpoint(trainer, candidates)
        if self._last_global_step_saved == trainer.global_step or (self.save_last == "link"
                                                                   and self._last_checkpoint_saved):
            self._save_last_checkpoint(trainer, candidates)


class StepBoundaryTimer(Timer):
    """Lightning's Timer (``trainer.max_time_s``; elapsed time kept in checkpoints), checked only right after an
    optimizer step. Lightning's own checks after every micro-batch: a stop inside a gradient-accumulation group
    dropped the group's micro-batches while the data position had counted them, and the resumed run's steps
    straddled the accumulation boundaries (an inexact resume, found by the training review)."""

    @property
    def state_key(self) -> str:
        return "Timer"  # Lightning's, so the elapsed time of checkpoints written with its Timer is restored

    def on_train_start(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        self._checked_step = trainer.global_step
        super().on_train_start(trainer, *args, **kwargs)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        if trainer.global_step != getattr(self, "_checked_step", None):  # an optimizer step has just finished
            self._checked_step = trainer.global_step
            super().on_train_batch_end(trainer, *args, **kwargs)


def build_trainer(t: TrainerConfig, run_dir: Path, accumulate: int, callbacks: List[pl.Callback],
                  checkpoint_dir: Optional[Path] = None, loggers: bool = True) -> pl.Trainer:
    """A Lightning Trainer on the megatron-aware strategy with TensorBoard + CSV loggers."""
    strategy = MegatronStrategy(tensor_parallel_size=t.tensor_parallel_size, seed=t.seed, accelerator_kind=t.accelerator,
                                expert_parallel_size=t.expert_parallel_size)
    cbs = list(callbacks)
    if t.max_time_s is not None:
        cbs.append(StepBoundaryTimer(duration=datetime.timedelta(seconds=float(t.max_time_s))))
    if checkpoint_dir is not None and t.ckpt_every_n_steps > 0:
        ckpt = AtomicLinkCheckpoint(dirpath=str(checkpoint_dir), filename="step{step:07d}",
                                    auto_insert_metric_name=False, every_n_train_steps=t.ckpt_every_n_steps,
                                    save_top_k=-1, save_last="link", save_on_train_epoch_end=False,
                                    # a resumed run's checkpoints went to last-v1 beside `last`, which kept pointing
                                    # at the checkpoint it resumed from: a second resume went back there (Lightning
                                    # restores last_model_path as saved before the link existed)
                                    enable_version_counter=False)
        ckpt.CHECKPOINT_NAME_LAST = "last"
        ckpt.FILE_EXTENSION = ""
        cbs.append(ckpt)
    if t.progress_bar:
        cbs.append(TQDMProgressBar(refresh_rate=1))
    lg: Any = False
    if loggers:
        lg = [TensorBoardLogger(str(run_dir), name="tb", version=""), CSVLogger(str(run_dir), name="csv", version="")]
    val_every = t.val_check_interval * accumulate if t.val_check_interval > 0 else None
    return pl.Trainer(
        accelerator="gpu" if t.accelerator == "gpu" else "cpu", devices=1, strategy=strategy, precision=t.precision,
        max_steps=t.max_steps, max_epochs=t.max_epochs, accumulate_grad_batches=accumulate,
        gradient_clip_val=None, val_check_interval=val_every, check_val_every_n_epoch=None if val_every else 1,
        limit_val_batches=t.limit_val_batches if val_every else 0, num_sanity_val_steps=0,
        log_every_n_steps=t.log_every_n_steps, callbacks=cbs, logger=lg, enable_checkpointing=checkpoint_dir is not None
        and t.ckpt_every_n_steps > 0, enable_progress_bar=t.progress_bar, use_distributed_sampler=False,
        default_root_dir=str(run_dir), enable_model_summary=False, deterministic=False)


def token_counts(dataset: Any, vocab_size: int) -> torch.Tensor:
    """Frequencies [V] of the loss-masked (trained, e.g. assistant) target tokens of a tokenised dataset, for the
    EAGLE-3 draft vocabulary (as SafeAILab/EAGLE and SpecForge count them: prompts and templates are excluded).

    Raises ConfigError on a token id outside [0, vocab_size) (a tokenizer/base mismatch, not something to clamp).
    """
    counts = torch.zeros(vocab_size, dtype=torch.long)
    samples = dataset.samples if hasattr(dataset, "samples") else (dataset[i] for i in range(len(dataset)))
    for n, s in enumerate(samples):
        ids = s.input_ids if hasattr(s, "input_ids") else s["input_ids"]
        mask = s.loss_mask if hasattr(s, "loss_mask") else (s.get("loss_mask") if isinstance(s, dict) else None)
        ids = torch.as_tensor(ids).flatten()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            bad = int(ids.max()) if int(ids.max()) >= vocab_size else int(ids.min())
            raise ConfigError(f"sample {n}: token id {bad} outside the base vocabulary [0, {vocab_size}); the "
                              f"tokenizer does not match the base model")
        if mask is not None:
            ids = ids[torch.as_tensor(mask).flatten().bool()]
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


#: the ``resume`` values that start from scratch
NO_RESUME = (None, "", "none")


def resolve_resume(cfg: TrainConfig, ckpt_dir: Path) -> Optional[str]:
    """Checkpoint directory to resume from ('auto' -> ckpt_dir/last when it exists)."""
    if cfg.resume in NO_RESUME:
        return None
    if cfg.resume == "auto":
        last = ckpt_dir / "last"
        if last.is_symlink() and not last.exists():
            raise TrainCheckpointError(f"{last} points to {os.readlink(last)!r}, which does not exist; pass "
                                       f"resume=<a checkpoint dir> or resume=none")
        return str(last) if last.exists() else None
    if not Path(cfg.resume).exists():
        raise FileNotFoundError(f"resume={cfg.resume} does not exist")
    return cfg.resume


#: data / trainer fields a resumed run must share with its checkpoint (the rest may change: steps, logging, ...)
_RESUME_DATA = ("path", "format", "max_seq_len", "loss_on", "system_prompt", "val_fraction", "val_max_samples", "seed",
                "max_samples", "offline_dir")


#: data fields the stored states of an offline directory depend on (its own split is made when training)
_OFFLINE_DATA = ("path", "format", "max_seq_len", "loss_on", "system_prompt", "max_samples", "strict")


def _abs(path: Any) -> Any:
    if isinstance(path, (list, tuple)):
        return [_abs(p) for p in path]
    return str(Path(path).expanduser().resolve()) if isinstance(path, str) and path else path


def _data_settings(cfg: TrainConfig, keys: Tuple[str, ...]) -> Dict[str, Any]:
    """``data.<key>`` -> value of ``keys`` (paths resolved: the same data however its path is spelt)."""
    return {f"data.{k}": _abs(getattr(cfg.data, k)) if k in ("path", "offline_dir") else getattr(cfg.data, k)
            for k in keys}


#: the resume setting holding :func:`data_digest` (checkpoints written before it was recorded resume without it)
DATA_DIGEST = "data contents (digest of the files' names, sizes, first and last MiB)"


def data_digest(path: Any, fmt: str = "auto") -> Optional[str]:
    """A digest of the data files read from ``path`` (a file, a directory or a list of them; the files
    ``read_conversations`` reads for ``fmt``): names, sizes and their first and last MiB. None when a path is not on
    disk (records given in memory)."""
    import hashlib

    from nemo_spec.data.formats import EmptyDatasetError, data_files

    paths = [path] if isinstance(path, (str, os.PathLike)) else list(path or [])
    if not paths:
        return None
    h = hashlib.sha256()
    for p in map(Path, paths):
        if not p.exists():
            return None
        try:
            files = data_files(p, fmt)
        except EmptyDatasetError:  # reading it names the problem
            return None
        for f in files:
            size = f.stat().st_size
            h.update(f"{f.relative_to(p) if p.is_dir() else f.name}\0{size}\0".encode())
            with open(f, "rb") as fh:
                h.update(fh.read(1 << 20))
                if size > 2 << 20:
                    fh.seek(-(1 << 20), os.SEEK_END)
                    h.update(fh.read())
    return h.hexdigest()[:16]


#: the run setting that records the samples per optimizer step
GLOBAL_BATCH = "global batch (samples per optimizer step)"


def resume_settings(cfg: TrainConfig, global_batch: int) -> Dict[str, Any]:
    """What a run resumed from a training checkpoint must share with the run that wrote it, as ``section.field``
    -> value: the base, the data and its split, the draft, the loss and the optimiser, the global batch (samples
    per optimizer step; its split into micro-batches, TP and DP may change) and the seed. Steps, epochs, time,
    validation, logging and checkpoint cadence may change too."""
    d = train_config_to_dict(cfg)
    out: Dict[str, Any] = {"model_path": _abs(cfg.model_path), "train_base": cfg.train_base, "offline": cfg.offline}
    for sec in (("loss", "optim") if cfg.train_base else ("spec", "loss", "optim")):
        out.update({f"{sec}.{k}": v for k, v in d[sec].items()})
    out.update(_data_settings(cfg, _RESUME_DATA))
    # the same path with other contents: another split and shuffle (validation samples trained on) resumed silently
    out[DATA_DIGEST] = data_digest(cfg.data.path, cfg.data.format)
    out.update({"trainer.seed": cfg.trainer.seed, GLOBAL_BATCH: int(global_batch)})
    return json.loads(json.dumps(out))


def check_resume_settings(resume: str, settings: Dict[str, Any]) -> None:
    """Refuse to resume ``resume`` with ``settings`` (:func:`resume_settings`) other than those it was trained
    with (a checkpoint from before they were recorded passes): resume=auto would otherwise continue another run's
    draft in a shared run_dir, and the optimiser would keep the checkpoint's lr while config.json shows the new
    one."""
    from nemo_spec.training.strategy import read_train_checkpoint_meta

    saved = read_train_checkpoint_meta(Path(resume).resolve()).get("run_settings")
    if not isinstance(saved, dict):
        return
    if DATA_DIGEST not in saved:  # written before the digest was recorded
        settings = {k: v for k, v in settings.items() if k != DATA_DIGEST}
    diff = setting_differences(saved, settings, "in the checkpoint")
    if diff:
        shown = "; ".join(diff[:4])
        hint = ""
        if saved.get(GLOBAL_BATCH) != settings.get(GLOBAL_BATCH) and isinstance(saved.get(GLOBAL_BATCH), int):
            # trainer.global_batch_size: null makes it train_bs x DP size, so another DP size or train_bs changes it
            hint = (f" To resume on another DP size or train_bs, keep the checkpoint's global batch: "
                    f"trainer.global_batch_size={saved[GLOBAL_BATCH]} (the split into micro-batches may change).")
        raise ConfigError(f"resume={resume}: this run's settings differ from the checkpoint's ({shown}"
                          f"{'; ...' if len(diff) > 4 else ''}).{hint} Resume with the same settings, or start a new run: "
                          f"another run_dir, or resume=null to train from scratch in this one (to start from its "
                          f"weights instead, set model_path to a checkpoint saved from it, e.g. its final/)")


def _set_aside(old: Path, numbered: Callable[[int], Path]) -> Path:
    """Move ``old`` to the first ``numbered(k)``, k = 1, 2, ..., that does not exist; returns it."""
    k = 1
    while numbered(k).exists():
        k += 1
    os.replace(old, numbered(k))
    return numbered(k)


def _keep_earlier_metrics(run_dir: Path) -> None:
    """Lightning's CSVLogger deletes an existing csv/metrics.csv; a resumed run keeps it as metrics.<k>.csv."""
    old = run_dir / "csv" / "metrics.csv"
    if old.is_file():
        kept = _set_aside(old, lambda k: old.parent / f"metrics.{k}.csv")
        log.info("resuming: the earlier rows of %s are kept in %s", old, kept)


def _set_aside_earlier_checkpoints(ckpt_dir: Path) -> None:
    """A fresh start (resume=null) in a used run_dir: the earlier run's checkpoints move to checkpoints.<k>/.
    Left in place, Lightning wrote the new run's beside them as ``step...-v1`` / ``last-v1`` while ``last`` kept
    pointing at the old run, which the next ``resume=auto`` then continued (training review)."""
    if ckpt_dir.is_dir() and any(ckpt_dir.iterdir()):
        kept = _set_aside(ckpt_dir, lambda k: ckpt_dir.with_name(f"{ckpt_dir.name}.{k}"))
        log.warning("resume=null: the earlier run's checkpoints in %s are kept in %s; this run starts from scratch",
                    ckpt_dir, kept)


def train(cfg: TrainConfig, model_factory: Optional[Callable[[], torch.nn.Module]] = None, tokenizer: Any = None,
          records: Optional[List[Dict[str, Any]]] = None, datamodule: Optional[pl.LightningDataModule] = None,
          yaml_text: Optional[str] = None, save_final: bool = True) -> TrainResult:
    """Run draft training as configured; returns the module, trainer and the final checkpoint path."""
    from nemo_spec.data import SpecDataModule, load_tokenizer
    from nemo_spec.speculative import SpeculativeTransform

    cfg.validate()
    t = cfg.trainer
    if cfg.model_path is None and model_factory is None:
        raise ConfigError("model_path is required (a base or speculative checkpoint directory)")
    if cfg.model_path is not None and not Path(cfg.model_path).exists():
        raise FileNotFoundError(f"model_path={cfg.model_path} does not exist")
    run_dir = Path(cfg.run_dir)
    ckpt_dir = run_dir / "checkpoints"
    dp = planned_dp_size(t.tensor_parallel_size, t.expert_parallel_size)
    accumulate = t.accumulation(dp)
    global_batch = t.train_bs * dp * accumulate
    settings = resume_settings(cfg, global_batch)
    resume = resolve_resume(cfg, ckpt_dir)
    if resume is not None:  # before anything is written into the run directory
        check_resume_settings(resume, settings)
    elif cfg.resume in NO_RESUME and _writes_run_files():
        _set_aside_earlier_checkpoints(ckpt_dir)
    save_resolved_config(cfg, run_dir, yaml_text)
    from nemo_spec import parallel

    parallel.initialize(tensor_parallel_size=t.tensor_parallel_size, seed=t.seed,
                        expert_parallel_size=t.expert_parallel_size)  # the strategy reuses it
    pl.seed_everything(t.seed, workers=True, verbose=False)

    tok_dir = None
    if tokenizer is None and datamodule is None:
        tok_path = cfg.tokenizer_path
        if tok_path is None and cfg.model_path is not None:
            from nemo_spec.checkpoint import find_tokenizer_dir

            tok_path = find_tokenizer_dir(cfg.model_path)
        if tok_path is None:
            raise ConfigError(f"no tokenizer found in {cfg.model_path}; set tokenizer_path=...")
        tok_dir = str(tok_path)
        tokenizer = load_tokenizer(tok_path)
    elif cfg.tokenizer_path:
        tok_dir = cfg.tokenizer_path
    need_precompute = cfg.offline and not (Path(cfg.data.offline_dir) / "index.json").exists()
    offline_source = {"model_path": _abs(cfg.model_path), **_data_settings(cfg, _OFFLINE_DATA)}
    if cfg.offline and not need_precompute:
        from nemo_spec.training.offline import check_source, read_index

        check_source(read_index(cfg.data.offline_dir), offline_source, cfg.data.offline_dir)
    if need_precompute and not (cfg.data.path or records):
        raise ConfigError(f"offline=true: {cfg.data.offline_dir}/index.json does not exist and data.path is not set "
                          "to precompute it from")
    online_dm = None
    if datamodule is None:
        if not cfg.offline or need_precompute:
            data_cfg = cfg.data
            if resume is not None and data_cfg.num_workers:
                # Lightning 2.6 starts the training loader (its workers prefetch) before on_train_start restores the
                # data position: the first resumed batches came from the start of the wrong epoch (diff review)
                log.warning("resuming: data.num_workers=%d -> 0 for this run, so that the data position is restored "
                            "before the first batch is read", data_cfg.num_workers)
                data_cfg = dataclasses.replace(data_cfg, num_workers=0)
            online_dm = SpecDataModule(data_cfg, tokenizer, micro_batch_size=t.train_bs, records=records)
        if cfg.offline:
            from nemo_spec.training.offline import OfflineDataModule

            pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
            datamodule = OfflineDataModule(cfg.data.offline_dir, t.train_bs, seed=cfg.data.seed,
                                           val_fraction=cfg.data.val_fraction, val_max_samples=cfg.data.val_max_samples,
                                           pad_id=pad or 0)
        else:
            datamodule = online_dm

    # The transform is built here and applied inside configure_model (before the optimizer).
    transform = None if cfg.train_base else SpeculativeTransform(config=cfg.spec)
    counts = None
    if transform is not None and cfg.spec.algorithm in ("eagle3", "peagle") and cfg.spec.draft_vocab_size is not None:
        (online_dm or datamodule).setup()
        train_set = (online_dm or datamodule).train_set
        counts = lambda vocab_size: token_counts(train_set, vocab_size)  # noqa: E731
    module = SpeculativeLightningModule(model_path=cfg.model_path if model_factory is None else None,
                                        model_factory=model_factory, model_transform=transform, optim=cfg.optim,
                                        loss=cfg.loss, max_steps=t.max_steps, draft_vocab_counts=counts, seed=t.seed)
    module.samples_per_batch = t.train_bs * dp
    datamodule.accumulation = accumulate  # epochs end on whole optimizer steps (DataParallelBatchSampler)
    if need_precompute:
        from nemo_spec.training.offline import precompute

        online_dm.setup()
        module.configure_model()
        precompute(module.model, online_dm.train_set.samples + online_dm.val_set.samples, cfg.data.offline_dir,
                   source=offline_source)
    callbacks: List[pl.Callback] = []
    tau_cb = None
    if t.acceptance_prompts > 0 and hasattr(datamodule, "val_prompts") and transform is not None:
        tau_cb = AcceptanceLengthCallback(lambda: datamodule.val_prompts(t.acceptance_prompts),
                                          depth=t.acceptance_depth, max_new_tokens=t.acceptance_new_tokens)
        callbacks.append(tau_cb)
    if resume is not None and _writes_run_files():
        _keep_earlier_metrics(run_dir)
    trainer = build_trainer(t, run_dir, accumulate, callbacks, checkpoint_dir=ckpt_dir)
    trainer.strategy.run_settings = settings
    log.info("training: dp=%d tp=%d ep=%d micro-batch=%d accumulation=%d global batch=%d max_steps=%d resume=%s",
             dp, t.tensor_parallel_size, t.expert_parallel_size, t.train_bs, accumulate, global_batch, t.max_steps, resume)
    with warnings.catch_warnings():
        # The data position is restored by SpeculativeLightningModule (sampler skip), not by Lightning.
        warnings.filterwarnings("ignore", message=".*resuming from a checkpoint that ended before the epoch ended.*")
        # The frozen base runs in eval mode on purpose (no dropout in the features the draft learns from).
        warnings.filterwarnings("ignore", message=r".*module\(s\) in eval mode at the start of training.*")
        trainer.fit(module, datamodule=datamodule, ckpt_path=resume)
    final = None
    if save_final:
        from nemo_spec.checkpoint import save_checkpoint
        from nemo_spec.models import unwrap_speculative

        spec = unwrap_speculative(module.model)
        if spec is not None:  # generation keeps the draft's prompt context within what it was trained on
            spec.trained_seq_len = int(cfg.data.max_seq_len)
        final = save_checkpoint(module.model, run_dir / "final", tokenizer_dir=tok_dir,
                                extra={"trained_steps": int(trainer.global_step)}, overwrite=True)
    return TrainResult(module, trainer, run_dir, final, tau_cb.history if tau_cb else [])

