"""The generic machinery behind the family declarations: weight rules, shape specs, layout conversions.

A family file declares *what* maps to what; this module does it. A :class:`Rule` ties one megatron-core tensor
(name relative to a layer, or to the model) to one or more Hugging Face tensors and says how they combine:

- ``copy``: the same tensor;  ``t``: transposed (GPT-2 ``Conv1D`` stores [in, out]);
- ``qkv``: HF ``q_proj``/``k_proj``/``v_proj`` fused into megatron's per-query-group ``linear_qkv``
  ([q heads of group g; k_g; v_g] for each g), weights or biases;
- ``qkv_t``: GPT-2's ``c_attn`` ([q; k; v] over all heads, transposed for the weight) into the per-head layout;
- ``gated``: HF ``gate_proj`` and ``up_proj`` into ``linear_fc1`` = [gate; up].

Shapes are written as comma-separated dims over :func:`dims` (``h`` hidden, ``v`` vocab, ``f`` dense FFN, ``fe``
one expert's FFN, ``q`` = heads*head_dim, ``kv`` = groups*head_dim, ``d`` head_dim, ``E`` experts, ``pos`` max
positions), with an optional integer factor (``3h``). Rules with ``{e}`` in their names repeat per expert.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch

from nemo_spec.checkpoint.megatron import CheckpointError
from nemo_spec.config import ModelConfig

Tensors = Dict[str, torch.Tensor]


class HFCheckpointError(CheckpointError, ValueError):
    """A Hugging Face checkpoint directory is missing, unsupported or inconsistent (message names file/field)."""


#: what the family declarations raise: a config or tensor does not fit (the message names the field or tensor)
FamilyError = HFCheckpointError


# ------------------------------------------------------------------------------------------------ layouts
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


def dims(cfg: ModelConfig) -> Dict[str, int]:
    """The named dimensions shape specs refer to."""
    return {"h": cfg.hidden_size, "v": cfg.vocab_size, "f": cfg.ffn_hidden_size,
            "fe": cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size, "d": cfg.head_dim,
            "q": cfg.num_attention_heads * cfg.head_dim, "kv": cfg.num_query_groups * cfg.head_dim,
            "E": cfg.num_moe_experts or 0, "pos": cfg.max_position_embeddings}


_DIM = re.compile(r"^(\d*)([A-Za-z]+)$")


def shape_of(spec: str, d: Mapping[str, int]) -> Tuple[int, ...]:
    """Evaluate a shape spec such as ``"q,h"`` or ``"h,3h"`` against named dims."""
    out = []
    for tok in spec.split(","):
        m = _DIM.match(tok.strip())
        if not m or m.group(2) not in d:
            raise ValueError(f"bad shape spec {spec!r}")
        out.append(int(m.group(1) or 1) * d[m.group(2)])
    return tuple(out)


# ------------------------------------------------------------------------------------------------ rules
@dataclass(frozen=True)
class Rule:
    """One megatron tensor <-> HF tensor(s), relative to the layer (or model) prefixes of a :class:`WeightMap`."""

    ours: str
    theirs: Tuple[str, ...]
    shapes: Tuple[str, ...]
    kind: str = "copy"  # copy | t | qkv | qkv_t | gated
    when: Optional[Callable[[ModelConfig], bool]] = None
    optional: bool = False  # may be absent from an HF checkpoint: zeros (exact; Llama biases of the unused kind)
    tag: str = ""  # lets callers drop rules (the EAGLE-1 format's layer 0 has no "input_norm")

    def applies(self, cfg: ModelConfig) -> bool:
        """Whether ``cfg`` has this tensor."""
        return self.when is None or bool(self.when(cfg))

    def expand(self, cfg: ModelConfig) -> Iterable["Rule"]:
        """This rule once, or once per expert when its names hold ``{e}``."""
        if "{e}" not in self.ours:
            yield self
            return
        for e in range(cfg.num_moe_experts or 0):
            yield Rule(self.ours.replace("{e}", str(e)), tuple(t.replace("{e}", str(e)) for t in self.theirs),
                       self.shapes, self.kind, self.when, self.optional, self.tag)


def r(ours: str, theirs: str, shape: str, kind: str = "copy", **kw: Any) -> Rule:
    """A one-to-one rule (copy or transpose)."""
    return Rule(ours, (theirs,), (shape,), kind, **kw)


def _to_megatron(rule: Rule, got: List[torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    nq, ng = cfg.num_attention_heads, cfg.num_query_groups
    if rule.kind == "copy":
        return got[0]
    if rule.kind == "t":
        return got[0].t().contiguous()
    if rule.kind == "qkv":
        return qkv_to_megatron(got[0], got[1], got[2], nq, ng)
    if rule.kind == "qkv_t":
        w = got[0].t() if got[0].dim() == 2 else got[0]
        return qkv_to_megatron(*w.chunk(3, 0), nq, nq)
    if rule.kind == "gated":
        return torch.cat([got[0], got[1]], 0).contiguous()
    raise ValueError(f"unknown rule kind {rule.kind!r}")


def _to_hf(rule: Rule, t: torch.Tensor, cfg: ModelConfig) -> List[torch.Tensor]:
    nq, ng, d = cfg.num_attention_heads, cfg.num_query_groups, cfg.head_dim
    if rule.kind == "copy":
        return [t]
    if rule.kind == "t":
        return [t.t().contiguous()]
    if rule.kind == "qkv":
        rows = (nq + 2 * ng) * d
        if t.shape[0] != rows:
            raise FamilyError(f"fused QKV has {t.shape[0]} rows, expected (heads {nq} + 2*groups {ng}) * head_dim "
                              f"{d} = {rows}")
        return list(qkv_from_megatron(t, nq, ng, d))
    if rule.kind == "qkv_t":
        q, k, v = qkv_from_megatron(t, nq, nq, d)
        cat = torch.cat([q, k, v], 0)
        return [cat.t().contiguous() if cat.dim() == 2 else cat]
    if rule.kind == "gated":
        gate, up = t.chunk(2, 0)
        return [gate.contiguous(), up.contiguous()]
    raise ValueError(f"unknown rule kind {rule.kind!r}")


def rules_to_megatron(rules: Sequence[Rule], hf_sd: Mapping[str, torch.Tensor], cfg: ModelConfig, src: str,
                      dst: str, skip_tags: Iterable[str] = (), error: type = FamilyError) -> Tensors:
    """Apply ``rules`` to HF tensors under prefix ``src``; megatron tensors under ``dst``."""
    skip, d = set(skip_tags), dims(cfg)
    out: Tensors = {}
    for base in rules:
        if base.tag in skip or not base.applies(cfg):
            continue
        for rule in base.expand(cfg):
            got = []
            for name, spec in zip(rule.theirs, rule.shapes):
                key = src + name
                if key in hf_sd:
                    got.append(hf_sd[key])
                elif rule.optional:
                    got.append(torch.zeros(shape_of(spec, d)))
                else:
                    raise error(f"state dict lacks tensor {key!r}")
            out[dst + rule.ours] = _to_megatron(rule, got, cfg)
    return out


def rules_to_hf(rules: Sequence[Rule], sd: Mapping[str, torch.Tensor], cfg: ModelConfig, src: str, dst: str,
                skip_tags: Iterable[str] = (), error: type = FamilyError) -> Tensors:
    """Apply ``rules`` backwards to megatron tensors under ``src``; HF tensors under ``dst``."""
    skip = set(skip_tags)
    out: Tensors = {}
    for base in rules:
        if base.tag in skip or not base.applies(cfg):
            continue
        for rule in base.expand(cfg):
            key = src + rule.ours
            if key not in sd:
                raise error(f"megatron state dict lacks tensor {key!r}")
            for name, t in zip(rule.theirs, _to_hf(rule, sd[key], cfg)):
                out[dst + name] = t
    return out


@dataclass(frozen=True)
class WeightMap:
    """A family's whole weight mapping: model-level rules plus per-layer rules under the two layer prefixes."""

    model: Tuple[Rule, ...]
    layer: Tuple[Rule, ...]
    hf_layer_prefix: str = "model.layers.{i}."
    our_layer_prefix: str = "decoder.layers.{i}."
    #: HF entries that are not weights (RoPE caches, GPT-2 causal-mask buffers)
    ignored_suffixes: Tuple[str, ...] = ("rotary_emb.inv_freq",)
    #: canonical HF name of a stored name (GPT-2 hub checkpoints lack the ``transformer.`` prefix)
    normalize: Optional[Callable[[str], str]] = None

    def expected_shapes(self, cfg: ModelConfig) -> Dict[str, Tuple[int, ...]]:
        """Every HF tensor name the checkpoint holds for ``cfg`` with its shape."""
        d = dims(cfg)
        out: Dict[str, Tuple[int, ...]] = {}
        for prefix, rules in self._groups(cfg):
            for base in rules:
                if not base.applies(cfg):
                    continue
                for rule in base.expand(cfg):
                    for name, spec in zip(rule.theirs, rule.shapes):
                        out[prefix + name] = shape_of(spec, d)
        return out

    def optional_names(self, cfg: ModelConfig) -> List[str]:
        """Expected HF names that may be absent (zero-filled on import)."""
        out = []
        for prefix, rules in self._groups(cfg):
            for base in rules:
                if base.optional and base.applies(cfg):
                    out += [prefix + n for rule in base.expand(cfg) for n in rule.theirs]
        return out

    def _groups(self, cfg: ModelConfig) -> List[Tuple[str, Tuple[Rule, ...]]]:
        groups = [("", self.model)]
        groups += [(self.hf_layer_prefix.format(i=i), self.layer) for i in range(cfg.num_layers)]
        return groups

    def to_megatron(self, hf_sd: Mapping[str, torch.Tensor], cfg: ModelConfig, error: type = FamilyError) -> Tensors:
        """Full (TP=1) megatron GPTModel state dict from an HF state dict (canonical names)."""
        out = rules_to_megatron(self.model, hf_sd, cfg, "", "", error=error)
        for i in range(cfg.num_layers):
            out.update(rules_to_megatron(self.layer, hf_sd, cfg, self.hf_layer_prefix.format(i=i),
                                         self.our_layer_prefix.format(i=i), error=error))
        return out

    def to_hf(self, sd: Mapping[str, torch.Tensor], cfg: ModelConfig, error: type = FamilyError) -> Tensors:
        """HF state dict from a full (TP=1) megatron GPTModel state dict."""
        out = rules_to_hf(self.model, sd, cfg, "", "", error=error)
        for i in range(cfg.num_layers):
            out.update(rules_to_hf(self.layer, sd, cfg, self.our_layer_prefix.format(i=i),
                                   self.hf_layer_prefix.format(i=i), error=error))
        return {k: v.contiguous() for k, v in out.items()}


