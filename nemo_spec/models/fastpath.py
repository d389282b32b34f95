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

import contextlib
import logging
import os
import threading
import time
import weakref
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from megatron.core.transformer.identity_op import IdentityOp

from nemo_spec import parallel
from nemo_spec.models import skinny_gemm

log = logging.getLogger(__name__)

#: Set to False to run generation through the modules' own forward (for debugging / comparisons).
ENABLED = True


def active() -> bool:
    """Whether the fast path should be used now (enabled and gradients off)."""
    return ENABLED and not torch.is_grad_enabled()


def _tp_group() -> Any:
    from megatron.core import parallel_state as ps
    return ps.get_tensor_model_parallel_group()


#: How the fast path computes CPU products of few rows (decode steps, verification blocks, draft trees): "auto"
#: (default) times the candidate kernels on the machine and keeps the fastest (see :func:`tune`); "linear" always
#: ``F.linear``; "transposed" always ``(W @ x^T)^T``; "skinny" always the compiled kernel of
#: :mod:`~nemo_spec.models.skinny_gemm` (``F.linear`` where it is unavailable). Environment variable
#: ``NEMO_SPEC_SMALL_GEMM``.
SMALL_GEMM = os.environ.get("NEMO_SPEC_SMALL_GEMM", "auto")
@contextlib.contextmanager
def small_gemm_rule(mode: str) -> Iterator[None]:
    """:data:`SMALL_GEMM` set to ``mode`` for the block (restored after): rules side by side in one process."""
    global SMALL_GEMM
    before, SMALL_GEMM = SMALL_GEMM, mode
    try:
        yield
    finally:
        SMALL_GEMM = before


#: row counts up to this get a timed kernel choice; larger products always take ``F.linear``
MAX_TUNED_ROWS = 32

#: a kernel: (kind, rows computed) — kind ``"linear"`` (``F.linear``) or ``"transposed"`` (``(W @ x^T)^T``) over x
#: zero-padded to that many rows, or ``"skinny"`` (:func:`skinny_gemm.linear`, never padded)
Kernel = Tuple[str, int]
KINDS = ("linear", "transposed", "skinny")


class WeightGroup:
    """The linear weights of one model (see :func:`register`), timed together: a kernel is timed while sweeping
    all of them in turn, as a forward does, so each weight is read cold from memory as in the model — timing one
    small weight over and over measures it hot in the cache, which on CPU can favour the other kernel."""

    def __init__(self, weights: Sequence[torch.Tensor]) -> None:
        self.refs = [weakref.ref(w) for w in weights]
        self.choice: Dict[Tuple[Any, ...], Kernel] = {}  # (shape, dtype, rows, threads) -> kernel
        self.lock = threading.Lock()  # one tuning at a time (two at once would skew each other's timings)
        self.pretuned = 0  # row counts 1..pretuned were timed ahead (pretune); larger ones are never timed later


#: the group of each registered weight, by id; an entry is dropped when its weight is freed (so a later tensor
#: with the same id is not taken for it). Kept here, not on the tensors: a module stays picklable and copyable.
_GROUP_OF: Dict[int, WeightGroup] = {}


def _set_group(w: torch.Tensor, group: WeightGroup) -> None:
    if id(w) not in _GROUP_OF:
        weakref.finalize(w, _GROUP_OF.pop, id(w), None)
    _GROUP_OF[id(w)] = group


def _alone(w: torch.Tensor) -> WeightGroup:
    """A group of its own for ``w`` (a weight no model registered, or one its group no longer sweeps)."""
    group = WeightGroup([w])
    _set_group(w, group)
    return group


def _cpu_matrix(p: torch.Tensor) -> bool:
    return p.dim() == 2 and p.is_floating_point() and p.device.type == "cpu"


def _embedding_tables(module: torch.nn.Module) -> List[torch.Tensor]:
    return [p for m in module.modules() if type(m).__name__.endswith("Embedding") for p in m.parameters(recurse=False)]


