"""Shared pieces of the export formats: dtypes, draft-layer <-> Hugging Face mapping, atomic directories.

Draft layers are written as Hugging Face Llama decoder layers with the Llama family's own weight rules
(:mod:`nemo_spec.checkpoint.families.llama`, fused per-query-group ``linear_qkv`` <-> ``q_proj``/``k_proj``/
``v_proj``, ``linear_fc1`` = [gate; up]): there is one mapping in the tree, used by HF import/export and here.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Dict, Iterator, Mapping, Optional, Set, Tuple

import torch

from nemo_spec.checkpoint.families import (
    DRAFT_LAYER, qkv_from_megatron, qkv_to_megatron, rules_to_hf, rules_to_megatron,
)
from nemo_spec.config import ModelConfig
from nemo_spec.fsutil import publish_directory

log = logging.getLogger(__name__)


class ExportError(RuntimeError):
    """An export or import cannot be done; the message names the path, field or value at fault."""


DTYPES: Dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_HF_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def hf_dtype_name(dtype: torch.dtype) -> str:
    """The ``torch_dtype`` string Hugging Face configs use for ``dtype``."""
    return _HF_NAMES[dtype]


# ----------------------------------------------------------------------------------------------- layers
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


def layer_to_hf(sd: Mapping[str, torch.Tensor], src: str, dst: str, cfg: ModelConfig,
                input_norm: bool = True) -> Dict[str, torch.Tensor]:
    """One Megatron draft TransformerLayer (keys under ``src``) -> HF Llama decoder-layer tensors under ``dst``,
    by the Llama family's layer rules (:data:`nemo_spec.checkpoint.families.DRAFT_LAYER`).

    ``input_norm=False`` drops ``input_layernorm`` (the EAGLE-1 format's layer 0 has none).
    """
    return rules_to_hf(DRAFT_LAYER, sd, cfg.draft_config(), src, dst, skip_tags=() if input_norm else ("input_norm",),
                       error=ExportError)


def layer_from_hf(sd: Mapping[str, torch.Tensor], src: str, dst: str, cfg: ModelConfig,
                  input_norm: bool = True) -> Dict[str, torch.Tensor]:
    """Inverse of :func:`layer_to_hf`: HF decoder-layer tensors under ``src`` -> Megatron keys under ``dst``."""
    return rules_to_megatron(DRAFT_LAYER, sd, cfg.draft_config(), src, dst,
                             skip_tags=() if input_norm else ("input_norm",), error=ExportError)


def layer_hf_names(src: str, cfg: ModelConfig, input_norm: bool = True) -> Set[str]:
    """The HF tensor names :func:`layer_from_hf` reads under ``src`` (what a draft layer of ``cfg`` has)."""
    c = cfg.draft_config()
    skip = () if input_norm else ("input_norm",)
    return {src + name for base in DRAFT_LAYER if base.tag not in skip and base.applies(c)
            for rule in base.expand(c) for name in rule.theirs}


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
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path))
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:  # SafetensorError, UnpicklingError, EOFError, RuntimeError (zip): all a bad file
        raise ExportError(f"{path} is damaged or not a {'safetensors' if path.suffix == '.safetensors' else 'torch'} "
                          f"tensor file ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from e
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ExportError(f"{path}: expected a dict of tensors, got {type(obj).__name__}")
    return obj


def read_safetensors_prefix(d: Path, prefix: str) -> Dict[str, torch.Tensor]:
    """The tensors named ``prefix*`` of a Hugging Face directory's ``model.safetensors`` or of the shards its
    ``model.safetensors.index.json`` lists (only those are read)."""
    from safetensors import safe_open

    d = Path(d)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ExportError(f"{index} has no 'weight_map' object")
        files = sorted({f for k, f in weight_map.items() if k.startswith(prefix)})
    elif (d / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ExportError(f"{d} has neither model.safetensors nor model.safetensors.index.json")
    out: Dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(d / f), framework="pt") as fh:
                for k in fh.keys():
                    if k.startswith(prefix):
                        out[k] = fh.get_tensor(k)
        except Exception as e:
            raise ExportError(f"{d / f} is missing, damaged or not a safetensors file ({type(e).__name__})") from e
    if not out:
        raise ExportError(f"{d} holds no tensors named {prefix}*")
    return out


def write_json(path: Path, obj: Mapping) -> None:
    """Write ``obj`` as indented JSON."""
    Path(path).write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def read_json(path: Path) -> Dict:
    """Read a JSON object, with an error naming the file."""
    path = Path(path)
    if not path.is_file():
        raise ExportError(f"{path} does not exist")
    try:
        obj = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ExportError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(obj, dict):
        raise ExportError(f"{path} holds a JSON {type(obj).__name__}, not the JSON object expected")
    return obj


def check_export_dir(path: Path, overwrite: bool) -> None:
    """Refuse a target that is a file, or a non-empty directory unless ``overwrite``; ``overwrite`` replaces an
    earlier export only (one with export_info.json), never a checkpoint or any other directory."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ExportError(f"export_dir {path} exists and is not a directory")
    if path.is_dir() and any(path.iterdir()):
        if not overwrite:
            raise ExportError(f"export_dir {path} exists and is not empty; pass --overwrite (overwrite=True) to "
                              f"replace it")
        if not (path / "export_info.json").is_file():
            raise ExportError(f"export_dir {path} exists and is not an export (no export_info.json): --overwrite "
                              f"replaces an earlier export only, never a checkpoint or another directory; "
                              f"refusing to replace it")


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
