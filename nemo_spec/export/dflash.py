"""DFlash draft export in the z-lab format (``DFlashDraftModel``), which SGLang 0.5.23, vLLM 0.33.0 and
TensorRT-LLM (engines/dflash.py) read as is.

Directory: ``config.json`` (a Qwen3 config plus ``block_size``, ``num_target_layers`` and
``dflash_config: {mask_token_id, target_layer_ids}``, as the z-lab / SpecForge checkpoints, e.g. SpecForge
``configs/qwen3-8b-dflash.json``) + ``model.safetensors`` with ``fc.weight`` [h, n*h], ``hidden_norm.weight``,
``layers.{i}.*`` (HF Qwen3 decoder-layer names: q/k/v/o_proj, q_norm/k_norm, input/post_attention_layernorm,
gate/up/down_proj) and ``norm.weight``. No ``embed_tokens`` / ``lm_head``: every reader borrows the target's
(z-lab model.py:111-119, SGLang models/dflash.py:1-3 and dflash_worker_v2.py:138, vLLM llm_base_proposer.py:
1418-1540 shares them when the draft has none), and DFlash's are the frozen base's anyway.

Where the references differ, the engines decide:
* ``target_layer_ids`` are written in z-lab's numbering (id = 0-based layer whose output is taken,
  ``hidden_states[id + 1]``, model.py:39-45). SGLang captures the input of layer ``id + 1`` (models/qwen3.py:
  793-805, llama.py:485-494) and vLLM adds 1 too when the config has no ``eagle_aux_hidden_state_layer_ids``
  (v1/worker/gpu/spec_decode/eagle/eagle3_utils.py:113-124) — the same hidden states, so no
  ``eagle_aux_hidden_state_layer_ids`` is written (it would take precedence in vLLM without the +1). The last
  base layer is refused at transform time: HF's ``hidden_states[L]`` is after the final norm and neither engine
  has a capture point ``L``.
* ``rope_theta`` is always written: vLLM defaults a missing one to 1e6 (qwen3_dflash.py:311).
* ``layer_types`` all ``full_attention``: non-causal in vLLM (qwen3_dflash.py:62-81) and SGLang (ENCODER_ONLY,
  models/dflash.py:166-191), as z-lab attends (``is_causal = False``, model.py:194).
"""
from __future__ import annotations

import logging
from typing import Any, Dict, Mapping, Tuple

import torch

from nemo_spec.config import ModelConfig, SpeculativeConfig

log = logging.getLogger(__name__)

DFLASH_ARCH = "DFlashDraftModel"  # z-lab model.py:302, SGLang models/dflash.py:671, vLLM registry.py:664


def dflash_layer_rules():
    """HF Qwen3 decoder-layer rules of a DFlash layer (Llama attention + MLP + per-head q/k norms)."""
    from nemo_spec.checkpoint.families import _llama_like as L
    from nemo_spec.checkpoint.families.llama import LAYER

    return tuple(LAYER) + L.qk_norm_rules()


def dflash_to_hf(neutral: Mapping[str, torch.Tensor], cfg: ModelConfig,
                 spec: SpeculativeConfig) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """Neutral DFlash draft tensors (draft-module names, TP-gathered) -> (tensors, config.json dict)."""
    from nemo_spec.checkpoint.families import rules_to_hf
    from nemo_spec.export.eagle import _need, _rope_scaling
    from nemo_spec.export.formats import ExportError
    from nemo_spec.speculative.dflash import dflash_layer_model_config

    if spec.algorithm != "dflash":
        raise ExportError(f"dflash export needs a dflash draft, got {spec.algorithm!r}")
    lcfg = dflash_layer_model_config(cfg)
    n = int(spec.num_eagle_layers)
    ids = spec.resolved_target_layer_ids(cfg.num_layers)
    out: Dict[str, torch.Tensor] = {"fc.weight": _need(neutral, "fc.weight"),
                                    "hidden_norm.weight": _need(neutral, "hidden_norm.weight"),
                                    "norm.weight": _need(neutral, "final_layernorm.weight")}
    rules = dflash_layer_rules()
    for i in range(n):
        out.update(rules_to_hf(rules, neutral, lcfg, f"layers.{i}.", f"layers.{i}.", error=ExportError))
    if tuple(out["fc.weight"].shape) != (cfg.hidden_size, len(ids) * cfg.hidden_size):
        raise ExportError(f"fc.weight has shape {tuple(out['fc.weight'].shape)}, expected "
                          f"({cfg.hidden_size}, {len(ids) * cfg.hidden_size}) for target_layer_ids {ids}")
    conf: Dict[str, Any] = {
        "architectures": [DFLASH_ARCH],
        "model_type": "qwen3",
        "block_size": int(spec.block_size),
        "dflash_config": {"mask_token_id": int(spec.resolved_mask_token_id(cfg)), "target_layer_ids": list(ids)},
        "num_target_layers": int(cfg.num_layers),
        "hidden_size": cfg.hidden_size,
        "intermediate_size": lcfg.ffn_hidden_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_query_groups,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": n,
        "hidden_act": "silu",
        "rms_norm_eps": lcfg.norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": float(lcfg.rope_theta),
        "rope_scaling": _rope_scaling(lcfg),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "layer_types": ["full_attention"] * n,
        "max_window_layers": n,
        "sliding_window": None,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "vocab_size": cfg.vocab_size,
        "initializer_range": cfg.init_method_std,
        "use_cache": True,
    }
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(cfg, k) is not None:
            conf[k] = getattr(cfg, k)
    return out, conf