def register(module: torch.nn.Module) -> None:
    """Group the CPU weight matrices of ``module`` (a model, its draft included) so that their small-row kernels
    are timed together, on first use of each row count; re-registering a module is a no-op. Embedding tables are
    left out (a tied output layer's weight is then timed on its own: the largest matrix, cold by itself)."""
    tables = {id(p) for p in _embedding_tables(module)}
    ws = [p for p in module.parameters() if _cpu_matrix(p) and id(p) not in tables]
    if not ws:
        return
    first = _GROUP_OF.get(id(ws[0]))
    if first is not None and len(first.refs) == len(ws) and all(_GROUP_OF.get(id(w)) is first for w in ws):
        return
    group = WeightGroup(ws)
    for w in ws:
        _set_group(w, group)


def candidates(rows: int, weight: Optional[torch.Tensor] = None) -> List[Kernel]:
    """The kernels timed for ``rows`` rows (of ``weight``, if given): ``F.linear`` and the transposed product, each
    over x as it is and zero-padded to the next multiple of 2, 4, 8, 16 and 32 rows up to twice the rows (at least
    4), and the compiled skinny kernel where it is available (and supports the weight). CPU GEMM libraries run some
    column counts much faster than others: over SmolLM2-135M's weights on a 2-core host a 1-row product ran 1.6x
    faster as 2 transposed rows, 11 rows 1.9x faster as 16; the skinny kernel ran 1-16 rows 1.6-3x faster still."""
    pads = sorted({rows} | {-(-rows // m) * m for m in (2, 4, 8, 16, 32)})
    pads = [p for p in pads if p <= max(2 * rows, 4)]
    out = [("linear", rows)] + [(t, p) for p in pads for t in ("linear", "transposed") if (t, p) != ("linear", rows)]
    if skinny_gemm.supports(weight) if weight is not None else skinny_gemm.available():
        out.append(("skinny", rows))
    return out


def _run(k: Kernel, x2: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Kernel ``k`` on x2 [rows, in]: [rows, out]."""
    kind, pad = k
    rows = x2.shape[0]
    if kind == "skinny":
        return skinny_gemm.linear(x2, weight)
    if pad > rows:
        x2 = torch.cat([x2, x2.new_zeros(pad - rows, x2.shape[1])])
    if kind == "linear":
        y = F.linear(x2, weight)
        return y if pad == rows else y[:rows]
    return (weight @ x2.t()).t()[:rows].contiguous()


def _cpu_weights(group: WeightGroup) -> List[torch.Tensor]:
    """The group's weights still alive and on the CPU (the ones :func:`tune` sweeps)."""
    return [w for w in (r() for r in group.refs) if w is not None and w.device.type == "cpu"]


def tune(group: WeightGroup, rows: int, sweeps: int = 3, margin: float = 0.9) -> None:
    """Choose the kernel of every weight shape of ``group`` for ``rows`` rows: each candidate of :func:`candidates`
    sweeps all the group's weights it applies to (one warm-up sweep, then ``sweeps`` timed ones, candidates
    alternating), each call timed; per shape the candidate with the lowest median total wins, ``F.linear`` unless
    another is faster by more than ``margin`` (so noise cannot pick a kernel that is not really faster)."""
    weights = _cpu_weights(group)
    cands_of = {(tuple(w.shape), w.dtype): candidates(rows, w) for w in weights}
    cands = list(dict.fromkeys(c for cs in cands_of.values() for c in cs))
    xs = {(w.shape[1], w.dtype): torch.randn(rows, w.shape[1], dtype=w.dtype) for w in weights}
    spent: Dict[Tuple[Any, ...], List[float]] = {}
    with torch.no_grad():
        for sweep in range(sweeps + 1):
            for c in (cands if sweep % 2 else cands[::-1]):
                tot: Dict[Tuple[Any, ...], float] = {}
                for w in weights:
                    shape = (tuple(w.shape), w.dtype)
                    if c not in cands_of[shape]:
                        continue
                    x2 = xs[(w.shape[1], w.dtype)]
                    t0 = time.perf_counter()
                    _run(c, x2, w)
                    key = (*shape, c)
                    tot[key] = tot.get(key, 0.0) + time.perf_counter() - t0
                if sweep:
                    for key, t in tot.items():
                        spent.setdefault(key, []).append(t)
    threads = torch.get_num_threads()
    for (shape, dtype), cs in cands_of.items():
        med = {c: sorted(spent[(shape, dtype, c)])[sweeps // 2] for c in cs}
        best = min(cs[1:], key=lambda c: med[c])
        group.choice[(shape, dtype, rows, threads)] = best if med[best] < margin * med[cs[0]] else cs[0]
    if log.isEnabledFor(logging.DEBUG):
        log.debug("small-row CPU kernels for %d rows: %s", rows,
                  {k[0]: v for k, v in list(group.choice.items()) if k[2] == rows})


_TUNING_S = [0.0]  # seconds spent in tune() by this process


def tuning_seconds() -> float:
    """Seconds this process has spent timing small-row kernels so far: a caller that times its own work (the
    adaptive speculation controller) can tell that a one-off kernel timing ran inside it."""
    return _TUNING_S[0]


def _ensure_tuned(group: WeightGroup, rows: int) -> bool:
    """Time ``group`` for ``rows`` rows (one tuning at a time per group) unless every shape it sweeps already has
    a kernel at this thread count; returns whether it timed."""
    threads = torch.get_num_threads()
    with group.lock:
        if all((tuple(w.shape), w.dtype, rows, threads) in group.choice for w in _cpu_weights(group)):
            return False
        t0 = time.perf_counter()
        try:
            tune(group, rows)
        finally:
            _TUNING_S[0] += time.perf_counter() - t0
        return True


def pretune(module: torch.nn.Module, max_rows: int = MAX_TUNED_ROWS) -> int:
    """Time the small-row kernels of ``module``'s weights (see :func:`register`) for every row count 1..max_rows
    now instead of at first use, where each new row count would pause generation for a few sweeps over the
    weights (a server meets a new count whenever a row joins or leaves). Row counts already timed are skipped;
    a no-op unless the rule is ``auto``. Returns how many (group, row count) timings ran.

    Afterwards a larger row count (up to :data:`MAX_TUNED_ROWS`) is not timed at its first use but runs
    ``F.linear``: the caller sized ``max_rows`` to the counts that matter (a server: its decode and verification
    steps), and a forward of another count (a prefill chunk of a few short prompts) must not pause the running
    batch — a timing costs ~0.1 s on the built-in base and 1.5-2 s on SmolLM2."""
    if SMALL_GEMM != "auto" or max_rows < 1:
        return 0
    register(module)
    groups = {id(g): g for g in (_GROUP_OF.get(id(p)) for p in module.parameters()) if g is not None}
    if any(getattr(m, "share_embeddings_and_output_weights", False) for m in module.modules()):
        for p in _embedding_tables(module):  # a tied output layer multiplies by the table: timed on its own
            if _cpu_matrix(p):
                g = _GROUP_OF.get(id(p)) or _alone(p)
                groups[id(g)] = g
    top = min(int(max_rows), MAX_TUNED_ROWS)
    n = sum(_ensure_tuned(group, rows) for rows in range(1, top + 1) for group in groups.values())
    for group in groups.values():
        group.pretuned = max(group.pretuned, top)
    return n


def kernel(weight: torch.Tensor, rows: int) -> Kernel:
    """The kernel for ``rows`` rows of ``weight`` on CPU (see :data:`SMALL_GEMM`, :func:`candidates`): timed once
    per weight group, shape, row count, dtype and thread count. A weight no model registered is timed alone."""
    if SMALL_GEMM == "linear" or rows > MAX_TUNED_ROWS:
        return ("linear", rows)
    if SMALL_GEMM == "transposed":
        return ("transposed", rows)
    if SMALL_GEMM == "skinny":
        return ("skinny" if skinny_gemm.supports(weight) else "linear", rows)
    if SMALL_GEMM != "auto":
        raise ValueError(f"NEMO_SPEC_SMALL_GEMM must be auto, linear, transposed or skinny, got {SMALL_GEMM!r}")
    group = _GROUP_OF.get(id(weight)) or _alone(weight)
    key = (tuple(weight.shape), weight.dtype, rows, torch.get_num_threads())
    k = group.choice.get(key)
    if k is None:
        if 0 < group.pretuned < rows:  # beyond what was timed ahead: no pause mid-generation (see pretune)
            return ("linear", rows)
        _ensure_tuned(group, rows)
        k = group.choice.get(key)
        if k is None:  # the group no longer sweeps this weight's shape (moved off the CPU since it was grouped)
            lone = _alone(weight)
            tune(lone, rows)
            k = lone.choice[key]
    return k


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear`` — except on CPU for few rows, where the fastest of a few kernels computing the same product
    is used (:func:`kernel`).

    Decode steps, verification blocks and draft trees are a few tokens wide, and which CPU kernel is fastest for
    such shapes depends on the machine and on the row count, by large factors: on one 2-core host a 1-row
    ``F.linear`` over SmolLM2-135M's weights streamed them at 11 GB/s where ``(W @ x^T)^T`` over the row padded to
    two streamed 26 GB/s; 5 rows ran 1.7x faster transposed; elsewhere ``F.linear`` won; the compiled skinny kernel
    (:mod:`~nemo_spec.models.skinny_gemm`, where it builds) streamed 1-5 rows at 18-24 GB/s. So the choice is timed
    on the model's own weights, once per row count (a one-off pause of a few sweeps over the weights). Same math;
    the summation order may differ in the last bits, as between any two GEMM kernels, so runs that must be
    bit-reproducible across processes set ``NEMO_SPEC_SMALL_GEMM=linear`` (or ``skinny``, whose rows do not depend
    on the row count either).
    """
    if x.device.type == "cpu":
        rows = x.numel() // x.shape[-1]
        k = kernel(weight, rows)
        if k != ("linear", rows):
            y = _run(k, x.reshape(rows, x.shape[-1]), weight).view(*x.shape[:-1], weight.shape[0])
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
        eps = module.eps if module.eps is not None else torch.finfo(x.dtype).eps
        if (SMALL_GEMM in ("auto", "skinny") and x.numel() <= MAX_TUNED_ROWS * x.shape[-1]
                and skinny_gemm.supports_norm(x, module.weight)):  # few fp32 rows: the compiled kernel's norm
            return skinny_gemm.rms_norm(x, module.weight, eps)
        return F.rms_norm(x, module.normalized_shape, module.weight, eps)
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


def qkv(attn: torch.nn.Module, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """megatron SelfAttention's ``get_query_key_value_tensors`` on normed input [s, b, in]: q [s, b, heads, d],
    k and v [s, b, groups, d], q/k normed where the layer has q/k norms."""
    s, b = x.shape[0], x.shape[1]
    heads, groups = attn.num_attention_heads_per_partition, attn.num_query_groups_per_partition
    hd = attn.hidden_size_per_attention_head
    per = heads // groups
    mixed = column(attn.linear_qkv, x).view(s, b, groups, (per + 2) * hd)
    q, k, v = torch.split(mixed, [per * hd, hd, hd], dim=3)
    q = norm(getattr(attn, "q_layernorm", None), q.reshape(s, b, heads, hd))
    return q, norm(getattr(attn, "k_layernorm", None), k), v


def self_attention(attn: torch.nn.Module, x: torch.Tensor, ctx: Any) -> torch.Tensor:
    """megatron SelfAttention on normed input [s, b, in]: qkv -> core attention -> proj (bias included)."""
    q, k, v = qkv(attn, x)
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
    normed = norm(layer.hidden_norm, feat)
    x = torch.cat([norm(layer.input_layernorm, emb), normed], dim=-1)
    h = (normed if layer.norm_before_residual else feat) + self_attention(layer.self_attention, x, ctx)
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
