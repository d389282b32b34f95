"""EAGLE-1 and EAGLE-3 draft modules built from the base model's own megatron-core layer spec.

Layout (state-dict names under ``eagle_module.``; the export helper maps them 1:1 to serving formats):

EAGLE-1 (EAGLE reference ``Model`` / vLLM ``EagleLlamaForCausalLM``)::

    fc.weight [h, 2h], fc.bias [h]        fc(cat(embed(x_{t+1}), f_t)), f_t = base final-normed hidden
    layers.N.*                             megatron TransformerLayers; layer 0 has NO input norm (IdentityOp)
    (no final norm; logits through the base's frozen output layer)

EAGLE-3 (vLLM / SGLang ``LlamaForCausalLMEagle3``: ``fc``, ``midlayer.*`` incl. ``hidden_norm``, ``norm``,
``lm_head``, ``d2t``)::

    fc.weight [h, 3h]                      fuses the three auxiliary base hidden states (no bias)
    layers.0.input_layernorm.weight        norm of the token embedding
    layers.0.hidden_norm.weight            norm of the feature (fused base feature or previous draft output)
    layers.0.self_attention.linear_qkv     input 2h = cat(input_layernorm(embed), hidden_norm(feature))
    layers.0.*                             rest of a standard layer; its attention residual is the feature
                                           (:class:`Eagle3FirstLayer`, built from :func:`eagle3_first_layer_spec`)
    layers.N.* (N >= 1)                    standard layers
    final_layernorm.weight                 ``norm``
    output_layer.weight [Vd, h]            ``lm_head`` over the draft vocabulary (vocab-parallel under TP)
    d2t [Vd] (int64 buffer)                base_id = draft_id + d2t[draft_id]

Every draft layer is built from a megatron ``ModuleSpec`` with ``build_module``: layers >= 1 (and all EAGLE-1 layers)
are megatron ``TransformerLayer``s of :func:`draft_layer_spec`; the EAGLE-3 first layer is an
:class:`Eagle3FirstLayer` of :func:`eagle3_first_layer_spec`, whose submodules (``input_layernorm``,
``hidden_norm``, a megatron ``SelfAttention`` whose ``linear_qkv`` is a :class:`ConcatInputColumnParallelLinear`
over the 2h concatenation, ``pre_mlp_layernorm``, ``mlp`` and the bias-dropout-adds) all come from its spec; nothing
is replaced after construction and no private megatron method is called.

Draft layers are numbered from 1 inside the draft so they use their own KV cache (layer = layer_number - 1).
They are dense Llama layers with the base's attention shape (``ModelConfig.draft_config``): no q/k norm, no
experts, no sliding window, also on Qwen3 / MoE / sliding-window bases, as the EAGLE formats and engines have them.
Token embeddings come from the frozen base embedding (not a draft parameter).
"""
from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from nemo_spec._mcore import ensure_metadata, sharded_state_dict_default

from nemo_spec import parallel
from nemo_spec.config import EAGLE3_LIKE, ModelConfig, SpeculativeConfig
from nemo_spec.models import fastpath
from nemo_spec.models.attention import AttnContext, SDPACoreAttention, apply_rope, expand_kv_for_backward
from nemo_spec.models.gpt import cast_params, gather_vocab, output_logits, word_embeddings
from nemo_spec.models.spec import layer_spec, transformer_config

log = logging.getLogger(__name__)


