"""Qwen3 (``Qwen3ForCausalLM``): a Llama layer with per-head RMSNorm of q and k before RoPE (megatron-core
``qk_layernorm``), ``head_dim`` independent of ``hidden_size``, tied or untied embeddings, no biases, and the
Qwen2 sliding-window convention (``layer_types`` / ``max_window_layers`` behind ``use_sliding_window``)."""
from __future__ import annotations

from typing import Any, Dict, Mapping

from nemo_spec.checkpoint.families import _llama_like as L
from nemo_spec.checkpoint.families._base import Family, Limits, WeightMap, is_, is_none
from nemo_spec.checkpoint.families.llama import ENGINES
from nemo_spec.config import ModelConfig

ARCH = "Qwen3ForCausalLM"


def from_hf(hf: Mapping[str, Any], source: str) -> ModelConfig:
    """ModelConfig of a Qwen3 config.json."""
    return L.llama_like_from_hf(hf, source, arch=ARCH, qk_layernorm=True, biases=False,
                                window=L.window_by_layer_type)


def to_hf(cfg: ModelConfig) -> Dict[str, Any]:
    """Qwen3 config.json."""
    return dict(L.llama_like_to_hf(cfg, ARCH, "qwen3"), attention_bias=False, **L.window_to_layer_types(cfg))


FAMILY = Family(
    model_type="qwen3", architecture=ARCH, from_hf=from_hf, to_hf=to_hf,
    weights=WeightMap(model=L.model_rules(), layer=L.attention_rules() + L.qk_norm_rules() + L.dense_mlp_rules()),
    requires=(("family", is_("llama"), "'llama'"), ("normalization", is_("RMSNorm"), "'RMSNorm'"),
              ("activation", is_("swiglu"), "'swiglu'"), ("position_embedding", is_("rope"), "'rope'"),
              ("qk_layernorm", is_(True), "True"), ("add_qkv_bias", is_(False), "False"),
              ("add_bias_linear", is_(False), "False"), ("num_moe_experts", is_none, "None")),
    auto=lambda c: c.qk_layernorm,
    limits=Limits(sliding_window="per layer (layer_types / max_window_layers)", engines=ENGINES,
                  notes="q/k norm; attention_bias=true refused"),
)
