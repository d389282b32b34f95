"""Medusa heads in the Medusa reference layout (FasterDecoding/Medusa) and in vLLM's Medusa layout.

Reference layout (``MedusaModel.from_pretrained(dir)``):
  ``config.json`` with ``medusa_num_heads``, ``medusa_num_layers`` and ``base_model_name_or_path`` (the base the
  heads belong to; the reference code loads the base from it). Tensors in ``medusa_lm_head.safetensors`` (newer
  code) and ``medusa_lm_head.pt`` (a torch-saved dict; older code reads only this), the state dict of an
  ``nn.ModuleList`` of ``nn.Sequential(ResBlock x L, Linear(h, V, bias=False))``:
    ``{k}.{j}.linear.weight`` [h, h] and ``{k}.{j}.linear.bias`` [h]   residual block j of head k: x + SiLU(Wx + b)
    ``{k}.{L}.weight`` [V, h]                                        head k's output layer (L = medusa_num_layers)
  Caveat: the reference builds ``[ResBlock] * L``, i.e. one block object repeated, so with L > 1 it cannot hold
  distinct per-layer weights (the last one loaded wins); heads with L == 1 round-trip exactly.
vLLM layout (``method: "medusa"``; ``MedusaConfig`` renames ``medusa_num_heads`` -> ``num_heads`` and
``medusa_num_layers`` -> ``num_hidden_layers``; ``medusa_fc_bias`` enables the block biases):
  ``blocks.{k}.layers.{j}.weight`` / ``.bias`` and ``lm_heads.{k}.weight`` in ``model.safetensors``.

Our heads (``SpeculativeGPT.draft``, a ``MedusaHeads``) are ``heads.{k}.blocks.{j}.linear.{weight,bias}`` and
``heads.{k}.output_layer.weight`` (vocab-parallel under TP; gathered before export).
"""
from __future__ import annotations

import logging
import re
from typing import Any, Dict, Mapping, Tuple

import torch

from nemo_spec.config import ModelConfig, SpeculativeConfig
from nemo_spec.export.formats import ExportError

log = logging.getLogger(__name__)

_OURS = re.compile(r"^heads\.(\d+)\.(?:blocks\.(\d+)\.linear\.(weight|bias)|output_layer\.weight)$")


def _medusa_fields(cfg: ModelConfig, spec: SpeculativeConfig) -> Dict[str, Any]:
    return {
        "architectures": ["MedusaModel"],
        "model_type": "medusa",
        "medusa_num_heads": spec.num_medusa_heads,
        "medusa_num_layers": spec.num_medusa_layers,
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "medusa_fc_bias": True,
    }


def _check_keys(neutral: Mapping[str, torch.Tensor], spec: SpeculativeConfig) -> None:
    unknown = [k for k in neutral if not _OURS.match(k)]
    if unknown:
        raise ExportError(f"unexpected Medusa draft tensors {unknown[:5]}")
    for k in range(spec.num_medusa_heads):
        need = [f"heads.{k}.output_layer.weight"] + [f"heads.{k}.blocks.{j}.linear.{p}"
                                                     for j in range(spec.num_medusa_layers) for p in ("weight", "bias")]
        missing = [n for n in need if n not in neutral]
        if missing:
            raise ExportError(f"Medusa draft lacks {missing[:5]}")


def medusa_to_reference(neutral: Mapping[str, torch.Tensor], cfg: ModelConfig,
                        spec: SpeculativeConfig) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """Our Medusa head tensors -> (reference ``medusa_lm_head`` tensors, config.json dict)."""
    _check_keys(neutral, spec)
    n_layers = spec.num_medusa_layers
    out: Dict[str, torch.Tensor] = {}
    for k in range(spec.num_medusa_heads):
        for j in range(n_layers):
            out[f"{k}.{j}.linear.weight"] = neutral[f"heads.{k}.blocks.{j}.linear.weight"]
            out[f"{k}.{j}.linear.bias"] = neutral[f"heads.{k}.blocks.{j}.linear.bias"]
        out[f"{k}.{n_layers}.weight"] = neutral[f"heads.{k}.output_layer.weight"]
    if n_layers > 1:
        log.warning("medusa_num_layers=%d: the Medusa reference code repeats one ResBlock object per head, so it "
                    "cannot load distinct per-layer blocks faithfully; vLLM's layout (draft_vllm/) can", n_layers)
    return out, _medusa_fields(cfg, spec)


