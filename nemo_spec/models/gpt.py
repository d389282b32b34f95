"""Build a megatron-core GPTModel from a ModelConfig, and run it with explicit positions/masks/KV cache."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, List, Optional, Sequence

import torch
from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel

from nemo_spec._cpu import apply_cpu_workarounds, default_device
from nemo_spec.config import ModelConfig
from nemo_spec.models import fastpath, foreign
from nemo_spec.models.attention import AttnContext, KVCache
from nemo_spec.models.spec import layer_spec, transformer_config
from nemo_spec import parallel


def build_gpt(cfg: ModelConfig, params_dtype: torch.dtype = torch.float32,
              device: Optional[torch.device] = None) -> GPTModel:
    """Build a (tensor- and expert-parallel, per the current parallel state) megatron-core GPTModel for ``cfg``."""
    apply_cpu_workarounds()
    tp = parallel.tp_size()
    cfg.check_tensor_parallel(tp)
    if cfg.vocab_size % tp:
        from nemo_spec.config import ConfigError
        raise ConfigError(f"tensor parallel size {tp} does not divide vocab_size={cfg.vocab_size}")
    cfg.check_expert_parallel(parallel.ep_size())
    tcfg = transformer_config(cfg, tp, params_dtype)
    model = GPTModel(
        config=tcfg,
        transformer_layer_spec=layer_spec(cfg),
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.max_position_embeddings,
        pre_process=True,
        post_process=True,
        parallel_output=True,
        share_embeddings_and_output_weights=cfg.tie_word_embeddings,
        position_embedding_type="learned_absolute" if cfg.position_embedding == "learned" else "none",
    )
    model.nemo_spec_config = cfg  # the ModelConfig travels with the module
    cast_params(model, params_dtype)
    return model.to(device or default_device())


def cast_params(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Give every floating-point parameter ``dtype`` (megatron builds torch norms and learned position
    embeddings in fp32 whatever ``params_dtype`` is, and a bf16 GPT-2-style model then fails at its first
    linear). Buffers such as RoPE inverse frequencies stay fp32."""
    for p in module.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
    return module


def _wrapped_chain(model: torch.nn.Module, through_gpt: bool) -> Iterator[torch.nn.Module]:
    """``model``, then what it wraps (``.module`` of DDP/Float16, ``.model`` of a LightningModule, and with
    ``through_gpt`` the base ``.gpt`` of a SpeculativeGPT), at most 8 levels deep."""
    m: Any = model
    for _ in range(8):
        yield m
        nxt = None
        for attr in (("gpt", "module", "model") if through_gpt else ("module", "model")):
            nxt = getattr(m, attr, None)
            if isinstance(nxt, torch.nn.Module):
                break
        if not isinstance(nxt, torch.nn.Module) or nxt is m:
            return
        m = nxt


def unwrap(model: torch.nn.Module) -> GPTModel:
    """The GPTModel inside DDP / Float16 / Lightning / SpeculativeGPT wrappers."""
    for m in _wrapped_chain(model, through_gpt=True):
        if isinstance(m, GPTModel):
            return m
    raise TypeError(f"expected a megatron-core GPTModel (or a wrapper holding one), got {type(model).__name__}")


def is_speculative(model: torch.nn.Module) -> bool:
    """True for a SpeculativeGPT (a frozen base ``.gpt`` plus a draft and its ``spec_config``) itself, not a wrapper
    that forwards attribute lookups to it (megatron's DDP does)."""
    return "spec_config" in vars(model) and "gpt" in getattr(model, "_modules", {})


def unwrap_speculative(model: torch.nn.Module) -> Optional[torch.nn.Module]:
    """The SpeculativeGPT inside DDP / Float16 / Lightning wrappers, or None when there is none."""
    for m in _wrapped_chain(model, through_gpt=False):
        if is_speculative(m):
            return m
    return None


def model_config(model: torch.nn.Module) -> ModelConfig:
    """The ModelConfig a model was built from."""
    return unwrap(model).nemo_spec_config


@dataclass
class GPTOutput:
    """Result of :func:`gpt_forward`: logits [b, s, V(_local)], final hidden [b, s, h], aux hiddens."""

    logits: Optional[torch.Tensor]
    hidden: torch.Tensor
    aux_hidden: List[torch.Tensor] = field(default_factory=list)


def gather_vocab(logits: torch.Tensor) -> torch.Tensor:
    """Gather vocab-parallel logits [..., V/tp] into full logits [..., V] (no-op at TP=1)."""
    if parallel.tp_size() == 1:
        return logits
    return tensor_parallel.gather_from_tensor_model_parallel_region(logits)


def word_embeddings(base: torch.nn.Module, ids_sb: torch.Tensor) -> torch.Tensor:
    """The base's (vocab-parallel) token embeddings [s, b, h] of ``ids_sb`` [s, b], the whole sequence on every TP
    rank: a sequence-parallel base (foreign, e.g. NeMo at TP > 1) would otherwise reduce-scatter them along the
    sequence (megatron's VocabParallelEmbedding.reduce_scatter_embeddings), which drafts do not use."""
    emb = unwrap(base).embedding.word_embeddings
    if not getattr(emb, "reduce_scatter_embeddings", False):
        return emb(ids_sb)
    emb.reduce_scatter_embeddings = False
    try:
        return emb(ids_sb)
    finally:
        emb.reduce_scatter_embeddings = True