def dflash_from_hf(tensors: Mapping[str, torch.Tensor], conf: Mapping[str, Any], cfg: ModelConfig,
                   spec: SpeculativeConfig) -> Dict[str, torch.Tensor]:
    """Inverse of :func:`dflash_to_hf` for the tensors: HF names -> neutral draft-module names.

    The export's ``config.json`` must describe the model's draft (layers, block size, mask token, target layers):
    a draft made for other base layers or another mask token would load and silently draft from the wrong inputs.
    Every tensor of the file is mapped, so one the draft does not have is refused by the strict load."""
    from nemo_spec.checkpoint.families import rules_to_megatron
    from nemo_spec.export.eagle import _need
    from nemo_spec.export.formats import ExportError
    from nemo_spec.speculative.dflash import dflash_layer_model_config

    dcfg = conf.get("dflash_config") or {}
    want = {"num_hidden_layers": int(spec.num_eagle_layers), "block_size": int(spec.block_size),
            "dflash_config.mask_token_id": int(spec.resolved_mask_token_id(cfg)),
            "dflash_config.target_layer_ids": list(spec.resolved_target_layer_ids(cfg.num_layers))}
    got = {"num_hidden_layers": conf.get("num_hidden_layers"), "block_size": conf.get("block_size"),
           "dflash_config.mask_token_id": dcfg.get("mask_token_id"),
           "dflash_config.target_layer_ids": dcfg.get("target_layer_ids")}
    bad = [f"{k}={got[k]!r} (the model's draft: {v!r})" for k, v in want.items() if got[k] != v]
    if bad:
        raise ExportError("config.json does not describe this model's DFlash draft: " + "; ".join(bad)
                          + " -- transform the base with the export's settings")
    # nemo_spec's DFlash layers (z-lab's) attend both ways over the whole context. vLLM runs a layer causally when
    # is_causal, else dflash_config.causal, else its layer_types entry says sliding_attention, and with a window on
    # dflash_config.use_swa or a sliding_attention layer (qwen3_dflash.py:86-115 @ 0.34.0); speculators' trainer
    # writes such drafts by default. They imported as another function (max logit error 4.2: review).
    types = list(conf.get("layer_types") or [])
    causal = conf.get("is_causal") if conf.get("is_causal") is not None else dcfg.get("causal")
    how = []
    if causal or (causal is None and "sliding_attention" in types):
        how.append("causal attention (is_causal / dflash_config.causal / layer_types)")
    if dcfg.get("use_swa") or "sliding_attention" in types:
        how.append("sliding-window attention (dflash_config.use_swa / layer_types)")
    if how:
        raise ExportError(f"the DFlash draft runs {' and '.join(how)}; nemo_spec's DFlash draft attends both ways "
                          f"over the whole context (z-lab's): not supported")
    lcfg = dflash_layer_model_config(cfg)
    out = {"fc.weight": _need(tensors, "fc.weight"), "hidden_norm.weight": _need(tensors, "hidden_norm.weight"),
           "final_layernorm.weight": _need(tensors, "norm.weight")}
    layers = sorted({int(k.split(".")[1]) for k in tensors if k.startswith("layers.") and k.split(".")[1].isdigit()})
    for i in layers:
        out.update(rules_to_megatron(dflash_layer_rules(), tensors, lcfg, f"layers.{i}.", f"layers.{i}.",
                                     error=ExportError))
    known = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    extra = sorted(k for k in tensors if k not in known and not k.startswith("layers."))
    if extra:
        raise ExportError(f"unexpected tensors in the DFlash export: {extra[:8]}")
    return out
