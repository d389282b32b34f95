"""Typed configs: the single source of truth for model and speculative-decoding settings."""
from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the value."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def dataclass_from_dict(cls: type, d: Dict[str, Any], source: str = "<dict>") -> Any:
    """Build dataclass ``cls`` from a (deep-copied) dict; unknown or ill-typed fields -> ConfigError naming ``source``."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ConfigError(f"{source}: unknown {cls.__name__} field(s) {unknown}; known: {sorted(known)}")
    try:
        return cls(**copy.deepcopy(dict(d)))
    except TypeError as e:
        raise ConfigError(f"{source}: {e}") from e


@dataclass
class ModelConfig:
    """Architecture of a GPT model (Llama-style layers, optionally with q/k norm, MoE, sliding window; or GPT-2)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    ffn_hidden_size: int
    num_query_groups: Optional[int] = None  # None -> multi-head attention
    head_dim: Optional[int] = None  # None -> hidden_size // num_attention_heads
    max_position_embeddings: int = 2048
    family: str = "llama"  # "llama" | "gpt2"
    normalization: str = "RMSNorm"  # "RMSNorm" | "LayerNorm"
    norm_eps: float = 1e-5
    activation: str = "swiglu"  # "swiglu" | "gelu" (tanh approximation, GPT-2) | "gelu_exact"
    position_embedding: str = "rope"  # "rope" | "learned"
    rope_theta: float = 10000.0
    rope_scaling: Optional[Dict[str, Any]] = None  # HF-style: {"rope_type": "linear"|"llama3", "factor": ...}
    add_bias_linear: bool = False
    add_qkv_bias: bool = False
    tie_word_embeddings: bool = False
    init_method_std: float = 0.02
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int] = None
    pad_token_id: Optional[int] = None
    qk_layernorm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3)
    num_moe_experts: Optional[int] = None  # None -> a dense MLP in every layer; else a MoE MLP in every layer
    moe_ffn_hidden_size: Optional[int] = None  # width of one expert (None -> ffn_hidden_size)
    moe_router_topk: int = 2  # experts per token
    moe_renormalize: bool = True  # top-k routing probabilities renormalised to sum 1 (Mixtral, norm_topk_prob)
    sliding_window: Optional[int] = None  # a query attends to the last ``sliding_window`` positions (itself incl.)
    sliding_window_layers: Optional[List[int]] = None  # 0-based layers that use the window; None -> every layer

    def __post_init__(self) -> None:
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.head_dim is None and self.num_attention_heads > 0:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_moe_experts is not None and self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        if self.sliding_window_layers is not None:
            self.sliding_window_layers = sorted(int(i) for i in self.sliding_window_layers)
        self.validate()

    def validate(self) -> None:
        """Raise ConfigError naming the first invalid field."""
        for name in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "ffn_hidden_size",
                     "max_position_embeddings"):
            v = getattr(self, name)
            _check(isinstance(v, int) and v > 0, f"ModelConfig.{name} must be a positive int, got {v!r}")
        _check(self.family in ("llama", "gpt2"), f"ModelConfig.family must be 'llama' or 'gpt2', got {self.family!r}")
        _check(self.normalization in ("RMSNorm", "LayerNorm"),
               f"ModelConfig.normalization must be 'RMSNorm' or 'LayerNorm', got {self.normalization!r}")
        _check(self.activation in ("swiglu", "gelu", "gelu_exact"),
               f"ModelConfig.activation must be 'swiglu', 'gelu' or 'gelu_exact', got {self.activation!r}")
        _check(self.position_embedding in ("rope", "learned"),
               f"ModelConfig.position_embedding must be 'rope' or 'learned', got {self.position_embedding!r}")
        _check(self.num_attention_heads % self.num_query_groups == 0,
               f"ModelConfig.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
               f"num_query_groups ({self.num_query_groups})")
        if self.rope_scaling is not None:
            rt = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            _check(rt in ("linear", "llama3", "default"),
                   f"ModelConfig.rope_scaling.rope_type {rt!r} is not supported (linear, llama3)")
        if self.num_moe_experts is not None:
            e, k = self.num_moe_experts, self.moe_router_topk
            _check(isinstance(e, int) and e >= 1, f"ModelConfig.num_moe_experts must be a positive int, got {e!r}")
            _check(isinstance(k, int) and 1 <= k <= e,
                   f"ModelConfig.moe_router_topk must be in [1, num_moe_experts={e}], got {k!r}")
            _check(not (k == 1 and self.moe_renormalize),
                   "ModelConfig.moe_router_topk=1 with moe_renormalize=True (every token's weight 1) is not supported "
                   "by megatron-core's router (softmax before top-1 is required)")
            _check(isinstance(self.moe_ffn_hidden_size, int) and self.moe_ffn_hidden_size > 0,
                   f"ModelConfig.moe_ffn_hidden_size must be a positive int, got {self.moe_ffn_hidden_size!r}")
            _check(self.activation == "swiglu" and not self.add_bias_linear,
                   "ModelConfig.num_moe_experts needs activation='swiglu' and add_bias_linear=False")
        if self.sliding_window is not None:
            _check(isinstance(self.sliding_window, int) and self.sliding_window > 0,
                   f"ModelConfig.sliding_window must be a positive int or None, got {self.sliding_window!r}")
        if self.sliding_window_layers is not None:
            _check(self.sliding_window is not None, "ModelConfig.sliding_window_layers is set without sliding_window")
            bad = [i for i in self.sliding_window_layers if not 0 <= i < self.num_layers]
            _check(not bad, f"ModelConfig.sliding_window_layers entries {bad} outside [0, {self.num_layers})")

    def window_layers(self) -> List[int]:
        """0-based layers that attend through the sliding window (empty without one)."""
        if self.sliding_window is None:
            return []
        if self.sliding_window_layers is None:
            return list(range(self.num_layers))
        return list(self.sliding_window_layers)

    def draft_config(self) -> "ModelConfig":
        """The dense Llama-layer config EAGLE draft layers use: same attention shape, no q/k norm, no MoE, no
        window (the EAGLE formats every engine reads are Llama layers)."""
        return dataclasses.replace(self, qk_layernorm=False, num_moe_experts=None, moe_ffn_hidden_size=None,
                                   sliding_window=None, sliding_window_layers=None)

    def check_tensor_parallel(self, tp: int) -> None:
        """Raise ConfigError if tensor-parallel size ``tp`` cannot shard this model."""
        _check(tp >= 1, f"tensor parallel size must be >= 1, got {tp}")
        _check(self.num_attention_heads % tp == 0,
               f"tensor parallel size {tp} does not divide num_attention_heads={self.num_attention_heads}")
        _check(self.num_query_groups % tp == 0,
               f"tensor parallel size {tp} does not divide num_query_groups={self.num_query_groups}")
        _check(self.ffn_hidden_size % tp == 0,
               f"tensor parallel size {tp} does not divide ffn_hidden_size={self.ffn_hidden_size}")
        if self.num_moe_experts is not None:
            _check(self.moe_ffn_hidden_size % tp == 0,
                   f"tensor parallel size {tp} does not divide moe_ffn_hidden_size={self.moe_ffn_hidden_size}")

    def check_expert_parallel(self, ep: int) -> None:
        """Raise ConfigError if expert-parallel size ``ep`` cannot shard this model's experts (or it has none)."""
        _check(isinstance(ep, int) and ep >= 1, f"expert parallel size must be a positive int, got {ep!r}")
        if ep == 1:
            return
        _check(self.num_moe_experts is not None,
               f"expert parallel size {ep} needs a mixture-of-experts model, but this model is dense "
               f"(num_moe_experts=None); use expert parallel size 1")
        _check(self.num_moe_experts % ep == 0,
               f"expert parallel size {ep} does not divide num_moe_experts={self.num_moe_experts} (each EP rank "
               f"holds num_moe_experts / EP experts)")

    def to_dict(self) -> Dict[str, Any]:
        """Plain-JSON representation."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, Any], source: str = "<dict>") -> "ModelConfig":
        """Build from a dict, rejecting unknown fields with a message naming ``source``."""
        return dataclass_from_dict(cls, d, source)


ALGORITHMS = ("eagle1", "eagle3", "medusa", "peagle")
#: algorithms whose draft is an EAGLE-3-style head (aux-layer features, fc, own lm_head over a draft vocabulary)
EAGLE3_LIKE = ("eagle3", "peagle")


@dataclass
class SpeculativeConfig:
    """Which draft to attach to the base model, and its shape."""

    algorithm: str = "eagle3"
    num_eagle_layers: int = 1
    num_medusa_heads: int = 4
    num_medusa_layers: int = 1
    draft_vocab_size: Optional[int] = None  # EAGLE-3 only; None -> base vocab
    aux_layers: Optional[List[int]] = None  # EAGLE-3 only; None -> default low/mid/high
    ttt_steps: int = 3  # EAGLE-3 training-time-test unroll depth
    parallel_depth: int = 4  # P-EAGLE: tokens drafted per step in one forward (training depths)
    mask_token_id: Optional[int] = None  # P-EAGLE: id of the mask placeholder; None -> pad id, else vocab_size - 1
    cod_ratio: float = 0.8  # P-EAGLE COD sampling: depth d keeps max(r^d, r_min) of the anchors
    cod_ratio_min: float = 0.2  # P-EAGLE COD sampling floor r_min

    def validate(self, model: Optional[ModelConfig] = None) -> "SpeculativeConfig":
        """Raise ConfigError naming the invalid field; returns self."""
        _check(self.algorithm in ALGORITHMS, f"unknown speculative algorithm {self.algorithm!r}; choose one of {ALGORITHMS}")
        if self.algorithm in ("eagle1", "eagle3", "peagle"):
            _check(isinstance(self.num_eagle_layers, int) and self.num_eagle_layers > 0,
                   f"num_eagle_layers must be > 0 for {self.algorithm}, got {self.num_eagle_layers!r}")
        if self.algorithm == "medusa":
            _check(isinstance(self.num_medusa_heads, int) and self.num_medusa_heads > 0,
                   f"num_medusa_heads must be > 0 for medusa, got {self.num_medusa_heads!r}")
            _check(isinstance(self.num_medusa_layers, int) and self.num_medusa_layers > 0,
                   f"num_medusa_layers must be > 0, got {self.num_medusa_layers!r}")
        _check(isinstance(self.ttt_steps, int) and self.ttt_steps >= 1, f"ttt_steps must be >= 1, got {self.ttt_steps!r}")
        if self.algorithm == "peagle":
            _check(isinstance(self.parallel_depth, int) and not isinstance(self.parallel_depth, bool)
                   and self.parallel_depth >= 1, f"parallel_depth must be an int >= 1 for peagle, got {self.parallel_depth!r}")
            for name in ("cod_ratio", "cod_ratio_min"):
                v = getattr(self, name)
                _check(isinstance(v, (int, float)) and not isinstance(v, bool) and 0.0 < v <= 1.0,
                       f"{name} must be in (0, 1], got {v!r}")
            if self.mask_token_id is not None:
                _check(isinstance(self.mask_token_id, int) and not isinstance(self.mask_token_id, bool)
                       and self.mask_token_id >= 0, f"mask_token_id must be a non-negative int, got {self.mask_token_id!r}")
        else:
            _check(self.mask_token_id is None, f"mask_token_id is only used by peagle, not {self.algorithm}")
        if model is not None:
            if self.draft_vocab_size is not None:
                _check(self.algorithm in EAGLE3_LIKE, f"draft_vocab_size is only used by {EAGLE3_LIKE}")
                _check(0 < self.draft_vocab_size <= model.vocab_size,
                       f"draft_vocab_size={self.draft_vocab_size} must be in [1, base vocab_size={model.vocab_size}]")
            if self.aux_layers is not None:
                _check(len(self.aux_layers) == 3, f"aux_layers must list 3 base layers, got {self.aux_layers}")
                for i in self.aux_layers:
                    _check(0 <= i < model.num_layers, f"aux_layers entry {i} outside [0, {model.num_layers})")
            if self.mask_token_id is not None:
                _check(self.mask_token_id < model.vocab_size,
                       f"mask_token_id={self.mask_token_id} outside the base vocabulary [0, {model.vocab_size})")
        return self

    def resolved_mask_token_id(self, model: ModelConfig) -> int:
        """P-EAGLE mask placeholder id: ``mask_token_id``, else the base's pad id, else its last vocabulary id."""
        if self.mask_token_id is not None:
            return int(self.mask_token_id)
        return int(model.pad_token_id) if model.pad_token_id is not None else model.vocab_size - 1

    def resolved_aux_layers(self, num_layers: int) -> List[int]:
        """The three base layers (0-based) whose outputs feed EAGLE-3."""
        if self.aux_layers is not None:
            return list(self.aux_layers)
        cand = [1, num_layers // 2 - 1, num_layers - 4]
        return [min(max(c, 0), num_layers - 1) for c in cand]

    def to_dict(self) -> Dict[str, Any]:
        """Plain-JSON representation."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, Any], source: str = "<dict>") -> "SpeculativeConfig":
        """Build from a dict, rejecting unknown fields."""
        return dataclass_from_dict(cls, d, source)


def dump_json(obj: Dict[str, Any]) -> str:
    """Stable JSON text for configs written next to checkpoints."""
    return json.dumps(obj, indent=2, sort_keys=True)
