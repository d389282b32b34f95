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

import numbers
from dataclasses import dataclass, field
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import torch

from nemo_spec import parallel


class SamplingError(ValueError):
    """An invalid sampling/generation parameter; the message names the field and the value."""


#: temperatures below this sample greedily (as vLLM's _SAMPLING_EPS): dividing logits by e.g. 1e-40 overflows
#: to inf/NaN probabilities
GREEDY_TEMPERATURE_EPS = 1e-5
#: seeds must fit a signed 64-bit integer (torch.Generator.manual_seed and the TP broadcast as torch.long)
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


def token_id_list(ids: Any, what: str) -> List[int]:
    """``ids`` (a sequence of ints: Python or numpy integers, not bools or floats) as a list of Python ints; a
    SamplingError names ``what`` otherwise (a float id was truncated before, an int raised a TypeError)."""
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise SamplingError(f"{what} must be a list of token ids, got {ids!r}")
    out = list(ids)
    bad = [t for t in out if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
    if bad:
        raise SamplingError(f"{what} must hold integer token ids, got {bad[0]!r}")
    return [int(t) for t in out]


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
        stops = () if self.stop_token_ids is None else self.stop_token_ids
        object.__setattr__(self, "stop_token_ids", tuple(token_id_list(stops, "SamplingParams.stop_token_ids")))
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


# prompt tokens decoded ahead of the generated ones, so that generated text reads as the prompt's continuation: a
# decoder that strips a text's leading space (SentencePiece's Metaspace) drops the space between prompt and output
# when the output is decoded alone. vLLM primes its detokenizer with the prompt (v1/engine/detokenizer.py
# FastIncrementalDetokenizer), transformers' text-generation pipeline cuts decode(prompt + output) after the prompt.
TEXT_CONTEXT_TOKENS = 6


def decode_text(tokenizer: Any, ids: Sequence[int]) -> str:
    """Generated text as the server returns it: special tokens skipped (vLLM's and transformers' pipeline default),
    no clean-up of spaces (so that a longer output's text extends a shorter one's)."""
    from tokenizers import Tokenizer

    if isinstance(tokenizer, Tokenizer):  # the tokenizers library's own (cleans up no spaces)
        return tokenizer.decode(list(ids), skip_special_tokens=True)
    return tokenizer.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)


def text_context(tokenizer: Any, prompt: Sequence[int]) -> Tuple[List[int], List[int]]:
    """The prompt's last tokens to decode ahead of the output, split in two: the context proper, and the tokens at its
    end that leave a character unfinished (a prompt of token ids cut inside a multi-byte character), which belong to
    the output's text (their character is completed there)."""
    ctx = [int(t) for t in prompt[max(0, len(prompt) - TEXT_CONTEXT_TOKENS):]]
    cut = len(ctx)
    while cut > 0 and decode_text(tokenizer, ctx[:cut]).endswith("\ufffd"):
        cut -= 1
    return ctx[:cut], ctx[cut:]


def continuation_text(tokenizer: Any, prompt: Sequence[int], out: Sequence[int]) -> str:
    """Text of ``out`` as the continuation of ``prompt`` (decoded after its last :data:`TEXT_CONTEXT_TOKENS` tokens),
    as the server streams it."""
    ctx, carried = text_context(tokenizer, prompt)
    head = decode_text(tokenizer, ctx)
    full = decode_text(tokenizer, ctx + carried + [int(t) for t in out])
    return full[len(head):] if full.startswith(head) else decode_text(tokenizer, carried + [int(t) for t in out])


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
    if len(groups) == 1:  # one set of parameters: no gather/scatter
        p = next(iter(groups.values()))[0]
        return warp_logits(logits, p)
    from nemo_spec.inference.transfer import tensor

    for p, rows in groups.values():
        idx = tensor(rows, logits.device)
        out[idx] = warp_logits(logits[idx], p)
    return out


