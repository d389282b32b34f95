"""Core attention on torch SDPA with explicit masks, explicit position ids (RoPE) and a KV cache.

megatron-core's ``SelfAttention`` projects q/k/v and calls ``core_attention(q, k, v, attention_mask, ...)``
with whatever object the caller passed as ``attention_mask``. We pass an :class:`AttnContext` that
carries explicit position ids, an arbitrary boolean mask (tree attention, padding) and, during
generation, a :class:`KVCache` plus the cache slots the new keys/values are written to.

Sliding-window layers (Mistral, Qwen2/Qwen3 ``layer_types``) restrict each query to keys whose *position* is
within the window (``q_pos - k_pos < window``, as transformers' ``sliding_window_overlay``). The cache records
the position of every slot, so the rule is exact in prefill, cached decode and tree verification (tree nodes sit
at slots past the committed length but carry their own positions), and after the accepted path is compacted.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.enums import AttnMaskType

from nemo_spec.config import rope_type


def rope_inv_freq(head_dim: int, theta: float, scaling: Optional[Dict[str, Any]] = None) -> torch.Tensor:
    """Inverse RoPE frequencies (fp32), with HF-compatible 'linear' and 'llama3' scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling:
        rtype = rope_type(scaling)
        factor = float(scaling.get("factor", 1.0))
        if rtype == "linear":
            inv_freq = inv_freq / factor
        elif rtype == "llama3":
            low = float(scaling.get("low_freq_factor", 1.0))
            high = float(scaling.get("high_freq_factor", 4.0))
            old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
            low_wl, high_wl = old_ctx / low, old_ctx / high
            wavelen = 2 * math.pi / inv_freq
            scaled = torch.where(wavelen > low_wl, inv_freq / factor, inv_freq)
            smooth = (old_ctx / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = (wavelen >= high_wl) & (wavelen <= low_wl)
            inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq.float()


def rope_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor) -> tuple:
    """cos/sin tables [b, 1, s, d] (fp32) for positions [b, s]."""
    freqs = position_ids.to(torch.float32)[..., None] * inv_freq.to(position_ids.device)[None, None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, position_ids: torch.Tensor, inv_freq: torch.Tensor,
               cos_sin: Optional[tuple] = None) -> torch.Tensor:
    """Rotate ``x`` [b, heads, s, d] by positions [b, s] (non-interleaved halves, as Llama)."""
    cos, sin = cos_sin if cos_sin is not None else rope_cos_sin(position_ids, inv_freq)
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rot = torch.cat((-x2, x1), dim=-1)
    return (xf * cos + rot * sin).to(x.dtype)


def rope_qk(q: torch.Tensor, k: torch.Tensor, cos_sin_signed: tuple) -> tuple:
    """q [b, h, s, d] and k [b, g, s, d] rotated in one pass: ``x * cos + roll(x, d/2) * [-sin, sin]`` equals
    :func:`apply_rope`'s ``x * cos + cat(-x2, x1) * sin`` exactly (a sign flip is exact), in 7 tensor ops for both
    instead of 12 — per layer of every decode step. ``cos_sin_signed``: :meth:`AttnContext.rope_signed`."""
    cos, sin_signed = cos_sin_signed
    h = q.shape[1]
    x = torch.cat([q, k], 1).float()
    y = (x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed).to(q.dtype)
    return y[:, :h], y[:, h:]


def expand_kv_for_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
    """(k, v, enable_gqa): on CPU with autograd recording, k/v [b, groups, s, d] repeated to q's heads and
    enable_gqa off. torch's CPU flash-attention backward is 10-40x slower with ``enable_gqa`` (measured, torch
    2.13, 3 heads / 1 group, 2048 tokens: 1.7 s vs 0.13 s; with a mask 4.8 s vs 0.1 s); the copy is linear in s."""
    heads, groups = q.shape[1], k.shape[1]
    if heads == groups:
        return k, v, False
    if q.device.type != "cpu" or not torch.is_grad_enabled() or not (q.requires_grad or k.requires_grad):
        return k, v, True
    rep = heads // groups
    b, _, s, d = k.shape
    return (k[:, :, None].expand(b, groups, rep, s, d).reshape(b, heads, s, d),
            v[:, :, None].expand(b, groups, rep, s, v.shape[-1]).reshape(b, heads, s, v.shape[-1]), False)


