"""A lean inference forward through the same megatron-core modules (no autograd, fewer Python layers).

Decoding one token through megatron-core's ``TransformerLayer`` pays, per layer, for the module-hook
machinery, ``autograd.Function`` wrappers of the tensor-parallel linears (even under
``torch.inference_mode``), bias-dropout-add closures and inference-context checks. On a CPU with a small
model that Python overhead is a large share of a decode step. This module evaluates the *same modules
with the same parameters and the same math* directly:

    h = h + proj(core_attention(split_qkv(qkv(input_norm(h)))))     (+ TP all-reduce after proj)
    h = h + fc2(act(fc1(pre_mlp_norm(h))))                           (+ TP all-reduce after fc2)

and calls our own core attention (:class:`~nemo_spec.models.attention.SDPACoreAttention`: RoPE by
position id, explicit masks, KV cache) exactly as megatron's ``SelfAttention`` does. It is used only
when gradients are off (generation); training always goes through the modules' own ``forward``.
Per-head q/k norms (Qwen3 ``qk_layernorm``) are applied after the q/k/v split, before RoPE, as megatron's
``SelfAttention.get_query_key_value_tensors`` does. Layers it does not cover (MoE MLPs, clamped GLU, TP wider than
the KV groups, ...) fall back to the module forward, so results never depend on whether it applies. ``tests/test_models.py`` checks it against
the module forward for the Llama and GPT-2 families, with caches, masks and at TP=2.
"""
from __future__ import annotations

import os
import time
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from megatron.core.transformer.identity_op import IdentityOp

from nemo_spec import parallel

#: Set to False to run generation through the modules' own forward (for debugging / comparisons).
ENABLED = True


def active() -> bool:
    """Whether the fast path should be used now (enabled and gradients off)."""
    return ENABLED and not torch.is_grad_enabled()


def _tp_group() -> Any:
    from megatron.core import parallel_state as ps
    return ps.get_tensor_model_parallel_group()


#: How the fast path computes CPU products of up to 10 rows: "auto" (default) times both kernels once per weight
#: shape, row count, dtype and thread count on the weight itself and keeps the faster; "linear" always
#: ``F.linear``; "transposed" always ``(W @ x^T)^T``. Environment variable ``NEMO_SPEC_SMALL_GEMM``.
SMALL_GEMM = os.environ.get("NEMO_SPEC_SMALL_GEMM", "auto")
_SMALL_GEMM_CHOICE: Dict[Tuple[Any, ...], bool] = {}
_BY_WEIGHT: Dict[Tuple[int, int], bool] = {}


