"""Checkpoints: Megatron torch_dist (+ nemo_spec_config.json), Megatron-LM legacy/torch_dist, Hugging Face (hf.py)."""
from nemo_spec.checkpoint import tp  # noqa: F401
from nemo_spec.checkpoint.megatron import (
    CheckpointConfigError,
    CheckpointError,
    detect_format,
    find_tokenizer_dir,
    load_model,
    read_checkpoint_config,
    save_checkpoint,
)

__all__ = ["tp", "CheckpointError", "CheckpointConfigError", "detect_format", "find_tokenizer_dir", "load_model",
           "read_checkpoint_config", "save_checkpoint"]
