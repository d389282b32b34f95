"""Draft training: typed config, LightningModule, megatron-aware strategy, callbacks, offline precompute, recipe."""
from nemo_spec.training.callbacks import AcceptanceLengthCallback, measure_tau
from nemo_spec.training.config import (LossConfig, OptimConfig, TrainConfig, TrainerConfig, train_config_from_dict,
                                       train_config_to_dict)
from nemo_spec.training.module import SpeculativeLightningModule, lm_loss, tp_grad_norm, warmup_cosine
from nemo_spec.training.run import TrainResult, build_trainer, save_resolved_config, train
from nemo_spec.training.strategy import MegatronStrategy, TrainCheckpointError

__all__ = ["AcceptanceLengthCallback", "measure_tau", "LossConfig", "OptimConfig", "TrainConfig", "TrainerConfig",
           "train_config_from_dict", "train_config_to_dict", "SpeculativeLightningModule", "lm_loss", "tp_grad_norm",
           "warmup_cosine", "TrainResult", "build_trainer", "save_resolved_config", "train", "MegatronStrategy",
           "TrainCheckpointError"]
