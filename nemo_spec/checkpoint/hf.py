"""Hugging Face checkpoints: import Llama / Qwen2 / Mistral / GPT-2 directories into our megatron-core GPTModel
and export it back to a directory ``transformers`` loads (``local_files_only``).

Weight layouts (HF -> megatron-core, full TP=1 state dicts):

- Llama family: ``q_proj``/``k_proj``/``v_proj`` are fused into ``linear_qkv`` laid out per query group
  ([q heads of group g; k_g; v_g] for each g); ``gate_proj``/``up_proj`` become ``linear_fc1`` = [gate; up].
  HF Llama q/k weights already use the rotate-half RoPE convention our core attention applies.
- GPT-2: ``Conv1D`` weights are stored [in, out] (transposed) and ``c_attn`` is [q; k; v] over all heads,
  which is rearranged to megatron's per-head [q_i; k_i; v_i]; learned positions, LayerNorm, gelu_new, tied
  embeddings.

Tensor parallelism: :func:`load_hf` builds the model for the current parallel state and takes this rank's shard
(``tp.load_full_state_dict``); :func:`export_hf` all-gathers the shards (``tp.gather_full_state_dict``) and rank 0
writes. Every rank must call both under torchrun.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple, Union

import torch

from nemo_spec import parallel
from nemo_spec.fsutil import publish_directory
from nemo_spec.config import ConfigError, ModelConfig
from nemo_spec.checkpoint.megatron import TOKENIZER_FILES, copy_tokenizer

log = logging.getLogger(__name__)

try:  # share the checkpoint package's error type when it defines one
    from nemo_spec.checkpoint import CheckpointError as _ErrorBase  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - depends on import order of the checkpoint package
    _ErrorBase = ValueError  # type: ignore[assignment,misc]

_BASES = (_ErrorBase,) if issubclass(_ErrorBase, ValueError) else (_ErrorBase, ValueError)


class HFCheckpointError(*_BASES):  # type: ignore[misc]
    """A Hugging Face checkpoint directory is missing, unsupported or inconsistent (message names file/field)."""


PathLike = Union[str, os.PathLike]

#: HF ``architectures`` entry -> ``model_type`` of the families we import and export.
SUPPORTED_ARCHITECTURES: Dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
    "GPT2LMHeadModel": "gpt2",
}
_MODEL_TYPE_TO_ARCH = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}


# Entries some checkpoints carry that are not weights (RoPE caches, GPT-2 causal-mask buffers).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "attn.bias", "attn.masked_bias")

_DTYPES: Dict[str, torch.dtype] = {
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
}
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def resolve_dtype(dtype: Union[str, torch.dtype], what: str = "dtype",
                  error: type = None) -> torch.dtype:  # type: ignore[assignment]
    """Map 'fp32'/'bf16'/'fp16' (float32, bfloat16, float16, half; 'auto' = bf16 on CUDA, fp32 on CPU) or a
    torch dtype to a torch dtype; anything else raises ``error`` (default HFCheckpointError) naming ``what``."""
    error = error or HFCheckpointError
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPE_NAMES:
            raise error(f"unknown {what} {dtype}; choose one of fp32, bf16, fp16")
        return dtype
    key = str(dtype).strip().lower().replace("torch.", "")
    if key == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    if key not in _DTYPES:
        raise error(f"unknown {what} {dtype!r}; choose one of fp32, bf16, fp16 (or auto)")
    return _DTYPES[key]


# --------------------------------------------------------------------------------------------------------------
# config.json
# --------------------------------------------------------------------------------------------------------------

def read_hf_config(path: PathLike) -> Dict[str, Any]:
    """Parse ``<path>/config.json``; raise HFCheckpointError naming the file when absent or invalid."""
    p = Path(path)
    if not p.is_dir():
        raise HFCheckpointError(f"{p}: not a directory (expected a Hugging Face checkpoint directory)")
    cfg_path = p / "config.json"
    if not cfg_path.is_file():
        raise HFCheckpointError(f"{cfg_path}: missing (a Hugging Face checkpoint directory needs config.json)")
    try:
        data = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise HFCheckpointError(f"{cfg_path}: invalid JSON ({e})") from e
    if not isinstance(data, dict):
        raise HFCheckpointError(f"{cfg_path}: expected a JSON object, got {type(data).__name__}")
    return data


def hf_model_type(hf: Mapping[str, Any], source: str = "config.json") -> str:
    """The supported model_type ('llama'|'qwen2'|'mistral'|'gpt2') of an HF config, from architectures/model_type."""
    archs = hf.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    supported = sorted(SUPPORTED_ARCHITECTURES)
    if archs:
        for a in archs:
            if a in SUPPORTED_ARCHITECTURES:
                return SUPPORTED_ARCHITECTURES[a]
        raise HFCheckpointError(
            f"{source}: field 'architectures' = {archs} is not supported; supported architectures: {supported}")
    mt = hf.get("model_type")
    if mt in _MODEL_TYPE_TO_ARCH:
        return str(mt)
    raise HFCheckpointError(
        f"{source}: cannot tell the architecture (architectures={archs!r}, model_type={mt!r}); "
        f"supported architectures: {supported}")


def _first_id(value: Any, field: str, source: str) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        if not value:
            return None
        if len(value) > 1:
            log.warning("%s: %s=%s has several ids; using %s (generation_config.json keeps the full list)",
                        source, field, list(value), value[0])
        value = value[0]
    if not isinstance(value, int):
        raise HFCheckpointError(f"{source}: field {field!r} must be an int or a list of ints, got {value!r}")
    return value


def _rope_from_hf(hf: Mapping[str, Any], source: str) -> Tuple[float, Optional[Dict[str, Any]]]:
    """(rope_theta, HF-style rope scaling dict or None) from either the v5 ``rope_parameters`` or legacy fields."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        raise HFCheckpointError(f"{source}: per-layer-type 'rope_parameters' {sorted(params)} are not supported")
    scaling: Dict[str, Any] = {}
    theta = hf.get("rope_theta")
    field = "rope_scaling"
    if isinstance(params, dict) and params:
        field = "rope_parameters"
        scaling = dict(params)
        theta = scaling.pop("rope_theta", theta)
    elif isinstance(hf.get("rope_scaling"), dict):
        scaling = dict(hf["rope_scaling"])
    theta = 10000.0 if theta is None else float(theta)
    rtype = scaling.pop("rope_type", scaling.pop("type", "default"))
    if float(scaling.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) or 1.0) != 1.0:
        raise HFCheckpointError(f"{source}: field 'partial_rotary_factor' != 1 is not supported")
    scaling.pop("partial_rotary_factor", None)
    if rtype in (None, "default"):
        return theta, None
    if rtype == "linear":
        return theta, {"rope_type": "linear", "factor": float(scaling["factor"])}
    if rtype == "llama3":
        need = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [k for k in need if k not in scaling]
        if missing:
            raise HFCheckpointError(f"{source}: field {field!r} (llama3) lacks {missing}")
        out = {"rope_type": "llama3", "factor": float(scaling["factor"]),
               "low_freq_factor": float(scaling["low_freq_factor"]),
               "high_freq_factor": float(scaling["high_freq_factor"]),
               "original_max_position_embeddings": int(scaling["original_max_position_embeddings"])}
        return theta, out
    raise HFCheckpointError(
        f"{source}: field {field!r} has rope_type {rtype!r}, which is not supported (default, linear, llama3)")