@dataclass
class TTTContext(AttnContext):
    """Attention context for EAGLE-3 training-time test: keys/values of earlier unrolled steps are kept per layer.

    Each draft step appends its keys/values to ``store[layer]``. Unrolled step ``i`` attends causally over the
    step-0 keys and, in every later step ``j <= i``, to its own position only (:func:`ttt_mask`). With
    ``mask`` None (training) that pattern is computed by :func:`ttt_attention` without ever materialising an
    ``[s, s]`` tensor; an explicit ``mask`` [b, q, kv_total] (True = attend) is applied as given (the reference
    formulation). Tensors keep their autograd history.
    """

    store: Dict[int, List[Tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)

#: queries x keys elements of one attention block in :func:`ttt_attention` (bounds its temporaries)
TTT_BLOCK_ELEMENTS = 1 << 22


def _ttt_block(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, kd: Tuple[torch.Tensor, ...],
               vd: Tuple[torch.Tensor, ...], start: int, scale: float, gqa: bool) -> torch.Tensor:
    """Attention of query rows ``[start, start + B)`` over step-0 keys ``[0, start + B)`` (causal) and the same
    rows of the later steps' keys (their own position only)."""
    n = q.shape[2]
    end = start + n
    keys = torch.cat([k0[:, :, :end]] + [k[:, :, start:end] for k in kd], dim=2)
    vals = torch.cat([v0[:, :, :end]] + [v[:, :, start:end] for v in vd], dim=2)
    causal = torch.ones(n, end, dtype=torch.bool, device=q.device).tril(diagonal=start)
    eye = torch.eye(n, dtype=torch.bool, device=q.device)
    mask = torch.cat([causal] + [eye] * len(kd), dim=1)
    return F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, scale=scale, enable_gqa=gqa)


