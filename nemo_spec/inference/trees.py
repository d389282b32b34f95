"""Token trees for verification: ancestor masks, cache-aware attention contexts, static Medusa trees.

A verification block for one row is ``[root, node_1, ..., node_n]`` where the root is the last accepted
token (not yet in the cache) and ``parents[i]`` (block index, -1 for the root) links the draft nodes.
A chain is the tree whose node ``i`` has parent ``i - 1``. Rows of a batch may carry different trees
(ragged), padded with invalid nodes that only attend to themselves and are never accepted.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from nemo_spec.models import AttnContext, KVCache
from nemo_spec.inference.sampling import SamplingError
from nemo_spec.inference.transfer import h2d

Choice = Tuple[int, ...]

#: A small static Medusa tree (paths of top-k ranks per head) that works with 3+ heads.
DEFAULT_MEDUSA_CHOICES: List[Choice] = [
    (0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0),
    (1, 0, 0), (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 0, 0, 0),
]


def ancestor_mask(parents: torch.Tensor, valid: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """anc [b, n, n] (True where j is an ancestor-or-self of i) and depth [b, n] from parents [b, n] (-1 = none).

    Invalid nodes attend only to themselves (depth 0). The transitive closure of the parent relation is
    taken by repeated squaring (log2(n) batched matmuls), not a Python loop over nodes.
    """
    b, n = parents.shape
    dev = parents.device
    eye = torch.eye(n, dtype=torch.bool, device=dev)[None].expand(b, n, n)
    if n == 0:
        return eye.clone(), torch.zeros(b, 0, dtype=torch.long, device=dev)
    has = (parents >= 0) & valid
    edge = torch.zeros(b, n, n, dtype=torch.bool, device=dev)
    edge.scatter_(2, parents.clamp(min=0)[:, :, None], has[:, :, None])
    anc = eye | edge
    reach = 1
    while reach < n:
        f = anc.float()
        anc = torch.bmm(f, f) > 0
        reach *= 2
    depth = anc.sum(-1) - 1
    return anc, depth


def chain_mask(valid: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`ancestor_mask` of right-padded chains (node i's parent is i - 1) given valid [b, n].

    ``valid`` must be a prefix per row (as :func:`pad_chains` makes it); a gap would be treated differently.
    """
    b, n = valid.shape
    dev = valid.device
    idx = torch.arange(n, device=dev)
    tril = idx[None, :] <= idx[:, None]
    anc = (tril[None] & valid[:, :, None]) | torch.eye(n, dtype=torch.bool, device=dev)[None]
    depth = torch.where(valid, idx[None], torch.zeros_like(idx)[None])
    return anc, depth