def _sliding_window(hf: Mapping[str, Any], model_type: str) -> Optional[int]:
    """The sliding-window size if any layer uses one (Mistral, Qwen2 with use_sliding_window), else None."""
    sw = hf.get("sliding_window")
    if sw is None or model_type not in ("mistral", "qwen2"):
        return None
    if model_type == "qwen2":
        layer_types = hf.get("layer_types")
        if layer_types is not None:
            return int(sw) if "sliding_attention" in layer_types else None
        if not hf.get("use_sliding_window", False):
            return None
        if int(hf.get("max_window_layers", 0)) >= int(hf.get("num_hidden_layers", 0)):
            return None  # every layer below max_window_layers uses full attention
    return int(sw)


def hf_to_model_config(hf_config: Mapping[str, Any], source: str = "config.json") -> ModelConfig:
    """Translate an HF config.json dict (Llama / Qwen2 / Mistral / GPT-2) into our ModelConfig."""
    hf = dict(hf_config)
    mt = hf_model_type(hf, source)

    def req(*names: str) -> Any:
        for n in names:
            if hf.get(n) is not None:
                return hf[n]
        raise HFCheckpointError(f"{source}: required field {names[0]!r} is missing")

    ids = {k: _first_id(hf.get(k), k, source) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    try:
        if mt == "gpt2":
            for flag, ok in (("add_cross_attention", False), ("scale_attn_by_inverse_layer_idx", False),
                             ("scale_attn_weights", True)):
                if flag in hf and bool(hf[flag]) != ok:
                    raise HFCheckpointError(f"{source}: field {flag!r}={hf[flag]!r} is not supported (need {ok})")
            act_name = hf.get("activation_function", "gelu_new")
            acts = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "gelu_fast": "gelu", "gelu": "gelu_exact"}
            if act_name not in acts:
                raise HFCheckpointError(f"{source}: field 'activation_function'={act_name!r} is not supported "
                                        f"(supported: {sorted(acts)})")
            hidden = int(req("n_embd", "hidden_size"))
            return ModelConfig(
                vocab_size=int(req("vocab_size")), hidden_size=hidden, num_layers=int(req("n_layer", "num_hidden_layers")),
                num_attention_heads=int(req("n_head", "num_attention_heads")),
                ffn_hidden_size=int(hf.get("n_inner") or 4 * hidden),
                max_position_embeddings=int(req("n_positions", "max_position_embeddings")),
                family="gpt2", normalization="LayerNorm", norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
                activation=acts[act_name], position_embedding="learned", add_bias_linear=True,
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
                init_method_std=float(hf.get("initializer_range", 0.02)), **ids)
        act = hf.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise HFCheckpointError(f"{source}: field 'hidden_act'={act!r} is not supported (need 'silu')")
        heads = int(req("num_attention_heads"))
        hidden = int(req("hidden_size"))
        theta, scaling = _rope_from_hf(hf, source)
        max_pos = int(req("max_position_embeddings"))
        sw = _sliding_window(hf, mt)
        if sw is not None and sw < max_pos:
            log.warning("%s: sliding_window=%d < max_position_embeddings=%d; sliding-window attention is not "
                        "implemented, so max_position_embeddings is limited to %d (exact up to that length)",
                        source, sw, max_pos, sw)
            max_pos = sw
        attention_bias = bool(hf.get("attention_bias", False))
        mlp_bias = bool(hf.get("mlp_bias", False))
        return ModelConfig(
            vocab_size=int(req("vocab_size")), hidden_size=hidden, num_layers=int(req("num_hidden_layers")),
            num_attention_heads=heads, ffn_hidden_size=int(req("intermediate_size")),
            num_query_groups=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hidden // heads), max_position_embeddings=max_pos,
            family="llama", normalization="RMSNorm", norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            activation="swiglu", position_embedding="rope", rope_theta=theta, rope_scaling=scaling,
            add_bias_linear=attention_bias or mlp_bias, add_qkv_bias=(mt == "qwen2") or attention_bias,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            init_method_std=float(hf.get("initializer_range", 0.02)), **ids)
    except ConfigError as e:
        raise HFCheckpointError(f"{source}: {e}") from e
    except (TypeError, ValueError) as e:
        if isinstance(e, HFCheckpointError):
            raise
        raise HFCheckpointError(f"{source}: invalid field value ({e})") from e