def output_logits(model: torch.nn.Module, hidden_sbh: torch.Tensor, fast: bool = False) -> torch.Tensor:
    """Apply the (possibly tied, vocab-parallel) output layer to final-normed hidden [s, b, h]; local logits [s, b, V/tp]."""
    m = unwrap(model)
    weight = m.shared_embedding_or_output_weight() if m.share_embeddings_and_output_weights else None
    if fast:
        return fastpath.linear(hidden_sbh, m.output_layer.weight if weight is None else weight, m.output_layer.bias)
    if getattr(m.output_layer, "sequence_parallel", False) and parallel.tp_size() > 1:
        # a sequence-parallel base (foreign, e.g. NeMo at TP > 1): these hidden states are the whole sequence
        # (foreign_forward gathers them), so no sequence gather -- the plain column-parallel product
        from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

        w = m.output_layer.weight if weight is None else weight
        return torch.nn.functional.linear(copy_to_tensor_model_parallel_region(hidden_sbh), w, m.output_layer.bias)
    logits, _ = m.output_layer(hidden_sbh, weight=weight)
    return logits


def gpt_forward(model: torch.nn.Module, input_ids: torch.Tensor, ctx: Optional[AttnContext] = None,
                aux_layers: Sequence[int] = (), compute_logits: bool = True,
                gather: bool = True, fast: Optional[bool] = None, last_logits_only: bool = False) -> GPTOutput:
    """Run the base model on input_ids [b, s] with explicit positions/mask/cache (ctx); [b, s, ...] outputs.

    ``aux_layers`` are 0-based layer indices whose outputs are returned (EAGLE-3 features).
    ``gather=False`` keeps vocab-parallel logits local to the TP rank.
    ``fast``: evaluate the layers with :mod:`nemo_spec.models.fastpath` (default: when gradients are off).
    ``last_logits_only``: logits [b, 1, V] of the last position only (a prefill needs no more).
    """
    m = unwrap(model)
    b, s = input_ids.shape
    if not torch.is_inference_mode_enabled():
        parallel.drop_inference_buffers()
    if not foreign.is_project_spec(m):  # another layer spec: its own forward, hidden states captured by hooks
        if ctx is not None and (ctx.cache is not None or ctx.mask is not None or not _default_positions(ctx, s)):
            foreign.require_project_spec(m, "a forward with a KV cache, a mask or explicit positions")
        out = foreign.foreign_forward(m, input_ids, aux_layers, compute_logits=compute_logits, gather=gather)
        if out.logits is not None and last_logits_only:
            out.logits = out.logits[:, -1:]
        return out
    fast = fastpath.active() if fast is None else fast
    if ctx is None:
        ctx = AttnContext(position_ids=torch.arange(s, device=input_ids.device)[None].expand(b, s))
    h = fastpath.embed(m, input_ids, ctx.position_ids) if fast else None
    if h is None:
        h = m.embedding(input_ids=input_ids, position_ids=ctx.position_ids)  # [s, b, h]
    aux: List[torch.Tensor] = []
    want = set(aux_layers)
    for i, layer in enumerate(m.decoder.layers):
        if fast:
            h = fastpath.layer_forward(layer, h, ctx)
        else:
            h, _ = layer(hidden_states=h, attention_mask=ctx)
        if i in want:
            aux.append(h)
    if m.decoder.final_layernorm is not None:
        h = fastpath.norm(m.decoder.final_layernorm, h) if fast else m.decoder.final_layernorm(h)
    logits = None
    if compute_logits:
        logits = output_logits(m, h[-1:] if last_logits_only else h, fast=fast)
        if gather:
            logits = gather_vocab(logits)
        logits = logits.transpose(0, 1)
    return GPTOutput(logits=logits, hidden=h.transpose(0, 1), aux_hidden=[a.transpose(0, 1) for a in aux])


def _default_positions(ctx: AttnContext, s: int) -> bool:
    """Whether ``ctx`` asks for positions 0..s-1 in every row (what a megatron-spec forward applies)."""
    pos = ctx.position_ids
    return pos.shape[-1] == s and bool((pos == torch.arange(s, device=pos.device)).all())


def new_kv_cache(model: torch.nn.Module, batch_size: int, max_len: int, num_layers: Optional[int] = None,
                 dtype: Optional[torch.dtype] = None) -> KVCache:
    """Allocate a KV cache shaped for ``model``'s attention layers on this TP rank."""
    cfg = model_config(model)
    tp = parallel.tp_size()
    foreign.require_project_spec(unwrap(model), "a KV cache (generation)")
    p = next(unwrap(model).parameters())
    return KVCache(num_layers or cfg.num_layers, batch_size, max_len, cfg.num_query_groups // tp, cfg.head_dim,
                   dtype or p.dtype, p.device)