def medusa_from_reference(tensors: Mapping[str, torch.Tensor], conf: Mapping[str, Any]) -> Dict[str, torch.Tensor]:
    """Reference ``medusa_lm_head`` tensors (+ config.json) -> our Medusa head tensors."""
    try:
        n_heads, n_layers = int(conf["medusa_num_heads"]), int(conf["medusa_num_layers"])
    except KeyError as e:
        raise ExportError(f"Medusa config.json lacks {e.args[0]!r}") from e
    out: Dict[str, torch.Tensor] = {}
    for k in range(n_heads):
        for j in range(n_layers):
            for p in ("weight", "bias"):
                src = f"{k}.{j}.linear.{p}"
                if src not in tensors:
                    raise ExportError(f"Medusa head file lacks {src!r}")
                out[f"heads.{k}.blocks.{j}.linear.{p}"] = tensors[src]
        src = f"{k}.{n_layers}.weight"
        if src not in tensors:
            raise ExportError(f"Medusa head file lacks {src!r}")
        out[f"heads.{k}.output_layer.weight"] = tensors[src]
    return out


def medusa_from_modelopt(tensors: Mapping[str, torch.Tensor], conf: Mapping[str, Any]) -> Dict[str, torch.Tensor]:
    """NVIDIA Model Optimizer's Medusa export (``export_hf_checkpoint`` of the whole model, nvidia-modelopt 0.47.0):
    ``config.medusa = {num_medusa_heads, num_medusa_layers}`` (plugins/hf_medusa.py:63-66) and per head
    ``medusa_heads.{k}.{j}.linear.{weight,bias}`` residual blocks then ``medusa_heads.{k}.{L}.weight`` (hf_medusa.py:
    72-80): the reference layout under a prefix."""
    m = conf.get("medusa") or {}
    ref_conf = {"medusa_num_heads": m.get("num_medusa_heads"), "medusa_num_layers": m.get("num_medusa_layers")}
    if not all(isinstance(v, int) and v >= 1 for v in ref_conf.values()):
        raise ExportError(f"ModelOpt Medusa config.json: 'medusa' must hold num_medusa_heads and num_medusa_layers >= 1, "
                          f"got {m}")
    return medusa_from_reference({k[len("medusa_heads."):]: v for k, v in tensors.items()}, ref_conf)


def medusa_to_vllm(neutral: Mapping[str, torch.Tensor], cfg: ModelConfig,
                   spec: SpeculativeConfig) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """Our Medusa head tensors -> (vLLM Medusa tensors, config.json dict)."""
    _check_keys(neutral, spec)
    out: Dict[str, torch.Tensor] = {}
    for k in range(spec.num_medusa_heads):
        for j in range(spec.num_medusa_layers):
            out[f"blocks.{k}.layers.{j}.weight"] = neutral[f"heads.{k}.blocks.{j}.linear.weight"]
            out[f"blocks.{k}.layers.{j}.bias"] = neutral[f"heads.{k}.blocks.{j}.linear.bias"]
        out[f"lm_heads.{k}.weight"] = neutral[f"heads.{k}.output_layer.weight"]
    conf = _medusa_fields(cfg, spec)
    conf["truncated_vocab_size"] = cfg.vocab_size
    return out, conf


def medusa_from_vllm(tensors: Mapping[str, torch.Tensor], conf: Mapping[str, Any]) -> Dict[str, torch.Tensor]:
    """vLLM Medusa tensors -> our Medusa head tensors."""
    n_heads = int(conf.get("medusa_num_heads", conf.get("num_heads", 0)))
    n_layers = int(conf.get("medusa_num_layers", conf.get("num_hidden_layers", 0)))
    out: Dict[str, torch.Tensor] = {}
    for k in range(n_heads):
        for j in range(n_layers):
            for p in ("weight", "bias"):
                src = f"blocks.{k}.layers.{j}.{p}"
                if src not in tensors:
                    raise ExportError(f"vLLM Medusa file lacks {src!r}")
                out[f"heads.{k}.blocks.{j}.linear.{p}"] = tensors[src]
        if f"lm_heads.{k}.weight" not in tensors:
            raise ExportError(f"vLLM Medusa file lacks 'lm_heads.{k}.weight'")
        out[f"heads.{k}.output_layer.weight"] = tensors[f"lm_heads.{k}.weight"]
    return out
