"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3 attention (per-head q/k norm) and a MoE MLP in every layer: router
``mlp.gate`` [E, h], softmax over all experts, top-``num_experts_per_tok``, renormalised when ``norm_topk_prob``;
experts ``mlp.experts.{e}.{gate,up,down}_proj`` (no shared expert). ``sliding_window`` applies to every layer
behind ``use_sliding_window``. Layers with a dense MLP (``mlp_only_layers``, ``decoder_sparse_step`` > 1) are refused."""
from __future__ import annotations

from typing import Any, Dict, Mapping

from nemo_spec.checkpoint.families import _llama_like as L
from nemo_spec.checkpoint.families._base import Family, Limits, WeightMap, is_, not_none
from nemo_spec.checkpoint.families.llama import ENGINES_NO_REFERENCE
from nemo_spec.config import ModelConfig

ARCH = "Qwen3MoeForCausalLM"
MOE = L.MoEFields(experts="num_experts", topk="num_experts_per_tok", ffn="moe_intermediate_size",
                  renormalize="norm_topk_prob")
UNSUPPORTED = {"mlp_only_layers": lambda v: not v, "decoder_sparse_step": lambda v: int(v) == 1}


def from_hf(hf: Mapping[str, Any], source: str) -> ModelConfig:
    """ModelConfig of a Qwen3-MoE config.json."""
    hf = dict(hf)
    if hf.get("num_experts") is None and hf.get("num_local_experts") is not None:  # transformers 5 alias
        hf["num_experts"] = hf["num_local_experts"]
    return L.llama_like_from_hf(hf, source, arch=ARCH, qk_layernorm=True, biases=False, moe=MOE,
                                window=lambda h, s: L.window_all_layers(h, s, "use_sliding_window"),
                                unsupported=UNSUPPORTED)


def to_hf(cfg: ModelConfig) -> Dict[str, Any]:
    """Qwen3-MoE config.json."""
    return dict(L.llama_like_to_hf(cfg, ARCH, "qwen3_moe"), attention_bias=False,
                num_experts=cfg.num_moe_experts, num_experts_per_tok=cfg.moe_router_topk,
                moe_intermediate_size=cfg.moe_ffn_hidden_size, norm_topk_prob=cfg.moe_renormalize,
                decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False, router_aux_loss_coef=0.001,
                use_sliding_window=cfg.sliding_window is not None, sliding_window=cfg.sliding_window,
                max_window_layers=cfg.num_layers)


FAMILY = Family(
    model_type="qwen3_moe", architecture=ARCH, from_hf=from_hf, to_hf=to_hf,
    weights=WeightMap(model=L.model_rules(), layer=L.attention_rules() + L.qk_norm_rules() + L.expert_mlp_rules(
        router="mlp.gate", experts="mlp.experts", gate="gate_proj", up="up_proj", down="down_proj")),
    requires=(("family", is_("llama"), "'llama'"), ("normalization", is_("RMSNorm"), "'RMSNorm'"),
              ("position_embedding", is_("rope"), "'rope'"), ("qk_layernorm", is_(True), "True"),
              ("add_qkv_bias", is_(False), "False"), ("num_moe_experts", not_none, "an int"),
              ("sliding_window_layers", lambda v: v is None, "None (the window covers every layer)")),
    auto=lambda c: c.qk_layernorm and c.num_moe_experts is not None,
    limits=Limits(moe="top-k softmax, norm_topk_prob", expert_parallel="yes (allgather dispatcher)",
                  sliding_window="all layers (use_sliding_window)", engines=ENGINES_NO_REFERENCE,
                  notes="no dense layers (mlp_only_layers)"),
)
