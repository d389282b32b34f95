"""DFlash block drafter: a few Qwen3-style layers that draft a whole block in ONE forward, with the base's hidden
states injected into every layer's keys/values.

References (read, not copied): z-lab/dflash ``dflash/model.py`` (the HF reference model and generation loop),
SpecForge ``specforge/modeling/draft/dflash.py`` + ``specforge/algorithms/common/dflash_family_model.py``
(training), SGLang 0.5.23 ``srt/models/dflash.py`` and vLLM 0.33.0 ``model_executor/models/qwen3_dflash.py`` /
``v1/spec_decode/dflash.py`` (serving). Line numbers below are of those files.

Model (z-lab model.py:185-347)::

    ctx    = hidden_norm(fc(cat(base hidden after layer i for i in target_layer_ids)))    [S, h]   (once)
    x      = embed(block) with block = [last token, MASK x (B - 1)]                      [B, h]
    layer: a = input_layernorm(x)
           q = q_norm(W_q a)                 keys   = k_norm(W_k [ctx ; a]),  values = W_v [ctx ; a]
           x = x + W_o attn(q, keys, values)  (RoPE at the context / block positions; not causal)
           x = x + mlp(post_attention_layernorm(x))
    out    = norm(x); logits = the base's frozen LM head (embedding and LM head are the base's)

The context goes through each layer's k/v projections and k_norm only: no input norm and no MLP for it
(z-lab model.py:226-232, SGLang dflash.py ``kv_proj_only`` + ``prepare_context_hidden_for_kv`` returning the
context unchanged, vLLM qwen3_dflash.py:581-619).

Layers are megatron TransformerLayers built from a ModuleSpec (:func:`dflash_layer_spec`): the base's dense
spec with per-head q/k RMSNorm, :class:`DFlashSelfAttention` (a megatron SelfAttention that also projects the
injected context through its own ``linear_qkv`` / ``k_layernorm``) and :class:`DFlashCoreAttention` (keys and
values = [context ; block], queries = the block). The context rides in the :class:`DFlashContext` passed as the
layer's ``attention_mask``, like every other attention context of the project.

Training (:func:`dflash_losses`, SpecForge dflash_family_model.py:179-461): random anchors on positions p with
``loss_mask[p]`` and ``loss_mask[p + 1]``; block n is [x_p, MASK...] at positions p .. p + B - 1, attends to the
context positions < p (strictly: the base hidden state at p is not known when x_p is the bonus token) and
bidirectionally to its own block; slot k >= 1 predicts the token at p + k with cross-entropy weighted
exp(-(k-1)/gamma), against a label chosen by ``spec.dflash_targets`` (the reference's x_{p+k}, or the base's own
tokens: see :func:`dflash_losses`). The attention runs in chunks of blocks (context prefix + block-diagonal), never
as one [N*B, S + N*B] mask.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.torch_norm import WrappedTorchNorm

from nemo_spec import parallel
from nemo_spec._mcore import ensure_metadata
from nemo_spec.config import ModelConfig, SpeculativeConfig
from nemo_spec.models import fastpath
from nemo_spec.models.attention import AttnContext, SDPACoreAttention, apply_rope, expand_kv_for_backward
from nemo_spec.models.gpt import cast_params, gather_vocab, output_logits, word_embeddings
from nemo_spec.models.spec import layer_spec, transformer_config

log = logging.getLogger(__name__)

#: queries x keys elements of one chunk of training blocks (bounds the attention temporaries)
DFLASH_CHUNK_ELEMENTS = 1 << 22


def dflash_layer_model_config(model_config: ModelConfig) -> ModelConfig:
    """The Qwen3-style layer config of DFlash draft layers at the base's width and attention shape: RMSNorm,
    SwiGLU, RoPE (the base's theta/scaling), per-head q/k RMSNorm, no biases, dense, no window (what
    ``DFlashDraftModel`` = Qwen3 layers holds; z-lab model.py:185-299)."""
    return dataclasses.replace(model_config.draft_config(), qk_layernorm=True, normalization="RMSNorm",
                               activation="swiglu", position_embedding="rope", add_bias_linear=False,
                               add_qkv_bias=False, family="llama")


@dataclass
class DFlashContext(AttnContext):
    """Attention context of a DFlash forward (passed as each layer's ``attention_mask``).

    ``position_ids`` [b, q] are the block (query) positions. ``target`` [S, b, h]: the fused context features to
    inject (hidden_norm(fc(...))), at positions ``ctx_position_ids`` [b, S]. Each layer's attention stores its
    context keys/values in ``kv`` (by layer number) before its core attention runs.

    Training (``anchors`` [b, N], ``block_valid`` [b, N], ``block_size`` B): q = N blocks of B; block n attends to
    context keys at index < anchors[b, n] and to its own block. Generation (``cache``): the S context entries
    (``ctx_valid`` [b, S] says which are real) are appended to each row's cached context at slots
    ``lengths .. lengths + S``; the block attends to the row's cached + new context and to itself; the caller
    commits the valid new context (``lengths += counts``) after the forward.
    """

    target: Optional[torch.Tensor] = None
    ctx_position_ids: Optional[torch.Tensor] = None
    ctx_valid: Optional[torch.Tensor] = None
    anchors: Optional[torch.Tensor] = None
    block_valid: Optional[torch.Tensor] = None
    block_size: int = 0
    kv: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False, compare=False)


class DFlashSelfAttention(SelfAttention):
    """megatron SelfAttention over the block that first projects the injected context to keys/values with the
    same ``linear_qkv`` and ``k_layernorm`` (KV injection; its queries are not used)."""

    def forward(self, hidden_states: torch.Tensor, attention_mask: Any, *args: Any, **kwargs: Any):
        """Context K/V into ``attention_mask.kv``, then the usual attention over the block."""
        ctx = attention_mask
        if isinstance(ctx, DFlashContext) and ctx.target is not None and ctx.target.shape[0] > 0:
            qkv = self.get_query_key_value_tensors(ctx.target)
            ctx.kv[self.layer_number] = (qkv[1], qkv[2])  # [S, b, g, d]
        return super().forward(hidden_states, attention_mask, *args, **kwargs)


class DFlashCoreAttention(SDPACoreAttention):
    """Core attention with keys/values = [injected context ; block], queries = the block, not causal."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None) -> torch.Tensor:
        ctx = attention_mask
        if not isinstance(ctx, DFlashContext):
            raise TypeError("DFlash draft layers need a DFlashContext as attention_mask")
        sq, b = query.shape[0], query.shape[1]
        q = query.permute(1, 2, 0, 3)  # [b, h, q, d]
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)
        cs = ctx.rope(self.inv_freq, getattr(self, "rope_key", None))
        q = apply_rope(q, ctx.position_ids, self.inv_freq, cs)
        k = apply_rope(k, ctx.position_ids, self.inv_freq, cs)
        kc = vc = None
        if self.layer_number in ctx.kv:
            kc, vc = (t.permute(1, 2, 0, 3) for t in ctx.kv[self.layer_number])  # [b, g, S, d]
            key_c = ("ctx_rope",) + tuple(getattr(self, "rope_key", (id(self.inv_freq),)))
            ccs = ctx.rope_cache.get(key_c)
            if ccs is None:
                from nemo_spec.models.attention import rope_cos_sin

                ccs = ctx.rope_cache[key_c] = rope_cos_sin(ctx.ctx_position_ids, self.inv_freq)
            kc = apply_rope(kc, ctx.ctx_position_ids, self.inv_freq, ccs)
        if ctx.anchors is not None:
            out = _training_attention(q, k, v, kc, vc, ctx.anchors, ctx.block_valid, ctx.block_size, self.scale)
        elif ctx.cache is not None:
            out = self._cached_attention(ctx, q, k, v, kc, vc)
        else:  # one block per row over all of the given context
            mask = None
            if kc is not None:
                k, v = torch.cat([kc.to(k.dtype), k], 2), torch.cat([vc.to(v.dtype), v], 2)
                if ctx.ctx_valid is not None:
                    mask = torch.cat([ctx.ctx_valid, torch.ones(b, sq, dtype=torch.bool, device=q.device)], 1)
                    mask = mask[:, None, None, :]
            k, v, gqa = expand_kv_for_backward(q, k, v)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=gqa)
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.heads * self.head_dim)

    def _cached_attention(self, ctx: DFlashContext, q, k, v, kc, vc) -> torch.Tensor:
        """Generation: append the new context (rope'd keys) to the row's cached context, attend over it + block."""
        cache, layer = ctx.cache, self.layer_number - 1
        b = q.shape[0]
        dev = q.device
        lengths = cache.lengths[:b]
        S = 0 if kc is None else kc.shape[2]
        if S:
            slots = (lengths[:, None] + torch.arange(S, device=dev)[None]).clamp(max=cache.max_len - 1)
            cache.write(layer, slots, kc.transpose(1, 2), vc.transpose(1, 2))
        kv = ctx.kv_len  # slots [0, kv) may hold context: the largest committed length + S
        kcache = cache.k[layer, :b, :kv].transpose(1, 2).to(q.dtype)
        vcache = cache.v[layer, :b, :kv].transpose(1, 2).to(q.dtype)
        j = torch.arange(kv, device=dev)[None]
        n_new = ctx.ctx_valid.sum(1) if ctx.ctx_valid is not None else torch.zeros_like(lengths)
        visible = (j >= cache.starts[:b, None]) & (j < (lengths + n_new)[:, None])
        mask = torch.cat([visible, torch.ones(b, q.shape[2], dtype=torch.bool, device=dev)], 1)[:, None, None, :]
        keys, vals = torch.cat([kcache, k], 2), torch.cat([vcache, v], 2)
        keys, vals, gqa = expand_kv_for_backward(q, keys, vals)
        return F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, scale=self.scale, enable_gqa=gqa)


