"""Megatron Bridge checkpoints (NeMo 3's LLM training: ``megatron-bridge``), read without Bridge installed.

Layout (as Megatron Bridge 0.3.1 writes it, megatron/bridge/training/checkpointing.py ``save_checkpoint``)::

    <root>/latest_checkpointed_iteration.txt   the step (Megatron-LM's tracker file, kept for compatibility)
    <root>/iter_NNNNNNN/run_config.yaml        the whole ConfigContainer; ``model:`` is the model provider
                                               (GPTModelProvider / LlamaModelProvider ... fields: TransformerConfig
                                               names, as NeMo 2's GPTConfig)
    <root>/iter_NNNNNNN/common.pt, .metadata   megatron ``torch_dist`` (no Megatron-LM ``args``; keys as GPTModel's
                                               sharded state dict, TE norm names ``linear_qkv.layer_norm_weight``)
    <root>/iter_NNNNNNN/tokenizer/             the tokenizer files (``save_tokenizer_assets``, on by default)

The architecture comes from ``run_config.yaml`` through the NeMo 2 mapping (same field names, and the provider's own
RoPE switch ``rope_scaling`` + ``rope_scaling_factor``; anything nemo_spec's layer spec cannot represent is refused,
naming the field); the padded vocabulary from the weights' metadata;
weights load at any TP size through ``dist_checkpointing``.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Dict, Optional

import torch

log = logging.getLogger(__name__)

RUN_CONFIG = "run_config.yaml"
FORMAT = "megatron_bridge"


def _iter_dir(p: Path) -> Optional[Path]:
    """The iteration directory of a Bridge root (tracker file) or ``p`` itself, when it holds a run_config.yaml."""
    from nemo_spec.checkpoint import legacy

    if (p / legacy.TRACKER).is_file():
        iteration, release = legacy.read_tracker(p / legacy.TRACKER)
        p = p / ("release" if release else f"iter_{iteration:07d}")
    return p if (p / RUN_CONFIG).is_file() and (p / "common.pt").is_file() else None


def is_bridge_dir(p: Path) -> bool:
    """Whether ``p`` is a Megatron Bridge checkpoint root or iteration directory."""
    try:
        return _iter_dir(p) is not None
    except Exception:  # noqa: BLE001 - an unreadable tracker is not Bridge's to report
        return False


def _run_config(it: Path) -> Dict[str, Any]:
    from nemo_spec.checkpoint import nemo2

    return nemo2.yaml_with(it / RUN_CONFIG, "model", "the model provider's fields")


def read_config(p: Path) -> Dict[str, Any]:
    """{"format": "megatron_bridge", "model": ModelConfig dict, "params_dtype", "tp_size_saved", "source",
    "target" (the provider class), "iter_dir"}."""
    from nemo_spec.checkpoint import nemo2
    from nemo_spec.checkpoint.megatron import CheckpointError

    it = _iter_dir(p)
    source = str(it / RUN_CONFIG)
    doc = _run_config(it)
    c = doc["model"]
    peft = doc.get("peft")
    if peft:  # checkpointing.py saves only the adapters' tensors when cfg.peft is set
        base = (doc.get("checkpoint") or {}).get("pretrained_checkpoint")
        raise CheckpointError(
            f"{source}: a PEFT checkpoint ({nemo2._target(peft) or peft}): Megatron Bridge saved only the adapter "
            f"weights; load the base it was trained on ({base or 'checkpoint.pretrained_checkpoint'}) or a checkpoint "
            f"with the adapters merged into the base")
    cfg = nemo2.model_config_from_yaml(c, nemo2._vocab_from_weights(it, source), source)
    return {"format": FORMAT, "model": cfg.to_dict(), **nemo2.saved_settings(c), "source": source,
            "target": nemo2._target(c), "iter_dir": str(it)}


def tokenizer_dir(p: Path) -> Optional[Path]:
    """``iter_NNNNNNN/tokenizer`` when Bridge saved a Hugging Face tokenizer's files there, else None (its other
    tokenizer types save files a Hugging Face loader misreads: a tiktoken vocabulary as ``tokenizer.json``)."""
    from nemo_spec.checkpoint.megatron import TOKENIZER_FILES

    it = _iter_dir(p)
    d = it / "tokenizer" if it is not None else None
    if d is None or not any((d / f).is_file() for f in TOKENIZER_FILES):
        return None
    kind = (_run_config(it).get("tokenizer") or {}).get("tokenizer_type")
    if kind != "HuggingFaceTokenizer":
        log.warning("%s holds a %s tokenizer's files, which nemo_spec does not read (Hugging Face tokenizers only); "
                    "pass --tokenizer", d, kind)
        return None
    return d


def load_bridge(p: Path, tp_size: Optional[int] = None, dtype: Optional[torch.dtype] = None) -> torch.nn.Module:
    """Load a Megatron Bridge checkpoint's GPTModel at the current TP (any saved TP)."""
    from nemo_spec.checkpoint import legacy
    from nemo_spec.checkpoint.megatron import _ensure_parallel, build_for_checkpoint, checkpoint_target, load_dist_into

    info = read_config(p)
    source, it = info["source"], Path(info["iter_dir"])
    cfg, tp, dtype = checkpoint_target(info, tp_size, dtype)
    _ensure_parallel(tp)
    model = build_for_checkpoint(cfg, None, dtype, source)
    load_dist_into(model, it, source, sharded_sd=legacy._dist_sharded_state_dict(model, it))
    log.info("loaded Megatron Bridge checkpoint %s (%s, saved tp=%d) at tp=%d", it, info["target"],
             info["tp_size_saved"], tp)
    return model
