"""Split and merge full (TP=1) state dicts to/from megatron tensor-parallel shards.

Layouts (megatron-core): column-parallel weights are split on dim 0, row-parallel on dim 1,
vocab-parallel embeddings/output layers on dim 0. The fused QKV weight is laid out per query
group ([q heads of group g, k_g, v_g] for each g), so a dim-0 split gives each rank whole groups.
A gated MLP's ``linear_fc1`` holds [gate; up]: each rank keeps [gate_r; up_r].
Rules are matched on the parameter name; other modules (drafts) can register their own.

Expert parallelism (EP): a MoE layer's ``mlp.experts.local_experts.{i}.*`` on EP rank ``r`` is global expert
``r * (num_experts // EP) + i`` -- megatron-core 0.16.1 ``transformer/moe/moe_layer.py:101-110``
(``num_local_experts = num_moe_experts // ep_size``, ``local_expert_indices = ep_rank * num_local_experts + i``)
and ``transformer/moe/experts.py:941-948`` (``SequentialMLP.sharded_state_dict`` writes local expert ``i`` as
global ``ep_group.rank() * num_local_experts + i``). A full state dict numbers experts globally; an EP shard keeps
its rank's block of experts renumbered from 0, then each kept expert is TP-split like a dense MLP (experts are
tensor-parallel over the same TP ranks). The router (``mlp.router.weight``) and everything else is replicated
over EP.
"""
from __future__ import annotations

import re
from typing import Dict, Iterable, List, Optional, Set, Tuple

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


_EXPERT = re.compile(r"^(?P<pre>.*\.local_experts\.)(?P<e>\d+)(?P<post>\..+)$")


def expert_name(name: str) -> Optional[Tuple[str, int, str]]:
    """(prefix, expert index, suffix) of a SequentialMLP expert tensor name, else None."""
    m = _EXPERT.match(name)
    return (m.group("pre"), int(m.group("e")), m.group("post")) if m else None


def _experts_by_layer(names: Iterable[str]) -> Dict[str, Set[int]]:
    out: Dict[str, Set[int]] = {}
    for k in names:
        got = expert_name(k)
        if got is not None:
            out.setdefault(got[0], set()).add(got[1])
    return out


def ep_split_state_dict(full: Dict[str, torch.Tensor], ep_rank: int, ep_size: int) -> Dict[str, torch.Tensor]:
    """The EP shard of ``rank``: its block of ``num_experts // ep_size`` experts per MoE layer, numbered from 0."""
    if ep_size == 1:
        return dict(full)
    if not 0 <= ep_rank < ep_size:
        raise ValueError(f"ep_rank={ep_rank} is not in [0, expert parallel size {ep_size})")
    layers = _experts_by_layer(full)
    if not layers:
        raise ValueError(f"expert parallel size {ep_size} needs a mixture-of-experts state dict, but it has no "
                         f"'local_experts.<i>.' tensors (a dense model)")
    local: Dict[str, int] = {}
    for pre, idx in layers.items():
        n = len(idx)
        if idx != set(range(n)):
            raise ValueError(f"{pre}*: expert indices {sorted(idx)} are not 0..{n - 1}")
        if n % ep_size:
            raise ValueError(f"{pre}*: expert parallel size {ep_size} does not divide the {n} experts")
        local[pre] = n // ep_size
    out: Dict[str, torch.Tensor] = {}
    for k, v in full.items():
        got = expert_name(k)
        if got is None:
            out[k] = v
            continue
        pre, e, post = got
        first = ep_rank * local[pre]
        if first <= e < first + local[pre]:
            out[f"{pre}{e - first}{post}"] = v
    return out