def sample_from(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sample from probs [..., V] with uniforms u [...] in [0, 1); zero-probability tokens are never picked."""
    cdf = probs.float().cumsum(-1)
    target = (u.to(cdf.device, torch.float32) * cdf[..., -1])[..., None]
    idx = torch.searchsorted(cdf.contiguous(), target.contiguous(), right=True)[..., 0]
    return idx.clamp(max=probs.shape[-1] - 1)


def row_generators(seeds: Sequence[Optional[int]]) -> List[torch.Generator]:
    """One seeded CPU generator per seed (None: a random seed, the same on every rank of the generation)."""
    resolved = [int(s) if s is not None else int(torch.randint(0, 2**62, (1,)).item()) for s in seeds]
    resolved = parallel.same_on_generation_ranks(resolved)
    gens: List[torch.Generator] = []
    for s in resolved:
        g = torch.Generator(device="cpu")
        g.manual_seed(s)
        gens.append(g)
    return gens


class RowRNG:
    """One seeded torch.Generator per batch row; hands out uniforms [b, n]."""

    def __init__(self, seeds: Sequence[Optional[int]] = (), gens: Optional[List[torch.Generator]] = None) -> None:
        self.gens: List[torch.Generator] = list(gens) if gens is not None else row_generators(seeds)

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



# --- vectorised acceptance (all rows at once, on the device) ----------------------------------------------

def accept_rows(p_x: torch.Tensor, q_x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """:func:`accept_test` for many candidates at once (bool tensor)."""
    return (q_x > 0) & (u * q_x < p_x)


def residual_rows(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """:func:`residual` row-wise: norm(max(0, p - q)) over the last dim, p where that is all zero."""
    r = (p - q).clamp(min=0)
    s = r.sum(-1, keepdim=True)
    return torch.where(s > 0, r / torch.where(s > 0, s, torch.ones_like(s)), p)


def children_table(parents: torch.Tensor, valid: torch.Tensor, max_children: int) -> torch.Tensor:
    """kids [b, N, K]: block indices of each node's children in order (-1 padded), from parents [b, N] (-1 = root)."""
    b, N = parents.shape
    dev = parents.device
    K = max(int(max_children), 1)
    has = valid & (parents >= 0)
    earlier = torch.ones(N, N, dtype=torch.bool, device=dev).tril(-1)  # [i, j]: j < i
    same = (parents[:, :, None] == parents[:, None, :]) & has[:, None, :] & earlier[None]
    rank = same.sum(-1)  # position of node i among its parent's children
    ok = has & (rank < K)
    node = torch.arange(N, device=dev)[None].expand(b, N)
    spare = N * K  # one spare cell takes every write of a non-child
    flat = torch.where(ok, parents.clamp(min=0) * K + rank, torch.full_like(rank, spare))
    out = torch.full((b, N * K + 1), -1, dtype=torch.long, device=dev)
    out.scatter_(1, flat, torch.where(ok, node, torch.full_like(node, -1)))
    return out[:, :spare].view(b, N, K)


def tree_accept_rows(tokens: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor, max_depth: int,
                     max_children: int, argmax: Optional[torch.Tensor] = None, p: Optional[torch.Tensor] = None,
                     q: Optional[torch.Tensor] = None, u: Optional[torch.Tensor] = None,
                     sampled: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy matching and recursive rejection over a verification block for every row at once, on the device.

    tokens/parents/valid [b, N] describe blocks ``[root, nodes]`` (parents as block indices, root -1);
    ``max_depth`` / ``max_children`` bound the trees (host values: the loop runs that often, no sync).
    Greedy rows follow the child equal to ``argmax`` [b, N]; rows where ``sampled`` [b] is True apply the lossless
    rule of :func:`tree_accept` with target distributions ``p`` [b, N, V], draft distributions ``q`` [b, N, V]
    (None: deterministic candidates) and uniforms ``u`` [b, >= N], consumed in the same order as the per-row code.
    Returns (accepted count m [b], accepted path [b, max_depth + 1] of block indices, root first, 0 past m,
    next token [b]).
    """
    b, N = tokens.shape
    dev = tokens.device
    rows = torch.arange(b, device=dev)
    kids = children_table(parents, valid, max_children)
    node = torch.zeros(b, dtype=torch.long, device=dev)
    m = torch.zeros(b, dtype=torch.long, device=dev)
    path = torch.zeros(b, max_depth + 1, dtype=torch.long, device=dev)
    any_sampled = sampled is not None and p is not None
    if any_sampled:
        dist = p[:, 0].float()
        ui = torch.zeros(b, dtype=torch.long, device=dev)
        stopped = torch.zeros(b, dtype=torch.bool, device=dev)
        final = dist
        final_ui = ui
        V = dist.shape[-1]
    greedy_rows = None if sampled is None else ~sampled
    live = torch.ones(b, dtype=torch.bool, device=dev)
    for d in range(max_depth):
        chosen = torch.full((b,), -1, dtype=torch.long, device=dev)
        want = argmax[rows, node] if argmax is not None else None
        qd = q[rows, node].float() if (any_sampled and q is not None) else None
        for k in range(max(int(max_children), 1)):
            c = kids[rows, node, k]
            has = (c >= 0) & live & (chosen < 0)
            cc = c.clamp(min=0)
            x = tokens[rows, cc]
            acc = torch.zeros(b, dtype=torch.bool, device=dev)
            if want is not None:
                g = has & (x == want)
                acc = g if greedy_rows is None else (g & greedy_rows)
            if any_sampled:
                hs = has & sampled
                p_x = dist[rows, x]
                qrow = qd if qd is not None else torch.nn.functional.one_hot(x, V).to(dist.dtype)
                q_x = qrow[rows, x]
                u_k = u[rows, ui.clamp(max=u.shape[1] - 1)].to(dist.dtype)
                a_s = hs & accept_rows(p_x, q_x, u_k)
                rej = hs & ~a_s
                ui = ui + hs.long()
                dist = torch.where(rej[:, None], residual_rows(dist, qrow), dist)
                acc = acc | a_s
            chosen = torch.where(acc, c, chosen)
        moved = chosen >= 0
        if any_sampled:
            stop_now = live & ~moved & sampled
            final = torch.where(stop_now[:, None], dist, final)
            final_ui = torch.where(stop_now, ui, final_ui)
            stopped = stopped | stop_now
        live = live & moved
        node = torch.where(moved, chosen, node)
        m = m + moved.long()
        path[:, d + 1] = torch.where(moved, chosen, torch.zeros_like(chosen))
        if any_sampled:
            dist = torch.where(moved[:, None], p[rows, node].float(), dist)
    nxt = argmax[rows, node] if argmax is not None else torch.zeros(b, dtype=torch.long, device=dev)
    if any_sampled:
        final = torch.where(stopped[:, None], final, dist)
        final_ui = torch.where(stopped, final_ui, ui)
        s_tok = sample_from(final, u[rows, final_ui.clamp(max=u.shape[1] - 1)])
        nxt = torch.where(sampled, s_tok, nxt)
    return m, path, nxt
