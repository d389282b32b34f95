"""Building blocks the Llama-style family files compose: config.json fields, RoPE, sliding windows, MoE routing,
and the weight rules of a Llama decoder layer (attention, q/k norms, dense or expert MLPs).

A family file picks its options (q/k/v bias policy, q/k norm, sliding-window convention, MoE field names) and its
weight rules from here; nothing in this module names a family.
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple

from nemo_spec.checkpoint.families._base import FamilyError, Rule, r
from nemo_spec.config import ConfigError, ModelConfig

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------------ fields
def id_list(value: Any, field: str, source: str) -> List[int]:
    """A token id field that may be an int, a list of ints or null, as a list."""
    ids = [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise FamilyError(f"{source}: field {field!r} must be an int or a list of ints, got {value!r}")
    return ids


def first_id(value: Any, field: str, source: str) -> Optional[int]:
    """A token id field that may be a list (the first id)."""
    ids = id_list(value, field, source)
    return ids[0] if ids else None


def token_ids(hf: Mapping[str, Any], source: str) -> Dict[str, Any]:
    """bos/eos/pad ids of a config.json; several eos ids (Llama 3) are all kept as eos_token_ids."""
    out: Dict[str, Any] = {k: first_id(hf.get(k), k, source) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    eos = id_list(hf.get("eos_token_id"), "eos_token_id", source)
    out["eos_token_ids"] = eos if len(eos) > 1 else None
    return out


def required(hf: Mapping[str, Any], source: str, *names: str) -> Any:
    """The first present field among ``names``; FamilyError naming the first when none is."""
    for n in names:
        if hf.get(n) is not None:
            return hf[n]
    raise FamilyError(f"{source}: required field {names[0]!r} is missing")


def refuse(hf: Mapping[str, Any], source: str, allowed: Mapping[str, Callable[[Any], bool]],
           arch: str) -> None:
    """FamilyError naming the first config.json field whose value this family's mapping does not support."""
    for name, ok in allowed.items():
        if name in hf and not ok(hf[name]):
            raise FamilyError(f"{source}: field {name!r}={hf[name]!r} is not supported for {arch}")