def select_tree(tokens: torch.Tensor, score: torch.Tensor, parent: torch.Tensor, depth: torch.Tensor,
                total: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """EAGLE-2 re-ranking: keep the ``total`` best-scoring candidates per row as a tree.

    Candidates [b, N] come level by level (a parent precedes its children); ``score`` is the cumulative
    log-probability (a child never scores above its parent), ``parent`` the candidate index of the parent
    (-1 = child of the root). Returns (tokens [b, n], parents [b, n] as block indices, 0 = root). On equal
    scores the shallower candidate wins, in float64 so that the tie-break is representable for any score,
    hence every kept node's parent is kept.
    """
    b, N = tokens.shape
    dev = tokens.device
    n = min(total, N)
    rows = torch.arange(b, device=dev)[:, None]
    key = score.double() - 1e-6 * depth.double()
    sel = key.topk(n, -1).indices.sort(-1).values  # ancestors precede descendants
    inv = torch.zeros(b, N, dtype=torch.long, device=dev)
    inv[rows.expand(b, n), sel] = torch.arange(1, n + 1, device=dev)[None].expand(b, n)
    p_sel = parent[rows, sel]
    parents = torch.where(p_sel >= 0, inv[rows, p_sel.clamp(min=0)], torch.zeros_like(p_sel))
    return tokens[rows, sel], parents


def chain_parents(b: int, n: int, device: torch.device) -> torch.Tensor:
    """parents [b, n] of a chain (node i's parent is i - 1)."""
    return (torch.arange(n, device=device) - 1)[None].expand(b, n).contiguous()


def block_context(cache: KVCache, anc: torch.Tensor, depth: torch.Tensor, max_pos: int,
                  prefix: Optional[torch.Tensor] = None, max_length: Optional[int] = None,
                  single_decode: bool = False, padded: bool = False) -> AttnContext:
    """Context for a block of n new entries per row written after each row's committed cache entries.

    ``prefix`` [b, n, S] optionally marks which of S earlier uncommitted entries (slots
    ``lengths .. lengths+S``, e.g. draft-tree levels) each new entry attends to; the block then starts
    at ``lengths + S``. ``depth`` [b, n] is the position offset of each entry after the committed ones.
    ``max_length``: the largest committed length of the rows, when the caller knows it on the host (else it is
    read from the device: a sync). ``single_decode``: the caller knows this is one row, one new entry and
    no left padding (then the mask allows everything and SDPA runs unmasked). ``padded``: entries past the
    cache end are padding (right-padded prompt chunks): they are written to the last slot, which holds no
    committed entry, instead of overflowing.
    """
    b, n = depth.shape
    dev = depth.device
    S = 0 if prefix is None else prefix.shape[-1]
    lengths, starts = cache.lengths, cache.starts
    kv = (int(lengths.max()) if max_length is None else int(max_length)) + S + n
    if padded:
        kv = min(kv, cache.max_len)
    if kv > cache.max_len:
        raise SamplingError(f"KV cache overflow: need {kv} slots, cache has {cache.max_len}")
    write = lengths[:, None] + S + torch.arange(n, device=dev)[None]
    if padded:
        write = write.clamp(max=cache.max_len - 1)
    j = torch.arange(kv, device=dev)[None]
    committed = (j >= starts[:, None]) & (j < lengths[:, None])
    full = anc if prefix is None else torch.cat([prefix, anc], dim=-1)  # [b, n, S + n]
    rel = j - lengths[:, None]
    in_new = (rel >= 0) & (rel < S + n)
    g = full.gather(2, rel.clamp(0, S + n - 1)[:, None, :].expand(b, n, kv))
    mask = committed[:, None, :] | (g & in_new[:, None, :])
    pos = ((lengths - starts)[:, None] + depth).clamp(max=max_pos - 1)
    hints = {}
    if max_length is not None:  # host facts: no device read in the attention layers
        hints["mask_all"] = bool(single_decode and b == 1 and n == 1 and S == 0)
        hints["first_write"] = int(max_length) + S if b == 1 else -1
    return AttnContext(position_ids=pos, mask=mask, cache=cache, write_slots=write, kv_len=kv, **hints)


def decode_context(cache: KVCache, max_length: int, max_pos: int, unpadded: bool = False) -> AttnContext:
    """Context for one new entry per row right after its committed entries (a plain decode step): the same
    context as :func:`block_context` of a one-node block, built in a few tensor ops. ``max_length``: the largest
    committed length (host value); ``unpadded``: no row has left padding (then, with one row, the mask allows
    everything and is not built)."""
    lengths, starts = cache.lengths, cache.starts
    b = lengths.shape[0]
    kv = int(max_length) + 1
    if kv > cache.max_len:
        raise SamplingError(f"KV cache overflow: need {kv} slots, cache has {cache.max_len}")
    pos = (lengths - starts)[:, None].clamp(max=max_pos - 1)
    write = lengths[:, None].clone()
    if b == 1 and unpadded:
        return AttnContext(position_ids=pos, mask=None, cache=cache, write_slots=write, kv_len=kv, mask_all=True,
                           first_write=int(max_length))
    j = torch.arange(kv, device=lengths.device)[None]
    mask = ((j >= starts[:, None]) & (j <= lengths[:, None]))[:, None, :]
    return AttnContext(position_ids=pos, mask=mask, cache=cache, write_slots=write, kv_len=kv, mask_all=False,
                       first_write=int(max_length) if b == 1 else -1)


def prefill_context(cache: KVCache, prompt_lens: torch.Tensor, width: int) -> AttnContext:
    """Context for left-padded prompts [b, width]: sets cache starts/lengths; pad queries attend to themselves."""
    dev = prompt_lens.device
    b = prompt_lens.shape[0]
    if width > cache.max_len:
        raise SamplingError(f"KV cache overflow: prompt width {width} > cache length {cache.max_len}")
    starts = width - prompt_lens
    cache.reset()
    cache.starts.copy_(starts)
    cache.lengths.copy_(starts)
    i = torch.arange(width, device=dev)
    mask = (i[None, None, :] <= i[None, :, None]) & (i[None, None, :] >= starts[:, None, None])
    mask = mask | torch.eye(width, dtype=torch.bool, device=dev)[None]
    pos = (i[None] - starts[:, None]).clamp(min=0)
    write = i[None].expand(b, width)
    return AttnContext(position_ids=pos, mask=mask, cache=cache, write_slots=write, kv_len=width)


def children_lists(parents: Sequence[int], valid: Sequence[bool]) -> List[List[int]]:
    """Per-node child lists (block indices, in order) for one row."""
    kids: List[List[int]] = [[] for _ in range(len(parents))]
    for i, (p, ok) in enumerate(zip(parents, valid)):
        if ok and p >= 0:
            kids[p].append(i)
    return kids


def validate_medusa_choices(choices: Sequence[Sequence[int]], num_heads: int, option: str = "medusa_choices",
                            depths: str = "Medusa heads") -> List[Choice]:
    """Check a static tree of rank paths (every prefix present, depth <= ``num_heads``, the number of ``depths``
    that predict) and return it sorted by depth; errors name ``option``."""
    try:
        out = sorted({tuple(int(r) for r in c) for c in choices}, key=lambda c: (len(c), c))
    except (TypeError, ValueError) as e:
        raise SamplingError(f"{option} must be a list of rank paths (lists of ints), got {choices!r}") from e
    if not out:
        raise SamplingError(f"{option} must not be empty")
    have = set(out)
    for c in out:
        if not c or any(r < 0 for r in c):
            raise SamplingError(f"{option} entry {c} must be a non-empty path of ranks >= 0")
        if len(c) > num_heads:
            raise SamplingError(f"{option} entry {c} is deeper than the {num_heads} {depths}")
        if len(c) > 1 and c[:-1] not in have:
            raise SamplingError(f"{option} entry {c} lacks its prefix {c[:-1]}")
    return out


def parallel_tree_choices(depth: int) -> List[Choice]:
    """Default static tree for a parallel (one-forward) draft of ``depth`` positions: the top-1 chain through
    every depth (the chain the reference engines verify) plus the runner-up tokens where acceptance is decided
    most often, near the root: ranks 1-2 at depth 1, rank 1 under the top-1 and rank-1 nodes at depth 2, rank 1
    at depth 3. ``depth + 5`` nodes (fewer when ``depth < 3``)."""
    chain = [(0,) * d for d in range(1, depth + 1)]
    extra = [(1,), (2,), (0, 1), (1, 0), (0, 0, 1)]
    return sorted(set(chain) | {c for c in extra if len(c) <= depth}, key=lambda c: (len(c), c))


def medusa_tree(choices: Sequence[Choice]) -> Tuple[List[int], List[int], List[int]]:
    """Static tree from validated choices: (parents (block index, root = 0), head index per node, rank per node)."""
    index = {c: i + 1 for i, c in enumerate(choices)}
    parents = [index[c[:-1]] if len(c) > 1 else 0 for c in choices]
    heads = [len(c) - 1 for c in choices]
    ranks = [c[-1] for c in choices]
    return parents, heads, ranks


def pad_chains(chains: Sequence[Sequence[int]], n: Optional[int] = None, pad: int = 0,
               device: Optional[torch.device] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Right-pad ragged token lists into tokens [b, n] and valid [b, n]."""
    n = max((len(c) for c in chains), default=0) if n is None else n
    tok = torch.full((len(chains), n), pad, dtype=torch.long)
    val = torch.zeros(len(chains), n, dtype=torch.bool)
    for r, c in enumerate(chains):
        c = list(c)[:n]
        if c:
            tok[r, : len(c)] = torch.tensor(c, dtype=torch.long)
            val[r, : len(c)] = True
    if device is None:
        return tok, val
    return h2d(tok, torch.device(device)), h2d(val, torch.device(device))
