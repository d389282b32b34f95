"""Sampling parameters, logit warping and the lossless accept/reject rules of speculative sampling.

All randomness comes from per-row seeded ``torch.Generator`` objects as uniforms in [0, 1); sampling a
token from a distribution is an inverse-CDF lookup of one uniform. This keeps every rule vectorisable
and makes results independent of the batch a request happens to share.

Lossless rules (``p`` = warped target distribution, ``q`` = the distribution a draft token was drawn from):

* chain (Leviathan et al. / Chen et al.): accept draft ``x`` with probability ``min(1, p(x)/q(x))``;
  on the first rejection sample from ``norm(max(0, p - q))``; when every draft is accepted, sample a
  bonus token from the target distribution after the last draft.
* siblings (SpecInfer / EAGLE recursive rejection): candidates of one node are tried in order; after
  each rejection ``p`` is replaced by its residual ``norm(max(0, p - q))``. For a deterministic draft
  (top-k tree, Medusa, prompt lookup) ``q`` is the one-hot of the candidate, so the residual is ``p``
  with that token removed and renormalised. Either way the emitted token is distributed exactly as ``p``.
* temperature 0: the warped target is one-hot at the argmax, and the rules reduce to exact greedy matching.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Sequence, Tuple

import torch


class SamplingError(ValueError):
    """An invalid sampling/generation parameter; the message names the field and the value."""


#: temperatures below this sample greedily (as vLLM's _SAMPLING_EPS): dividing logits by e.g. 1e-40 overflows
#: to inf/NaN probabilities
GREEDY_TEMPERATURE_EPS = 1e-5
#: seeds must fit a signed 64-bit integer (torch.Generator.manual_seed and the TP broadcast as torch.long)
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request (temperature 0 means greedy)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 64
    stop_token_ids: Tuple[int, ...] = field(default_factory=tuple)
    stop_strings: Tuple[str, ...] = field(default_factory=tuple)
    seed: Optional[int] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in (self.stop_token_ids or ())))
        if isinstance(self.stop_strings, str):
            object.__setattr__(self, "stop_strings", (self.stop_strings,))
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings or ()))
        self.validate()

    def validate(self) -> "SamplingParams":
        """Raise SamplingError naming the first invalid field."""
        t = self.temperature
        if not isinstance(t, (int, float)) or isinstance(t, bool) or t != t or t < 0 or t == float("inf"):
            raise SamplingError(f"SamplingParams.temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise SamplingError(f"SamplingParams.top_k must be an int >= 0 (0 = disabled), got {self.top_k!r}")
        p = self.top_p
        if not isinstance(p, (int, float)) or isinstance(p, bool) or not (0.0 < p <= 1.0):
            raise SamplingError(f"SamplingParams.top_p must be in (0, 1], got {p!r}")
        m = self.max_new_tokens
        if not isinstance(m, int) or isinstance(m, bool) or m < 1:
            raise SamplingError(f"SamplingParams.max_new_tokens must be an int >= 1, got {m!r}")
        if any(t < 0 for t in self.stop_token_ids):
            raise SamplingError(f"SamplingParams.stop_token_ids must be >= 0, got {self.stop_token_ids!r}")
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise SamplingError(f"SamplingParams.stop_strings must be non-empty strings, got {self.stop_strings!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise SamplingError(f"SamplingParams.seed must be an int or None, got {self.seed!r}")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise SamplingError(f"SamplingParams.seed must be in [{SEED_MIN}, {SEED_MAX}] (a signed 64-bit "
                                f"integer), got {self.seed}")
        return self

    @property
    def greedy(self) -> bool:
        """True when tokens are picked by argmax (temperature below GREEDY_TEMPERATURE_EPS, or top_k 1)."""
        return self.temperature < GREEDY_TEMPERATURE_EPS or self.top_k == 1

    def warp_key(self) -> Tuple[float, int, float]:
        """The fields that determine the warped distribution."""
        return (float(self.temperature), int(self.top_k), float(self.top_p))


def warp_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature / top-k / top-p warp of logits [..., V] into fp32 probabilities (one-hot argmax if greedy)."""
    x = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(x.argmax(-1), x.shape[-1]).to(torch.float32)
    x = x / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        srt, idx = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(srt, dim=-1)
        before = probs.cumsum(-1) - probs  # mass strictly before each token
        drop = before >= params.top_p
        drop[..., 0] = False
        x = x.masked_fill(torch.zeros_like(drop).scatter(-1, idx, drop), float("-inf"))
    return torch.softmax(x, dim=-1)


