"""EAGLE-1 and EAGLE-3 draft checkpoints in the layouts serving engines and the EAGLE reference code read.

EAGLE-3 (vLLM ``llama_eagle3.py`` / SGLang ``llama_eagle3.py`` / TensorRT-LLM / SafeAILab ``cnets.py``)
  config.json: a Llama config with ``architectures: ["LlamaForCausalLMEagle3"]``, ``model_type: "llama"``,
  ``num_hidden_layers`` = number of draft layers, ``vocab_size`` = the *base* vocabulary, ``draft_vocab_size``,
  ``hidden_act: "silu"``, ``rms_norm_eps``,
  ``rope_theta``/``rope_scaling``, ``max_position_embeddings``, ``tie_word_embeddings: false`` and
  ``eagle_config.eagle_aux_hidden_state_layer_ids`` (vLLM numbering: id j is the *input* of base layer j, i.e. the
  output of 0-based layer j-1, so our 0-based ``aux_layers`` are written +1).
  Tensors (``model.safetensors``):
    ``fc.weight`` [h, 3h] (no bias) fuses the three base features (low, mid, high, concatenated in that order);
    ``midlayer.input_layernorm.weight`` [h] normalises the token embedding,
    ``midlayer.hidden_norm.weight`` [h] normalises the fused feature; attention sees cat([emb, feature]);
    ``midlayer.self_attn.{q,k,v}_proj.weight`` [n*d, 2h] (input is 2h), ``o_proj`` [h, H*d];
    ``midlayer.post_attention_layernorm.weight``, ``midlayer.mlp.{gate,up,down}_proj.weight``;
    ``norm.weight`` [h]; ``lm_head.weight`` [Vd, h]; ``d2t`` int64 [Vd] with base_id = draft_id + d2t[draft_id];
    ``t2d`` bool [V] (True for base ids in the draft vocabulary; vLLM/SGLang skip it, the EAGLE code keeps it).
  The residual stream of the mid layer starts from the fused feature (before ``hidden_norm``); the embedding
  table is not stored (engines share the base's). Extra draft layers (vLLM only) are ``layers.{i}.*``, Llama style.
  ``target_hidden_size`` is left out (draft and base widths are equal; engines default it to ``hidden_size``): with
  it set, the EAGLE reference code expects ``embed_tokens`` inside the draft instead of reading the base's through
  the base's ``model.safetensors.index.json`` (which the export therefore writes next to ``base/model.safetensors``).
EAGLE-1 (SafeAILab ``cnets1.py`` ``Model`` loaded by ``EaModel`` from ``pytorch_model.bin``; vLLM
``llama_eagle.py`` ``EagleLlamaForCausalLM`` from safetensors)
  config.json: a plain Llama config (``architectures: ["LlamaForCausalLM"]``) whose ``num_hidden_layers`` is the
  number of draft layers, plus ``bias`` (whether ``fc`` has a bias; EaModel defaults it to true when absent).
  Tensors: ``embed_tokens.weight`` [V, h] (EaModel loads strictly, so it is stored; vLLM skips it and shares the
  base's), ``fc.weight`` [h, 2h] over cat([embedding, base final hidden]) and ``fc.bias`` [h] when ``bias``;
  ``layers.N.self_attn.{q,k,v,o}_proj.weight``, ``layers.N.mlp.{gate,up,down}_proj.weight``,
  ``layers.N.post_attention_layernorm.weight`` and, for N > 0 only, ``layers.N.input_layernorm.weight`` (layer 0
  has none). There is no final norm and no lm_head: the draft's hidden goes straight into the base's lm_head.

Both are produced from the full (TP-gathered) state dict of ``SpeculativeGPT.draft`` (an ``EagleDraft``:
``fc``, ``layers.N.*`` Megatron layers, ``layers.0.hidden_norm``, ``final_layernorm``, ``output_layer``, ``d2t``)
and read back into it.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, Mapping, Tuple

import torch

from nemo_spec.config import ModelConfig, SpeculativeConfig
from nemo_spec.export.formats import ExportError, layer_from_hf, layer_to_hf

log = logging.getLogger(__name__)

EAGLE3_ARCH = "LlamaForCausalLMEagle3"
EAGLE1_ARCH = "LlamaForCausalLM"


def check_llama_family(cfg: ModelConfig, fmt: str) -> None:
    """EAGLE formats describe Llama layers (RMSNorm, SwiGLU, RoPE, no biases): refuse anything else."""
    bad = []
    if cfg.normalization != "RMSNorm":
        bad.append(f"normalization={cfg.normalization!r}")
    if cfg.activation != "swiglu":
        bad.append(f"activation={cfg.activation!r}")
    if cfg.position_embedding != "rope":
        bad.append(f"position_embedding={cfg.position_embedding!r}")
    if cfg.add_bias_linear:
        bad.append("add_bias_linear=True")
    if bad:
        raise ExportError(f"the {fmt} format stores Llama-style draft layers; this base has {', '.join(bad)}")


def _llama_fields(cfg: ModelConfig, num_layers: int) -> Dict[str, Any]:
    """Llama config.json fields describing draft layers that inherit the base's architecture."""
    d: Dict[str, Any] = {
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_hidden_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_query_groups,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": num_layers,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": _rope_scaling(cfg),
        "attention_bias": bool(cfg.add_qkv_bias),
        "mlp_bias": False,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": False,
        "initializer_range": cfg.init_method_std,
        "pretraining_tp": 1,
        "use_cache": True,
    }
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(cfg, k) is not None:
            d[k] = getattr(cfg, k)
    return d


