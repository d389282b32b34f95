"""Mixtral (``MixtralForCausalLM``): a Llama attention and a MoE MLP in every layer: router
``block_sparse_moe.gate`` [E, h], softmax, top-``num_experts_per_tok``, always renormalised; experts
``block_sparse_moe.experts.{e}.w1`` (gate) / ``w3`` (up) / ``w2`` (down); ``sliding_window`` (when set) on every
layer. ``router_jitter_noise`` (training-time noise) must be 0."""
from __future__ import annotations

from typing import Any, Dict, Mapping

from nemo_spec.checkpoint.families import _llama_like as L
from nemo_spec.checkpoint.families._base import Family, Limits, WeightMap, is_, not_none
from nemo_spec.config import ModelConfig

ARCH = "MixtralForCausalLM"
MOE = L.MoEFields(experts="num_local_experts", topk="num_experts_per_tok", ffn="intermediate_size", renormalize=True)
UNSUPPORTED = {"router_jitter_noise": lambda v: not v}


def from_hf(hf: Mapping[str, Any], source: str) -> ModelConfig:
    """ModelConfig of a Mixtral config.json."""
    return L.llama_like_from_hf(hf, source, arch=ARCH, biases=False, moe=MOE, window=L.window_all_layers,
                                unsupported=UNSUPPORTED)


def to_hf(cfg: ModelConfig) -> Dict[str, Any]:
    """Mixtral config.json."""
    out = dict(L.llama_like_to_hf(cfg, ARCH, "mixtral"), num_local_experts=cfg.num_moe_experts,
               num_experts_per_tok=cfg.moe_router_topk, output_router_logits=False, router_aux_loss_coef=0.02,
               router_jitter_noise=0.0, sliding_window=cfg.sliding_window)
    out["intermediate_size"] = cfg.moe_ffn_hidden_size
    return out


FAMILY = Family(
    model_type="mixtral", architecture=ARCH, from_hf=from_hf, to_hf=to_hf,
    weights=WeightMap(model=L.model_rules(), layer=L.attention_rules() + L.expert_mlp_rules(
        router="block_sparse_moe.gate", experts="block_sparse_moe.experts", gate="w1", up="w3", down="w2")),
    requires=(("family", is_("llama"), "'llama'"), ("normalization", is_("RMSNorm"), "'RMSNorm'"),
              ("position_embedding", is_("rope"), "'rope'"), ("qk_layernorm", is_(False), "False"),
              ("add_qkv_bias", is_(False), "False"), ("num_moe_experts", not_none, "an int"),
              ("moe_renormalize", is_(True), "True (Mixtral always renormalises the top-k)"),
              ("sliding_window_layers", lambda v: v is None, "None (Mixtral's window covers every layer)")),
    auto=lambda c: c.num_moe_experts is not None and not c.qk_layernorm,
    limits=Limits(moe="top-k softmax, renormalised", expert_parallel="yes (allgather dispatcher)",
                  sliding_window="all layers",
                  engines="vllm and sglang (EAGLE-1 only: no aux hidden states), reference (EAGLE-1 only); "
                          "trtllm: none (no aux hidden states)"),
)
