"""Llama (``LlamaForCausalLM``): RMSNorm, SwiGLU, RoPE (default / linear / llama3), GQA, optional attention and MLP
biases (``attention_bias`` / ``mlp_bias``; a checkpoint may omit the biases of the kind it does not use)."""
from __future__ import annotations

from typing import Any, Dict, Mapping

from nemo_spec.checkpoint.families import _llama_like as L
from nemo_spec.checkpoint.families._base import Family, Limits, WeightMap, is_, is_none
from nemo_spec.config import ModelConfig

ARCH = "LlamaForCausalLM"
#: engines whose conformance readers verify EAGLE drafts on this base (export.engines; the reference code, EaModel,
#: runs Llama, Qwen2, Qwen3 and Mixtral bases only, and EAGLE-3 drafts on Llama and Qwen3 only:
#: export/engines/reference.py BASE_ARCHITECTURES, EAGLE3_BASE_ARCHITECTURES)
ENGINES = "vllm, sglang, trtllm, reference"
ENGINES_NO_REFERENCE = "vllm, sglang, trtllm"


def from_hf(hf: Mapping[str, Any], source: str) -> ModelConfig:
    """ModelConfig of a Llama config.json."""
    return L.llama_like_from_hf(hf, source, arch=ARCH)


def to_hf(cfg: ModelConfig) -> Dict[str, Any]:
    """Llama config.json."""
    return dict(L.llama_like_to_hf(cfg, ARCH, "llama"), attention_bias=cfg.add_bias_linear,
                mlp_bias=cfg.add_bias_linear, pretraining_tp=1)


#: one decoder layer (the EAGLE draft exports write their layers with these rules too)
LAYER = L.attention_rules(optional_bias=True) + L.dense_mlp_rules(optional_bias=True)

FAMILY = Family(
    model_type="llama", architecture=ARCH, from_hf=from_hf, to_hf=to_hf,
    weights=WeightMap(model=L.model_rules(), layer=LAYER),
    requires=(("family", is_("llama"), "'llama'"), ("normalization", is_("RMSNorm"), "'RMSNorm'"),
              ("activation", is_("swiglu"), "'swiglu'"), ("position_embedding", is_("rope"), "'rope'"),
              ("qk_layernorm", is_(False), "False"), ("num_moe_experts", is_none, "None"),
              ("sliding_window", is_none, "None (Llama has no sliding window; use MistralForCausalLM)")),
    auto=lambda c: not (c.add_qkv_bias and not c.add_bias_linear),
    check=lambda c: None if not (c.add_qkv_bias and not c.add_bias_linear) else (
        "ModelConfig.add_qkv_bias=True without add_bias_linear cannot be exported as LlamaForCausalLM (its "
        "attention_bias puts biases on q, k, v and o together; q/k/v biases alone: Qwen2ForCausalLM)"),
    limits=Limits(engines=ENGINES, notes="attention_bias / mlp_bias"),
)
