"""The project's transformer layer spec and TransformerConfig mapping."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

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

from nemo_spec import parallel
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
    nemo_sliding_window: Optional[int] = None  # window size of the layers in nemo_window_layers
    nemo_window_layers: Optional[List[int]] = None  # 1-based layer numbers that attend through the window


_TC_FIELDS = {f.name for f in dataclasses.fields(TransformerConfig)}


def transformer_config(cfg: ModelConfig, tp_size: int = 1, params_dtype: torch.dtype = torch.float32,
                       num_layers: Optional[int] = None) -> SpecTransformerConfig:
    """Map our ModelConfig to a megatron-core TransformerConfig (CPU-safe fusions off)."""
    act = {"swiglu": F.silu, "gelu": gelu_tanh, "gelu_exact": F.gelu}[cfg.activation]
    extra: Dict[str, Any] = {}
    if "cuda_graph_scope" in _TC_FIELDS:  # megatron's default "full" warns that it is deprecated; [] is the same
        extra["cuda_graph_scope"] = []
    if cfg.num_moe_experts is not None:
        extra.update(
            num_moe_experts=cfg.num_moe_experts, moe_ffn_hidden_size=cfg.moe_ffn_hidden_size,
            moe_router_topk=cfg.moe_router_topk,
            # renormalised top-k == softmax over the top-k logits (megatron's default); otherwise softmax over
            # all experts first and keep the top-k probabilities as they are (Qwen3-MoE norm_topk_prob=false)
            moe_router_pre_softmax=not cfg.moe_renormalize,
            moe_token_dispatcher_type="allgather",  # alltoall creates a torch.cuda.Stream (CPU); exact either way
            moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_grouped_gemm=False,
            # experts are split over the EP group of the current parallel state (MoELayer reads the group; the
            # config size must agree) and tensor-parallel inside each expert over the same TP ranks
            expert_model_parallel_size=parallel.ep_size(), expert_tensor_parallel_size=tp_size)
    window = cfg.window_layers()
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
        qk_layernorm=cfg.qk_layernorm,
        nemo_sliding_window=cfg.sliding_window if window else None,
        nemo_window_layers=[i + 1 for i in window] if window else None,
    )


def moe_spec() -> ModuleSpec:
    """megatron-core's MoE layer with SequentialMLP experts on our TP linears (router top-k, no shared expert)."""
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules

    experts = ModuleSpec(module=SequentialMLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                                        linear_fc2=RowParallelLinear))
    return ModuleSpec(module=MoELayer, submodules=MoESubmodules(experts=experts, shared_experts=None))


def layer_spec(cfg: Optional[ModelConfig] = None) -> ModuleSpec:
    """Transformer layer spec: megatron SelfAttention/MLP/TP linears, our SDPA core attention, torch norms; with
    ``cfg``, per-head q/k RMSNorm (``qk_layernorm``) and a MoE MLP (``num_moe_experts``) where it asks for them."""
    spec = _dense_layer_spec()
    if cfg is not None and cfg.qk_layernorm:
        spec.submodules.self_attention.submodules.q_layernorm = WrappedTorchNorm
        spec.submodules.self_attention.submodules.k_layernorm = WrappedTorchNorm
    if cfg is not None and cfg.num_moe_experts is not None:
        spec.submodules.mlp = moe_spec()
    return spec


def _dense_layer_spec() -> ModuleSpec:
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