def _choose_arch(cfg: ModelConfig, architecture: Optional[str]) -> str:
    if architecture is not None:
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise HFCheckpointError(f"architecture {architecture!r} is not supported; supported architectures: "
                                    f"{sorted(SUPPORTED_ARCHITECTURES)}")
        if (architecture == "GPT2LMHeadModel") != (cfg.family == "gpt2"):
            raise HFCheckpointError(f"architecture {architecture!r} cannot hold a model of family {cfg.family!r}")
        return architecture
    if cfg.family == "gpt2":
        return "GPT2LMHeadModel"
    if cfg.add_qkv_bias and not cfg.add_bias_linear:
        return "Qwen2ForCausalLM"
    return "LlamaForCausalLM"


def check_exportable(cfg: ModelConfig, architecture: Optional[str] = None) -> str:
    """Raise HFCheckpointError naming the field if ``cfg`` cannot be written as an HF model; return the architecture."""
    arch = _choose_arch(cfg, architecture)
    mt = SUPPORTED_ARCHITECTURES[arch]
    need: List[Tuple[str, Any]]
    if mt == "gpt2":
        need = [("normalization", "LayerNorm"), ("position_embedding", "learned"), ("add_bias_linear", True),
                ("num_query_groups", cfg.num_attention_heads),
                ("head_dim", cfg.hidden_size // cfg.num_attention_heads)]
        if cfg.activation not in ("gelu", "gelu_exact"):
            raise HFCheckpointError(f"ModelConfig.activation={cfg.activation!r} cannot be exported as GPT-2")
        if cfg.rope_scaling:
            raise HFCheckpointError("ModelConfig.rope_scaling is set but GPT-2 has no RoPE")
    else:
        need = [("normalization", "RMSNorm"), ("activation", "swiglu"), ("position_embedding", "rope")]
        if mt == "qwen2":
            need += [("add_qkv_bias", True), ("add_bias_linear", False)]
        elif cfg.add_qkv_bias and not cfg.add_bias_linear:
            raise HFCheckpointError(f"ModelConfig.add_qkv_bias=True without add_bias_linear needs "
                                    f"Qwen2ForCausalLM, not {arch}")
    for field, value in need:
        if getattr(cfg, field) != value:
            raise HFCheckpointError(f"ModelConfig.{field}={getattr(cfg, field)!r} cannot be exported as {arch} "
                                    f"(needs {value!r})")
    return arch


def model_config_to_hf(cfg: ModelConfig, architecture: Optional[str] = None,
                       dtype: Union[str, torch.dtype] = torch.float32) -> Dict[str, Any]:
    """The HF config.json dict for ``cfg`` (readable by transformers 4.x and 5.x)."""
    arch = check_exportable(cfg, architecture)
    mt = SUPPORTED_ARCHITECTURES[arch]
    dname = _DTYPE_NAMES[resolve_dtype(dtype)]
    common = {"architectures": [arch], "model_type": mt, "vocab_size": cfg.vocab_size,
              "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id,
              "tie_word_embeddings": cfg.tie_word_embeddings, "initializer_range": cfg.init_method_std,
              "torch_dtype": dname, "dtype": dname, "use_cache": True}
    try:
        import transformers

        common["transformers_version"] = transformers.__version__
    except ImportError:  # pragma: no cover
        pass
    if mt == "gpt2":
        out = dict(common, n_embd=cfg.hidden_size, n_layer=cfg.num_layers, n_head=cfg.num_attention_heads,
                   n_inner=cfg.ffn_hidden_size, n_positions=cfg.max_position_embeddings,
                   activation_function="gelu_new" if cfg.activation == "gelu" else "gelu",
                   layer_norm_epsilon=cfg.norm_eps, attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0,
                   scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False,
                   add_cross_attention=False)
        return out
    rope_params: Dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    legacy_scaling = None
    if cfg.rope_scaling:
        rs = dict(cfg.rope_scaling)
        rtype = rs.pop("rope_type", rs.pop("type", "default"))
        if rtype != "default":
            legacy_scaling = dict(rs, rope_type=rtype, type=rtype)
            rope_params = dict(rs, rope_type=rtype, rope_theta=cfg.rope_theta)
    out = dict(common, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size,
               num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
               num_key_value_heads=cfg.num_query_groups, head_dim=cfg.head_dim, hidden_act="silu",
               max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.norm_eps,
               rope_theta=cfg.rope_theta, rope_scaling=legacy_scaling, rope_parameters=rope_params,
               attention_dropout=0.0)
    if mt == "llama":
        out.update(attention_bias=cfg.add_bias_linear, mlp_bias=cfg.add_bias_linear, pretraining_tp=1)
    elif mt == "qwen2":
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.num_layers)
    else:
        out.update(sliding_window=None)
    return out


# --------------------------------------------------------------------------------------------------------------
# weights: HF names and shapes, reading, and the layout mapping
# --------------------------------------------------------------------------------------------------------------

def expected_hf_shapes(cfg: ModelConfig, model_type: str) -> Dict[str, Tuple[int, ...]]:
    """Every HF tensor name the checkpoint must hold for ``cfg`` with its shape (biases only where used)."""
    h, v, f, L = cfg.hidden_size, cfg.vocab_size, cfg.ffn_hidden_size, cfg.num_layers
    out: Dict[str, Tuple[int, ...]] = {}
    if model_type == "gpt2":
        out["transformer.wte.weight"] = (v, h)
        out["transformer.wpe.weight"] = (cfg.max_position_embeddings, h)
        for i in range(L):
            p = f"transformer.h.{i}."
            out.update({p + "ln_1.weight": (h,), p + "ln_1.bias": (h,), p + "ln_2.weight": (h,), p + "ln_2.bias": (h,),
                        p + "attn.c_attn.weight": (h, 3 * h), p + "attn.c_attn.bias": (3 * h,),
                        p + "attn.c_proj.weight": (h, h), p + "attn.c_proj.bias": (h,),
                        p + "mlp.c_fc.weight": (h, f), p + "mlp.c_fc.bias": (f,),
                        p + "mlp.c_proj.weight": (f, h), p + "mlp.c_proj.bias": (h,)})
        out["transformer.ln_f.weight"] = (h,)
        out["transformer.ln_f.bias"] = (h,)
        if not cfg.tie_word_embeddings:
            out["lm_head.weight"] = (v, h)
        return out
    d, nq, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_query_groups
    out["model.embed_tokens.weight"] = (v, h)
    for i in range(L):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                    p + "self_attn.q_proj.weight": (nq * d, h), p + "self_attn.k_proj.weight": (nkv * d, h),
                    p + "self_attn.v_proj.weight": (nkv * d, h), p + "self_attn.o_proj.weight": (h, nq * d),
                    p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                    p + "mlp.down_proj.weight": (h, f)})
        if cfg.add_qkv_bias or cfg.add_bias_linear:
            out.update({p + "self_attn.q_proj.bias": (nq * d,), p + "self_attn.k_proj.bias": (nkv * d,),
                        p + "self_attn.v_proj.bias": (nkv * d,)})
        if cfg.add_bias_linear:
            out.update({p + "self_attn.o_proj.bias": (h,), p + "mlp.gate_proj.bias": (f,),
                        p + "mlp.up_proj.bias": (f,), p + "mlp.down_proj.bias": (h,)})
    out["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (v, h)
    return out


def _optional_hf_names(cfg: ModelConfig, model_type: str) -> Tuple[str, ...]:
    """Expected names that may be absent and are then zero-filled (Llama biases of the disabled kind)."""
    if model_type not in ("llama", "mistral") or not cfg.add_bias_linear:
        return ()
    suffixes = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias", "self_attn.o_proj.bias",
                "mlp.gate_proj.bias", "mlp.up_proj.bias", "mlp.down_proj.bias")
    return tuple(f"model.layers.{i}.{s}" for i in range(cfg.num_layers) for s in suffixes)


