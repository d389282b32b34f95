"""GPTModels built from other people's layer specs (megatron's local spec, Transformer Engine, NeMo 2).

nemo_spec's own layer spec puts :class:`~nemo_spec.models.attention.SDPACoreAttention` in every layer: RoPE by
explicit position id, arbitrary masks and a KV cache, all driven by an :class:`AttnContext` passed as
``attention_mask``. A model built from another spec (megatron's ``DotProductAttention``, TE's
``TEDotProductAttention``, NeMo's ``llm.GPTModel``) applies RoPE in ``GPTModel.forward`` and understands only
megatron masks, so it must never see an AttnContext. Such a *foreign* base is

* run for draft training through **its own forward** (its RoPE, its attention, its masks), with the decoder
  layers' outputs captured by forward hooks (:func:`foreign_forward`): the hidden states are exactly those of
  the model's own forward;
* refused, with an error naming the fix, by everything that needs a KV cache, tree masks or explicit
  positions (generation, verification) — :func:`to_project_spec` converts it into nemo_spec's spec (the same
  weights, the logits checked against the model's own forward).
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional, Sequence

import torch

from nemo_spec._mcore import activation, function_changing_settings
from nemo_spec.config import ConfigError

log = logging.getLogger(__name__)

#: relative tolerance of :func:`to_project_spec`'s logit check (different attention kernels, fp32 rounding)
CONVERT_RTOL = 1e-4


class ForeignSpecError(ConfigError):
    """An operation needs nemo_spec's layer spec (KV cache, tree masks, positions) and the model has another."""


def _core_attention(layer: torch.nn.Module) -> Optional[torch.nn.Module]:
    return getattr(getattr(layer, "self_attention", None), "core_attention", None)


def is_project_spec(gpt: torch.nn.Module) -> bool:
    """Whether every decoder layer of ``gpt`` (a GPTModel) attends through nemo_spec's SDPA core attention."""
    from nemo_spec.models.attention import SDPACoreAttention

    cached = getattr(gpt, "_nemo_spec_own_spec", None)
    if cached is not None:
        return cached
    layers = list(getattr(getattr(gpt, "decoder", None), "layers", []) or [])
    own = bool(layers) and all(isinstance(_core_attention(l), SDPACoreAttention) for l in layers)
    try:
        gpt._nemo_spec_own_spec = own
    except AttributeError:  # pragma: no cover - exotic wrappers
        pass
    return own


def require_project_spec(gpt: torch.nn.Module, what: str) -> None:
    """Raise ForeignSpecError naming ``what`` and the conversion when ``gpt`` is not built from nemo_spec's spec."""
    if is_project_spec(gpt):
        return
    core = type(_core_attention(gpt.decoder.layers[0])).__name__ if len(gpt.decoder.layers) else "?"
    raise ForeignSpecError(
        f"{what} needs nemo_spec's layer spec (KV cache, tree masks, explicit positions), but this "
        f"{type(gpt).__name__} attends through {core} (megatron's local, Transformer Engine or NeMo spec). "
        f"Convert it first: model = nemo_spec.models.foreign.to_project_spec(model) (same weights, logits "
        f"checked), or save it and load the checkpoint with nemo_spec.checkpoint.load_model")


def causal_megatron_mask(s: int, device: torch.device) -> Optional[torch.Tensor]:
    """The attention mask a megatron-spec GPTModel needs for plain causal attention over ``s`` tokens: None on
    CUDA (TE / megatron build their causal mask there), an explicit ``[1, 1, s, s]`` bool mask (True = masked
    out, megatron's convention) on CPU, where megatron's default causal mask is created with ``device="cuda"``
    (megatron/core/transformer/utils.py ``get_default_causal_mask``)."""
    if device.type == "cuda":
        return None
    return torch.ones(s, s, dtype=torch.bool, device=device).triu(1)[None, None]


class _StopForward(Exception):
    """Raised by the decoder hook when the logits are not wanted (the output layer never runs)."""


@contextmanager
def _capture(gpt: torch.nn.Module, layers: Sequence[int], stop_after_decoder: bool) -> Iterator[Dict[Any, Any]]:
    """Forward hooks on the wanted decoder layers and on the decoder (final-normed hidden [s, b, h])."""
    got: Dict[Any, Any] = {}
    handles = []
    blocks = gpt.decoder.layers
    from nemo_spec import parallel

    # under sequence parallelism (NeMo's default at TP > 1) the decoder's outputs are this rank's slice of the
    # sequence [s / tp, b, h]; the draft reads every position, as the output layer does: gather them
    sharded = bool(getattr(gpt.config, "sequence_parallel", False)) and parallel.tp_size() > 1

    def full(out: Any) -> torch.Tensor:
        out = out[0] if isinstance(out, (tuple, list)) else out
        if sharded:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            out = gather_from_sequence_parallel_region(out, tensor_parallel_output_grad=False)
        return out

    def layer_hook(i: int):
        def hook(module, args, output):
            got[i] = full(output)
        return hook

    def decoder_hook(module, args, output):
        got["final"] = full(output)
        if stop_after_decoder:
            raise _StopForward

    try:
        for i in sorted(set(layers)):
            handles.append(blocks[i].register_forward_hook(layer_hook(i)))
        handles.append(gpt.decoder.register_forward_hook(decoder_hook))
        yield got
    finally:
        for h in handles:
            h.remove()


