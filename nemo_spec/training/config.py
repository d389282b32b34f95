"""Typed training configuration; Hydra YAML (conf/train.yaml and its groups) maps onto these dataclasses."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from nemo_spec.config import ConfigError, SpeculativeConfig, check_field_types
from nemo_spec.data.datamodule import DataConfig


@dataclass
class OptimConfig:
    """AdamW + linear warm-up then cosine decay to ``min_lr``."""

    lr: float = 3e-4
    min_lr: float = 3e-5
    weight_decay: float = 0.0
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    warmup_steps: int = 10
    grad_clip: float = 1.0  # 0 disables clipping

    def validate(self) -> "OptimConfig":
        """Raise ConfigError naming the first invalid field."""
        if not self.lr > 0:
            raise ConfigError(f"optim.lr must be > 0, got {self.lr}")
        if not 0 <= self.min_lr <= self.lr:
            raise ConfigError(f"optim.min_lr must be in [0, lr={self.lr}], got {self.min_lr}")
        if self.warmup_steps < 0:
            raise ConfigError(f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.grad_clip < 0:
            raise ConfigError(f"optim.grad_clip must be >= 0, got {self.grad_clip}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"optim.betas must be two values in [0, 1), got {self.betas}")
        if not self.eps > 0:
            raise ConfigError(f"optim.eps must be > 0, got {self.eps}")
        if self.weight_decay < 0:
            raise ConfigError(f"optim.weight_decay must be >= 0, got {self.weight_decay}")
        return self


@dataclass
class LossConfig:
    """Draft-loss knobs passed to SpeculativeGPT.training_losses."""

    decay: float = 0.8  # EAGLE-3 step / Medusa head weight decay^i
    eagle1_ce_weight: float = 0.1

    def validate(self) -> "LossConfig":
        """Raise ConfigError naming the first invalid field."""
        if not 0 < self.decay <= 1:
            raise ConfigError(f"loss.decay must be in (0, 1], got {self.decay}")
        if self.eagle1_ce_weight < 0:
            raise ConfigError(f"loss.eagle1_ce_weight must be >= 0, got {self.eagle1_ce_weight}")
        return self


@dataclass
class TrainerConfig:
    """Devices, precision, batch sizes, schedule, logging, checkpoints, validation."""

    accelerator: str = "cpu"  # cpu | gpu
    precision: str = "32-true"  # 32-true on CPU, bf16-mixed on GPU
    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1  # MoE base: experts split over EP ranks (TP x EP divides the world size)
    train_bs: int = 2  # micro-batch per data-parallel rank
    global_batch_size: Optional[int] = None  # None -> train_bs * data-parallel size (no accumulation)
    max_steps: int = 100
    max_epochs: int = -1
    max_time_s: Optional[float] = None  # stop after this much training time (Lightning max_time); None: no limit
    val_check_interval: int = 50  # optimizer steps between validations (0 disables)
    limit_val_batches: int = 8
    log_every_n_steps: int = 1
    ckpt_every_n_steps: int = 50  # 0 disables periodic checkpoints
    seed: int = 1234
    progress_bar: bool = True
    acceptance_prompts: int = 4  # held-out prompts for the tau (acceptance length) measurement; 0 disables
    acceptance_depth: int = 4  # chain draft depth K for tau
    acceptance_new_tokens: int = 24

    def validate(self) -> "TrainerConfig":
        """Raise ConfigError naming the first invalid field."""
        if self.accelerator not in ("cpu", "gpu"):
            raise ConfigError(f"trainer.accelerator must be 'cpu' or 'gpu', got {self.accelerator!r}")
        if self.precision not in ("32-true", "bf16-mixed", "bf16-true"):
            raise ConfigError(f"trainer.precision must be 32-true, bf16-mixed or bf16-true, got {self.precision!r}")
        if self.train_bs < 1:
            raise ConfigError(f"trainer.train_bs must be >= 1, got {self.train_bs}")
        for name in ("tensor_parallel_size", "expert_parallel_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"trainer.{name} must be a positive int, got {v!r}")
        if self.max_time_s is not None and (isinstance(self.max_time_s, bool) or
                                            not isinstance(self.max_time_s, (int, float)) or self.max_time_s <= 0):
            raise ConfigError(f"trainer.max_time_s must be a number of seconds > 0 or null, got {self.max_time_s!r}")
        if self.max_steps < 1 and self.max_epochs < 1:
            raise ConfigError("set trainer.max_steps or trainer.max_epochs to a positive value")
        if self.global_batch_size is not None and self.global_batch_size < 1:
            raise ConfigError(f"trainer.global_batch_size must be >= 1 or null, got {self.global_batch_size}")
        for name in ("val_check_interval", "limit_val_batches", "ckpt_every_n_steps", "acceptance_prompts"):
            if getattr(self, name) < 0:
                raise ConfigError(f"trainer.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("log_every_n_steps", "acceptance_depth", "acceptance_new_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"trainer.{name} must be >= 1, got {getattr(self, name)}")
        return self

    def accumulation(self, dp_size: int) -> int:
        """Gradient-accumulation steps that keep ``global_batch_size`` constant at this data-parallel size."""
        if self.global_batch_size is None:
            return 1
        per_step = self.train_bs * dp_size
        if self.global_batch_size % per_step:
            raise ConfigError(f"trainer.global_batch_size={self.global_batch_size} is not a multiple of "
                              f"train_bs ({self.train_bs}) x data-parallel size ({dp_size})")
        return self.global_batch_size // per_step


@dataclass
class TrainConfig:
    """Everything a draft-training run needs."""

    model_path: Optional[str] = None  # base or already-transformed checkpoint (torch_dist, legacy, HF)
    tokenizer_path: Optional[str] = None  # default: the checkpoint's tokenizer/ dir
    run_dir: str = "runs/speculative"
    resume: Optional[str] = None  # "auto" (run_dir/checkpoints/last if present), a checkpoint dir, or None
    offline: bool = False  # train from precomputed base outputs (data.offline_dir)
    train_base: bool = False  # no draft: train the whole GPT with the LM loss (base pretraining / fine-tuning)
    spec: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)

    def validate(self) -> "TrainConfig":
        """Validate every section (before any heavy work)."""
        if not self.train_base:
            self.spec.validate()
        self.trainer.validate()
        if self.train_base and self.trainer.expert_parallel_size > 1:
            raise ConfigError(f"train_base=true with trainer.expert_parallel_size={self.trainer.expert_parallel_size} "
                              "is not supported: expert gradients would need the expert-data-parallel reduction "
                              "(draft training at EP > 1 is; the base is frozen)")
        self.optim.validate()
        self.loss.validate()
        self.data.validate()
        if self.offline and not self.data.offline_dir:
            raise ConfigError("offline=true needs data.offline_dir (made by nemo_spec.training.offline.precompute)")
        return self


def _build(cls: type, d: Dict[str, Any], where: str) -> Any:
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - set(known))
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {unknown}; known: {sorted(known)}")
    kw = {}
    for k, v in d.items():
        sub = _SECTIONS.get((cls, k))
        if sub is not None and v is not None and not isinstance(v, dict):
            raise ConfigError(f"{where}.{k} must be a mapping of {sub.__name__} fields, got {v!r}")
        kw[k] = _build(sub, v or {}, f"{where}.{k}") if sub is not None else v
    if cls is TrainConfig and kw.get("resume") is False:
        kw["resume"] = None  # resume=false: the natural way to say "start fresh"
    obj = cls(**kw)
    check_field_types(obj, where[len("train."):] if where.startswith("train.") else "")
    return obj


_SECTIONS = {(TrainConfig, "spec"): SpeculativeConfig, (TrainConfig, "loss"): LossConfig,
             (TrainConfig, "data"): DataConfig, (TrainConfig, "trainer"): TrainerConfig,
             (TrainConfig, "optim"): OptimConfig}


def train_config_from_dict(d: Dict[str, Any]) -> TrainConfig:
    """Typed TrainConfig from a plain dict (e.g. ``OmegaConf.to_container(cfg, resolve=True)``)."""
    return _build(TrainConfig, dict(d), "train")


def train_config_to_dict(cfg: TrainConfig) -> Dict[str, Any]:
    """Plain dict of a TrainConfig."""
    return dataclasses.asdict(cfg)