def ep_merge_state_dicts(shards: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """Merge per-EP-rank shards (in EP rank order) into global expert numbering (non-expert entries from rank 0)."""
    if len(shards) == 1:
        return dict(shards[0])
    out = {k: v for k, v in shards[0].items() if expert_name(k) is None}
    for r, shard in enumerate(shards):
        layers = _experts_by_layer(shard)
        for k, v in shard.items():
            got = expert_name(k)
            if got is None:
                continue
            pre, i, post = got
            out[f"{pre}{r * len(layers[pre]) + i}{post}"] = v
    return out


def is_tensor_entry(name: str, value: object) -> bool:
    """True for real parameters/buffers (not megatron's ``_extra_state`` entries)."""
    return isinstance(value, torch.Tensor) and not name.endswith("_extra_state")


def split_state_dict(full: Dict[str, torch.Tensor], rank: int, size: int, gated: bool, ep_rank: int = 0,
                     ep_size: int = 1) -> Dict[str, torch.Tensor]:
    """The shard for TP ``rank`` (and EP ``ep_rank``: its experts only) of a full state dict."""
    full = ep_split_state_dict({k: v for k, v in full.items() if is_tensor_entry(k, v)}, ep_rank, ep_size)
    return {k: _split(v, shard_kind(k, gated), rank, size, k) for k, v in full.items()}


def merge_state_dicts(shards: List[Dict[str, torch.Tensor]], gated: bool) -> Dict[str, torch.Tensor]:
    """Merge per-rank TP shards (in rank order) into a full state dict."""
    keys = [k for k, v in shards[0].items() if is_tensor_entry(k, v)]
    for i, s in enumerate(shards[1:], 1):
        missing = set(keys) - set(s)
        if missing:
            raise KeyError(f"TP shard {i} lacks {sorted(missing)[:5]}")
    return {k: _merge([s[k] for s in shards], shard_kind(k, gated), k) for k in keys}


def gather_full_state_dict(model: torch.nn.Module, gated: bool) -> Dict[str, torch.Tensor]:
    """All-gather a TP/EP-sharded model's state dict into a full (TP=1, EP=1) one, on every rank (CPU tensors)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from nemo_spec import parallel

    local = {k: v.detach().cpu() for k, v in model.state_dict().items() if is_tensor_entry(k, v)}
    size, ep = parallel.tp_size(), parallel.ep_size()
    if size > 1:  # the TP group is also the experts' TP group (expert_tensor_parallel_size == TP)
        shards: List[Dict[str, torch.Tensor]] = [None] * size  # type: ignore[list-item]
        dist.all_gather_object(shards, local, group=parallel_state.get_tensor_model_parallel_group())
        local = merge_state_dicts(shards, gated)
    if ep > 1:  # only the experts differ over EP
        experts = {k: v for k, v in local.items() if expert_name(k) is not None}
        parts: List[Dict[str, torch.Tensor]] = [None] * ep  # type: ignore[list-item]
        dist.all_gather_object(parts, experts, group=parallel_state.get_expert_model_parallel_group())
        local = ep_merge_state_dicts([{**local, **parts[0]}] + parts[1:])  # rank 0 experts first, everywhere
    return local


def load_full_state_dict(model: torch.nn.Module, full: Dict[str, torch.Tensor], gated: bool, strict: bool = True) -> None:
    """Load a full state dict into a (possibly TP/EP-sharded) model, taking this rank's shard."""
    from nemo_spec import parallel

    shard = split_state_dict(full, parallel.tp_rank(), parallel.tp_size(), gated, parallel.ep_rank(), parallel.ep_size())
    own = {k: v for k, v in model.state_dict().items() if is_tensor_entry(k, v)}
    if strict:
        missing, unexpected = set(own) - set(shard), set(shard) - set(own)
        if missing or unexpected:
            raise KeyError(f"state dict mismatch: missing {sorted(missing)[:8]}, unexpected {sorted(unexpected)[:8]}")
    for k, v in shard.items():
        if k in own and own[k].shape != v.shape:
            raise ValueError(f"{k}: checkpoint shape {tuple(v.shape)} != model shape {tuple(own[k].shape)}")
    model.load_state_dict(shard, strict=False)