# ------------------------------------------------------------------------------------------------ families
@dataclass(frozen=True)
class Limits:
    """What a family supports here, as the README table shows it."""

    tensor_parallel: str = "yes"
    moe: str = "-"
    expert_parallel: str = "-"
    sliding_window: str = "-"
    engines: str = "-"
    notes: str = ""


@dataclass(frozen=True)
class Family:
    """One architecture family: architecture strings, config mapping, weight mapping, limits.

    ``from_hf(hf_config, source) -> ModelConfig`` and ``to_hf(cfg) -> dict`` translate config.json;
    ``requires`` lists ``(ModelConfig field, predicate, what it must be)`` for a config to be written as this
    family; ``auto(cfg)`` says whether an export without an explicit architecture picks this family.
    """

    model_type: str
    architecture: str
    from_hf: Callable[[Mapping[str, Any], str], ModelConfig]
    to_hf: Callable[[ModelConfig], Dict[str, Any]]
    weights: WeightMap
    requires: Tuple[Tuple[str, Callable[[Any], bool], str], ...]
    auto: Callable[[ModelConfig], bool]
    limits: Limits = field(default_factory=Limits)
    check: Optional[Callable[[ModelConfig], Optional[str]]] = None  # requirements across fields

    def why_not(self, cfg: ModelConfig) -> Optional[str]:
        """The first ModelConfig field that keeps ``cfg`` from being this family (None when it fits)."""
        for name, ok, want in self.requires:
            if not ok(getattr(cfg, name)):
                return f"ModelConfig.{name}={getattr(cfg, name)!r} cannot be exported as {self.architecture} " \
                       f"(needs {want})"
        return self.check(cfg) if self.check is not None else None


def is_(value: Any) -> Callable[[Any], bool]:
    """Predicate: equal to ``value``."""
    return lambda v: v == value


def is_none(v: Any) -> bool:
    """Predicate: None."""
    return v is None


def not_none(v: Any) -> bool:
    """Predicate: not None."""
    return v is not None
