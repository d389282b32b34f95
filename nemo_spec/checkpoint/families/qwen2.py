"""Qwen2 (``Qwen2ForCausalLM``): a Llama layer with q/k/v biases (no o_proj / MLP bias), tied or untied embeddings,
sliding window on the layers ``layer_types`` marks (or ``i >= max_window_layers``) when ``use_sliding_window``."""
from __future__ import annotations

from typing import Any, Dict, Mapping

from nemo_spec.checkpoint.families import _llama_like as L
from nemo_spec.checkpoint.families._base import Family, Limits, WeightMap, is_, is_none
from nemo_spec.config import ModelConfig

ARCH = "Qwen2ForCausalLM"


def from_hf(hf: Mapping[str, Any], source: str) -> ModelConfig:
    """ModelConfig of a Qwen2 config.json."""
    # attention_bias / mlp_bias are not Qwen2's fields: q/k/v always have biases, o_proj and the MLP never
    # (transformers' Qwen2Attention, vllm's qwen2.py), whatever a config.json says
    return L.llama_like_from_hf(hf, source, arch=ARCH, qkv_bias=True, window=L.window_by_layer_type, biases=None)


def to_hf(cfg: ModelConfig) -> Dict[str, Any]:
    """Qwen2 config.json."""
    return dict(L.llama_like_to_hf(cfg, ARCH, "qwen2"), **L.window_to_layer_types(cfg))


FAMILY = Family(
    model_type="qwen2", architecture=ARCH, from_hf=from_hf, to_hf=to_hf,
    weights=WeightMap(model=L.model_rules(), layer=L.attention_rules() + L.dense_mlp_rules()),
    requires=(("family", is_("llama"), "'llama'"), ("normalization", is_("RMSNorm"), "'RMSNorm'"),
              ("activation", is_("swiglu"), "'swiglu'"), ("position_embedding", is_("rope"), "'rope'"),
              ("add_qkv_bias", is_(True), "True"), ("add_bias_linear", is_(False), "False"),
              ("qk_layernorm", is_(False), "False"), ("num_moe_experts", is_none, "None")),
    auto=lambda c: c.add_qkv_bias and not c.add_bias_linear and not c.qk_layernorm,
    limits=Limits(sliding_window="per layer (layer_types / max_window_layers)", engines="vllm, sglang, reference (EAGLE-1 only); trtllm: none",
                  notes="q/k/v bias: SGLang/TRT-LLM EAGLE-3 drafts have none (reported unsupported); "
                        "SGLang, TRT-LLM: no DFlash"),
)