def _rope_scaling(cfg: ModelConfig) -> Dict[str, Any] | None:
    """HF rope_scaling with both ``rope_type`` (transformers/vLLM) and legacy ``type`` (the EAGLE reference code)."""
    if not cfg.rope_scaling:
        return None
    d = dict(cfg.rope_scaling)
    kind = d.get("rope_type", d.get("type"))
    d["rope_type"] = d["type"] = kind
    return d


def _warn_reference_head_dim(cfg: ModelConfig) -> None:
    if cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size:
        log.warning("head_dim=%d != hidden_size/num_attention_heads: vLLM and SGLang read head_dim from the config, "
                    "the EAGLE reference code assumes hidden_size/num_attention_heads", cfg.head_dim)


def _need(sd: Mapping[str, torch.Tensor], key: str) -> torch.Tensor:
    if key not in sd:
        raise ExportError(f"draft state dict lacks {key!r}")
    return sd[key]


def _heads(cfg: ModelConfig) -> Tuple[int, int, int]:
    return cfg.num_attention_heads, cfg.num_query_groups, cfg.head_dim


# ------------------------------------------------------------------------------------------------ EAGLE-3
def eagle3_to_reference(neutral: Mapping[str, torch.Tensor], cfg: ModelConfig,
                        spec: SpeculativeConfig) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """Neutral EAGLE-3 draft tensors -> (reference tensors, config.json dict)."""
    check_llama_family(cfg, "eagle3")
    _warn_reference_head_dim(cfg)
    nh, ng, hd = _heads(cfg)
    n_layers = spec.num_eagle_layers
    out: Dict[str, torch.Tensor] = {"fc.weight": _need(neutral, "fc.weight")}
    if "fc.bias" in neutral:
        out["fc.bias"] = neutral["fc.bias"]
    for i in range(n_layers):
        dst = "midlayer." if i == 0 else f"layers.{i}."
        out.update(layer_to_hf(neutral, f"layers.{i}.", dst, nh, ng, hd, input_norm=True))
    out["midlayer.hidden_norm.weight"] = _need(neutral, "layers.0.hidden_norm.weight")
    out["norm.weight"] = _need(neutral, "final_layernorm.weight")
    out["lm_head.weight"] = _need(neutral, "output_layer.weight")
    vd = out["lm_head.weight"].shape[0]
    d2t = neutral.get("d2t")
    if d2t is None:
        d2t = torch.zeros(vd, dtype=torch.long)
    d2t = d2t.to(torch.long)
    if d2t.shape != (vd,):
        raise ExportError(f"d2t has shape {tuple(d2t.shape)}, expected ({vd},) = draft vocab size")
    base_ids = d2t + torch.arange(vd)
    if int(base_ids.min()) < 0 or int(base_ids.max()) >= cfg.vocab_size:
        raise ExportError(f"d2t maps draft ids outside the base vocabulary [0, {cfg.vocab_size})")
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[base_ids] = True
    out["d2t"], out["t2d"] = d2t, t2d
    aux = spec.resolved_aux_layers(cfg.num_layers)
    conf = {"architectures": [EAGLE3_ARCH], **_llama_fields(cfg, n_layers)}
    conf.update({
        "draft_vocab_size": int(vd),
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in aux],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i + 1 for i in aux], "use_aux_hidden_state": True},
    })
    if cfg.num_layers - 1 in aux:
        log.warning("EAGLE-3 aux layer %d is the base's last layer: vLLM captures the hidden states entering layers "
                    "0..%d (ids), so id %d is not captured there; choose aux_layers below %d for vLLM",
                    cfg.num_layers - 1, cfg.num_layers - 1, cfg.num_layers, cfg.num_layers - 1)
    if n_layers > 1:
        log.warning("EAGLE-3 with %d draft layers: layers 1.. are written as layers.N.* (vLLM's layout); "
                    "SGLang and the EAGLE reference code load a single midlayer only", n_layers)
    return out, conf


