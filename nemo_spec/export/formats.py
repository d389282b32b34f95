"""Shared pieces of the export formats: dtypes, Megatron <-> Hugging Face layer mapping, atomic directories.

Megatron-core keeps attention as one fused ``linear_qkv`` weight laid out per query group: for each of the
``G`` groups, the ``H/G`` query heads of that group, then the group's key head, then its value head (each
``head_dim`` rows). Hugging Face Llama layers keep ``q_proj`` [H*d, in], ``k_proj`` [G*d, in] and ``v_proj``
[G*d, in] separately, heads in order. A gated MLP's ``linear_fc1`` is [gate; up] where HF has ``gate_proj``
and ``up_proj``; ``linear_fc2`` is ``down_proj`` and ``linear_proj`` is ``o_proj``. The functions here convert
full (already TP-gathered) tensors between the two layouts, exactly and invertibly.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Dict, Iterator, Mapping, Optional, Tuple

import torch

from nemo_spec.checkpoint.hf import qkv_from_megatron, qkv_to_megatron
from nemo_spec.fsutil import publish_directory

log = logging.getLogger(__name__)


class ExportError(RuntimeError):
    """An export or import cannot be done; the message names the path, field or value at fault."""


DTYPES: Dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_HF_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def hf_dtype_name(dtype: torch.dtype) -> str:
    """The ``torch_dtype`` string Hugging Face configs use for ``dtype``."""
    return _HF_NAMES[dtype]


# ----------------------------------------------------------------------------------------------- QKV / MLP
def split_qkv(w: torch.Tensor, num_heads: int, num_groups: int, head_dim: int) -> Tuple[torch.Tensor, ...]:
    """Megatron fused per-group QKV weight/bias [(H+2G)*d, ...] -> (q [H*d, ...], k [G*d, ...], v [G*d, ...])."""
    rows = (num_heads + 2 * num_groups) * head_dim
    if w.shape[0] != rows:
        raise ExportError(f"fused QKV has {w.shape[0]} rows, expected (heads {num_heads} + 2*groups {num_groups})"
                          f" * head_dim {head_dim} = {rows}")
    return qkv_from_megatron(w, num_heads, num_groups, head_dim)


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, num_groups: int,
              head_dim: int) -> torch.Tensor:
    """Inverse of :func:`split_qkv`: HF q/k/v -> Megatron fused per-group QKV."""
    for name, t, n in (("q_proj", q, num_heads), ("k_proj", k, num_groups), ("v_proj", v, num_groups)):
        if t.shape[0] != n * head_dim:
            raise ExportError(f"{name} has {t.shape[0]} rows, expected {n} heads * head_dim {head_dim}")
    return qkv_to_megatron(q, k, v, num_heads, num_groups)


def split_gated(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Megatron gated fc1 [2F, h] -> (gate_proj [F, h], up_proj [F, h])."""
    gate, up = w.chunk(2, dim=0)
    return gate.contiguous(), up.contiguous()