def rope_from_hf(hf: Mapping[str, Any], source: str) -> Tuple[float, Optional[Dict[str, Any]]]:
    """(rope_theta, HF-style rope scaling dict or None) from either the v5 ``rope_parameters`` or legacy fields.
    A non-empty ``rope_scaling`` wins over ``rope_parameters``, as transformers 5 decides (modeling_rope_utils.py
    convert_rope_params_to_dict: ``rope_scaling or rope_parameters``) and as 4.x, which reads only ``rope_scaling``."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        raise FamilyError(f"{source}: per-layer-type 'rope_parameters' {sorted(params)} are not supported")
    scaling: Dict[str, Any] = {}
    theta = hf.get("rope_theta")
    field = "rope_scaling"
    if isinstance(hf.get("rope_scaling"), dict) and hf["rope_scaling"]:
        scaling = dict(hf["rope_scaling"])
        theta = scaling.pop("rope_theta", theta if theta is not None else (params or {}).get("rope_theta"))
    elif isinstance(params, dict) and params:
        field = "rope_parameters"
        scaling = dict(params)
        theta = scaling.pop("rope_theta", theta)
    theta = 10000.0 if theta is None else float(theta)
    rtype = scaling.pop("rope_type", scaling.pop("type", "default"))
    if float(scaling.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) or 1.0) != 1.0:
        raise FamilyError(f"{source}: field 'partial_rotary_factor' != 1 is not supported")
    scaling.pop("partial_rotary_factor", None)
    if rtype in (None, "default"):
        return theta, None
    if rtype == "linear":
        return theta, {"rope_type": "linear", "factor": float(scaling["factor"])}
    if rtype == "llama3":
        need = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [k for k in need if k not in scaling]
        if missing:
            raise FamilyError(f"{source}: field {field!r} (llama3) lacks {missing}")
        return theta, {"rope_type": "llama3", "factor": float(scaling["factor"]),
                       "low_freq_factor": float(scaling["low_freq_factor"]),
                       "high_freq_factor": float(scaling["high_freq_factor"]),
                       "original_max_position_embeddings": int(scaling["original_max_position_embeddings"])}
    raise FamilyError(
        f"{source}: field {field!r} has rope_type {rtype!r}, which is not supported (default, linear, llama3)")


def rope_to_hf(cfg: ModelConfig) -> Dict[str, Any]:
    """rope_theta / rope_scaling (transformers 4.x) and rope_parameters (5.x) for config.json."""
    params: Dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    legacy = None
    if cfg.rope_scaling:
        rs = dict(cfg.rope_scaling)
        rtype = rs.pop("rope_type", rs.pop("type", "default"))
        if rtype != "default":
            legacy = dict(rs, rope_type=rtype, type=rtype)
            params = dict(rs, rope_type=rtype, rope_theta=cfg.rope_theta)
    return {"rope_theta": cfg.rope_theta, "rope_scaling": legacy, "rope_parameters": params}


# ------------------------------------------------------------------------------------------------ windows
def window_all_layers(hf: Mapping[str, Any], source: str, enable_field: Optional[str] = None
                      ) -> Tuple[Optional[int], Optional[List[int]]]:
    """Mistral / Mixtral (and Qwen3-MoE behind ``use_sliding_window``): ``sliding_window`` applies to every layer."""
    sw = hf.get("sliding_window")
    if sw is None or (enable_field is not None and not hf.get(enable_field, False)):
        return None, None
    return int(sw), None


def window_by_layer_type(hf: Mapping[str, Any], source: str) -> Tuple[Optional[int], Optional[List[int]]]:
    """Qwen2 / Qwen3: the window is ``sliding_window`` only when ``use_sliding_window`` (transformers nulls it
    otherwise); it applies to the ``layer_types`` entries 'sliding_attention', or without ``layer_types`` to the
    layers ``i >= max_window_layers`` (transformers configuration_qwen2.py / configuration_qwen3.py)."""
    n = int(hf.get("num_hidden_layers") or 0)
    sw = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
    types = hf.get("layer_types")
    if types is not None:
        bad = sorted(set(types) - {"full_attention", "sliding_attention"})
        if bad or len(types) != n:
            raise FamilyError(f"{source}: field 'layer_types' must list {n} of 'full_attention'/'sliding_attention'"
                              f", got {types!r}")
        layers = [i for i, t in enumerate(types) if t == "sliding_attention"]
    else:
        layers = list(range(int(hf.get("max_window_layers", 0)), n))
    if sw is None or not layers:
        return None, None
    return int(sw), (None if len(layers) == n else layers)


def window_to_layer_types(cfg: ModelConfig) -> Dict[str, Any]:
    """Qwen2 / Qwen3 config.json window fields (both ``layer_types`` and the legacy max_window_layers form)."""
    layers = cfg.window_layers()
    if not layers:
        return {"use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.num_layers,
                "layer_types": ["full_attention"] * cfg.num_layers}
    types = ["sliding_attention" if i in layers else "full_attention" for i in range(cfg.num_layers)]
    suffix = layers == list(range(layers[0], cfg.num_layers))
    return {"use_sliding_window": True, "sliding_window": cfg.sliding_window,
            "max_window_layers": layers[0] if suffix else cfg.num_layers, "layer_types": types}


# ------------------------------------------------------------------------------------------------ MoE
@dataclass(frozen=True)
class MoEFields:
    """config.json names of a MoE family (top-k softmax router; ``renormalize`` True/False or a field name)."""

    experts: str
    topk: str
    ffn: str
    renormalize: Any  # bool (fixed by the family) or the name of the config.json flag


def moe_from_hf(hf: Mapping[str, Any], source: str, m: MoEFields) -> Dict[str, Any]:
    """ModelConfig MoE fields from config.json."""
    renorm = m.renormalize if isinstance(m.renormalize, bool) else bool(hf.get(m.renormalize, False))
    return {"num_moe_experts": int(required(hf, source, m.experts)), "moe_router_topk": int(required(hf, source, m.topk)),
            "moe_ffn_hidden_size": int(required(hf, source, m.ffn)), "moe_renormalize": renorm}


# ------------------------------------------------------------------------------------------------ config
def llama_like_from_hf(hf: Mapping[str, Any], source: str, *, arch: str, qkv_bias: bool = False,
                       qk_layernorm: bool = False,
                       window: Callable[[Mapping[str, Any], str], Tuple[Optional[int], Optional[List[int]]]]
                       = lambda hf, source: (None, None),
                       moe: Optional[MoEFields] = None, ffn_field: str = "intermediate_size",
                       biases: Optional[bool] = True, unsupported: Optional[Mapping[str, Callable[[Any], bool]]] = None
                       ) -> ModelConfig:
    """ModelConfig of a Llama-style config.json: RMSNorm, SwiGLU (or experts), RoPE, GQA, the family's options.

    ``qkv_bias``: the family always has q/k/v biases (Qwen2). ``biases``: read ``attention_bias`` / ``mlp_bias``
    (Llama); False: a true one is refused; None: the fields are not read (transformers' Qwen2 and vLLM's ignore
    them). ``window``: the family's sliding-window convention.
    """
    refuse(hf, source, dict(unsupported or {}), arch)
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise FamilyError(f"{source}: field 'hidden_act'={act!r} is not supported (need 'silu')")
    attention_bias, mlp_bias = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
    if biases is None:
        attention_bias = mlp_bias = False
    elif not biases and (attention_bias or mlp_bias):
        raise FamilyError(f"{source}: field {'attention_bias' if attention_bias else 'mlp_bias'}=true is not "
                          f"supported for {arch}")
    heads, hidden = int(required(hf, source, "num_attention_heads")), int(required(hf, source, "hidden_size"))
    theta, scaling = rope_from_hf(hf, source)
    sw, sw_layers = window(hf, source)
    extra: Dict[str, Any] = moe_from_hf(hf, source, moe) if moe is not None else {}
    with config_errors(source):
        return ModelConfig(
            vocab_size=int(required(hf, source, "vocab_size")), hidden_size=hidden,
            num_layers=int(required(hf, source, "num_hidden_layers")), num_attention_heads=heads,
            ffn_hidden_size=int(hf.get(ffn_field) or extra.get("moe_ffn_hidden_size") or required(hf, source, ffn_field)),
            num_query_groups=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hidden // heads),
            max_position_embeddings=int(required(hf, source, "max_position_embeddings")),
            family="llama", normalization="RMSNorm", norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            activation="swiglu", position_embedding="rope", rope_theta=theta, rope_scaling=scaling,
            add_bias_linear=attention_bias or mlp_bias, add_qkv_bias=qkv_bias or attention_bias,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            init_method_std=float(hf.get("initializer_range", 0.02)), qk_layernorm=qk_layernorm,
            sliding_window=sw, sliding_window_layers=sw_layers, **extra, **token_ids(hf, source))


@contextmanager
def config_errors(source: str) -> Iterator[None]:
    """Building a ModelConfig from config.json values: a ConfigError, or a field value of the wrong type, becomes a
    FamilyError naming ``source`` (FamilyErrors pass through)."""
    try:
        yield
    except FamilyError:
        raise
    except ConfigError as e:
        raise FamilyError(f"{source}: {e}") from e
    except (TypeError, ValueError) as e:
        raise FamilyError(f"{source}: invalid field value ({e})") from e


def common_to_hf(cfg: ModelConfig, arch: str, model_type: str) -> Dict[str, Any]:
    """config.json fields every family writes."""
    out = {"architectures": [arch], "model_type": model_type, "vocab_size": cfg.vocab_size,
           "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_ids or cfg.eos_token_id,
           "pad_token_id": cfg.pad_token_id,
           "tie_word_embeddings": cfg.tie_word_embeddings, "initializer_range": cfg.init_method_std,
           "use_cache": True}
    try:
        import transformers

        out["transformers_version"] = transformers.__version__
    except ImportError:  # pragma: no cover
        pass
    return out


def llama_like_to_hf(cfg: ModelConfig, arch: str, model_type: str) -> Dict[str, Any]:
    """Llama-style config.json fields (the family adds its own)."""
    return dict(common_to_hf(cfg, arch, model_type), hidden_size=cfg.hidden_size,
                intermediate_size=cfg.ffn_hidden_size, num_hidden_layers=cfg.num_layers,
                num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_query_groups,
                head_dim=cfg.head_dim, hidden_act="silu", max_position_embeddings=cfg.max_position_embeddings,
                rms_norm_eps=cfg.norm_eps, attention_dropout=0.0, **rope_to_hf(cfg))


# ------------------------------------------------------------------------------------------------ weights
def _has_qkv_bias(c: ModelConfig) -> bool:
    return c.add_qkv_bias or c.add_bias_linear


def _has_bias(c: ModelConfig) -> bool:
    return c.add_bias_linear


def model_rules() -> Tuple[Rule, ...]:
    """Embedding, final norm, untied lm_head (model.* names)."""
    return (r("embedding.word_embeddings.weight", "model.embed_tokens.weight", "v,h"),
            r("decoder.final_layernorm.weight", "model.norm.weight", "h"),
            r("output_layer.weight", "lm_head.weight", "v,h", when=lambda c: not c.tie_word_embeddings))


def attention_rules(optional_bias: bool = False) -> Tuple[Rule, ...]:
    """Norms around attention, fused q/k/v (+ biases), o_proj (+ bias), per decoder layer."""
    return (
        r("input_layernorm.weight", "input_layernorm.weight", "h", tag="input_norm"),
        r("pre_mlp_layernorm.weight", "post_attention_layernorm.weight", "h"),
        Rule("self_attention.linear_qkv.weight",
             ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
             ("q,h", "kv,h", "kv,h"), "qkv"),
        Rule("self_attention.linear_qkv.bias",
             ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
             ("q", "kv", "kv"), "qkv", when=_has_qkv_bias, optional=optional_bias),
        r("self_attention.linear_proj.weight", "self_attn.o_proj.weight", "h,q"),
        r("self_attention.linear_proj.bias", "self_attn.o_proj.bias", "h", when=_has_bias, optional=optional_bias),
    )


def qk_norm_rules() -> Tuple[Rule, ...]:
    """Per-head q/k RMSNorm weights [head_dim] (Qwen3 ``q_norm`` / ``k_norm``)."""
    return (r("self_attention.q_layernorm.weight", "self_attn.q_norm.weight", "d"),
            r("self_attention.k_layernorm.weight", "self_attn.k_norm.weight", "d"))


def dense_mlp_rules(optional_bias: bool = False) -> Tuple[Rule, ...]:
    """SwiGLU MLP: gate/up fused into linear_fc1, down_proj = linear_fc2 (+ biases)."""
    return (
        Rule("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), ("f,h", "f,h"), "gated"),
        r("mlp.linear_fc2.weight", "mlp.down_proj.weight", "h,f"),
        Rule("mlp.linear_fc1.bias", ("mlp.gate_proj.bias", "mlp.up_proj.bias"), ("f", "f"), "gated",
             when=_has_bias, optional=optional_bias),
        r("mlp.linear_fc2.bias", "mlp.down_proj.bias", "h", when=_has_bias, optional=optional_bias),
    )


def expert_mlp_rules(router: str, experts: str, gate: str, up: str, down: str) -> Tuple[Rule, ...]:
    """Router [E, h] and per-expert SwiGLU weights (hub layout, one tensor per expert and projection) mapped onto
    megatron's MoELayer with SequentialMLP experts (``mlp.experts.local_experts.{e}.*``)."""
    ours = "mlp.experts.local_experts.{e}."
    return (
        r("mlp.router.weight", router + ".weight", "E,h"),
        Rule(ours + "linear_fc1.weight", (f"{experts}.{{e}}.{gate}.weight", f"{experts}.{{e}}.{up}.weight"),
             ("fe,h", "fe,h"), "gated"),
        r(ours + "linear_fc2.weight", f"{experts}.{{e}}.{down}.weight", "h,fe"),
    )