def warp_rows(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Warp logits [b, ..., V] row by row with per-row params (rows sharing params are warped together)."""
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    groups: dict = {}
    for i, p in enumerate(params):
        groups.setdefault(p.warp_key(), (p, []))[1].append(i)
    for p, rows in groups.values():
        idx = torch.tensor(rows, device=logits.device)
        out[idx] = warp_logits(logits[idx], p)
    return out


def sample_from(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sample from probs [..., V] with uniforms u [...] in [0, 1); zero-probability tokens are never picked."""
    cdf = probs.float().cumsum(-1)
    target = (u.to(cdf.device, torch.float32) * cdf[..., -1])[..., None]
    idx = torch.searchsorted(cdf.contiguous(), target.contiguous(), right=True)[..., 0]
    return idx.clamp(max=probs.shape[-1] - 1)


def _same_on_tp_ranks(seeds: List[int]) -> List[int]:
    """Broadcast seeds from the first rank of the tensor-parallel group so every rank samples the same tokens."""
    from nemo_spec import parallel

    if parallel.tp_size() <= 1 or not seeds:
        return seeds
    import torch.distributed as dist
    from megatron.core import parallel_state

    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor(seeds, dtype=torch.long, device=dev)
    dist.broadcast(t, src=parallel_state.get_tensor_model_parallel_src_rank(),
                   group=parallel_state.get_tensor_model_parallel_group())
    return [int(x) for x in t.tolist()]


class RowRNG:
    """One seeded torch.Generator per batch row; hands out uniforms [b, n]."""

    def __init__(self, seeds: Sequence[Optional[int]]) -> None:
        resolved = [int(s) if s is not None else int(torch.randint(0, 2**62, (1,)).item()) for s in seeds]
        resolved = _same_on_tp_ranks(resolved)
        self.gens: List[torch.Generator] = []
        for s in resolved:
            g = torch.Generator(device="cpu")
            g.manual_seed(s)
            self.gens.append(g)

    def uniform(self, n: int, rows: Optional[Sequence[int]] = None) -> torch.Tensor:
        """Uniforms [len(rows), n] (CPU), each row from its own generator."""
        rows = range(len(self.gens)) if rows is None else rows
        if not len(rows):
            return torch.empty(0, n)
        return torch.stack([torch.rand(n, generator=self.gens[r]) for r in rows])


def sample(probs: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Sample token ids from probs [..., V] with an (optionally seeded) generator."""
    u = torch.rand(probs.shape[:-1], generator=generator)
    return sample_from(probs, u.to(probs.device))


# --- lossless accept/reject -------------------------------------------------------------------

def accept_test(p_x: float, q_x: float, u: float) -> bool:
    """Leviathan/Chen test: accept a draft token with probability min(1, p(x)/q(x))."""
    return q_x > 0 and u * q_x < p_x


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)): the distribution to resample from after a rejection."""
    r = (p - q).clamp(min=0)
    s = r.sum()
    return r / s if float(s) > 0 else p


def chain_accept(p: torch.Tensor, draft: Sequence[int], q: Optional[torch.Tensor], u: Sequence[float]) -> Tuple[int, int]:
    """Verify a draft chain: p [g+1, V] target dists, q [g, V] draft dists (None = deterministic draft).

    Returns (number of accepted drafts m, next token) where the next token is the resample after the
    first rejection or the bonus token from p[g] when all g drafts are accepted. Needs g+1 uniforms.
    """
    children = [[i + 1] if i < len(draft) else [] for i in range(len(draft) + 1)]
    qs = None if q is None else [q[i] for i in range(len(draft))] + [None]
    path, tok = tree_accept(p, [0] + list(draft), children, qs, iter(u))
    return len(path), tok


def tree_accept(p: torch.Tensor, tokens: Sequence[int], children: Sequence[Sequence[int]],
                q: Optional[Sequence[Optional[torch.Tensor]]], u: Iterator[float]) -> Tuple[List[int], int]:
    """Recursive rejection over a token tree; returns (accepted node indices excluding the root, next token).

    p [n, V]: target distribution at each node (node 0 = root); tokens[i]: token of node i;
    children[i]: child node indices of i, tried in order; q[i]: the distribution the children of node i
    were drawn from (i.i.d.), or None for deterministic candidates (one-hot q). ``u`` yields uniforms.
    """
    node, path = 0, []
    while True:
        dist = p[node]
        qd = None if q is None else q[node]
        nxt = None
        for c in children[node]:
            x = int(tokens[c])
            q_x = float(qd[x]) if qd is not None else 1.0
            if accept_test(float(dist[x]), q_x, next(u)):
                nxt = c
                break
            if qd is not None:
                dist = residual(dist, qd)
            else:
                dist = residual(dist, torch.nn.functional.one_hot(torch.tensor(x), dist.shape[-1]).to(dist))
        if nxt is None:
            return path, int(sample_from(dist, torch.tensor(next(u))))
        path.append(nxt)
        node = nxt


def greedy_tree_accept(argmax: Sequence[int], tokens: Sequence[int], children: Sequence[Sequence[int]]) -> Tuple[List[int], int]:
    """Greedy matching: follow the child whose token equals the target argmax; returns (path, next token)."""
    node, path = 0, []
    while True:
        want = int(argmax[node])
        nxt = next((c for c in children[node] if int(tokens[c]) == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)
        node = nxt