def _transposed(x2: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (weight @ x2.t()).t().contiguous()


def _time_kernels(weight: torch.Tensor, rows: int, rounds: int = 9, calls: int = 4, margin: float = 0.9) -> bool:
    """Whether ``(W @ x^T)^T`` beats ``F.linear`` for ``rows`` rows on ``weight`` by more than ``margin`` (median
    of alternating rounds; near-equal timings keep the standard kernel, so noise cannot pick the other)."""
    x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
    t = {True: [], False: []}
    for _ in range(2):  # warm both
        _transposed(x, weight)
        F.linear(x, weight)
    for _ in range(rounds):
        for tr in (True, False):
            s = time.perf_counter()
            for _ in range(calls):
                _transposed(x, weight) if tr else F.linear(x, weight)
            t[tr].append(time.perf_counter() - s)
    med = {k: sorted(v)[len(v) // 2] for k, v in t.items()}
    return med[True] < margin * med[False]


def transposed_faster(weight: torch.Tensor, rows: int) -> bool:
    """The small-row kernel choice for ``weight`` and ``rows`` on CPU (see :data:`SMALL_GEMM`): measured once per
    weight shape, row count, dtype and thread count, then looked up by the weight's identity (a reused id can only
    pick the slower of two kernels that compute the same product)."""
    if SMALL_GEMM == "linear":
        return False
    if SMALL_GEMM == "transposed":
        return True
    if SMALL_GEMM != "auto":
        raise ValueError(f"NEMO_SPEC_SMALL_GEMM must be auto, linear or transposed, got {SMALL_GEMM!r}")
    choice = _BY_WEIGHT.get((id(weight), rows))
    if choice is not None:
        return choice
    key = (tuple(weight.shape), rows, weight.dtype, torch.get_num_threads())
    choice = _SMALL_GEMM_CHOICE.get(key)
    if choice is None:
        with torch.no_grad():
            choice = _SMALL_GEMM_CHOICE[key] = _time_kernels(weight, rows)
    _BY_WEIGHT[(id(weight), rows)] = choice
    return choice


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear`` — except on CPU for up to 10 rows where ``(W @ x^T)^T`` measured faster.

    Decode steps, verification blocks and draft trees are a few tokens wide, and which CPU kernel is faster for
    such shapes depends on the machine: on one 2-core host the transposed product was up to ~1.5x faster
    in-model (small base, one thread: 1 row 9.4 vs 8.0 ms per forward); on another ``F.linear`` was 1.2-2x
    faster for 2-10 rows (the same base, 5-token verification forward 9.6 vs 8.3 ms). So the choice is measured
    once per weight shape and row count (:func:`transposed_faster`), at first use (a one-off pause of a few ms
    per shape). Same math; the summation order may differ in the last bits, as between any two GEMM kernels, so
    runs that must be bit-reproducible across processes set ``NEMO_SPEC_SMALL_GEMM=linear``.
    """
    if x.device.type == "cpu":
        rows = x.numel() // x.shape[-1]
        if rows <= 10 and transposed_faster(weight, rows):
            y = _transposed(x.reshape(rows, x.shape[-1]), weight).view(*x.shape[:-1], weight.shape[0])
            return y if bias is None else y + bias
    return F.linear(x, weight, bias)


def column(lin: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A ColumnParallelLinear (gather_output=False) with its bias added: local output shard."""
    return linear(x, lin.weight, lin.bias)


def row(lin: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A RowParallelLinear: local partial product, all-reduced over TP, then the (replicated) bias."""
    y = linear(x, lin.weight)
    if parallel.tp_size() > 1:
        torch.distributed.all_reduce(y, group=_tp_group())
    if lin.bias is not None:
        y = y + lin.bias
    return y


def norm(module: Optional[torch.nn.Module], x: torch.Tensor) -> torch.Tensor:
    """Apply a (torch) norm module without the module-call machinery; None and IdentityOp pass through."""
    if module is None or isinstance(module, IdentityOp):
        return x
    if type(module) is torch.nn.RMSNorm:  # what its forward calls, without the Python frame
        return F.rms_norm(x, module.normalized_shape, module.weight, module.eps)
    return module.forward(x)


def _plain_norm(module: Any) -> bool:
    """None, IdentityOp or a torch RMSNorm/LayerNorm (what :func:`norm` can apply)."""
    return module is None or isinstance(module, (IdentityOp, torch.nn.RMSNorm, torch.nn.LayerNorm))


def _supported_attention(attn: torch.nn.Module) -> bool:
    from nemo_spec.models.attention import SDPACoreAttention

    cfg = attn.config
    return (isinstance(attn.core_attention, SDPACoreAttention)
            and _plain_norm(getattr(attn, "q_layernorm", None))
            and _plain_norm(getattr(attn, "k_layernorm", None))
            and cfg.num_query_groups >= parallel.tp_size()
            and not getattr(attn.linear_qkv, "skip_bias_add", False)
            and getattr(attn.linear_proj, "skip_bias_add", True)
            and hasattr(attn.core_attention, "inv_freq") == bool(getattr(cfg, "nemo_rope", False)))


def _supported_mlp(mlp: torch.nn.Module) -> bool:
    cfg = mlp.config
    return (getattr(cfg, "activation_func_clamp_value", None) is None
            and float(getattr(cfg, "glu_linear_offset", 0.0) or 0.0) == 0.0
            and not getattr(cfg, "use_te_activation_func", False)
            and hasattr(mlp, "linear_fc1") and hasattr(mlp, "linear_fc2"))


def supported(layer: torch.nn.Module) -> bool:
    """Whether ``layer`` (a TransformerLayer or an EAGLE-3 first layer) can run on the fast path; cached on it."""
    ok = getattr(layer, "_nemo_fast_ok", None)
    if ok is None:
        try:
            ok = (_supported_attention(layer.self_attention) and _supported_mlp(layer.mlp)
                  and isinstance(getattr(layer, "pre_cross_attn_layernorm", IdentityOp()), IdentityOp))
        except AttributeError:
            ok = False
        layer._nemo_fast_ok = ok
    return ok


def self_attention(attn: torch.nn.Module, x: torch.Tensor, ctx: Any) -> torch.Tensor:
    """megatron SelfAttention on normed input [s, b, in]: qkv -> core attention -> proj (bias included)."""
    s, b = x.shape[0], x.shape[1]
    heads, groups = attn.num_attention_heads_per_partition, attn.num_query_groups_per_partition
    hd = attn.hidden_size_per_attention_head
    per = heads // groups
    qkv = column(attn.linear_qkv, x).view(s, b, groups, (per + 2) * hd)
    q, k, v = torch.split(qkv, [per * hd, hd, hd], dim=3)
    q = norm(getattr(attn, "q_layernorm", None), q.reshape(s, b, heads, hd))
    k = norm(getattr(attn, "k_layernorm", None), k)
    out = attn.core_attention.forward(q, k, v, ctx)
    return row(attn.linear_proj, out)


def mlp(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """megatron MLP on normed input [s, b, h] (gated or not), fc2 bias included."""
    y = column(m.linear_fc1, x)
    act = m.config.activation_func
    if m.config.gated_linear_unit:
        g, u = torch.chunk(y, 2, dim=-1)
        y = act(g) * u
    else:
        y = act(y)
    return row(m.linear_fc2, y)


def layer_forward(layer: torch.nn.Module, h: torch.Tensor, ctx: Any) -> torch.Tensor:
    """One TransformerLayer on [s, b, h]; falls back to the module forward when not supported."""
    if not supported(layer):
        from nemo_spec.models.attention import SDPACoreAttention

        if not isinstance(getattr(layer.self_attention, "core_attention", None), SDPACoreAttention):
            raise TypeError(f"{type(layer.self_attention.core_attention).__name__} is not nemo_spec's core "
                            "attention: it cannot take an AttnContext (see nemo_spec.models.foreign)")
        out, _ = layer(hidden_states=h, attention_mask=ctx)
        return out
    if "_nemo_compile" in layer.__dict__:  # opt-in torch.compile of the dense halves (models/compiled.py)
        from nemo_spec.models import compiled

        out = compiled.layer_forward(layer, h, ctx)
        if out is not None:
            return out
    h = h + self_attention(layer.self_attention, norm(layer.input_layernorm, h), ctx)
    return h + mlp(layer.mlp, norm(layer.pre_mlp_layernorm, h))


def fused_layer_forward(layer: torch.nn.Module, emb: torch.Tensor, feat: torch.Tensor, ctx: Any) -> torch.Tensor:
    """The EAGLE-3 first draft layer (:class:`~nemo_spec.speculative.eagle.Eagle3FirstLayer`) on embeddings and
    features [s, b, h]: attention over cat(input_norm(emb), hidden_norm(feat)) with ``feat`` as residual, then
    the MLP half; falls back to the module forward when not supported."""
    if not supported(layer):
        return layer(emb, feat, ctx)
    x = torch.cat([norm(layer.input_layernorm, emb), norm(layer.hidden_norm, feat)], dim=-1)
    h = feat + self_attention(layer.self_attention, x, ctx)
    if "_nemo_compile" in layer.__dict__:  # opt-in torch.compile of the MLP half (models/compiled.py)
        from nemo_spec.models import compiled

        out = compiled.mlp_block(layer, h)
        if out is not None:
            return out
    return h + mlp(layer.mlp, norm(layer.pre_mlp_layernorm, h))


def embed(model: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor) -> Optional[torch.Tensor]:
    """Word (+ learned position) embeddings as [s, b, h] at TP=1; None where the module must run (TP>1)."""
    emb = model.embedding
    if parallel.tp_size() > 1 or emb.training or emb.config.fp32_residual_connection:
        return None
    x = F.embedding(input_ids.t(), emb.word_embeddings.weight)
    pos = getattr(emb, "position_embeddings", None)
    if pos is not None and getattr(emb, "add_position_embedding", False):
        x = x + F.embedding(position_ids.t(), pos.weight)
    return x