def ttt_attention(q: torch.Tensor, ks: List[torch.Tensor], vs: List[torch.Tensor], scale: float,
                  gqa: bool, block: Optional[int] = None) -> torch.Tensor:
    """The training-time-test attention of :func:`ttt_mask` with memory linear in the sequence length.

    q [b, h, s, d]; ks/vs the keys/values of steps 0..i, each [b, g, s, d]. Step 0 alone is plain causal SDPA
    (flash path, no mask). Later steps run in blocks of query rows, each recomputed in the backward pass
    (activation checkpointing), so no ``[s, s]`` (or ``[s, s * steps]``) mask or probability tensor exists;
    the largest temporary is one block's ``[b, h, B, <= s + i * B]`` scores.
    """
    if len(ks) == 1:
        return F.scaled_dot_product_attention(q, ks[0], vs[0], is_causal=True, scale=scale, enable_gqa=gqa)
    s = q.shape[2]
    if block is None:
        block = max(16, TTT_BLOCK_ELEMENTS // max(1, s * q.shape[1] * q.shape[0]))
    kd, vd = tuple(ks[1:]), tuple(vs[1:])
    if block >= s:
        return _ttt_block(q, ks[0], vs[0], kd, vd, 0, scale, gqa)
    outs = [_RecomputedTTTBlock.apply(a, scale, gqa, len(kd), q[:, :, a:a + block], ks[0], vs[0], *kd, *vd)
            for a in range(0, s, block)]
    return torch.cat(outs, dim=2)


class _RecomputedTTTBlock(torch.autograd.Function):
    """One query block of :func:`ttt_attention`, keeping only references to its inputs: the forward runs without
    autograd, the backward recomputes the block with autograd and returns its input gradients. (Through
    torch.utils.checkpoint each block's [B, s] mask stayed alive until the backward: s^2/2 bytes per step.)"""

    @staticmethod
    def forward(ctx, start, scale, gqa, n_later, q, k0, v0, *later):  # type: ignore[override]
        ctx.meta = (start, scale, gqa, n_later)
        ctx.save_for_backward(q, k0, v0, *later)
        with torch.no_grad():
            return _ttt_block(q, k0, v0, later[:n_later], later[n_later:], start, scale, gqa)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        start, scale, gqa, n_later = ctx.meta
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        q, k0, v0, later = inputs[0], inputs[1], inputs[2], inputs[3:]
        with torch.enable_grad():
            out = _ttt_block(q, k0, v0, tuple(later[:n_later]), tuple(later[n_later:]), start, scale, gqa)
            want = [t for t in inputs if t.requires_grad]
            grads = iter(torch.autograd.grad(out, want, grad_out, allow_unused=True))
        return (None, None, None, None) + tuple(next(grads) if t.requires_grad else None for t in inputs)


class DraftCoreAttention(SDPACoreAttention):
    """The project's SDPA core attention plus the training-time-test context (attention over earlier steps)."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None) -> torch.Tensor:
        """Plain SDPA core attention, or attention over all unrolled steps when given a TTTContext."""
        if not isinstance(attention_mask, TTTContext):
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params)
        ctx = attention_mask
        sq, b = query.shape[0], query.shape[1]
        q = query.permute(1, 2, 0, 3)
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)
        if self.use_rope:
            q = apply_rope(q, ctx.position_ids, self.inv_freq)
            k = apply_rope(k, ctx.position_ids, self.inv_freq)
        steps = ctx.store.setdefault(self.layer_number - 1, [])
        steps.append((k, v))
        if ctx.mask is None:
            kvs = [expand_kv_for_backward(q, st[0], st[1]) for st in steps]
            out = ttt_attention(q, [x[0] for x in kvs], [x[1] for x in kvs], self.scale, kvs[0][2])
        else:
            k_all, v_all, gqa = expand_kv_for_backward(q, torch.cat([st[0] for st in steps], dim=2),
                                                       torch.cat([st[1] for st in steps], dim=2))
            out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=ctx.mask[:, None], scale=self.scale,
                                                 enable_gqa=gqa)
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.heads * self.head_dim)


def draft_layer_spec(skip_input_norm: bool = False) -> ModuleSpec:
    """The base's layer spec with the draft core attention (and optionally no input norm, EAGLE-1 layer 0)."""
    spec = copy.deepcopy(layer_spec())
    spec.submodules.self_attention.submodules.core_attention = DraftCoreAttention
    if skip_input_norm:
        spec.submodules.input_layernorm = IdentityOp
    return spec


class ConcatInputColumnParallelLinear(ColumnParallelLinear):
    """A ColumnParallelLinear over the concatenation of ``INPUT_STREAMS`` inputs of the size it is built with.

    A megatron ``linear_qkv`` builder (megatron-core 0.16 ``SelfAttention.__init__`` calls
    ``submodules.linear_qkv(config.hidden_size, qkv_size, ...)``, attention.py:1267): put in a ``SelfAttention``
    spec it gives that attention a ``2h``-input qkv projection, the EAGLE-3 first layer's
    ``qkv(cat(input_layernorm(embed), hidden_norm(feature)))``. Parameters, TP sharding and state-dict entries are
    a plain ColumnParallelLinear's.
    """

    INPUT_STREAMS = 2

    def __init__(self, input_size: int, output_size: int, *args, **kwargs) -> None:
        super().__init__(self.INPUT_STREAMS * input_size, output_size, *args, **kwargs)


@dataclass
class Eagle3FirstLayerSubmodules:
    """Submodules of :class:`Eagle3FirstLayer` (megatron ``TransformerLayerSubmodules`` plus ``hidden_norm``)."""

    input_layernorm: Union[ModuleSpec, type] = IdentityOp
    hidden_norm: Union[ModuleSpec, type] = IdentityOp
    self_attention: Union[ModuleSpec, type] = IdentityOp
    self_attn_bda: Union[ModuleSpec, type] = IdentityFuncOp
    pre_mlp_layernorm: Union[ModuleSpec, type] = IdentityOp
    mlp: Union[ModuleSpec, type] = IdentityOp
    mlp_bda: Union[ModuleSpec, type] = IdentityFuncOp


class Eagle3FirstLayer(MegatronModule):
    """The EAGLE-3 first draft layer (vLLM / SGLang ``midlayer``), every submodule built from its spec::

        x = cat(input_layernorm(embed), hidden_norm(feature))          [s, b, 2h]
        h = feature + self_attention(x)                                 (the feature is the attention residual)
        out = h + mlp(pre_mlp_layernorm(h))

    State-dict names are those of a megatron TransformerLayer plus ``hidden_norm.*``.
    """

    def __init__(self, config: TransformerConfig, submodules: Eagle3FirstLayerSubmodules, layer_number: int = 1,
                 hidden_dropout: Optional[float] = None,
                 pg_collection: Optional[ProcessGroupCollection] = None, norm_before_residual: bool = False) -> None:
        super().__init__(config=config)
        #: speculators' option (vLLM llama_eagle3.py _norm_before_residual): the residual is hidden_norm(feature)
        self.norm_before_residual = norm_before_residual
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        self.layer_number = layer_number
        self.hidden_dropout = config.hidden_dropout if hidden_dropout is None else hidden_dropout
        norm_kw = dict(config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon)
        # built in TransformerLayer's order; hidden_norm last, where the state dicts written so far have it
        self.input_layernorm = build_module(submodules.input_layernorm, **norm_kw)
        self.self_attention = build_module(submodules.self_attention, config=config, layer_number=layer_number,
                                           pg_collection=pg_collection)
        self.self_attn_bda = build_module(submodules.self_attn_bda)
        self.pre_mlp_layernorm = build_module(submodules.pre_mlp_layernorm, **norm_kw)
        mlp_kw = ({"tp_group": pg_collection.tp}
                  if isinstance(submodules.mlp, ModuleSpec) and submodules.mlp.module is MLP
                  else {"pg_collection": pg_collection})
        self.mlp = build_module(submodules.mlp, config=config, **mlp_kw)
        self.mlp_bda = build_module(submodules.mlp_bda)
        self.hidden_norm = build_module(submodules.hidden_norm, **norm_kw)

    def forward(self, emb: torch.Tensor, feature: torch.Tensor, ctx: Optional[AttnContext] = None) -> torch.Tensor:
        """Token embeddings ``emb`` [s, b, h] and features ``feature`` [s, b, h] -> hidden states [s, b, h]."""
        normed = self.hidden_norm(feature)
        x = torch.cat([self.input_layernorm(emb), normed], dim=-1)
        attn = self.self_attention(x, attention_mask=ctx)  # (output, bias)
        fused = self.config.bias_dropout_fusion
        residual = normed if self.norm_before_residual else feature
        h = self.self_attn_bda(self.training, fused)(attn, residual, self.hidden_dropout)
        out = self.mlp(self.pre_mlp_layernorm(h))
        return self.mlp_bda(self.training, fused)(out, h, self.hidden_dropout)


def eagle3_first_layer_spec(norm_before_residual: bool = False) -> ModuleSpec:
    """The EAGLE-3 first layer: the draft layer spec's parts, a 2h-input ``linear_qkv`` and a ``hidden_norm``
    (``norm_before_residual``: speculators' option, the attention residual is the normalised feature)."""
    sub = draft_layer_spec().submodules
    attn = sub.self_attention
    attn.submodules.linear_qkv = ConcatInputColumnParallelLinear
    return ModuleSpec(module=Eagle3FirstLayer, params={"norm_before_residual": norm_before_residual},
                      submodules=Eagle3FirstLayerSubmodules(
        input_layernorm=sub.input_layernorm, hidden_norm=WrappedTorchNorm, self_attention=attn,
        self_attn_bda=sub.self_attn_bda, pre_mlp_layernorm=sub.pre_mlp_layernorm, mlp=sub.mlp,
        mlp_bda=sub.mlp_bda))


def ttt_mask(seq_len: int, step: int, device: torch.device) -> torch.Tensor:
    """Mask [s, s*(step+1)] for unrolled step ``step``: causal over step-0 keys, own position in later steps."""
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
    eye = torch.eye(seq_len, dtype=torch.bool, device=device)
    return torch.cat([causal] + [eye] * step, dim=1)


class EagleDraft(MegatronModule):
    """EAGLE-1 / EAGLE-3 draft head: feature fusion, N decoder layers with the base's architecture, (own) LM head."""

    def __init__(self, model_config: ModelConfig, spec_config: SpeculativeConfig, base: torch.nn.Module) -> None:
        p = next(base.parameters())
        tp = parallel.tp_size()
        # draft layers are dense Llama layers whatever the base (q/k norm, MoE, sliding window): that is what the
        # EAGLE formats hold and every engine builds (ModelConfig.draft_config)
        tcfg = transformer_config(model_config.draft_config(), tp, p.dtype, num_layers=spec_config.num_eagle_layers)
        super().__init__(config=tcfg)
        self.algorithm = spec_config.algorithm
        h = model_config.hidden_size
        self.hidden_size = h
        self.num_layers = spec_config.num_eagle_layers
        eagle3 = self.algorithm in EAGLE3_LIKE  # P-EAGLE (speculative/peagle.py) is an EAGLE-3 head plus mask inputs
        self.fc = torch.nn.Linear((3 if eagle3 else 2) * h, h, bias=not eagle3, dtype=p.dtype)
        layers = []
        for i in range(self.num_layers):
            if i == 0:
                spec = (eagle3_first_layer_spec(spec_config.norm_before_residual) if eagle3
                        else draft_layer_spec(skip_input_norm=True))
            else:
                spec = draft_layer_spec()
            layers.append(build_module(spec, config=tcfg, layer_number=i + 1))
        self.layers = torch.nn.ModuleList(layers)
        #: speculators' options (SpeculativeConfig): an RMSNorm over the 3h features before fc; the normalised
        #: output as the next step's feature
        self.input_norm = (WrappedTorchNorm(config=tcfg, hidden_size=3 * h, eps=tcfg.layernorm_epsilon)
                           if spec_config.norm_before_fc else None)
        self.norm_output = spec_config.norm_output
        if eagle3:
            self.final_layernorm = WrappedTorchNorm(config=tcfg, hidden_size=h, eps=tcfg.layernorm_epsilon)
            vd = spec_config.draft_vocab_size or model_config.vocab_size
            self.draft_vocab_size = vd
            self.output_layer = ColumnParallelLinear(h, vd, config=tcfg, init_method=tcfg.init_method, bias=False,
                                                     gather_output=False, skip_bias_add=False)
            self.register_buffer("d2t", torch.zeros(vd, dtype=torch.long), persistent=True)
            self.register_buffer("t2d", torch.zeros(model_config.vocab_size, dtype=torch.bool), persistent=False)
            self.register_load_state_dict_post_hook(lambda module, incompatible: module._refresh_t2d())
            self._refresh_t2d()
            self._init_head_from_base(base)
        else:
            self.draft_vocab_size = model_config.vocab_size
        cast_params(self, p.dtype)
        self.to(p.device)

    # ---- vocabulary mapping (EAGLE-3) -------------------------------------------------------------------
    def _refresh_t2d(self) -> None:
        """Recompute the base-vocab membership mask t2d from d2t."""
        ids = torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t
        t2d = torch.zeros_like(self.t2d)
        t2d[ids] = True
        self.t2d.copy_(t2d)

    def base_ids_of_draft_vocab(self) -> torch.Tensor:
        """Base token id of every draft-vocab entry, [Vd]."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    @torch.no_grad()
    def _init_head_from_base(self, base: torch.nn.Module) -> None:
        """Copy the base output-layer rows of the draft vocabulary into this head (TP-aware)."""
        w = _base_output_weight(base)
        full = _gather_rows(w)
        rows = full[self.base_ids_of_draft_vocab().to(full.device)]
        tp, rank = parallel.tp_size(), parallel.tp_rank()
        self.output_layer.weight.copy_(rows.chunk(tp, 0)[rank])

    @torch.no_grad()
    def set_draft_vocab(self, token_counts: torch.Tensor, base: torch.nn.Module, reinit_head: bool = True) -> None:
        """Keep the ``draft_vocab_size`` most frequent base tokens; rebuild d2t/t2d (and re-seed the head rows)."""
        if self.algorithm not in EAGLE3_LIKE:
            raise ValueError(f"set_draft_vocab is only defined for {EAGLE3_LIKE}, not {self.algorithm}")
        counts = torch.as_tensor(token_counts).flatten().to(torch.float64)
        if counts.numel() != self.t2d.numel():
            raise ValueError(f"token_counts has {counts.numel()} entries, base vocab_size is {self.t2d.numel()}")
        order = torch.sort(-counts, stable=True).indices  # most frequent first, ties -> lower id
        chosen = order[: self.draft_vocab_size].sort().values
        self.d2t.copy_((chosen - torch.arange(self.draft_vocab_size)).to(self.d2t.device))
        self._refresh_t2d()
        if reinit_head:
            self._init_head_from_base(base)
        log.info("EAGLE-3 draft vocabulary set: %d of %d base tokens, covering %.1f%% of counted tokens",
                 self.draft_vocab_size, counts.numel(),
                 100.0 * counts[chosen].sum().item() / max(counts.sum().item(), 1.0))

    # ---- forward ------------------------------------------------------------------------------------------
    def forward(self, base: torch.nn.Module, input_ids: torch.Tensor, hidden: torch.Tensor,
                ctx: Optional[AttnContext] = None, gather: bool = True,
                head: bool = True) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """One draft pass: (input_ids [b,s], feature [b,s,h]) -> (out_hidden [b,s,h], logits [b,s,Vd]); with
        ``head=False`` (EAGLE-3 training: :meth:`head_logits` row block by row block; generation: :meth:`logits`
        of the rows it needs) the logits are None."""
        fast = fastpath.active()  # generation: the lean path through the same modules (see models/fastpath.py)
        emb = self.embed(base, input_ids, fast)  # [s, b, h]
        feat = hidden.transpose(0, 1).to(emb.dtype)
        if self.algorithm == "eagle1":
            x = self.fc(torch.cat([emb, feat], dim=-1))
            for layer in self.layers:
                x = self._layer(layer, x, ctx, fast)
        else:
            x = self._eagle3_first_layer(emb, feat, ctx, fast)
            for layer in self.layers[1:]:
                x = self._layer(layer, x, ctx, fast)
            if self.norm_output:  # what the next step reads is the normalised output (head_logits: no second norm)
                x = fastpath.norm(self.final_layernorm, x) if fast else self.final_layernorm(x)
        if not head:
            return x.transpose(0, 1), None
        return x.transpose(0, 1), self.logits(base, x, gather).transpose(0, 1)

    def logits(self, base: torch.nn.Module, x: torch.Tensor, gather: bool = True) -> torch.Tensor:
        """Draft logits of output hidden rows [..., h]: EAGLE-1 through the base's output layer, EAGLE-3 through
        :meth:`head_logits` (a proposer that needs only some rows' logits runs the forward with ``head=False``)."""
        if self.algorithm != "eagle1":
            return self.head_logits(x, gather)
        logits = output_logits(base, x, fast=fastpath.active())
        return gather_vocab(logits) if gather else logits

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """EAGLE-3 fused feature fc(features) [b, s, h] (after ``input_norm`` when the draft has one)."""
        x = features.to(self.fc.weight.dtype)
        if self.input_norm is not None:
            x = self.input_norm(x)
        return self.fc(x)

    def embed(self, base: torch.nn.Module, input_ids: torch.Tensor, fast: bool = False) -> torch.Tensor:
        """Token embeddings [s, b, h] of ``input_ids`` [b, s] from the frozen base embedding."""
        if fast and parallel.tp_size() == 1:
            return F.embedding(input_ids.t(), base.embedding.word_embeddings.weight)
        return word_embeddings(base, input_ids.t())

    def head_logits(self, x: torch.Tensor, gather: bool = True) -> torch.Tensor:
        """EAGLE-3 draft head (final norm + lm_head over the draft vocabulary) on hidden rows [..., h]."""
        if self.norm_output:  # the rows are already normalised (forward)
            logits = (fastpath.column(self.output_layer, x) if fastpath.active() else self.output_layer(x)[0])
        elif fastpath.active():
            logits = fastpath.column(self.output_layer, fastpath.norm(self.final_layernorm, x))
        else:
            logits, _ = self.output_layer(self.final_layernorm(x))
        return gather_vocab(logits) if gather else logits

    @staticmethod
    def _layer(layer: TransformerLayer, x: torch.Tensor, ctx: Optional[AttnContext], fast: bool) -> torch.Tensor:
        if fast:
            return fastpath.layer_forward(layer, x, ctx)
        x, _ = layer(hidden_states=x, attention_mask=ctx)
        return x

    def _eagle3_first_layer(self, emb: torch.Tensor, feat: torch.Tensor, ctx: Optional[AttnContext],
                            fast: bool = False) -> torch.Tensor:
        """EAGLE-3 midlayer (:class:`Eagle3FirstLayer`), on the fast path when gradients are off."""
        layer: Eagle3FirstLayer = self.layers[0]
        if fast:
            return fastpath.fused_layer_forward(layer, emb, feat, ctx)
        return layer(emb, feat, ctx)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """Distributed-checkpoint view: TP-sharded layers/head, replicated fc/norms/d2t."""
        metadata = ensure_metadata(metadata)
        out = draft_sharded_state_dict(self, prefix, sharded_offsets, metadata)
        if self.algorithm in EAGLE3_LIKE:
            out.update(_replicated_buffer(self.d2t, f"{prefix}d2t", metadata))
        return out


def _replicated_buffer(t: torch.Tensor, key: str, metadata: Optional[dict]) -> dict:
    """A ShardedTensor entry for a tensor replicated over TP/DP."""
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    return make_sharded_tensors_for_checkpoint({key: t}, "")


def _base_output_weight(base: torch.nn.Module) -> torch.Tensor:
    """The base's local (vocab-parallel) output weight [V/tp, h], tied to the embedding when shared."""
    if base.share_embeddings_and_output_weights:
        return base.shared_embedding_or_output_weight()
    return base.output_layer.weight


def _gather_rows(w: torch.Tensor) -> torch.Tensor:
    """All-gather a vocab-parallel weight [V/tp, h] into the full [V, h] (no-op at TP=1)."""
    if parallel.tp_size() == 1:
        return w.detach()
    import torch.distributed as dist
    from megatron.core import parallel_state

    parts = [torch.empty_like(w) for _ in range(parallel.tp_size())]
    dist.all_gather(parts, w.detach().contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(parts, 0)


def draft_sharded_state_dict(draft: torch.nn.Module, prefix: str, sharded_offsets: tuple,
                             metadata: dict) -> dict:
    """A draft module's distributed-checkpoint view: its ``layers`` (a ModuleList of megatron layers) by their own
    TP-aware ``sharded_state_dict``, every other child (fc, norms, heads) by megatron's default rules."""
    out = {}
    for name, module in draft.named_children():
        if name == "layers":
            for i, layer in enumerate(module):
                out.update(layer.sharded_state_dict(f"{prefix}layers.{i}.", sharded_offsets, metadata))
        else:
            out.update(sharded_state_dict_default(module, f"{prefix}{name}.", sharded_offsets, metadata,
                                                  tp_group=_tp_group()))
    return out


def _tp_group():
    """The tensor-parallel process group (replica ids of replicated draft tensors are taken over it)."""
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def count_tokens(sequences, vocab_size: int) -> torch.Tensor:
    """Token frequencies [vocab_size] (float64) over an iterable of token-id sequences (for set_draft_vocab)."""
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for seq in sequences:
        ids = torch.as_tensor(seq, dtype=torch.long).flatten()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            raise ValueError(f"token id outside [0, {vocab_size}) in a sequence passed to count_tokens")
        counts += torch.bincount(ids, minlength=vocab_size).to(torch.float64)
    return counts