def foreign_forward(gpt: torch.nn.Module, input_ids: torch.Tensor, aux_layers: Sequence[int] = (),
                    compute_logits: bool = True, gather: bool = True, position_ids: Optional[torch.Tensor] = None,
                    attention_mask: Any = "causal", **forward_kwargs: Any):
    """``gpt``'s own forward on input_ids [b, s] with the outputs of ``aux_layers`` (0-based) captured: a
    :class:`~nemo_spec.models.gpt.GPTOutput` ([b, s, ...] tensors). ``attention_mask`` "causal" builds the
    plain causal mask (:func:`causal_megatron_mask`); anything else is passed to the model as given (NeMo's
    batch mask). Without ``compute_logits`` the forward stops after the decoder (no output layer)."""
    from nemo_spec.models.gpt import GPTOutput, gather_vocab

    b, s = input_ids.shape
    n = len(gpt.decoder.layers)
    for i in aux_layers:
        if not 0 <= i < n:
            raise ConfigError(f"auxiliary layer {i} is outside the base's {n} decoder layers")
    if position_ids is None:
        position_ids = torch.arange(s, device=input_ids.device)[None].expand(b, s)
    if isinstance(attention_mask, str) and attention_mask == "causal":
        attention_mask = causal_megatron_mask(s, input_ids.device)
    logits = None
    with _capture(gpt, aux_layers, stop_after_decoder=not compute_logits) as got:
        try:
            logits = gpt(input_ids, position_ids, attention_mask, **forward_kwargs)
        except _StopForward:
            pass
    if "final" not in got:
        raise RuntimeError(f"{type(gpt).__name__}.forward did not run its decoder (no final hidden state captured)")
    if logits is not None and gather:
        logits = gather_vocab(logits)
    uniq = sorted(set(aux_layers))
    return GPTOutput(logits=logits, hidden=got["final"].transpose(0, 1),
                     aux_hidden=[got[i].transpose(0, 1) for i in uniq])


def _inv_freq(gpt: torch.nn.Module) -> Optional[torch.Tensor]:
    rot = getattr(gpt, "rotary_pos_emb", None)
    return None if rot is None else getattr(rot, "inv_freq", None)


def _interpolation(gpt: torch.nn.Module) -> Optional[float]:
    """megatron's ``seq_len_interpolation_factor``: RotaryEmbedding divides the positions by it (megatron/core/models/
    common/embeddings/rotary_pos_embedding.py ``get_freqs_non_repeated``), i.e. HF 'linear' RoPE scaling."""
    rot = getattr(gpt, "rotary_pos_emb", None)
    f = getattr(rot, "seq_len_interpolation_factor", None) if rot is not None else None
    return float(f) if f else None


def conversion_problems(gpt: torch.nn.Module) -> List[str]:
    """What of ``gpt``'s architecture nemo_spec's layer spec cannot represent (empty when it converts); each names
    the option, so that nothing is converted into a silently different model."""

    c = gpt.config
    problems = []
    for name, bad in (("rotary_interleaved", True), ("multi_latent_attention", True),
                      ("apply_residual_connection_post_layernorm", True), ("add_qkv_bias", None)):
        v = getattr(c, name, False)
        if bad is not None and bool(v) == bad:
            problems.append(f"{name}={v}")
    if getattr(c, "num_moe_experts", None):
        problems.append(f"num_moe_experts={c.num_moe_experts}")
    gated = bool(c.gated_linear_unit)
    problems += [f"{fld}={v} ({what})" for fld, v, what in
                 function_changing_settings(lambda f: getattr(c, f, None), gated,
                                            gated and bool(getattr(c, "bias_activation_fusion", False)))
                 if fld != "mtp_num_layers"]  # the MTP layers themselves are checked below
    pos = getattr(gpt, "position_embedding_type", "rope")
    if pos not in ("rope", "learned_absolute"):
        problems.append(f"position_embedding_type={pos!r}")
    inv = _inv_freq(gpt)
    if pos == "rope" and inv is not None and 2 * inv.numel() != c.kv_channels:
        problems.append(f"rotary_percent={2 * inv.numel() / c.kv_channels:g} (RoPE on {2 * inv.numel()} of "
                        f"{c.kv_channels} head dims)")
    interp = _interpolation(gpt)
    if interp and getattr(c, "scale_factor", None) and getattr(c, "old_context_len", None):
        problems.append(f"seq_len_interpolation_factor={interp} together with Llama-3.1 RoPE scaling")
    act = getattr(c.activation_func, "__name__", str(c.activation_func))
    if activation(act, bool(c.gated_linear_unit), bool(getattr(c, "bias_activation_fusion", False))) is None:
        problems.append(f"gated_linear_unit with activation_func={act} (only SwiGLU)" if c.gated_linear_unit else
                        f"activation_func={act} without gated_linear_unit (only GELU: exact, or its tanh "
                        f"approximation)")
    if getattr(gpt, "mtp_process", False):
        problems.append("multi-token-prediction layers")
    return problems