def merge_gated(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`split_gated`."""
    return torch.cat([gate, up], dim=0).contiguous()


def layer_to_hf(sd: Mapping[str, torch.Tensor], src: str, dst: str, num_heads: int, num_groups: int,
                head_dim: int, input_norm: bool = True) -> Dict[str, torch.Tensor]:
    """One Megatron TransformerLayer (keys under ``src``) -> HF Llama decoder-layer tensors under ``dst``.

    ``input_norm=False`` drops ``input_layernorm`` (callers that store it elsewhere or whose format lacks it).
    """
    def get(name: str) -> torch.Tensor:
        key = src + name
        if key not in sd:
            raise ExportError(f"draft state dict lacks {key!r}")
        return sd[key]

    out: Dict[str, torch.Tensor] = {}
    q, k, v = split_qkv(get("self_attention.linear_qkv.weight"), num_heads, num_groups, head_dim)
    for name, t in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
        out[f"{dst}self_attn.{name}.weight"] = t
    if src + "self_attention.linear_qkv.bias" in sd:
        qb, kb, vb = split_qkv(sd[src + "self_attention.linear_qkv.bias"], num_heads, num_groups, head_dim)
        for name, t in (("q_proj", qb), ("k_proj", kb), ("v_proj", vb)):
            out[f"{dst}self_attn.{name}.bias"] = t
    out[dst + "self_attn.o_proj.weight"] = get("self_attention.linear_proj.weight")
    gate, up = split_gated(get("mlp.linear_fc1.weight"))
    out[dst + "mlp.gate_proj.weight"], out[dst + "mlp.up_proj.weight"] = gate, up
    out[dst + "mlp.down_proj.weight"] = get("mlp.linear_fc2.weight")
    out[dst + "post_attention_layernorm.weight"] = get("pre_mlp_layernorm.weight")
    if input_norm:
        out[dst + "input_layernorm.weight"] = get("input_layernorm.weight")
    return out


def layer_from_hf(sd: Mapping[str, torch.Tensor], src: str, dst: str, num_heads: int, num_groups: int,
                  head_dim: int, input_norm: bool = True) -> Dict[str, torch.Tensor]:
    """Inverse of :func:`layer_to_hf`: HF decoder-layer tensors under ``src`` -> Megatron keys under ``dst``."""
    def get(name: str) -> torch.Tensor:
        key = src + name
        if key not in sd:
            raise ExportError(f"exported draft lacks tensor {key!r}")
        return sd[key]

    out: Dict[str, torch.Tensor] = {}
    out[dst + "self_attention.linear_qkv.weight"] = merge_qkv(
        get("self_attn.q_proj.weight"), get("self_attn.k_proj.weight"), get("self_attn.v_proj.weight"),
        num_heads, num_groups, head_dim)
    if src + "self_attn.q_proj.bias" in sd:
        out[dst + "self_attention.linear_qkv.bias"] = merge_qkv(
            get("self_attn.q_proj.bias"), get("self_attn.k_proj.bias"), get("self_attn.v_proj.bias"),
            num_heads, num_groups, head_dim)
    out[dst + "self_attention.linear_proj.weight"] = get("self_attn.o_proj.weight")
    out[dst + "mlp.linear_fc1.weight"] = merge_gated(get("mlp.gate_proj.weight"), get("mlp.up_proj.weight"))
    out[dst + "mlp.linear_fc2.weight"] = get("mlp.down_proj.weight")
    out[dst + "pre_mlp_layernorm.weight"] = get("post_attention_layernorm.weight")
    if input_norm:
        out[dst + "input_layernorm.weight"] = get("input_layernorm.weight")
    return out


# ----------------------------------------------------------------------------------------------- files
def cast_tensors(tensors: Mapping[str, torch.Tensor], dtype: torch.dtype) -> Dict[str, torch.Tensor]:
    """Floating tensors to ``dtype`` (integer/bool index tensors such as d2t/t2d keep theirs), contiguous, unshared."""
    out = {}
    for k, v in tensors.items():
        t = v.detach().cpu()
        if t.is_floating_point():
            t = t.to(dtype)
        out[k] = t.contiguous().clone()
    return out


def save_safetensors(tensors: Mapping[str, torch.Tensor], path: Path,
                     metadata: Optional[Dict[str, str]] = None) -> None:
    """Write ``tensors`` to ``path`` in safetensors format (pt metadata as transformers writes it)."""
    from safetensors.torch import save_file

    meta = {"format": "pt"}
    meta.update(metadata or {})
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=meta)


def load_tensors(path: Path) -> Dict[str, torch.Tensor]:
    """Read a safetensors or torch pickle (.bin/.pt) tensor file onto CPU."""
    path = Path(path)
    if not path.is_file():
        raise ExportError(f"tensor file {path} does not exist")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    obj = torch.load(str(path), map_location="cpu", weights_only=True)
    if not isinstance(obj, dict):
        raise ExportError(f"{path}: expected a dict of tensors, got {type(obj).__name__}")
    return obj


def write_json(path: Path, obj: Mapping) -> None:
    """Write ``obj`` as indented JSON."""
    Path(path).write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def read_json(path: Path) -> Dict:
    """Read a JSON object, with an error naming the file."""
    path = Path(path)
    if not path.is_file():
        raise ExportError(f"{path} does not exist")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ExportError(f"{path} is not valid JSON: {e}") from e


def check_export_dir(path: Path, overwrite: bool) -> None:
    """Refuse a target that is a file, or a non-empty directory unless ``overwrite``."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ExportError(f"export_dir {path} exists and is not a directory")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise ExportError(f"export_dir {path} exists and is not empty; pass --overwrite (overwrite=True) to replace it")


@contextlib.contextmanager
def atomic_directory(path: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a fresh temp dir next to ``path``; on success it replaces ``path``, on failure it is removed.

    A partially written export is never visible under ``path``: the previous content (if overwritten) is
    only removed after the new directory has been renamed into place.
    """
    path = Path(path).absolute()
    check_export_dir(path, overwrite)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        publish_directory(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("wrote %s", path)
