"""Mistral (``MistralForCausalLM``): a Llama layer without biases; ``sliding_window`` (when set) on every layer."""
from __future__ import annotations

from typing import Any, Dict, Mapping

from nemo_spec.checkpoint.families import _llama_like as L
from nemo_spec.checkpoint.families._base import Family, Limits, WeightMap, is_, is_none
from nemo_spec.config import ModelConfig

ARCH = "MistralForCausalLM"


def from_hf(hf: Mapping[str, Any], source: str) -> ModelConfig:
    """ModelConfig of a Mistral config.json."""
    return L.llama_like_from_hf(hf, source, arch=ARCH, window=L.window_all_layers)


def to_hf(cfg: ModelConfig) -> Dict[str, Any]:
    """Mistral config.json."""
    return dict(L.llama_like_to_hf(cfg, ARCH, "mistral"), sliding_window=cfg.sliding_window)


FAMILY = Family(
    model_type="mistral", architecture=ARCH, from_hf=from_hf, to_hf=to_hf,
    weights=WeightMap(model=L.model_rules(), layer=L.attention_rules(optional_bias=True)
                      + L.dense_mlp_rules(optional_bias=True)),
    requires=(("family", is_("llama"), "'llama'"), ("normalization", is_("RMSNorm"), "'RMSNorm'"),
              ("activation", is_("swiglu"), "'swiglu'"), ("position_embedding", is_("rope"), "'rope'"),
              ("add_qkv_bias", is_(False), "False"), ("add_bias_linear", is_(False), "False"),
              ("qk_layernorm", is_(False), "False"), ("num_moe_experts", is_none, "None"),
              ("sliding_window_layers", is_none, "None (Mistral's window covers every layer)")),
    auto=lambda c: c.sliding_window is not None,
    limits=Limits(sliding_window="all layers",
                  engines="vllm, sglang, trtllm (EAGLE-3 in its two-model mode; no DFlash)"),
)
