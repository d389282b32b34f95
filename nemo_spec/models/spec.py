"""The project's transformer layer spec and TransformerConfig mapping."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

from nemo_spec.config import ModelConfig
from nemo_spec.models.attention import SDPACoreAttention


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (GPT-2's ``gelu_new``)."""
    return F.gelu(x, approximate="tanh")


@dataclass
class SpecTransformerConfig(TransformerConfig):
    """megatron TransformerConfig plus the RoPE settings our core attention applies by position id."""

    nemo_rope: bool = False
    nemo_rope_theta: float = 10000.0
    nemo_rope_scaling: Optional[Dict[str, Any]] = None


_TC_FIELDS = {f.name for f in dataclasses.fields(TransformerConfig)}


def transformer_config(cfg: ModelConfig, tp_size: int = 1, params_dtype: torch.dtype = torch.float32,
                       num_layers: Optional[int] = None) -> SpecTransformerConfig:
    """Map our ModelConfig to a megatron-core TransformerConfig (CPU-safe fusions off)."""
    act = {"swiglu": F.silu, "gelu": gelu_tanh, "gelu_exact": F.gelu}[cfg.activation]
    extra: Dict[str, Any] = {}
    if "cuda_graph_scope" in _TC_FIELDS:  # megatron's default "full" warns that it is deprecated; [] is the same
        extra["cuda_graph_scope"] = []
    return SpecTransformerConfig(
        **extra,
        num_layers=num_layers if num_layers is not None else cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        kv_channels=cfg.head_dim,
        ffn_hidden_size=cfg.ffn_hidden_size,
        normalization=cfg.normalization,
        layernorm_epsilon=cfg.norm_eps,
        gated_linear_unit=cfg.activation == "swiglu",
        activation_func=act,
        add_bias_linear=cfg.add_bias_linear,
        add_qkv_bias=cfg.add_qkv_bias or cfg.add_bias_linear,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=cfg.init_method_std,
        tensor_model_parallel_size=tp_size,
        use_cpu_initialization=True,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        persist_layer_norm=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        nemo_rope=cfg.position_embedding == "rope",
        nemo_rope_theta=cfg.rope_theta,
        nemo_rope_scaling=dict(cfg.rope_scaling) if cfg.rope_scaling else None,
    )


def layer_spec() -> ModuleSpec:
    """Transformer layer spec: megatron SelfAttention/MLP/TP linears, our SDPA core attention, torch norms."""
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=WrappedTorchNorm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ColumnParallelLinear,
                    core_attention=SDPACoreAttention,
                    linear_proj=RowParallelLinear,
                    q_layernorm=IdentityOp,
                    k_layernorm=IdentityOp,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=WrappedTorchNorm,
            mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                                linear_fc2=RowParallelLinear)),
            mlp_bda=get_bias_dropout_add,
        ),
    )
