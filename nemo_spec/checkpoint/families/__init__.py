"""Architecture families, one declarative module each: config.json <-> ModelConfig, weight names/shapes/layouts,
architecture string, limits. Import (``checkpoint.hf``), HF export and the draft exports (``export.eagle``) all read
these declarations; adding a family is one module here plus its tests.

``FAMILIES`` is ordered by export preference: a config exported without an explicit architecture becomes the first
family whose ``requires`` hold and whose ``auto`` accepts it.
"""
from __future__ import annotations

import re
from typing import Any, Dict, List, Mapping, Optional, Tuple

from nemo_spec.checkpoint.families import gpt2, llama, mistral, mixtral, qwen2, qwen3, qwen3_moe
from nemo_spec.checkpoint.families._base import (
    Family, FamilyError, HFCheckpointError, Limits, Rule, WeightMap, qkv_from_megatron, qkv_to_megatron,
    rules_to_hf, rules_to_megatron,
)
from nemo_spec.config import ModelConfig

FAMILIES: List[Family] = [gpt2.FAMILY, qwen3_moe.FAMILY, mixtral.FAMILY, qwen3.FAMILY, qwen2.FAMILY,
                          mistral.FAMILY, llama.FAMILY]
BY_ARCH: Dict[str, Family] = {f.architecture: f for f in FAMILIES}
BY_MODEL_TYPE: Dict[str, Family] = {f.model_type: f for f in FAMILIES}

#: the Llama decoder-layer rules EAGLE draft layers are written with (every engine reads Llama draft layers)
DRAFT_LAYER = llama.LAYER

__all__ = ["FAMILIES", "BY_ARCH", "BY_MODEL_TYPE", "DRAFT_LAYER", "Family", "FamilyError", "HFCheckpointError",
           "Limits", "Rule", "WeightMap", "family_of_hf", "family_for_export", "family_by_model_type",
           "support_table", "qkv_from_megatron", "qkv_to_megatron", "rules_to_hf", "rules_to_megatron"]


def supported_architectures() -> List[str]:
    """Every architecture string the families declare, sorted."""
    return sorted(BY_ARCH)


def family_of_hf(hf: Mapping[str, Any], source: str = "config.json") -> Family:
    """The family of an HF config.json dict (``architectures``, else ``model_type``); FamilyError names the field."""
    archs = hf.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    if archs:
        for a in archs:
            if a in BY_ARCH:
                return BY_ARCH[a]
        raise FamilyError(f"{source}: field 'architectures' = {archs} is not supported; supported architectures: "
                          f"{supported_architectures()}")
    mt = hf.get("model_type")
    if mt in BY_MODEL_TYPE:
        return BY_MODEL_TYPE[mt]
    raise FamilyError(f"{source}: cannot tell the architecture (architectures={archs!r}, model_type={mt!r}); "
                      f"supported architectures: {supported_architectures()}")


def family_by_model_type(model_type: str) -> Family:
    """The family registered for ``model_type``."""
    if model_type not in BY_MODEL_TYPE:
        raise FamilyError(f"unknown model_type {model_type!r}; known: {sorted(BY_MODEL_TYPE)}")
    return BY_MODEL_TYPE[model_type]


def family_for_export(cfg: ModelConfig, architecture: Optional[str] = None) -> Family:
    """The family ``cfg`` is written as (``architecture`` or the first that fits); FamilyError names the field."""
    if architecture is not None:
        if architecture not in BY_ARCH:
            raise FamilyError(f"architecture {architecture!r} is not supported; supported architectures: "
                              f"{supported_architectures()}")
        fam = BY_ARCH[architecture]
        why = fam.why_not(cfg)
        if why:
            raise FamilyError(why)
        return fam
    reasons = []
    for fam in FAMILIES:
        why = fam.why_not(cfg)
        if why is None and fam.auto(cfg):
            return fam
        if why is not None:
            reasons.append(why)
    # the families of another layer family (Llama's for a GPT-2-style model) only say so: name what keeps the
    # model out of its own family's architectures (the last three reasons had hidden GPT-2's, a review found)
    own = [r for r in reasons if not r.startswith("ModelConfig.family=")] or reasons
    merged: Dict[Tuple[str, str], List[str]] = {}  # one line per (field=value, need) over the architectures
    for r in own:
        m = re.fullmatch(r"(.*) cannot be exported as (\w+) (\(needs .*\))", r)
        key = (m.group(1), m.group(3)) if m else (r, "")
        merged.setdefault(key, []).append(m.group(2) if m else "")
    raise FamilyError("no Hugging Face architecture can hold this model: " + "; ".join(
        f"{what} cannot be exported as {', '.join(archs)} {need}" if need else what
        for (what, need), archs in merged.items()))


SUPPORT_COLUMNS = ("Architecture", "model_type", "TP", "MoE", "EP", "Sliding window", "Draft export engines", "Notes")


def support_table() -> str:
    """The README's supported-architecture table (Markdown), generated from the declarations."""
    rows = [SUPPORT_COLUMNS, tuple("---" for _ in SUPPORT_COLUMNS)]
    for fam in sorted(FAMILIES, key=lambda f: f.architecture):
        lim = fam.limits
        rows.append((f"`{fam.architecture}`", f"`{fam.model_type}`", lim.tensor_parallel, lim.moe,
                     lim.expert_parallel, lim.sliding_window, lim.engines, lim.notes or "-"))
    return "\n".join("| " + " | ".join(r) + " |" for r in rows)