def _normalize_name(name: str, model_type: str) -> str:
    """Canonical HF tensor name (GPT-2 hub checkpoints often lack the ``transformer.`` prefix)."""
    if model_type == "gpt2" and not name.startswith(("transformer.", "lm_head.")):
        return "transformer." + name
    return name


def weight_files(path: PathLike) -> List[Path]:
    """The weight files of an HF directory (single or sharded safetensors, else pytorch_model*.bin)."""
    p = Path(path)
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = p / index_name
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise HFCheckpointError(f"{index}: invalid index file, need a 'weight_map' object ({e})") from e
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not (p / f).is_file()]
            if missing:
                raise HFCheckpointError(f"{index}: shard file(s) {missing} listed in weight_map are missing")
            return [p / f for f in files]
    for single in ("model.safetensors", "pytorch_model.bin"):
        if (p / single).is_file():
            return [p / single]
    raise HFCheckpointError(
        f"{p}: no weights found (expected model.safetensors, model.safetensors.index.json, pytorch_model.bin "
        f"or pytorch_model.bin.index.json)")


def _read_weights(files: Iterable[Path], model_type: str, shapes_only: bool
                  ) -> Dict[str, Union[torch.Tensor, Tuple[int, ...]]]:
    """Tensors (or, for safetensors with ``shapes_only``, just their shapes) keyed by canonical HF name."""
    from safetensors import safe_open

    out: Dict[str, Union[torch.Tensor, Tuple[int, ...]]] = {}
    for f in files:
        if f.suffix == ".safetensors":
            try:
                with safe_open(str(f), framework="pt") as sf:
                    for k in sf.keys():
                        name = _normalize_name(k, model_type)
                        out[name] = tuple(sf.get_slice(k).get_shape()) if shapes_only else sf.get_tensor(k)
            except Exception as e:  # safetensors raises its own error types for corrupt headers
                raise HFCheckpointError(f"{f}: cannot read safetensors file ({e})") from e
        else:
            try:
                try:
                    sd = torch.load(str(f), map_location="cpu", weights_only=True, mmap=True)
                except RuntimeError:  # legacy (non-zip) serialization cannot be memory-mapped
                    sd = torch.load(str(f), map_location="cpu", weights_only=True)
            except Exception as e:
                raise HFCheckpointError(f"{f}: cannot read torch weights file ({e})") from e
            if not isinstance(sd, dict):
                raise HFCheckpointError(f"{f}: expected a state dict, got {type(sd).__name__}")
            for k, v in sd.items():
                if isinstance(v, torch.Tensor):
                    out[_normalize_name(k, model_type)] = tuple(v.shape) if shapes_only else v
    return out


