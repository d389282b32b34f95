"""``torch.compile`` of the decode step's dense per-layer work (opt-in: ``options={"compile": ...}``).

A decode or verify step runs, per layer, ``norm -> qkv -> split (-> q/k norm)`` before core attention and
``proj + residual -> norm -> fc1 -> act (* gate) -> fc2 + residual`` after it. Those two halves have the same
shapes for every layer of a model and every step of a batch size, so each is compiled once (``dynamic=True``:
one graph for all sequence and batch sizes beyond torch's 0/1 specialisation) and called with the layer's own
parameters as inputs — one compiled function serves every layer. Core attention (the KV-cache write and SDPA
over a cache length that grows every step) stays eager, as does everything at tensor parallel size > 1 (the
row-parallel all-reduce sits between the halves).

Modes are torch.compile's: ``"default"``; ``"reduce-overhead"`` (CUDA graphs on a GPU); ``"max-autotune"``.
What it buys is measured by ``scripts/benchmark.py --compile`` (``<method>+compiled`` rows next to the eager
ones, same weights, same run). On the 2-core CPU the eager fast path was as fast or faster (README, "Compiled
decode step"), so the default is off. A layer whose compilation fails falls back to the eager fast path with one
warning. Results equal the eager fast path's up to the last bits (fused kernels may sum in another order).
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from megatron.core.transformer.identity_op import IdentityOp

log = logging.getLogger(__name__)

#: torch.compile modes the ``compile`` option accepts (True means "default"; False / "off" / None: eager).
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")

_ATTR = "_nemo_compile"  # the mode a TransformerLayer's dense halves run compiled with (set by compile_layers)


def resolve_mode(value: Any) -> Optional[str]:
    """The torch.compile mode of a ``compile`` option value, None for eager; ValueError names a bad value."""
    if value is None or value is False or value == "off":
        return None
    if value is True:
        return "default"
    if isinstance(value, str) and value in MODES:
        return value
    raise ValueError(f"option 'compile' must be true/false, 'off' or one of {list(MODES)}, got {value!r}")


def _norm_args(module: Optional[torch.nn.Module]) -> Tuple[Any, ...]:
    """(kind, weight, bias, eps, shape) of a torch RMSNorm / LayerNorm; ("none",) for None / IdentityOp."""
    if module is None or isinstance(module, IdentityOp):
        return ("none",)
    if isinstance(module, torch.nn.RMSNorm):
        return ("rms", module.weight, None, module.eps, tuple(module.normalized_shape))
    if isinstance(module, torch.nn.LayerNorm):
        return ("ln", module.weight, module.bias, module.eps, tuple(module.normalized_shape))
    raise TypeError(f"no compiled form for norm {type(module).__name__}")


def _norm(x: torch.Tensor, p: Tuple[Any, ...]) -> torch.Tensor:
    if p[0] == "rms":
        return F.rms_norm(x, p[4], p[1], p[3])
    if p[0] == "ln":
        return F.layer_norm(x, p[4], p[1], p[2], p[3])
    return x


def _lin(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor]) -> torch.Tensor:
    """``(W @ x^T)^T`` for up to 10 rows on CPU, else F.linear: a fixed rule (traced code cannot time kernels;
    the eager fastpath.linear measures which is faster)."""
    rows = x.numel() // x.shape[-1]
    if x.device.type == "cpu" and rows <= 10:
        y = (w @ x.reshape(rows, x.shape[-1]).t()).t().reshape(*x.shape[:-1], w.shape[0])
        return y if b is None else y + b
    return F.linear(x, w, b)


def _attn_in(h: torch.Tensor, ln: Tuple[Any, ...], qkv_w: torch.Tensor, qkv_b: Optional[torch.Tensor],
             groups: int, per: int, hd: int, qn: Tuple[Any, ...], kn: Tuple[Any, ...]):
    """input norm -> qkv -> q [s, b, heads, hd], k / v [s, b, groups, hd] (q/k norms applied)."""
    s, b = h.shape[0], h.shape[1]
    qkv = _lin(_norm(h, ln), qkv_w, qkv_b).view(s, b, groups, (per + 2) * hd)
    q, k, v = torch.split(qkv, [per * hd, hd, hd], dim=3)
    return _norm(q.reshape(s, b, groups * per, hd), qn), _norm(k, kn), v


def _mlp_res(h: torch.Tensor, ln2: Tuple[Any, ...], fc1_w: torch.Tensor, fc1_b: Optional[torch.Tensor],
             fc2_w: torch.Tensor, fc2_b: Optional[torch.Tensor], gated: bool, act: Callable) -> torch.Tensor:
    """h + fc2(act(fc1(norm(h)))) (gated: act(gate) * up)."""
    y = _lin(_norm(h, ln2), fc1_w, fc1_b)
    if gated:
        g, u = torch.chunk(y, 2, dim=-1)
        y = act(g) * u
    else:
        y = act(y)
    return h + _lin(y, fc2_w, fc2_b)


def _attn_out_mlp(h: torch.Tensor, o: torch.Tensor, proj_w: torch.Tensor, proj_b: Optional[torch.Tensor],
                  ln2: Tuple[Any, ...], fc1_w: torch.Tensor, fc1_b: Optional[torch.Tensor], fc2_w: torch.Tensor,
                  fc2_b: Optional[torch.Tensor], gated: bool, act: Callable) -> torch.Tensor:
    """h + proj(o), then the MLP half with its residual."""
    return _mlp_res(h + _lin(o, proj_w, proj_b), ln2, fc1_w, fc1_b, fc2_w, fc2_b, gated, act)


_FNS: Dict[str, Dict[str, Callable]] = {}


def _compiled(mode: str) -> Dict[str, Callable]:
    fns = _FNS.get(mode)
    if fns is None:
        cfg = torch._dynamo.config
        # one entry per (layer shape, 0/1-specialised sizes, rows <= 10 branch): base and draft layers, decode and
        # verify blocks, batch 1 and more -- raise the per-function limit so none of them falls back to eager
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(cfg, name) and getattr(cfg, name) < 64:
                setattr(cfg, name, 64)
        kw = {} if mode == "default" else {"mode": mode}
        fns = _FNS[mode] = {name: torch.compile(fn, dynamic=True, **kw)
                            for name, fn in (("attn_in", _attn_in), ("attn_out_mlp", _attn_out_mlp),
                                             ("mlp_res", _mlp_res))}
    return fns


def _mlp_args(layer: torch.nn.Module) -> Tuple[Any, ...]:
    m = layer.mlp
    return (_norm_args(layer.pre_mlp_layernorm), m.linear_fc1.weight, m.linear_fc1.bias, m.linear_fc2.weight,
            m.linear_fc2.bias, bool(m.config.gated_linear_unit), m.config.activation_func)


def _layer_args(layer: torch.nn.Module) -> Tuple[Tuple[Any, ...], Tuple[Any, ...]]:
    """(attention-input args, attention-output + MLP args) of a fast-path layer; cached on the layer (they hold
    the Parameter objects, so in-place weight loads and dtype casts through ``p.data`` are seen)."""
    args = layer.__dict__.get("_nemo_compile_args")
    if args is None:
        a = layer.self_attention
        per = a.num_attention_heads_per_partition // a.num_query_groups_per_partition
        pre = (_norm_args(layer.input_layernorm), a.linear_qkv.weight, a.linear_qkv.bias,
               a.num_query_groups_per_partition, per, a.hidden_size_per_attention_head,
               _norm_args(getattr(a, "q_layernorm", None)), _norm_args(getattr(a, "k_layernorm", None)))
        post = (a.linear_proj.weight, a.linear_proj.bias) + _mlp_args(layer)
        args = layer.__dict__["_nemo_compile_args"] = (pre, post)
    return args


def mode_of(layer: torch.nn.Module) -> Optional[str]:
    """The compile mode ``layer`` runs with (None: eager)."""
    return layer.__dict__.get(_ATTR)


def _failed(layer: torch.nn.Module, err: Exception) -> None:
    log.warning("torch.compile of %s failed (%s: %s); this layer runs eager from now on", type(layer).__name__,
                type(err).__name__, str(err).splitlines()[0] if str(err) else "")
    layer.__dict__.pop(_ATTR, None)


def layer_forward(layer: torch.nn.Module, h: torch.Tensor, ctx: Any) -> Optional[torch.Tensor]:
    """One fast-path layer with its dense halves compiled; None when the layer is not (or no longer) compiled."""
    mode = mode_of(layer)
    if mode is None:
        return None
    fns = _compiled(mode)
    pre, post = _layer_args(layer)
    try:
        q, k, v = fns["attn_in"](h, *pre)
    except Exception as err:  # compilation problems only: the eager path re-raises a genuine error
        _failed(layer, err)
        return None
    out = layer.self_attention.core_attention.forward(q, k, v, ctx)
    return fns["attn_out_mlp"](h, out, *post)


def mlp_block(layer: torch.nn.Module, h: torch.Tensor) -> Optional[torch.Tensor]:
    """The MLP half with its residual, compiled; None when the layer is not compiled."""
    mode = mode_of(layer)
    if mode is None:
        return None
    try:
        return _compiled(mode)["mlp_res"](h, *_mlp_args(layer))
    except Exception as err:
        _failed(layer, err)
        return None


def compile_layers(model: torch.nn.Module, mode: Any) -> int:
    """Run the dense halves of every fast-path layer in ``model`` (base and draft) compiled with ``mode``
    (a ``compile`` option value; off/False makes them eager again). Returns how many layers are compiled.
    Only at tensor parallel size 1; layers the fast path does not cover are left alone."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from nemo_spec import parallel
    from nemo_spec.models import fastpath
    from nemo_spec.speculative.eagle import Eagle3FirstLayer  # its MLP half (fastpath.fused_layer_forward)

    mode = resolve_mode(mode)
    n = 0
    for mod in model.modules():
        if not isinstance(mod, (TransformerLayer, Eagle3FirstLayer)):
            continue
        if mode is None or parallel.tp_size() > 1 or not fastpath.supported(mod):
            mod.__dict__.pop(_ATTR, None)
            continue
        try:
            _layer_args(mod)
        except (TypeError, AttributeError):  # a norm or layout with no compiled form: eager
            mod.__dict__.pop(_ATTR, None)
            continue
        mod.__dict__[_ATTR] = mode
        n += 1
    return n