def eagle3_from_reference(tensors: Mapping[str, torch.Tensor], conf: Mapping[str, Any],
                          cfg: ModelConfig) -> Dict[str, torch.Tensor]:
    """Reference EAGLE-3 tensors (+ config.json) -> draft tensors; layer 0 may be ``midlayer.*`` or ``layers.0.*``."""
    nh, ng, hd = _heads(cfg)
    n_layers = int(conf.get("num_hidden_layers", 1))
    if "fc.weight" not in tensors:
        raise ExportError("EAGLE-3 draft lacks 'fc.weight' (drafts without aux-hidden-state fusion are not supported)")
    first = "midlayer." if "midlayer.self_attn.q_proj.weight" in tensors else "layers.0."
    out: Dict[str, torch.Tensor] = {"fc.weight": tensors["fc.weight"]}
    if "fc.bias" in tensors:
        out["fc.bias"] = tensors["fc.bias"]
    for i in range(n_layers):
        src = first if i == 0 else f"layers.{i}."
        out.update(layer_from_hf(tensors, src, f"layers.{i}.", nh, ng, hd, input_norm=True))
    for src, dst in ((first + "hidden_norm.weight", "layers.0.hidden_norm.weight"),
                     ("norm.weight", "final_layernorm.weight"), ("lm_head.weight", "output_layer.weight")):
        if src not in tensors:
            raise ExportError(f"EAGLE-3 draft lacks {src!r}")
        out[dst] = tensors[src]
    vd = out["output_layer.weight"].shape[0]
    if int(conf.get("draft_vocab_size") or vd) != vd:
        raise ExportError(f"config draft_vocab_size={conf.get('draft_vocab_size')} but lm_head has {vd} rows")
    if "d2t" in tensors:
        out["d2t"] = tensors["d2t"].to(torch.long)
    elif vd == cfg.vocab_size:
        out["d2t"] = torch.zeros(vd, dtype=torch.long)
    else:
        raise ExportError(f"EAGLE-3 draft has a reduced vocabulary ({vd} of {cfg.vocab_size}) but no 'd2t' mapping")
    if "embed_tokens.weight" in tensors:
        log.info("EAGLE-3 draft stores embed_tokens.weight; ignored (the draft embeds tokens with the base's table)")
    return out


# ------------------------------------------------------------------------------------------------ EAGLE-1
def eagle1_to_reference(neutral: Mapping[str, torch.Tensor], cfg: ModelConfig, spec: SpeculativeConfig,
                        embedding: torch.Tensor) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """Neutral EAGLE-1 draft tensors (+ the base's embedding table) -> (reference tensors, config.json dict)."""
    check_llama_family(cfg, "eagle1")
    _warn_reference_head_dim(cfg)
    nh, ng, hd = _heads(cfg)
    n_layers = spec.num_eagle_layers
    if "layers.0.input_layernorm.weight" in neutral:
        raise ExportError("this EAGLE-1 draft normalises the input of its first layer, which the EAGLE-1 format "
                          "(layer 0 without input_layernorm) cannot represent")
    if "final_layernorm.weight" in neutral:
        raise ExportError("this EAGLE-1 draft has a final norm, which the EAGLE-1 format (draft hidden goes "
                          "straight to the base lm_head) cannot represent")
    out: Dict[str, torch.Tensor] = {"embed_tokens.weight": embedding, "fc.weight": _need(neutral, "fc.weight")}
    has_bias = "fc.bias" in neutral
    if has_bias:
        out["fc.bias"] = neutral["fc.bias"]
    for i in range(n_layers):
        out.update(layer_to_hf(neutral, f"layers.{i}.", f"layers.{i}.", nh, ng, hd, input_norm=i > 0))
    conf = {"architectures": [EAGLE1_ARCH], **_llama_fields(cfg, n_layers), "bias": has_bias}
    if has_bias:
        log.warning("EAGLE-1 fc has a bias: the EAGLE reference code uses it; vLLM's EAGLE-1 loader builds fc "
                    "without bias and ignores fc.bias")
    return out, conf


def eagle1_from_reference(tensors: Mapping[str, torch.Tensor], conf: Mapping[str, Any],
                          cfg: ModelConfig) -> Dict[str, torch.Tensor]:
    """Reference EAGLE-1 tensors (+ config.json) -> neutral draft tensors (the stored embedding is dropped)."""
    nh, ng, hd = _heads(cfg)
    n_layers = int(conf.get("num_hidden_layers", 1))
    if "fc.weight" not in tensors:
        raise ExportError("EAGLE-1 draft lacks 'fc.weight'")
    out: Dict[str, torch.Tensor] = {"fc.weight": tensors["fc.weight"]}
    if "fc.bias" in tensors:
        out["fc.bias"] = tensors["fc.bias"]
    for i in range(n_layers):
        out.update(layer_from_hf(tensors, f"layers.{i}.", f"layers.{i}.", nh, ng, hd, input_norm=i > 0))
    return out