def check_hf_shapes(shapes: Mapping[str, Tuple[int, ...]], cfg: ModelConfig, model_type: str, source: str) -> None:
    """Raise HFCheckpointError for a missing, unexpected or wrongly shaped tensor (naming it and both shapes)."""
    expected = expected_hf_shapes(cfg, model_type)
    optional = set(_optional_hf_names(cfg, model_type))
    missing = [k for k in expected if k not in shapes and k not in optional]
    if missing:
        hint = ""
        if "lm_head.weight" in missing and not cfg.tie_word_embeddings:
            hint = " (config.json says tie_word_embeddings=false but there is no lm_head.weight)"
        raise HFCheckpointError(f"{source}: missing tensor(s) {missing[:8]}{' ...' if len(missing) > 8 else ''}{hint}")
    for k, shape in shapes.items():
        if k in expected:
            if tuple(shape) != tuple(expected[k]):
                raise HFCheckpointError(f"{source}: tensor {k!r} has shape {tuple(shape)} but config.json implies "
                                        f"{tuple(expected[k])}")
        elif k == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # some tied checkpoints also store the (identical) head
        elif not k.endswith(_IGNORED_SUFFIXES):
            unexpected = sorted(x for x in shapes if x not in expected and not x.endswith(_IGNORED_SUFFIXES)
                                and not (x == "lm_head.weight" and cfg.tie_word_embeddings))
            raise HFCheckpointError(f"{source}: unexpected tensor(s) {unexpected[:8]} not used by a "
                                    f"{_MODEL_TYPE_TO_ARCH[model_type]} with this config.json")


def qkv_to_megatron(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, groups: int) -> torch.Tensor:
    """Fuse q [nq*d, ...], k/v [ng*d, ...] into megatron's per-query-group layout."""
    per = heads // groups
    rest = q.shape[1:]
    qg = q.reshape(groups, per, -1, *rest).flatten(1, 2)  # [g, per*d, ...]
    kg = k.reshape(groups, -1, *rest)
    vg = v.reshape(groups, -1, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *rest).contiguous()


