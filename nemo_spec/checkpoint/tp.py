"""Split and merge full (TP=1) state dicts to/from megatron tensor-parallel shards.

Layouts (megatron-core): column-parallel weights are split on dim 0, row-parallel on dim 1,
vocab-parallel embeddings/output layers on dim 0. The fused QKV weight is laid out per query
group ([q heads of group g, k_g, v_g] for each g), so a dim-0 split gives each rank whole groups.
A gated MLP's ``linear_fc1`` holds [gate; up]: each rank keeps [gate_r; up_r].
Rules are matched on the parameter name; other modules (drafts) can register their own.
"""
from __future__ import annotations

import re
from typing import Dict, List, Tuple

import torch

COLUMN, ROW, VOCAB, REPLICATED, GATED_COLUMN = "column", "row", "vocab", "replicated", "gated_column"

_RULES: List[Tuple[re.Pattern, str]] = []


def register_rule(pattern: str, kind: str, first: bool = False) -> None:
    """Declare how parameters whose name matches ``pattern`` (regex, searched) are sharded."""
    entry = (re.compile(pattern), kind)
    if first:
        _RULES.insert(0, entry)
    else:
        _RULES.append(entry)


register_rule(r"word_embeddings\.weight$", VOCAB)
register_rule(r"output_layer\.weight$", VOCAB)
register_rule(r"linear_qkv\.(weight|bias)$", COLUMN)
register_rule(r"linear_proj\.weight$", ROW)
register_rule(r"linear_fc2\.weight$", ROW)
register_rule(r"linear_fc1\.(weight|bias)$", GATED_COLUMN)


def shard_kind(name: str, gated: bool) -> str:
    """How parameter ``name`` is sharded across tensor-parallel ranks."""
    for pat, kind in _RULES:
        if pat.search(name):
            if kind == GATED_COLUMN and not gated:
                return COLUMN
            return kind
    return REPLICATED


def _split(t: torch.Tensor, kind: str, rank: int, size: int, name: str) -> torch.Tensor:
    if kind == REPLICATED or size == 1:
        return t.clone()
    dim = 1 if kind == ROW else 0
    if t.shape[dim] % size:
        raise ValueError(f"{name}: dim {dim} of shape {tuple(t.shape)} is not divisible by TP size {size}")
    if kind == GATED_COLUMN:
        gate, up = t.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, 0)[rank], up.chunk(size, 0)[rank]], 0).clone()
    return t.chunk(size, dim=dim)[rank].clone()


def _merge(parts: List[torch.Tensor], kind: str, name: str) -> torch.Tensor:
    if kind == REPLICATED or len(parts) == 1:
        return parts[0].clone()
    if kind == GATED_COLUMN:
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([torch.cat([h[0] for h in halves], 0), torch.cat([h[1] for h in halves], 0)], 0)
    return torch.cat(parts, dim=1 if kind == ROW else 0)


def is_tensor_entry(name: str, value: object) -> bool:
    """True for real parameters/buffers (not megatron's ``_extra_state`` entries)."""
    return isinstance(value, torch.Tensor) and not name.endswith("_extra_state")


def split_state_dict(full: Dict[str, torch.Tensor], rank: int, size: int, gated: bool) -> Dict[str, torch.Tensor]:
    """The TP shard for ``rank`` of a full state dict."""
    return {k: _split(v, shard_kind(k, gated), rank, size, k) for k, v in full.items() if is_tensor_entry(k, v)}


def merge_state_dicts(shards: List[Dict[str, torch.Tensor]], gated: bool) -> Dict[str, torch.Tensor]:
    """Merge per-rank TP shards (in rank order) into a full state dict."""
    keys = [k for k, v in shards[0].items() if is_tensor_entry(k, v)]
    for i, s in enumerate(shards[1:], 1):
        missing = set(keys) - set(s)
        if missing:
            raise KeyError(f"TP shard {i} lacks {sorted(missing)[:5]}")
    return {k: _merge([s[k] for s in shards], shard_kind(k, gated), k) for k in keys}


def gather_full_state_dict(model: torch.nn.Module, gated: bool) -> Dict[str, torch.Tensor]:
    """All-gather a TP-sharded model's state dict into a full (TP=1) one, on every rank (CPU tensors)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    local = {k: v.detach().cpu() for k, v in model.state_dict().items() if is_tensor_entry(k, v)}
    size = parallel_state.get_tensor_model_parallel_world_size() if parallel_state.model_parallel_is_initialized() else 1
    if size == 1:
        return local
    shards: List[Dict[str, torch.Tensor]] = [None] * size  # type: ignore[list-item]
    dist.all_gather_object(shards, local, group=parallel_state.get_tensor_model_parallel_group())
    return merge_state_dicts(shards, gated)


def load_full_state_dict(model: torch.nn.Module, full: Dict[str, torch.Tensor], gated: bool, strict: bool = True) -> None:
    """Load a full state dict into a (possibly TP-sharded) model, taking this rank's shard."""
    from nemo_spec import parallel

    shard = split_state_dict(full, parallel.tp_rank(), parallel.tp_size(), gated)
    own = {k: v for k, v in model.state_dict().items() if is_tensor_entry(k, v)}
    if strict:
        missing, unexpected = set(own) - set(shard), set(shard) - set(own)
        if missing or unexpected:
            raise KeyError(f"state dict mismatch: missing {sorted(missing)[:8]}, unexpected {sorted(unexpected)[:8]}")
    for k, v in shard.items():
        if k in own and own[k].shape != v.shape:
            raise ValueError(f"{k}: checkpoint shape {tuple(v.shape)} != model shape {tuple(own[k].shape)}")
    model.load_state_dict(shard, strict=False)
