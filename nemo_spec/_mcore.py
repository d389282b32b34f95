"""megatron-core version differences (0.15.x and 0.16.x are supported), in one place."""
from __future__ import annotations

import inspect
from typing import Any, Callable, List, Optional, Tuple

import torch
from megatron.core.transformer import utils as _utils

try:  # 0.16: sharded_state_dict implementations expect metadata["dp_cp_group"]
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group as _ensure_dp_cp
except ImportError:  # 0.15: no such key, metadata passes through
    _ensure_dp_cp = None

_DEFAULT_TAKES_TP_GROUP = "tp_group" in inspect.signature(_utils.sharded_state_dict_default).parameters


def ensure_metadata(metadata: Optional[dict]) -> Optional[dict]:
    """``metadata`` as this megatron-core's ``sharded_state_dict`` implementations expect it."""
    return _ensure_dp_cp(metadata) if _ensure_dp_cp is not None else metadata


def sharded_state_dict_default(module: torch.nn.Module, prefix: str, sharded_offsets: tuple,
                               metadata: Optional[dict], tp_group: Any = None) -> dict:
    """megatron's ``sharded_state_dict_default`` (0.16 takes the TP group; 0.15 finds it itself)."""
    if _DEFAULT_TAKES_TP_GROUP:
        return _utils.sharded_state_dict_default(module, prefix, sharded_offsets, metadata, tp_group=tp_group)
    return _utils.sharded_state_dict_default(module, prefix, sharded_offsets, metadata)


#: megatron ``TransformerConfig`` settings (the same names in Megatron-LM's arguments and NeMo's model configs) under
#: which megatron's layers compute another function than nemo_spec's layer spec (megatron/core/transformer/
#: transformer_config.py @ 0.16.1); set to anything but their default, a checkpoint of such a model is refused
_CHANGES_FUNCTION = (
    ("layernorm_zero_centered_gamma", "zero-centred layer norm (weight + 1)"),
    ("apply_layernorm_1p", "zero-centred layer norm (weight + 1)"),  # Megatron-LM's argument before 0.16
    ("softmax_scale", "a custom attention softmax scale"),
    ("window_size", "sliding-window attention"),
    ("window_attn_skip_freq", "sliding-window attention"),
    ("no_rope_freq", "layers without RoPE"),
    ("attention_output_gate", "a gated attention output"),
    ("glu_linear_offset", "an offset on the gated MLP's linear half"),
    ("experimental_attention_variant", "an experimental attention variant"),
    ("is_hybrid_model", "a hybrid (Mamba) model"),
    ("mtp_num_layers", "multi-token prediction layers"),
)


def function_changing_settings(get: Callable[[str], Any], gated: bool, fused_glu: bool,
                               qk_l2_norm_applies: bool = True) -> List[Tuple[str, Any, str]]:
    """(setting, value, what) for each megatron setting in ``get`` (a config / argument lookup) that makes the model
    another function than nemo_spec's layers. ``fused_glu``: the gated MLP runs megatron's fused bias-SwiGLU kernel,
    which ignores ``activation_func_clamp_value`` (megatron/core/transformer/mlp.py, ``bias_swiglu_impl``; the
    unfused ``glu`` clamps). ``qk_l2_norm_applies``: the layer spec builds the L2 norm (Megatron-LM's local spec
    ignores ``--qk-l2-norm``, gpt_builders.py ``_get_transformer_layer_spec``)."""
    out = [(f, v, what) for f, what in _CHANGES_FUNCTION if (v := get(f)) not in (None, False, 0, 0.0, [], (), "")]
    st = get("softmax_type")
    if st not in (None, "vanilla"):
        out.append(("softmax_type", st, f"attention softmax {st!r}"))
    clamp = get("activation_func_clamp_value")
    if clamp is not None and gated and not fused_glu:
        out.append(("activation_func_clamp_value", clamp, "a clamped gated MLP"))
    if get("qk_l2_norm") and qk_l2_norm_applies:
        out.append(("qk_l2_norm", True, "L2-normalised queries and keys"))
    return out


#: megatron-core / NeMo activation functions that compute GELU's tanh approximation (megatron.core.activations
#: fast_gelu, transformer/utils.py gelu_impl / openai_gelu, the fused bias_gelu_impl; nemo_spec's own gelu_tanh)
TANH_GELU = ("gelu_tanh", "openai_gelu", "fast_gelu", "gelu_impl", "bias_gelu_impl")


def activation(name: str, gated: bool, bias_activation_fusion: bool) -> Optional[str]:
    """Our ``ModelConfig.activation`` for a megatron-core MLP with ``activation_func`` named ``name`` (None when no
    activation of ours computes it). With ``bias_activation_fusion`` megatron's MLP runs a non-gated ``F.gelu``
    through its fused bias-GELU kernel, which is the tanh approximation, not ``F.gelu``'s erf (transformer/mlp.py
    forward, fusions/fused_bias_gelu.py:17-19); NeMo's Starcoder/Starcoder2 and GPTConfig126M-175B set it."""
    if gated:
        return "swiglu" if name == "silu" else None
    if name == "gelu":
        return "gelu" if bias_activation_fusion else "gelu_exact"
    return "gelu" if name in TANH_GELU else None