class KVCache:
    """Preallocated per-layer key/value cache, batch-aware, with per-row committed lengths.

    ``k``/``v`` are [layers, batch, max_len, local_kv_heads, head_dim]. Row ``b`` holds valid
    entries in slots ``[start[b], length[b])``; slots before ``start`` are left padding.
    """

    def __init__(self, num_layers: int, batch_size: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_layers, batch_size, max_len, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.starts = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.pos = torch.zeros(batch_size, max_len, dtype=torch.long, device=device)  # position held by each slot

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def matches(self, num_layers: int, batch_size: int, max_len: int, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether this cache can be reused for the given shape."""
        return (self.k.shape[0] == num_layers and self.batch_size == batch_size and self.max_len >= max_len
                and self.k.dtype == dtype and self.k.device == torch.device(device))

    def reset(self) -> None:
        """Forget all entries (buffers are kept)."""
        self.lengths.zero_()
        self.starts.zero_()

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              start: Optional[int] = None) -> None:
        """Store k/v [b, q, heads, d] at cache slots [b, q] of ``layer`` (``start``: one row, consecutive slots)."""
        if start is not None:
            q = k.shape[1]
            self.k[layer, 0, start:start + q] = k[0]
            self.v[layer, 0, start:start + q] = v[0]
            return
        rows = torch.arange(k.shape[0], device=k.device)[:, None].expand_as(slots)
        self.k[layer, rows, slots] = k.to(self.k.dtype)
        self.v[layer, rows, slots] = v.to(self.v.dtype)

    def write_positions(self, slots: torch.Tensor, positions: torch.Tensor, start: Optional[int] = None) -> None:
        """Record the positions [b, q] of the entries written at ``slots`` [b, q] (all layers share them)."""
        if start is not None:
            self.pos[0, start:start + positions.shape[1]] = positions[0]
            return
        rows = torch.arange(slots.shape[0], device=slots.device)[:, None].expand_as(slots)
        self.pos[rows, slots] = positions.to(self.pos.device)

    def keep(self, src_slots: torch.Tensor, num_kept: torch.Tensor) -> None:
        """Compact accepted entries: for each row copy ``src_slots[b, :num_kept[b]]`` to ``lengths[b]...``.

        Used after tree/chain verification so that only the accepted path stays in the cache. No host sync:
        positions past ``num_kept`` copy their own slot onto itself (the caller guarantees
        ``lengths + src_slots.shape[1] <= max_len``, as the verified block was written there).
        """
        b, n = src_slots.shape
        if n == 0:
            return
        dev = src_slots.device
        idx = torch.arange(n, device=dev)[None, :]
        valid = idx < num_kept[:, None]
        dst = (self.lengths[:, None] + idx).clamp(max=self.max_len - 1)
        rows = torch.arange(b, device=dev)[:, None].expand(b, n)
        src = torch.where(valid, src_slots, dst)
        self.k[:, rows, dst] = self.k[:, rows, src]
        self.v[:, rows, dst] = self.v[:, rows, src]
        self.pos[rows, dst] = self.pos[rows, src]
        self.lengths += num_kept

    def view(self, lo: int, hi: int) -> "KVCache":
        """Rows [lo, hi) as a cache sharing this one's storage (writes and length updates go through)."""
        c = KVCache.__new__(KVCache)
        c.k, c.v = self.k[:, lo:hi], self.v[:, lo:hi]
        c.lengths, c.starts = self.lengths[lo:hi], self.starts[lo:hi]
        c.pos = self.pos[lo:hi]
        return c

    def swap_rows(self, i: int, j: int, used: Optional[int] = None) -> None:
        """Exchange rows i and j (their first ``used`` slots, default all) with their lengths and starts."""
        if i == j:
            return
        u = self.max_len if used is None else min(int(used), self.max_len)
        for buf in (self.k, self.v):
            tmp = buf[:, i, :u].clone()
            buf[:, i, :u] = buf[:, j, :u]
            buf[:, j, :u] = tmp
        tmp = self.pos[i, :u].clone()  # the positions of the entries (sliding-window masks read them)
        self.pos[i, :u] = self.pos[j, :u]
        self.pos[j, :u] = tmp
        for t in (self.lengths, self.starts):
            tmp = t[i].clone()
            t[i] = t[j]
            t[j] = tmp

    def truncate(self, new_lengths: torch.Tensor) -> None:
        """Roll rows back to the given committed lengths."""
        self.lengths.copy_(torch.minimum(self.lengths, new_lengths))


@dataclass
class AttnContext:
    """What core attention needs beyond q/k/v: positions, mask, and optionally a KV cache.

    position_ids: [b, q] absolute positions of the q new tokens (RoPE).
    mask: optional bool [b, q, kv] (True = attend). Without a cache kv == q; with a cache kv == kv_len.
      None without a cache means plain causal attention.
    cache / write_slots / kv_len: generation mode — new k/v are written at ``write_slots`` [b, q]
      and queries attend over cache slots ``[0, kv_len)`` subject to ``mask``.
    """

    position_ids: torch.Tensor
    mask: Optional[torch.Tensor] = None
    cache: Optional[KVCache] = None
    write_slots: Optional[torch.Tensor] = None
    kv_len: int = 0
    rope_cache: Dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)  # per-forward memo
    #: host-side facts the caller knows (then no device read is needed): the mask allows everything
    #: (True/False), the write slots of a single row are consecutive from this slot (int, or -1: they are not)
    mask_all: Optional[bool] = None
    first_write: Optional[int] = None
    #: when a dict: every layer of nemo_spec's core attention records its rotated keys/values [b, g, kv, d] here
    #: by 0-based layer index (a training forward whose sequence a later cached pass continues: DFlash rollouts)
    capture_kv: Optional[Dict[int, Tuple[torch.Tensor, torch.Tensor]]] = field(default=None, repr=False,
                                                                               compare=False)

    def sdpa_mask(self) -> Optional[torch.Tensor]:
        """``mask`` as SDPA's [b, 1, q, kv]; None when it allows everything (a batch-1 decode step), which lets
        SDPA skip masking. Worked out once per forward and shared by all layers (from ``mask_all`` when the
        caller set it, else by reading the mask: a device sync)."""
        if "sdpa_mask" not in self.rope_cache:
            m = self.mask
            allows_all = self.mask_all if self.mask_all is not None else (m is None or bool(m.all()))
            self.rope_cache["sdpa_mask"] = None if m is None or allows_all else m[:, None]
        return self.rope_cache["sdpa_mask"]

    def write_start(self) -> Optional[int]:
        """First slot when there is one row and its write slots are consecutive (then a slice copy replaces
        the scatter); None otherwise. Worked out once per forward (from ``first_write`` when set, else by
        reading the slots: a device sync)."""
        if "write_start" not in self.rope_cache:
            w = self.write_slots
            start = None
            if w is not None and w.shape[0] == 1 and w.numel() > 0:
                if self.first_write is not None:
                    start = self.first_write if self.first_write >= 0 else None
                else:
                    first = int(w[0, 0])
                    if bool((w[0] == torch.arange(first, first + w.shape[1], device=w.device)).all()):
                        start = first
            self.rope_cache["write_start"] = start
        return self.rope_cache["write_start"]

    def window_mask(self, window: int, base: Optional[torch.Tensor]) -> torch.Tensor:
        """``base`` (SDPA mask [b, 1, q, kv] or None = all allowed) restricted to keys within ``window`` positions
        of each query; keys are the cache slots ``[0, kv_len)`` with a cache, else the queries themselves.
        Worked out once per forward and shared by every window layer."""
        key = ("window", window)
        if key not in self.rope_cache:
            q_pos = self.position_ids
            if self.cache is not None:
                if "positions_written" not in self.rope_cache:
                    self.cache.write_positions(self.write_slots, q_pos, self.write_start())
                    self.rope_cache["positions_written"] = True
                k_pos = self.cache.pos[:, : self.kv_len]
            else:
                k_pos = q_pos
            near = (q_pos[:, :, None] - k_pos[:, None, :]) < window
            self.rope_cache[key] = near[:, None] if base is None else base & near[:, None]
        return self.rope_cache[key]

    def rope_signed(self, inv_freq: torch.Tensor, key: Any = None) -> tuple:
        """(cos, [-sin, sin] halves) for :func:`rope_qk`, once per forward like :meth:`rope`."""
        key = ("rope", id(inv_freq)) if key is None else key
        cs = self.rope_cache.get(("signed", key))
        if cs is None:
            cos, sin = self.rope(inv_freq, key)
            half = sin.shape[-1] // 2
            cs = self.rope_cache[("signed", key)] = (cos, torch.cat([-sin[..., :half], sin[..., half:]], -1))
        return cs

    def rope(self, inv_freq: torch.Tensor, key: Any = None) -> tuple:
        """cos/sin for this context's positions, computed once per forward and shared by all layers with the
        same table ``key`` (host values identifying the frequencies; default: the tensor itself)."""
        key = ("rope", id(inv_freq)) if key is None else key
        cs = self.rope_cache.get(key)
        if cs is None:
            cs = self.rope_cache[key] = rope_cos_sin(self.position_ids, inv_freq)
        return cs


def sliding_window_mask(seq_len: int, window: int, device: torch.device) -> torch.Tensor:
    """[s, s] bool: key j within ``window`` positions of query i (i - j < window) for positions 0..s-1."""
    idx = torch.arange(seq_len, device=device)
    return (idx[:, None] - idx[None, :]) < window


class SDPACoreAttention(MegatronModule):
    """Drop-in for megatron's core attention: torch SDPA, GQA, explicit masks, RoPE by position id, KV cache."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType = AttnMaskType.causal,
                 attention_type: str = "self", attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, cp_comm_type: Optional[str] = None,
                 pg_collection: Any = None, **kwargs: Any) -> None:
        super().__init__(config=config)
        self.layer_number = layer_number  # 1-based within its block
        tp = config.tensor_model_parallel_size
        self.heads = config.num_attention_heads // tp
        self.groups = config.num_query_groups // tp
        self.head_dim = config.kv_channels
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.use_rope = getattr(config, "nemo_rope", False)
        layers = getattr(config, "nemo_window_layers", None) or ()
        self.window: Optional[int] = config.nemo_sliding_window if layer_number in layers else None
        if self.use_rope:
            inv = rope_inv_freq(self.head_dim, config.nemo_rope_theta, config.nemo_rope_scaling)
            self.register_buffer("inv_freq", inv, persistent=False)
            # layers with equal tables share one cos/sin per forward; a host key, so no device read per layer
            self.rope_key = ("rope", self.head_dim, float(config.nemo_rope_theta),
                             repr(sorted((config.nemo_rope_scaling or {}).items())))

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None) -> torch.Tensor:
        sq, b = query.shape[0], query.shape[1]
        q = query.permute(1, 2, 0, 3)  # [b, h, s, d]
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)
        ctx = attention_mask if isinstance(attention_mask, AttnContext) else None
        if self.use_rope:
            if ctx is not None and not torch.is_grad_enabled():  # generation: both rotations in one pass
                q, k = rope_qk(q, k, ctx.rope_signed(self.inv_freq, getattr(self, "rope_key", None)))
            else:
                if ctx is not None:
                    pos, cs = ctx.position_ids, ctx.rope(self.inv_freq, getattr(self, "rope_key", None))
                else:
                    pos = torch.arange(sq, device=q.device)[None].expand(b, sq)
                    cs = rope_cos_sin(pos, self.inv_freq)
                q = apply_rope(q, pos, self.inv_freq, cs)
                k = apply_rope(k, pos, self.inv_freq, cs)
        if ctx is not None and ctx.capture_kv is not None:  # copies: views would keep the whole q/k/v buffers
            ctx.capture_kv[self.layer_number - 1] = (k.clone(), v.clone())
        mask = None
        is_causal = False
        if ctx is not None and ctx.cache is not None:
            layer = self.layer_number - 1
            ctx.cache.write(layer, ctx.write_slots, k.transpose(1, 2), v.transpose(1, 2), ctx.write_start())
            k = ctx.cache.k[layer, :, : ctx.kv_len].transpose(1, 2).to(q.dtype)
            v = ctx.cache.v[layer, :, : ctx.kv_len].transpose(1, 2).to(q.dtype)
            mask = ctx.sdpa_mask()
            if self.window is not None:
                mask = ctx.window_mask(self.window, mask)
        elif ctx is not None and ctx.mask is not None:
            mask = ctx.mask[:, None]
            if self.window is not None:
                mask = ctx.window_mask(self.window, mask)
        elif isinstance(attention_mask, torch.Tensor):
            mask = ~attention_mask.bool()  # megatron convention: True = masked out
            if self.window is not None:
                mask = mask & sliding_window_mask(sq, self.window, q.device)
        elif self.window is not None:
            causal = torch.ones(sq, sq, dtype=torch.bool, device=q.device).tril()[None, None]
            mask = ctx.window_mask(self.window, causal) if ctx is not None else \
                causal & sliding_window_mask(sq, self.window, q.device)
        else:
            is_causal = True
        k, v, gqa = expand_kv_for_backward(q, k, v)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=self.scale,
                                             enable_gqa=gqa)
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.heads * self.head_dim)
