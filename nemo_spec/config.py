"""Typed configs: the single source of truth for model and speculative-decoding settings."""
from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the value."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


_KIND_NAMES = {int: "an int", float: "a number", bool: "true or false", str: "a string", list: "a list",
               dict: "a mapping"}


def _typed(value: Any, hint: Any, where: str) -> Any:
    """``value`` checked against the type ``hint`` (int, float, bool, str, Optional/Union, List[X], Dict; others
    pass); an int given for a float becomes a float. Raises ConfigError naming ``where``."""
    import typing

    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any or (origin is None and hint not in _KIND_NAMES):
        return value
    if origin is typing.Union:
        if value is None and type(None) in args:
            return None
        errors = []
        for a in (a for a in args if a is not type(None)):
            try:
                return _typed(value, a, where)
            except ConfigError as e:
                errors.append(e)
        raise errors[0] if len(errors) == 1 else ConfigError(
            f"{where} must be {' or '.join(_describe(a) for a in args)}, got {value!r}")
    base = origin or hint
    if base is list and isinstance(value, tuple):
        value = list(value)
    ok = (isinstance(value, base) and not (isinstance(value, bool) and base in (int, float))) or \
        (base is float and isinstance(value, int) and not isinstance(value, bool))
    if not ok:
        raise ConfigError(f"{where} must be {_describe(hint)}, got {value!r}")
    if base is float:
        return float(value)
    if base is list and args:
        return [_typed(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
    return value


def _describe(hint: Any) -> str:
    import typing

    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is type(None):
        return "null"
    if origin is list and args:
        return f"a list of {_describe(args[0]).split(' ', 1)[-1]}s"
    return _KIND_NAMES.get(origin or hint, str(hint))


def check_field_types(obj: Any, where: str) -> None:
    """Check (and coerce int -> float) every field of dataclass ``obj`` against its annotation; the error names
    ``where``.field. Values from YAML / Hydra overrides arrive untyped: ``trainer.max_steps=ten`` is a string."""
    import typing

    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        if f.name in hints and not dataclasses.is_dataclass(getattr(obj, f.name)):
            setattr(obj, f.name, _typed(getattr(obj, f.name), hints[f.name], f"{where}.{f.name}" if where else f.name))


def setting_differences(saved: Dict[str, Any], now: Dict[str, Any], saved_as: str) -> List[str]:
    """``'key: <saved> <saved_as>, <now> now'`` for each key (sorted) whose value differs between two flat settings
    dicts, compared as JSON (``saved`` was read back from a file)."""
    now = json.loads(json.dumps(now))
    return [f"{k}: {saved.get(k)!r} {saved_as}, {now.get(k)!r} now" for k in sorted(set(saved) | set(now))
            if saved.get(k) != now.get(k)]


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
    # every id that ends generation when a checkpoint lists several (Llama 3's generation_config.json: end of text,
    # of message, of turn); None -> just eos_token_id
    eos_token_ids: Optional[List[int]] = None
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
        if (self.head_dim is None and isinstance(self.num_attention_heads, int) and self.num_attention_heads > 0
                and isinstance(self.hidden_size, int)):  # (wrong types: validate() names the field)
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_moe_experts is not None and self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        if isinstance(self.sliding_window_layers, (list, tuple)) and all(
                isinstance(i, int) and not isinstance(i, bool) for i in self.sliding_window_layers):
            self.sliding_window_layers = sorted(self.sliding_window_layers)
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
        for name in ("num_query_groups", "head_dim"):
            v = getattr(self, name)
            _check(isinstance(v, int) and not isinstance(v, bool) and v > 0,
                   f"ModelConfig.{name} must be a positive int, got {v!r}")
        for name in ("rope_theta", "norm_eps"):
            v = getattr(self, name)
            _check(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0,
                   f"ModelConfig.{name} must be a positive number, got {v!r}")
        _check(self.num_attention_heads % self.num_query_groups == 0,
               f"ModelConfig.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
               f"num_query_groups ({self.num_query_groups})")
        _check(self.rope_scaling is None or isinstance(self.rope_scaling, dict),
               f"ModelConfig.rope_scaling must be a mapping or None, got {self.rope_scaling!r}")
        if self.eos_token_ids is not None:
            _check(isinstance(self.eos_token_ids, (list, tuple)) and all(
                _is_int(i) and 0 <= i < self.vocab_size for i in self.eos_token_ids),
                f"ModelConfig.eos_token_ids must be a list of token ids in [0, {self.vocab_size}), got "
                f"{self.eos_token_ids!r}")
        if self.sliding_window_layers is not None:
            _check(isinstance(self.sliding_window_layers, (list, tuple))
                   and all(isinstance(i, int) and not isinstance(i, bool) for i in self.sliding_window_layers),
                   f"ModelConfig.sliding_window_layers must be a list of ints, got {self.sliding_window_layers!r}")
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

    def stop_token_ids(self) -> List[int]:
        """The ids generation stops at: ``eos_token_ids`` when the checkpoint lists several, else ``eos_token_id``."""
        if self.eos_token_ids:
            return list(dict.fromkeys(int(i) for i in self.eos_token_ids))
        return [] if self.eos_token_id is None else [int(self.eos_token_id)]

    def to_dict(self) -> Dict[str, Any]:
        """Plain-JSON representation."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, Any], source: str = "<dict>") -> "ModelConfig":
        """Build from a dict, rejecting unknown fields with a message naming ``source``."""
        return dataclass_from_dict(cls, d, source)


ALGORITHMS = ("eagle1", "eagle3", "medusa", "peagle", "dflash")
#: algorithms whose draft is an EAGLE-3-style head (aux-layer features, fc, own lm_head over a draft vocabulary)
EAGLE3_LIKE = ("eagle3", "peagle")
#: what DFlash slots learn (SpeculativeConfig.dflash_targets)
DFLASH_TARGETS = ("base", "rollout", "data")


def rope_type(scaling: Optional[Mapping[str, Any]]) -> str:
    """The RoPE type of an HF ``rope_scaling`` mapping (``rope_type``, or the legacy ``type``; 'default' when none)."""
    scaling = scaling or {}
    return scaling.get("rope_type", scaling.get("type", "default"))


#: EAGLE-3 options of the speculators format (SpeculativeConfig)
SPECULATORS_OPTIONS = ("norm_before_fc", "norm_before_residual", "norm_output")


@dataclass
class SpeculativeConfig:
    """Which draft to attach to the base model, and its shape."""

    algorithm: str = "eagle3"
    num_eagle_layers: int = 1  # draft decoder layers (EAGLE-1/3, P-EAGLE, DFlash)
    num_medusa_heads: int = 4
    num_medusa_layers: int = 1
    draft_vocab_size: Optional[int] = None  # EAGLE-3 only; None -> base vocab
    aux_layers: Optional[List[int]] = None  # EAGLE-3 only; None -> default low/mid/high
    ttt_steps: int = 3  # EAGLE-3 training-time-test unroll depth
    parallel_depth: int = 4  # P-EAGLE: tokens drafted per step in one forward (training depths)
    mask_token_id: Optional[int] = None  # P-EAGLE / DFlash: mask placeholder id; None -> pad id, else vocab_size - 1
    cod_ratio: float = 0.8  # P-EAGLE COD sampling: depth d keeps max(r^d, r_min) of the anchors
    cod_ratio_min: float = 0.2  # P-EAGLE COD sampling floor r_min
    depth_warmup_steps: int = 0  # P-EAGLE training: the first N optimizer steps train depth 0 only (0 = off)
    block_size: int = 16  # DFlash: block [last token, MASK x (B-1)] drafted in one forward (B - 1 draft tokens)
    target_layer_ids: Optional[List[int]] = None  # DFlash: 0-based base layers whose outputs are fused; None -> ref.
    num_anchors: int = 512  # DFlash training: random anchors (blocks) per sequence
    loss_decay_gamma: Optional[float] = None  # DFlash: CE weight exp(-(k-1)/gamma) of slot k; None -> by block size
    #: DFlash training labels of slot k: "base" -- the base's own next token at p + k (the argmax of its logits at
    #: p + k - 1 over the sequence); "rollout" -- the k-th token of the base's greedy continuation of x_{<=p} (what
    #: a drafted block must reproduce; per step B - 2 one-token base forwards per anchor after the sequence,
    #: whose keys/values come from the training forward (offline: one more base forward); not under expert
    #: parallelism); "data" -- the sequence's x_{p+k} (the reference's CE, right when the data is the base's own
    #: generations)
    dflash_targets: str = "base"
    #: EAGLE-3 draft options of vLLM's speculators format (speculators models/eagle3/core.py:236-306,
    #: model_definitions.py:73-103; vLLM llama_eagle3.py reads them): an RMSNorm (``input_norm``, width 3h) over the
    #: concatenated base features before ``fc``; layer 0's attention residual is ``hidden_norm(feature)`` instead
    #: of the feature; the draft's normalised output (not the pre-norm one) is the next drafting step's feature
    norm_before_fc: bool = False
    norm_before_residual: bool = False
    norm_output: bool = False

    def validate(self, model: Optional[ModelConfig] = None) -> "SpeculativeConfig":
        """Raise ConfigError naming the invalid field; returns self."""
        _check(self.algorithm in ALGORITHMS, f"unknown speculative algorithm {self.algorithm!r}; choose one of {ALGORITHMS}")
        if self.algorithm in ("eagle1", "eagle3", "peagle", "dflash"):
            _check(isinstance(self.num_eagle_layers, int) and self.num_eagle_layers > 0,
                   f"num_eagle_layers must be > 0 for {self.algorithm}, got {self.num_eagle_layers!r}")
        if self.algorithm == "medusa":
            _check(isinstance(self.num_medusa_heads, int) and self.num_medusa_heads > 0,
                   f"num_medusa_heads must be > 0 for medusa, got {self.num_medusa_heads!r}")
            _check(isinstance(self.num_medusa_layers, int) and self.num_medusa_layers > 0,
                   f"num_medusa_layers must be > 0, got {self.num_medusa_layers!r}")
        _check(isinstance(self.ttt_steps, int) and self.ttt_steps >= 1, f"ttt_steps must be >= 1, got {self.ttt_steps!r}")
        for name in SPECULATORS_OPTIONS:
            v = getattr(self, name)
            _check(isinstance(v, bool), f"{name} must be true or false, got {v!r}")
            _check(not v or self.algorithm == "eagle3", f"{name} is an EAGLE-3 draft option, not {self.algorithm}'s")
        if self.algorithm == "dflash":
            _check(_is_int(self.block_size) and self.block_size >= 2,
                   f"block_size must be an int >= 2 for dflash (one anchor + at least one draft slot), "
                   f"got {self.block_size!r}")
            _check(_is_int(self.num_anchors) and self.num_anchors >= 1,
                   f"num_anchors must be an int >= 1, got {self.num_anchors!r}")
            if self.loss_decay_gamma is not None:
                g = self.loss_decay_gamma
                _check(isinstance(g, (int, float)) and not isinstance(g, bool) and g > 0,
                       f"loss_decay_gamma must be a number > 0 or null, got {g!r}")
            _check(self.dflash_targets in DFLASH_TARGETS,
                   f"dflash_targets must be one of {DFLASH_TARGETS}, got {self.dflash_targets!r}")
            if self.target_layer_ids is not None:
                ids = self.target_layer_ids
                _check(isinstance(ids, (list, tuple)) and len(ids) > 0 and all(_is_int(i) for i in ids),
                       f"target_layer_ids must be a non-empty list of ints, got {ids!r}")
                _check(list(ids) == sorted(set(ids)),
                       f"target_layer_ids must be distinct and increasing (the engines capture base layers in "
                       f"layer order), got {list(ids)}")
            _check(self.aux_layers is None, "aux_layers is not used by dflash (its base layers are target_layer_ids)")
            _check(self.draft_vocab_size is None, "draft_vocab_size is not used by dflash (it reuses the base's "
                                                  "embedding and LM head over the full vocabulary)")
        else:
            _check(self.target_layer_ids is None, f"target_layer_ids is only used by dflash, not {self.algorithm}")
            _check(self.dflash_targets == "base",
                   f"dflash_targets is only used by dflash, not {self.algorithm} (got {self.dflash_targets!r})")
        if self.algorithm in ("peagle", "dflash") and self.mask_token_id is not None:
            _check(_is_int(self.mask_token_id) and self.mask_token_id >= 0,
                   f"mask_token_id must be a non-negative int, got {self.mask_token_id!r}")
        if self.algorithm == "peagle":
            _check(isinstance(self.parallel_depth, int) and not isinstance(self.parallel_depth, bool)
                   and self.parallel_depth >= 1, f"parallel_depth must be an int >= 1 for peagle, got {self.parallel_depth!r}")
            _check(self.depth_warmup_steps is None or (_is_int(self.depth_warmup_steps) and self.depth_warmup_steps >= 0),
                   f"depth_warmup_steps must be an int >= 0 (or null: 0), got {self.depth_warmup_steps!r}")
            for name in ("cod_ratio", "cod_ratio_min"):
                v = getattr(self, name)
                _check(isinstance(v, (int, float)) and not isinstance(v, bool) and 0.0 < v <= 1.0,
                       f"{name} must be in (0, 1], got {v!r}")
            if self.mask_token_id is not None:
                _check(isinstance(self.mask_token_id, int) and not isinstance(self.mask_token_id, bool)
                       and self.mask_token_id >= 0, f"mask_token_id must be a non-negative int, got {self.mask_token_id!r}")
        elif self.algorithm != "dflash":
            _check(self.mask_token_id is None, f"mask_token_id is only used by peagle and dflash, not {self.algorithm}")
        if self.algorithm != "peagle":
            _check(self.depth_warmup_steps is None or (_is_int(self.depth_warmup_steps) and self.depth_warmup_steps == 0),
                   f"depth_warmup_steps is only used by peagle, not {self.algorithm}")
        if model is not None:
            if self.draft_vocab_size is not None:
                _check(self.algorithm in EAGLE3_LIKE, f"draft_vocab_size is only used by {EAGLE3_LIKE}")
                _check(0 < self.draft_vocab_size <= model.vocab_size,
                       f"draft_vocab_size={self.draft_vocab_size} must be in [1, base vocab_size={model.vocab_size}]")
            if self.aux_layers is not None:
                _check(len(self.aux_layers) == 3, f"aux_layers must list 3 base layers, got {self.aux_layers}")
                for i in self.aux_layers:
                    _check(0 <= i < model.num_layers, f"aux_layers entry {i} outside [0, {model.num_layers})")
            if self.norm_before_fc and self.algorithm == "eagle3":
                aux = self.resolved_aux_layers(model.num_layers)
                _check(len(set(aux)) == len(aux),
                       f"norm_before_fc needs 3 distinct aux layers (engines capture each layer once; an RMSNorm over "
                       f"the repeated features {aux} could not be exported), got {aux}: set aux_layers")
            if self.mask_token_id is not None:
                _check(self.mask_token_id < model.vocab_size,
                       f"mask_token_id={self.mask_token_id} outside the base vocabulary [0, {model.vocab_size})")
            if self.algorithm == "dflash":
                self.resolved_target_layer_ids(model.num_layers)  # raises ConfigError when out of range
        return self

    def resolved_target_layer_ids(self, num_layers: int) -> List[int]:
        """DFlash: the 0-based base layers whose outputs feed the draft (z-lab ``hidden_states[id + 1]``).

        The default is the reference's ``build_target_layer_ids`` (z-lab dflash/model.py:27-36, SGLang
        dflash_utils.py:348-385): one layer per draft layer, spread over [1, L - 3]; one draft layer -> [L // 2].
        The last base layer is refused: HF's ``hidden_states[L]`` is after the final norm while vLLM / SGLang
        capture the residual entering layer ``id + 1`` (vLLM eagle3_utils.py:121-124), which does not exist for it.
        """
        ids = self.target_layer_ids
        if ids is None:
            n = self.num_eagle_layers
            if n == 1:
                ids = [num_layers // 2]
            else:
                start, end = 1, num_layers - 3
                _check(end >= start, f"dflash: the default target_layer_ids need a base of >= 4 layers (got "
                                     f"{num_layers}); pass target_layer_ids")
                ids = [int(round(start + i * (end - start) / (n - 1))) for i in range(n)]
                ids = sorted(set(ids))
        for i in ids:
            _check(0 <= i < num_layers - 1,
                   f"dflash target_layer_ids entry {i} outside [0, {num_layers - 1}) (base has {num_layers} layers; "
                   f"the last layer's output is not a capture point the serving engines share)")
        return [int(i) for i in ids]

    def resolved_loss_decay_gamma(self) -> float:
        """DFlash loss decay gamma: ``loss_decay_gamma``, else the paper's 7 / 5 / 4 for block 16 / 10 / 8 and
        7 (B - 1) / 15 for other block sizes."""
        if self.loss_decay_gamma is not None:
            return float(self.loss_decay_gamma)
        return {16: 7.0, 10: 5.0, 8: 4.0}.get(self.block_size, 7.0 * (self.block_size - 1) / 15.0)

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


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def dump_json(obj: Dict[str, Any]) -> str:
    """Stable JSON text for configs written next to checkpoints."""
    return json.dumps(obj, indent=2, sort_keys=True)