def _state_dict_for_project_spec(gpt: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """``gpt``'s local (TP-shard) tensors under nemo_spec's layer-spec names (TE's fused norms unfused)."""
    out = {}
    for k, v in gpt.state_dict().items():
        if k.endswith("_extra_state") or "rotary_pos_emb" in k:
            continue
        k = k.replace(".self_attention.linear_qkv.layer_norm_", ".input_layernorm.")
        k = k.replace(".mlp.linear_fc1.layer_norm_", ".pre_mlp_layernorm.")
        out[k] = v
    return out


@torch.no_grad()
def convert_gpt(gpt: torch.nn.Module, check_tokens: int = 16) -> torch.nn.Module:
    """A GPTModel of nemo_spec's spec holding ``gpt``'s weights, its logits checked against ``gpt``'s own
    forward on ``check_tokens`` tokens (ForeignSpecError when the architecture cannot be represented or the
    logits differ)."""
    from nemo_spec.models.attention import rope_inv_freq
    from nemo_spec.models.gpt import build_gpt
    from nemo_spec.speculative.transform import model_config_from_megatron

    problems = conversion_problems(gpt)
    if problems:
        raise ForeignSpecError(f"{type(gpt).__name__} cannot be converted to nemo_spec's layer spec: "
                               f"{', '.join(problems)} not supported")
    cfg = getattr(gpt, "nemo_spec_config", None) or model_config_from_megatron(gpt)
    inv = _inv_freq(gpt)
    if cfg.position_embedding == "rope" and inv is not None:
        ours = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        theirs = inv.float().cpu() / (_interpolation(gpt) or 1.0)  # positions / f == frequencies / f
        if ours.shape != theirs.shape or not torch.allclose(ours, theirs, rtol=1e-5, atol=0):
            raise ForeignSpecError(f"{type(gpt).__name__}'s RoPE frequencies are not those of theta={cfg.rope_theta} "
                                   f"(scaled RoPE?); nemo_spec cannot reproduce them when converting")
    p = next(gpt.parameters())
    new = build_gpt(cfg, params_dtype=p.dtype, device=p.device)
    result = new.load_state_dict(_state_dict_for_project_spec(gpt), strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing or result.unexpected_keys:
        raise ForeignSpecError(f"converting {type(gpt).__name__}: no value for {missing[:4]}, unused "
                               f"{result.unexpected_keys[:4]}")
    new.eval()
    s = min(check_tokens, cfg.max_position_embeddings)
    ids = torch.randint(0, cfg.vocab_size, (1, s), generator=torch.Generator().manual_seed(0)).to(p.device)
    was_training = gpt.training
    gpt.eval()
    try:
        want = foreign_forward(gpt, ids).logits.float()
    finally:
        gpt.train(was_training)
    from nemo_spec.models.gpt import gpt_forward

    got = gpt_forward(new, ids).logits.float()
    err = (got - want).abs().max().item()
    scale = want.abs().max().item() or 1.0
    if err > CONVERT_RTOL * scale + (1e-2 * scale if p.dtype != torch.float32 else 0.0):
        raise ForeignSpecError(f"converted {type(gpt).__name__} does not reproduce its logits (max |diff| {err:.3g}, "
                               f"max |logit| {scale:.3g}); refusing a silently different model")
    log.info("converted %s to nemo_spec's layer spec (logits max |diff| %.2e)", type(gpt).__name__, err)
    return new


def to_project_spec(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` (a GPTModel or SpeculativeGPT, possibly wrapped) with its base in nemo_spec's layer spec: returned
    unchanged when it already is, else a converted copy (a SpeculativeGPT's copy shares its draft module)."""
    import copy

    from nemo_spec.models.gpt import unwrap, unwrap_speculative

    spec_model = unwrap_speculative(model)
    gpt = unwrap(model)
    if is_project_spec(gpt):
        return model
    new_gpt = convert_gpt(gpt)
    if spec_model is None:
        return new_gpt
    for prm in new_gpt.parameters():
        prm.requires_grad_(False)
    new = copy.copy(spec_model)
    new._modules = dict(spec_model._modules)
    new._modules["gpt"] = new_gpt
    return new