def _training_attention(q, k, v, kc, vc, anchors, valid, B: int, scale: float) -> torch.Tensor:
    """Blocks of B queries: block n sees context keys at index < anchors[:, n] and its own block (bidirectional).

    q/k/v [b, h|g, N*B, d], kc/vc [b, g, S, d] or None. Runs over chunks of blocks, each with keys
    [context ; the chunk's blocks] and a [nB, S + nB] mask, so no [N*B, S + N*B] mask exists.
    """
    b, heads, nq, d = q.shape
    N = nq // B
    S = 0 if kc is None else kc.shape[2]
    dev = q.device
    per_block = B * (S + B) * heads * b
    n = max(1, min(N, DFLASH_CHUNK_ELEMENTS // max(1, per_block)))
    outs = []
    for c0 in range(0, N, n):
        c1 = min(N, c0 + n)
        m = c1 - c0
        qs = slice(c0 * B, c1 * B)
        blk_id = torch.arange(m * B, device=dev) // B  # [mB]
        own = blk_id[:, None] == blk_id[None, :]  # [mB, mB] block diagonal
        parts_k, parts_v, masks = [], [], []
        if S:
            anc = anchors[:, c0:c1].repeat_interleave(B, dim=1)  # [b, mB]
            ctx_ok = torch.arange(S, device=dev)[None, None, :] < anc[:, :, None]  # [b, mB, S]
            ctx_ok = ctx_ok & valid[:, c0:c1].repeat_interleave(B, dim=1)[:, :, None]
            parts_k.append(kc.to(k.dtype))
            parts_v.append(vc.to(v.dtype))
            masks.append(ctx_ok)
        parts_k.append(k[:, :, qs])
        parts_v.append(v[:, :, qs])
        masks.append(own[None].expand(b, m * B, m * B))
        keys, vals = torch.cat(parts_k, 2), torch.cat(parts_v, 2)
        mask = torch.cat(masks, 2)[:, None]
        keys, vals, gqa = expand_kv_for_backward(q, keys, vals)
        outs.append(F.scaled_dot_product_attention(q[:, :, qs], keys, vals, attn_mask=mask, scale=scale,
                                                   enable_gqa=gqa))
    return torch.cat(outs, 2)


def _project(layer: torch.nn.Module, x: torch.Tensor, fast: bool) -> Tuple[torch.Tensor, ...]:
    """(q, k, v) of a draft layer's ``linear_qkv`` (+ q/k norms) on x [S, b, h]: k/v [S, b, g, d] are what the
    context is injected as; on the fast path where the layer supports it (generation), else megatron's own."""
    if fast and fastpath.supported(layer):
        return fastpath.qkv(layer.self_attention, x)
    return tuple(layer.self_attention.get_query_key_value_tensors(x)[:3])


def dflash_layer_spec() -> ModuleSpec:
    """The project's dense layer spec with q/k RMSNorm, the KV-injection self attention and DFlash core attention."""
    spec = copy.deepcopy(layer_spec())
    attn = spec.submodules.self_attention
    attn.module = DFlashSelfAttention
    attn.submodules.core_attention = DFlashCoreAttention
    attn.submodules.q_layernorm = WrappedTorchNorm
    attn.submodules.k_layernorm = WrappedTorchNorm
    return spec


class DFlashDraft(MegatronModule):
    """DFlash draft: fc + hidden_norm over the base's target-layer features, N KV-injection layers, final norm;
    the base's embedding and LM head (frozen, not draft parameters)."""

    def __init__(self, model_config: ModelConfig, spec_config: SpeculativeConfig, base: torch.nn.Module) -> None:
        if spec_config.algorithm != "dflash":
            raise ValueError(f"DFlashDraft needs algorithm 'dflash', got {spec_config.algorithm!r}")
        p = next(base.parameters())
        tp = parallel.tp_size()
        self.layer_config = dflash_layer_model_config(model_config)
        tcfg = transformer_config(self.layer_config, tp, p.dtype, num_layers=spec_config.num_eagle_layers)
        super().__init__(config=tcfg)
        self.algorithm = "dflash"
        h = model_config.hidden_size
        self.hidden_size = h
        self.num_layers = spec_config.num_eagle_layers
        self.target_layer_ids = spec_config.resolved_target_layer_ids(model_config.num_layers)
        self.mask_token_id = spec_config.resolved_mask_token_id(model_config)
        self.block_size = spec_config.block_size
        self.fc = torch.nn.Linear(len(self.target_layer_ids) * h, h, bias=False, dtype=p.dtype)
        self.hidden_norm = WrappedTorchNorm(config=tcfg, hidden_size=h, eps=tcfg.layernorm_epsilon)
        spec = dflash_layer_spec()
        self.layers = torch.nn.ModuleList([build_module(spec, config=tcfg, layer_number=i + 1)
                                           for i in range(self.num_layers)])
        self.final_layernorm = WrappedTorchNorm(config=tcfg, hidden_size=h, eps=tcfg.layernorm_epsilon)
        self.draft_vocab_size = model_config.vocab_size
        cast_params(self, p.dtype)
        self.to(p.device)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Context features [..., len(ids) * h] -> hidden_norm(fc(features)) [..., h]."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def write_context(self, cache, fused: torch.Tensor, counts: torch.Tensor) -> None:
        """Inject context: the keys/values of fused features [b, n, h] (row r's first ``counts[r]`` are real) at
        positions ``cache.lengths ..`` into every layer's rows of ``cache`` (a draft KVCache or a view of one),
        then commit them (``lengths += counts``). The context passes only each layer's k/v projection and k_norm
        (what vLLM 0.33.0 ``precompute_and_store_context_kv`` does, qwen3_dflash.py:633-708)."""
        b, n = fused.shape[:2]
        if n == 0:
            return
        dev = fused.device
        pos = cache.lengths[:b, None] + torch.arange(n, device=dev)[None]  # draft cache slot == position
        slots = pos.clamp(max=cache.max_len - 1)
        x = fused.transpose(0, 1).to(self.fc.weight.dtype)
        fast = fastpath.active()
        for i, layer in enumerate(self.layers):
            attn = layer.self_attention
            _, k, v = _project(layer, x, fast)  # [n, b, g, d]
            core = attn.core_attention
            k = apply_rope(k.permute(1, 2, 0, 3), pos, core.inv_freq)  # [b, g, n, d]
            cache.write(i, slots, k.transpose(1, 2), v.transpose(0, 1))
        cache.lengths[:b] += counts.to(cache.lengths.dtype)

    def forward(self, base: torch.nn.Module, block_ids: torch.Tensor, ctx: DFlashContext, gather: bool = True,
                head: bool = True, head_rows: slice = slice(None)) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Block tokens [b, q] (context in ``ctx``) -> (normed draft hidden [b, q, h], logits [b, q', V] | None);
        ``head_rows`` selects the block positions q' the LM head runs on (drafting needs the mask slots only).

        Drafting (gradients off, not the training blocks) runs the layers on the fast path (models/fastpath.py):
        the same modules and math without megatron's per-call machinery, which cost more than the arithmetic of a
        few-token block on CPU."""
        fast = fastpath.active() and ctx.anchors is None and all(fastpath.supported(l) for l in self.layers)
        if fast and parallel.tp_size() == 1:
            x = F.embedding(block_ids.t(), base.embedding.word_embeddings.weight)
        else:
            x = word_embeddings(base, block_ids.t())  # [q, b, h], frozen base embedding
        inject = ctx.target is not None and ctx.target.shape[0] > 0
        for layer in self.layers:
            if fast:
                if inject:  # what DFlashSelfAttention.forward does before its attention
                    ctx.kv[layer.self_attention.layer_number] = _project(layer, ctx.target, True)[1:]
                x = fastpath.layer_forward(layer, x, ctx)
            else:
                x, _ = layer(hidden_states=x, attention_mask=ctx)
        x = fastpath.norm(self.final_layernorm, x) if fast else self.final_layernorm(x)
        logits = None
        if head:
            logits = output_logits(base, x[head_rows], fast=fast)
            if gather:
                logits = gather_vocab(logits)
            logits = logits.transpose(0, 1)
        return x.transpose(0, 1), logits

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """Distributed-checkpoint view: TP-sharded layers, replicated fc / norms."""
        from nemo_spec.speculative.eagle import draft_sharded_state_dict

        return draft_sharded_state_dict(self, prefix, sharded_offsets, ensure_metadata(metadata))


# ---- training ----------------------------------------------------------------------------------------------

def sample_anchors(loss_mask: torch.Tensor, num_anchors: int,
                   generator: Optional[torch.Generator] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(anchors [b, N], keep [b, N]): up to ``num_anchors`` random positions p per row with ``loss_mask[p]`` and
    ``loss_mask[p + 1]``, sorted, right-padded with 0 / False (SpecForge dflash_family_model.py:179-210)."""
    b, s = loss_mask.shape
    dev = loss_mask.device
    lm = loss_mask.bool()
    valid = lm[:, : s - 1] & lm[:, 1:]
    counts = valid.sum(1)
    width = min(num_anchors, int(counts.max()) if counts.numel() else 0)
    if width == 0:
        raise ValueError("DFlash training needs two consecutive loss-masked tokens in some row of the batch")
    r = torch.rand(valid.shape, generator=generator).to(dev)
    r = r.masked_fill(~valid, 2.0)
    cand = r.argsort(dim=1)[:, :width]
    keep = torch.arange(width, device=dev)[None] < counts.clamp(max=width)[:, None]
    sentinel = s
    anchors = torch.where(keep, cand, torch.full_like(cand, sentinel)).sort(dim=1).values
    keep = anchors < sentinel
    return torch.where(keep, anchors, torch.zeros_like(anchors)), keep


def base_argmax(model, hidden: torch.Tensor) -> torch.Tensor:
    """The base's argmax token [b, n] over the full vocabulary from its final hidden states [b, n, h], computed one
    row block of logits at a time: the logits never exist whole, also on a GPU, where a block holds at most 2^28
    logits (a 128k vocabulary over 32k tokens would be 8 GiB in bf16). Only the rows asked for are computed."""
    from nemo_spec.models.gpt import GPTOutput
    from nemo_spec.speculative.losses import _base_logit_rows, _row_block

    rows, n, v = _base_logit_rows(model, GPTOutput(logits=None, hidden=hidden))
    top = torch.empty(n, dtype=torch.long, device=hidden.device)
    step = min(_row_block(v, hidden.device), max(1, (1 << 28) // v))
    with torch.no_grad():
        for a in range(0, n, step):
            top[a:a + step] = rows(a, a + step).argmax(-1)
    return top.view(hidden.shape[1], hidden.shape[0]).t()  # the rows come in [n, b] order


def rollout_labels(model, input_ids: torch.Tensor, anchors: torch.Tensor, first: torch.Tensor,
                   steps: int, seq_kv: Optional[Dict[int, Tuple[torch.Tensor, torch.Tensor]]] = None) -> torch.Tensor:
    """The base's own greedy continuation of every anchor: labels [b, N, steps + 1] where [..., 0] is ``first``
    (its argmax after x_{<=p}) and [..., j] the argmax after x_{<=p}, y_1 .. y_j -- what greedy decoding from the
    anchor generates, which a block slot has to reproduce (it sees x_p and the context before it, never the
    data tokens after p).

    The sequence's keys/values come from ``seq_kv`` (the training base forward's, by layer: see
    ``AttnContext.capture_kv``; emptied here) when it holds every layer, else from a cached base forward over the
    sequence (offline training); then ``steps`` forwards of one token per anchor: all anchors
    of a row roll out side by side in the cache, each query seeing the sequence up to its anchor and its own
    rollout; their argmax is taken a row block of logits at a time. Refused under expert parallelism (the
    anchor counts differ between EP ranks; their token dispatch needs equal counts)."""
    from nemo_spec.models import gpt_forward, model_config, new_kv_cache

    gpt = model.gpt
    top_pos = model_config(gpt).max_position_embeddings - 1
    b, s = input_ids.shape
    if parallel.ep_size() > 1:
        raise ValueError("dflash_targets='rollout' is not supported with expert parallelism (ep_size > 1): the "
                         "rollout forwards' token counts differ between EP ranks; use dflash_targets='base'")
    if s > top_pos + 1:
        raise ValueError(f"dflash_targets='rollout': sequences of {s} tokens exceed the base's "
                         f"{top_pos + 1} positions")
    N = anchors.shape[1]
    dev = input_ids.device
    labels = [first]
    if steps <= 0:
        return torch.stack(labels, -1)
    cache = new_kv_cache(gpt, batch_size=b, max_len=s + steps * N)
    slot = torch.arange(s + steps * N, device=dev)
    pos = torch.arange(s, device=dev)[None].expand(b, s)
    with torch.no_grad():
        if seq_kv is not None and len(seq_kv) == cache.k.shape[0]:
            for i in sorted(seq_kv):  # [b, g, s, d] -> the cache's [b, s, g, d]; each layer's copy freed at once
                k, v = seq_kv.pop(i)
                cache.k[i, :, :s] = k.transpose(1, 2)
                cache.v[i, :, :s] = v.transpose(1, 2)
            cache.pos[:, :s] = pos  # the positions sliding-window layers mask by
        else:
            causal = (slot[None, :s, None] >= slot[None, None, :s]).expand(b, s, s)
            gpt_forward(gpt, input_ids, AttnContext(position_ids=pos, mask=causal, cache=cache, write_slots=pos,
                                                    kv_len=s), compute_logits=False)
        n = torch.arange(N, device=dev)
        for j in range(1, steps + 1):
            kv = s + j * N
            keys = slot[:kv]
            sees_seq = (keys[None, None, :] < s) & (keys[None, None, :] <= anchors[:, :, None])  # [b, N, kv]
            r = keys - s  # rollout slots: step r // N + 1, anchor r % N
            sees_own = (keys >= s)[None, None, :] & ((r % N)[None, None, :] == n[None, :, None])
            # positions past the base's last one only occur past the sequence end, where nothing is scored
            ctx = AttnContext(position_ids=(anchors + j).clamp(max=top_pos), mask=sees_seq | sees_own, cache=cache,
                              write_slots=(s + (j - 1) * N + n)[None].expand(b, N), kv_len=kv)
            out = gpt_forward(gpt, labels[-1], ctx, compute_logits=False)
            labels.append(base_argmax(model, out.hidden))
    return torch.stack(labels, -1)


def dflash_losses(model, input_ids: torch.Tensor, loss_mask: torch.Tensor, out, num_anchors: Optional[int] = None,
                  generator: Optional[torch.Generator] = None, return_logits: bool = False,
                  token_loss: bool = False,
                  seq_kv: Optional[Dict[int, Tuple[torch.Tensor, torch.Tensor]]] = None) -> Dict[str, object]:
    """DFlash loss: weighted CE of slot k >= 1 of every anchored block against its label, weight
    ``exp(-(k-1)/gamma) * loss_mask[p+k]``, normalised by the weights (SpecForge dflash_family_model.py:332-461).

    The label of slot k (``spec.dflash_targets``): ``"data"`` -- x_{p+k}, the reference's, which teaches the
    draft the data; ``"base"`` (default) -- the base's argmax at position p + k - 1 of the same forward, the
    token greedy decoding would take after x_{<=p+k-1}, which teaches it the base. They agree on data the base
    generated greedily; on other text (the recipe's plain-text data) only the base's labels teach what
    verification accepts (on the quickstart base: validation tau 3.1 against 1.7 after the same 229 s).

    ``seq_kv``: the base forward's keys/values by layer, which ``rollout`` labels continue (see
    :func:`rollout_labels`; None: they run the sequence through the base once more).

    Returns {"loss", "step_losses" / "step_acc" (per slot k = 1..B-1), "num_elements", (+ "token_loss" [b, s]
    by megatron label position p + k - 1, weighted, unnormalised)}.
    """
    sc = model.spec_config
    draft: DFlashDraft = model.eagle_module
    B = int(sc.block_size)
    gamma = sc.resolved_loss_decay_gamma()
    b, s = input_ids.shape
    dev = input_ids.device
    anchors, keep = sample_anchors(loss_mask, num_anchors or sc.num_anchors, generator)
    N = anchors.shape[1]
    rows = torch.arange(b, device=dev)[:, None]
    block = torch.full((b, N, B), draft.mask_token_id, dtype=torch.long, device=dev)
    block[:, :, 0] = torch.where(keep, input_ids[rows, anchors], block[:, :, 0])
    offs = torch.arange(B, device=dev)
    # labels first: a rollout's KV cache and forwards are done before the draft's autograd graph exists
    lab = anchors[:, :, None] + offs  # [b, N, B]
    in_seq = lab < s
    labc = lab.clamp(max=s - 1)
    if sc.dflash_targets == "base":  # the base's own next token after x_{<=p+k-1}
        target = base_argmax(model, out.hidden)[rows[:, :, None], (labc - 1).clamp(min=0)]
    elif sc.dflash_targets == "rollout":  # the base's greedy continuation of x_{<=p}: slot k = its k-th token
        first = base_argmax(model, out.hidden[rows, anchors])  # the anchors' rows only
        target = torch.cat([first[..., None], rollout_labels(model, input_ids, anchors, first, B - 2, seq_kv)], -1)
    else:
        target = input_ids[rows[:, :, None], labc]
    pos = (anchors[:, :, None] + offs).reshape(b, N * B)
    fused = model.fuse(model.base_features(out))  # [b, s, h]
    ctx = DFlashContext(position_ids=pos, target=fused.transpose(0, 1),
                        ctx_position_ids=torch.arange(s, device=dev)[None].expand(b, s),
                        anchors=anchors, block_valid=keep, block_size=B)
    hidden, _ = draft(model.gpt, block.reshape(b, N * B), ctx, head=False)
    decay = torch.exp(-(offs - 1).clamp(min=0).float() / gamma)
    w = keep[:, :, None].float() * in_seq.float() * (offs > 0).float()[None, None]
    w = w * loss_mask.float()[rows[:, :, None], labc]
    lw = w * decay[None, None]
    hid = hidden.reshape(b, N, B, -1)
    ce = torch.zeros(b, N, B, dtype=torch.float32, device=dev)
    pred = torch.zeros(b, N, B, dtype=torch.long, device=dev)
    step = max(1, (1 << 20) // max(1, B * draft.draft_vocab_size))  # blocks per LM-head chunk
    for n0 in range(0, N, step):
        h = hid[:, n0:n0 + step]
        logits = gather_vocab(output_logits(model.gpt, h.reshape(-1, 1, h.shape[-1])))[:, 0].float()
        t = target[:, n0:n0 + step].reshape(-1)
        ce[:, n0:n0 + step] = F.cross_entropy(logits, t, reduction="none").view(b, -1, B)
        pred[:, n0:n0 + step] = logits.argmax(-1).view(b, -1, B).detach()
    loss = (ce * lw).sum() / lw.sum().clamp(min=1e-12)
    step_losses, step_acc = [], []
    with torch.no_grad():
        correct = (pred == target).float()
        for k in range(1, B):
            m = w[:, :, k]
            den = m.sum().clamp(min=1.0)
            step_losses.append((ce[:, :, k].detach() * m).sum() / den)
            step_acc.append((correct[:, :, k] * m).sum() / den)
    res: Dict[str, object] = {"loss": loss, "step_losses": step_losses, "step_acc": step_acc,
                              "num_elements": int(keep.sum()) * (B - 1)}
    if token_loss:
        tok = torch.zeros(b, s, dtype=torch.float32, device=dev)
        tok.index_put_((rows[:, :, None].expand(b, N, B), (labc - 1).clamp(min=0)), (ce * lw).float(),
                       accumulate=True)
        res["token_loss"] = tok
    if return_logits:
        res.update(hidden=hidden, anchors=anchors, keep=keep)
    return res
