"""GPT-2 (``GPT2LMHeadModel``): learned positions, LayerNorm, gelu_new / gelu, biases everywhere, tied embeddings
by default. ``Conv1D`` weights are stored [in, out] (transposed) and ``c_attn`` is [q; k; v] over all heads, which
maps onto megatron's per-head [q_i; k_i; v_i]. Hub checkpoints often lack the ``transformer.`` prefix and carry
causal-mask buffers (``attn.bias`` / ``attn.masked_bias``), which are ignored."""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

from nemo_spec.checkpoint.families import _llama_like as L
from nemo_spec.checkpoint.families._base import Family, FamilyError, Limits, WeightMap, is_, is_none, r
from nemo_spec.config import ConfigError, ModelConfig

ARCH = "GPT2LMHeadModel"
_ACTS = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "gelu_fast": "gelu", "gelu": "gelu_exact"}
_FLAGS = (("add_cross_attention", False), ("scale_attn_by_inverse_layer_idx", False), ("scale_attn_weights", True))


def from_hf(hf: Mapping[str, Any], source: str) -> ModelConfig:
    """ModelConfig of a GPT-2 config.json."""
    for flag, ok in _FLAGS:
        if flag in hf and bool(hf[flag]) != ok:
            raise FamilyError(f"{source}: field {flag!r}={hf[flag]!r} is not supported (need {ok})")
    act = hf.get("activation_function", "gelu_new")
    if act not in _ACTS:
        raise FamilyError(f"{source}: field 'activation_function'={act!r} is not supported (supported: {sorted(_ACTS)})")
    req = lambda *n: L.required(hf, source, *n)  # noqa: E731
    hidden = int(req("n_embd", "hidden_size"))
    with L.config_errors(source):
        return ModelConfig(
            vocab_size=int(req("vocab_size")), hidden_size=hidden, num_layers=int(req("n_layer", "num_hidden_layers")),
            num_attention_heads=int(req("n_head", "num_attention_heads")),
            ffn_hidden_size=int(hf.get("n_inner") or 4 * hidden),
            max_position_embeddings=int(req("n_positions", "max_position_embeddings")),
            family="gpt2", normalization="LayerNorm", norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
            activation=_ACTS[act], position_embedding="learned", add_bias_linear=True,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
            init_method_std=float(hf.get("initializer_range", 0.02)), **L.token_ids(hf, source))


def to_hf(cfg: ModelConfig) -> Dict[str, Any]:
    """GPT-2 config.json."""
    return dict(L.common_to_hf(cfg, ARCH, "gpt2"), n_embd=cfg.hidden_size, n_layer=cfg.num_layers,
                n_head=cfg.num_attention_heads, n_inner=cfg.ffn_hidden_size, n_positions=cfg.max_position_embeddings,
                activation_function="gelu_new" if cfg.activation == "gelu" else "gelu",
                layer_norm_epsilon=cfg.norm_eps, attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0,
                scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False,
                add_cross_attention=False)


def check_mha(cfg: ModelConfig) -> Optional[str]:
    """GPT-2 is multi-head attention with head_dim = hidden / heads: the field that is not, else None."""
    for name, want in (("num_query_groups", cfg.num_attention_heads),
                       ("head_dim", cfg.hidden_size // cfg.num_attention_heads)):
        if getattr(cfg, name) != want:
            return f"ModelConfig.{name}={getattr(cfg, name)!r} cannot be exported as {ARCH} (needs {want!r})"
    return None


def _normalize(name: str) -> str:
    return name if name.startswith(("transformer.", "lm_head.")) else "transformer." + name


LAYER = (
    r("input_layernorm.weight", "ln_1.weight", "h"), r("input_layernorm.bias", "ln_1.bias", "h"),
    r("pre_mlp_layernorm.weight", "ln_2.weight", "h"), r("pre_mlp_layernorm.bias", "ln_2.bias", "h"),
    r("self_attention.linear_qkv.weight", "attn.c_attn.weight", "h,3h", "qkv_t"),
    r("self_attention.linear_qkv.bias", "attn.c_attn.bias", "3h", "qkv_t"),
    r("self_attention.linear_proj.weight", "attn.c_proj.weight", "h,h", "t"),
    r("self_attention.linear_proj.bias", "attn.c_proj.bias", "h"),
    r("mlp.linear_fc1.weight", "mlp.c_fc.weight", "h,f", "t"), r("mlp.linear_fc1.bias", "mlp.c_fc.bias", "f"),
    r("mlp.linear_fc2.weight", "mlp.c_proj.weight", "f,h", "t"), r("mlp.linear_fc2.bias", "mlp.c_proj.bias", "h"),
)
MODEL = (
    r("embedding.word_embeddings.weight", "transformer.wte.weight", "v,h"),
    r("embedding.position_embeddings.weight", "transformer.wpe.weight", "pos,h"),
    r("decoder.final_layernorm.weight", "transformer.ln_f.weight", "h"),
    r("decoder.final_layernorm.bias", "transformer.ln_f.bias", "h"),
    r("output_layer.weight", "lm_head.weight", "v,h", when=lambda c: not c.tie_word_embeddings),
)


FAMILY = Family(
    model_type="gpt2", architecture=ARCH, from_hf=from_hf, to_hf=to_hf,
    weights=WeightMap(model=MODEL, layer=LAYER, hf_layer_prefix="transformer.h.{i}.",
                      ignored_suffixes=("attn.bias", "attn.masked_bias"), normalize=_normalize),
    requires=(("family", is_("gpt2"), "'gpt2'"), ("normalization", is_("LayerNorm"), "'LayerNorm'"),
              ("position_embedding", is_("learned"), "'learned'"), ("add_bias_linear", is_(True), "True"),
              ("activation", lambda v: v in ("gelu", "gelu_exact"), "'gelu' or 'gelu_exact'"),
              ("rope_scaling", is_none, "None (GPT-2 has no RoPE)"), ("qk_layernorm", is_(False), "False"),
              ("num_moe_experts", is_none, "None"), ("sliding_window", is_none, "None")),
    auto=lambda c: c.family == "gpt2",
    limits=Limits(engines="reference (Medusa)", notes="EAGLE formats need Llama layers"),
    check=lambda c: check_mha(c),
)