def qkv_from_megatron(qkv: torch.Tensor, heads: int, groups: int, head_dim: int
                       ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split megatron's per-query-group fused QKV into q, k, v."""
    per = heads // groups
    rest = qkv.shape[1:]
    g = qkv.reshape(groups, (per + 2) * head_dim, *rest)
    q, k, v = g.split([per * head_dim, head_dim, head_dim], dim=1)
    return (q.reshape(-1, *rest).contiguous(), k.reshape(-1, *rest).contiguous(), v.reshape(-1, *rest).contiguous())


def _model_type_for(cfg: ModelConfig) -> str:
    return "gpt2" if cfg.family == "gpt2" else "llama"


def megatron_state_dict_from_hf(hf_sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> Dict[str, torch.Tensor]:
    """Full (TP=1) megatron GPTModel state dict from an HF state dict (canonical names) for ``cfg``."""
    L, nq, ng, d = cfg.num_layers, cfg.num_attention_heads, cfg.num_query_groups, cfg.head_dim
    sd: Dict[str, torch.Tensor] = {}

    def get(name: str, like_shape: Optional[Tuple[int, ...]] = None) -> torch.Tensor:
        if name in hf_sd:
            return hf_sd[name]
        if like_shape is not None:  # optional bias absent from the checkpoint -> zeros (exact)
            return torch.zeros(like_shape)
        raise HFCheckpointError(f"HF state dict lacks tensor {name!r}")

    if cfg.family == "gpt2":
        sd["embedding.word_embeddings.weight"] = get("transformer.wte.weight")
        sd["embedding.position_embeddings.weight"] = get("transformer.wpe.weight")
        for i in range(L):
            p, m = f"transformer.h.{i}.", f"decoder.layers.{i}."
            for ours, theirs in (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2")):
                sd[m + ours + ".weight"] = get(p + theirs + ".weight")
                sd[m + ours + ".bias"] = get(p + theirs + ".bias")
            w = get(p + "attn.c_attn.weight").t()  # [3h, h] rows [q; k; v]
            b = get(p + "attn.c_attn.bias")
            sd[m + "self_attention.linear_qkv.weight"] = qkv_to_megatron(*w.chunk(3, 0), nq, nq)
            sd[m + "self_attention.linear_qkv.bias"] = qkv_to_megatron(*b.chunk(3, 0), nq, nq)
            sd[m + "self_attention.linear_proj.weight"] = get(p + "attn.c_proj.weight").t().contiguous()
            sd[m + "self_attention.linear_proj.bias"] = get(p + "attn.c_proj.bias")
            sd[m + "mlp.linear_fc1.weight"] = get(p + "mlp.c_fc.weight").t().contiguous()
            sd[m + "mlp.linear_fc1.bias"] = get(p + "mlp.c_fc.bias")
            sd[m + "mlp.linear_fc2.weight"] = get(p + "mlp.c_proj.weight").t().contiguous()
            sd[m + "mlp.linear_fc2.bias"] = get(p + "mlp.c_proj.bias")
        sd["decoder.final_layernorm.weight"] = get("transformer.ln_f.weight")
        sd["decoder.final_layernorm.bias"] = get("transformer.ln_f.bias")
    else:
        h, f = cfg.hidden_size, cfg.ffn_hidden_size
        sd["embedding.word_embeddings.weight"] = get("model.embed_tokens.weight")
        for i in range(L):
            p, m = f"model.layers.{i}.self_attn.", f"decoder.layers.{i}."
            pm = f"model.layers.{i}.mlp."
            sd[m + "input_layernorm.weight"] = get(f"model.layers.{i}.input_layernorm.weight")
            sd[m + "pre_mlp_layernorm.weight"] = get(f"model.layers.{i}.post_attention_layernorm.weight")
            sd[m + "self_attention.linear_qkv.weight"] = qkv_to_megatron(
                get(p + "q_proj.weight"), get(p + "k_proj.weight"), get(p + "v_proj.weight"), nq, ng)
            if cfg.add_qkv_bias or cfg.add_bias_linear:
                sd[m + "self_attention.linear_qkv.bias"] = qkv_to_megatron(
                    get(p + "q_proj.bias", (nq * d,)), get(p + "k_proj.bias", (ng * d,)),
                    get(p + "v_proj.bias", (ng * d,)), nq, ng)
            sd[m + "self_attention.linear_proj.weight"] = get(p + "o_proj.weight")
            sd[m + "mlp.linear_fc1.weight"] = torch.cat([get(pm + "gate_proj.weight"), get(pm + "up_proj.weight")], 0)
            sd[m + "mlp.linear_fc2.weight"] = get(pm + "down_proj.weight")
            if cfg.add_bias_linear:
                sd[m + "self_attention.linear_proj.bias"] = get(p + "o_proj.bias", (h,))
                sd[m + "mlp.linear_fc1.bias"] = torch.cat([get(pm + "gate_proj.bias", (f,)),
                                                           get(pm + "up_proj.bias", (f,))], 0)
                sd[m + "mlp.linear_fc2.bias"] = get(pm + "down_proj.bias", (h,))
        sd["decoder.final_layernorm.weight"] = get("model.norm.weight")
    if not cfg.tie_word_embeddings:
        sd["output_layer.weight"] = get("lm_head.weight")
    return sd


def hf_state_dict_from_megatron(full_sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> Dict[str, torch.Tensor]:
    """HF state dict (Llama/Qwen2/Mistral or GPT-2 names) from a full (TP=1) megatron GPTModel state dict."""
    L, nq, ng, d = cfg.num_layers, cfg.num_attention_heads, cfg.num_query_groups, cfg.head_dim

    def get(name: str) -> torch.Tensor:
        if name not in full_sd:
            raise HFCheckpointError(f"megatron state dict lacks tensor {name!r}")
        return full_sd[name]

    out: Dict[str, torch.Tensor] = {}
    if cfg.family == "gpt2":
        out["transformer.wte.weight"] = get("embedding.word_embeddings.weight")
        out["transformer.wpe.weight"] = get("embedding.position_embeddings.weight")
        for i in range(L):
            p, m = f"transformer.h.{i}.", f"decoder.layers.{i}."
            for ours, theirs in (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2")):
                out[p + theirs + ".weight"] = get(m + ours + ".weight")
                out[p + theirs + ".bias"] = get(m + ours + ".bias")
            q, k, v = qkv_from_megatron(get(m + "self_attention.linear_qkv.weight"), nq, nq, d)
            out[p + "attn.c_attn.weight"] = torch.cat([q, k, v], 0).t()
            q, k, v = qkv_from_megatron(get(m + "self_attention.linear_qkv.bias"), nq, nq, d)
            out[p + "attn.c_attn.bias"] = torch.cat([q, k, v], 0)
            out[p + "attn.c_proj.weight"] = get(m + "self_attention.linear_proj.weight").t()
            out[p + "attn.c_proj.bias"] = get(m + "self_attention.linear_proj.bias")
            out[p + "mlp.c_fc.weight"] = get(m + "mlp.linear_fc1.weight").t()
            out[p + "mlp.c_fc.bias"] = get(m + "mlp.linear_fc1.bias")
            out[p + "mlp.c_proj.weight"] = get(m + "mlp.linear_fc2.weight").t()
            out[p + "mlp.c_proj.bias"] = get(m + "mlp.linear_fc2.bias")
        out["transformer.ln_f.weight"] = get("decoder.final_layernorm.weight")
        out["transformer.ln_f.bias"] = get("decoder.final_layernorm.bias")
    else:
        out["model.embed_tokens.weight"] = get("embedding.word_embeddings.weight")
        for i in range(L):
            p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
            out[p + "input_layernorm.weight"] = get(m + "input_layernorm.weight")
            out[p + "post_attention_layernorm.weight"] = get(m + "pre_mlp_layernorm.weight")
            q, k, v = qkv_from_megatron(get(m + "self_attention.linear_qkv.weight"), nq, ng, d)
            out.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                        p + "self_attn.v_proj.weight": v})
            if cfg.add_qkv_bias or cfg.add_bias_linear:
                q, k, v = qkv_from_megatron(get(m + "self_attention.linear_qkv.bias"), nq, ng, d)
                out.update({p + "self_attn.q_proj.bias": q, p + "self_attn.k_proj.bias": k,
                            p + "self_attn.v_proj.bias": v})
            out[p + "self_attn.o_proj.weight"] = get(m + "self_attention.linear_proj.weight")
            gate, up = get(m + "mlp.linear_fc1.weight").chunk(2, 0)
            out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = gate, up
            out[p + "mlp.down_proj.weight"] = get(m + "mlp.linear_fc2.weight")
            if cfg.add_bias_linear:
                out[p + "self_attn.o_proj.bias"] = get(m + "self_attention.linear_proj.bias")
                gate_b, up_b = get(m + "mlp.linear_fc1.bias").chunk(2, 0)
                out[p + "mlp.gate_proj.bias"], out[p + "mlp.up_proj.bias"] = gate_b, up_b
                out[p + "mlp.down_proj.bias"] = get(m + "mlp.linear_fc2.bias")
        out["model.norm.weight"] = get("decoder.final_layernorm.weight")
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = get("output_layer.weight")
    return {k: v.contiguous() for k, v in out.items()}


# --------------------------------------------------------------------------------------------------------------
# import / export
# --------------------------------------------------------------------------------------------------------------

def is_hf_dir(path: PathLike) -> bool:
    """True if ``path`` looks like a Hugging Face model directory (config.json with ``architectures``)."""
    cfg_path = Path(path) / "config.json"
    if not cfg_path.is_file():
        return False
    try:
        data = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, OSError):
        return False
    return isinstance(data, dict) and bool(data.get("architectures"))


def read_hf_model_config(path: PathLike) -> ModelConfig:
    """The ModelConfig of an HF directory (reads config.json only)."""
    p = Path(path)
    return hf_to_model_config(read_hf_config(p), str(p / "config.json"))


def load_hf_state_dict(path: PathLike, cfg: Optional[ModelConfig] = None) -> Dict[str, torch.Tensor]:
    """Read (and shape-check against config.json) an HF directory's weights; canonical HF names, CPU tensors."""
    p = Path(path)
    hf = read_hf_config(p)
    source = str(p / "config.json")
    mt = hf_model_type(hf, source)
    cfg = cfg or hf_to_model_config(hf, source)
    files = weight_files(p)
    if all(f.suffix == ".safetensors" for f in files):  # cheap header-only check before reading any tensor
        check_hf_shapes(_read_weights(files, mt, shapes_only=True), cfg, mt, str(p))  # type: ignore[arg-type]
    sd = _read_weights(files, mt, shapes_only=False)
    check_hf_shapes({k: tuple(v.shape) for k, v in sd.items()}, cfg, mt, str(p))  # type: ignore[union-attr]
    return sd  # type: ignore[return-value]


def load_hf(path: PathLike, params_dtype: torch.dtype = torch.float32,
            device: Optional[torch.device] = None) -> "torch.nn.Module":
    """Build our megatron-core GPTModel (for the current TP size) from a Hugging Face directory and load its weights."""
    from nemo_spec.checkpoint import tp as tp_mod
    from nemo_spec.models import build_gpt

    p = Path(path)
    source = str(p / "config.json")
    hf = read_hf_config(p)
    cfg = hf_to_model_config(hf, source)
    tp_size = parallel.tp_size()
    try:
        cfg.check_tensor_parallel(tp_size)
    except ConfigError as e:
        raise HFCheckpointError(f"{source}: {e}") from e
    if cfg.vocab_size % tp_size:
        raise HFCheckpointError(f"{source}: tensor parallel size {tp_size} does not divide vocab_size={cfg.vocab_size}")
    hf_sd = load_hf_state_dict(p, cfg)
    full = {k: v.to(params_dtype) for k, v in megatron_state_dict_from_hf(hf_sd, cfg).items()}
    del hf_sd
    model = build_gpt(cfg, params_dtype=params_dtype, device=torch.device("cpu"))
    tp_mod.load_full_state_dict(model, full, gated=cfg.activation == "swiglu")
    if device is not None:
        model = model.to(device)
    else:
        from nemo_spec._cpu import default_device

        model = model.to(default_device())
    log.info("loaded %s (%s, %d layers, hidden %d, vocab %d) at TP=%d", p, _MODEL_TYPE_TO_ARCH[hf_model_type(hf)],
             cfg.num_layers, cfg.hidden_size, cfg.vocab_size, tp_size)
    return model


def _generation_config(cfg: ModelConfig) -> Dict[str, Any]:
    out: Dict[str, Any] = {"_from_model_config": True}
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(cfg, k) is not None:
            out[k] = getattr(cfg, k)
    try:
        import transformers

        out["transformers_version"] = transformers.__version__
    except ImportError:  # pragma: no cover
        pass
    return out


def _write_hf_dir(tmp: Path, hf_config: Dict[str, Any], tensors: Dict[str, torch.Tensor], cfg: ModelConfig,
                  tokenizer_dir: Optional[Path]) -> None:
    from safetensors.torch import save_file

    (tmp / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    copied: List[str] = []
    if tokenizer_dir is not None:
        copied = copy_tokenizer(tokenizer_dir, tmp)
    if not (tmp / "generation_config.json").exists():
        (tmp / "generation_config.json").write_text(json.dumps(_generation_config(cfg), indent=2) + "\n")
    log.info("wrote config.json, model.safetensors (%d tensors), generation_config.json%s", len(tensors),
             f", tokenizer files {copied}" if copied else "")


def _replace_dir(tmp: Path, out: Path, overwrite: bool) -> None:
    """Move ``tmp`` to ``out`` atomically; an existing non-empty ``out`` is replaced only with ``overwrite``."""
    if out.exists():
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        elif not overwrite:
            raise HFCheckpointError(f"{out}: exists and is not empty (pass overwrite=True, or --overwrite, to replace it)")
    publish_directory(tmp, out)


def export_hf(model: torch.nn.Module, out_dir: PathLike, tokenizer_dir: Optional[PathLike] = None,
              dtype: Union[str, torch.dtype] = torch.float32, architecture: Optional[str] = None,
              overwrite: bool = False) -> Path:
    """Write ``model`` (any TP; all ranks call) as an HF directory transformers loads; rank 0 writes atomically."""
    import torch.distributed as dist

    from nemo_spec.checkpoint import tp as tp_mod
    from nemo_spec.models import unwrap

    out = Path(out_dir).resolve()
    gpt = unwrap(model)
    cfg: ModelConfig = gpt.nemo_spec_config
    torch_dtype = resolve_dtype(dtype)
    hf_config = model_config_to_hf(cfg, architecture, torch_dtype)  # validates before any communication
    tok = Path(tokenizer_dir) if tokenizer_dir is not None else None
    if tok is not None and not tok.is_dir():
        raise HFCheckpointError(f"tokenizer_dir {tok}: not a directory")
    if out.exists() and not overwrite and (not out.is_dir() or any(out.iterdir())):
        raise HFCheckpointError(f"{out}: exists and is not empty (pass overwrite=True, or --overwrite, to replace it)")
    full = tp_mod.gather_full_state_dict(gpt, gated=cfg.activation == "swiglu")
    error: Optional[BaseException] = None
    if parallel.is_rank_zero():
        tmp: Optional[Path] = None
        try:
            tensors = {k: v.detach().to("cpu", torch_dtype).contiguous()
                       for k, v in hf_state_dict_from_megatron(full, cfg).items()}
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
            _write_hf_dir(tmp, hf_config, tensors, cfg, tok)
            _replace_dir(tmp, out, overwrite)
            tmp = None
            log.info("exported %s (%s, %s) to %s", hf_config["architectures"][0], cfg.family,
                     _DTYPE_NAMES[torch_dtype], out)
        except BaseException as e:  # noqa: BLE001 - re-raised below after the barrier
            error = e
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
    if dist.is_initialized() and dist.get_world_size() > 1:
        flag = [error is not None]
        dist.broadcast_object_list(flag, src=0)
        if flag[0] and error is None:
            raise HFCheckpointError(f"{out}: export failed on rank 0")
    if error is not None:
        raise error
    return out


# --------------------------------------------------------------------------------------------------------------
# conversions used by scripts/convert_hf.py
# --------------------------------------------------------------------------------------------------------------

def has_tokenizer_files(path: PathLike) -> bool:
    """True if ``path`` holds at least one tokenizer file."""
    p = Path(path)
    return p.is_dir() and any((p / n).is_file() for n in TOKENIZER_FILES)


def convert_hf_to_checkpoint(hf_dir: PathLike, out_dir: PathLike,
                             params_dtype: torch.dtype = torch.float32) -> Path:
    """Import an HF directory (current TP size) and save it as our torch_dist checkpoint (all ranks call)."""
    from nemo_spec.checkpoint import save_checkpoint  # type: ignore[attr-defined]  # written by the checkpoint helper

    src = Path(hf_dir).resolve()
    model = load_hf(src, params_dtype=params_dtype)
    with tempfile.TemporaryDirectory(prefix="nemo_spec_hf_tok-") as tmp:
        tok: Optional[Path] = None
        if has_tokenizer_files(src):  # only tokenizer files (and the generation config), never the weights
            tok = Path(tmp)
            copy_tokenizer(src, tok)
        return save_checkpoint(model, out_dir, tokenizer_dir=tok, extra={"converted_from_hf": str(src)})


def convert_checkpoint_to_hf(ckpt_dir: PathLike, out_dir: PathLike, dtype: Union[str, torch.dtype] = torch.float32,
                             tokenizer_dir: Optional[PathLike] = None, architecture: Optional[str] = None,
                             overwrite: bool = False) -> Path:
    """Export the base model of any checkpoint ``load_model`` reads (or an HF dir) as an HF directory (all ranks)."""
    src = Path(ckpt_dir)
    resolve_dtype(dtype)  # fail before loading anything
    out = Path(out_dir)
    if out.exists() and not overwrite and (not out.is_dir() or any(out.iterdir())):
        raise HFCheckpointError(f"{out}: exists and is not empty (pass overwrite=True, or --overwrite, to replace it)")
    if is_hf_dir(src):
        model = load_hf(src)
        tok = Path(tokenizer_dir) if tokenizer_dir else (src if has_tokenizer_files(src) else None)
    else:
        from nemo_spec.checkpoint import find_tokenizer_dir, load_model  # type: ignore[attr-defined]

        model = load_model(src)
        tok = Path(tokenizer_dir) if tokenizer_dir else find_tokenizer_dir(src)
    return export_hf(model, out, tokenizer_dir=tok, dtype=dtype, architecture=architecture, overwrite=overwrite)
