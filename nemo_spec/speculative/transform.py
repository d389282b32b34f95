"""SpeculativeTransform: attach an EAGLE-1 / EAGLE-3 / Medusa draft to a megatron-core GPTModel.

Two spellings::

    SpeculativeTransform(num_eagle_layers=1, num_medusa_heads=0)      # NeMo's (EAGLE defaults to eagle3)
    SpeculativeTransform(algorithm="eagle3", num_eagle_layers=1, draft_vocab_size=32000)
    SpeculativeTransform(algorithm="peagle", num_eagle_layers=2, parallel_depth=4, mask_token_id=0)
    SpeculativeTransform(algorithm="dflash", num_layers=2, block_size=8, target_layer_ids=[1, 3], mask_token_id=0)

``transform(model)`` accepts a GPTModel (returns a SpeculativeGPT), a SpeculativeGPT (idempotent no-op for the
same draft; refuses a different one), or any module (e.g. a LightningModule) holding one of those as a
submodule, which is swapped in place (the holder is returned).
"""
from __future__ import annotations

import copy
import dataclasses
import logging
from typing import List, Optional, Tuple

import torch
from megatron.core.models.gpt import GPTModel

from nemo_spec import parallel
from nemo_spec._mcore import activation as mcore_activation
from nemo_spec.config import ALGORITHMS, ConfigError, ModelConfig, SpeculativeConfig
from nemo_spec.speculative.model import SpeculativeGPT

log = logging.getLogger(__name__)

# Fields that define each algorithm's draft architecture: a second transform must agree on these
# (fields another algorithm uses, e.g. num_medusa_heads for an EAGLE draft, are ignored).
ARCH_FIELDS = {
    "eagle1": ("num_eagle_layers",),
    "eagle3": ("num_eagle_layers", "draft_vocab_size", "aux_layers", "norm_before_fc", "norm_before_residual",
               "norm_output"),
    "medusa": ("num_medusa_heads", "num_medusa_layers"),
    "peagle": ("num_eagle_layers", "draft_vocab_size", "aux_layers", "mask_token_id"),
    "dflash": ("num_eagle_layers", "target_layer_ids", "mask_token_id"),
}
#: training/drafting settings a re-applied transform may change on an existing draft (not its shape)
_SOFT_FIELDS = ("ttt_steps", "parallel_depth", "cod_ratio", "cod_ratio_min", "depth_warmup_steps", "block_size",
                "num_anchors", "loss_decay_gamma", "dflash_targets")
#: keyword settings of SpeculativeTransform that only DFlash uses
_DFLASH_FIELDS = ("block_size", "target_layer_ids", "num_anchors", "loss_decay_gamma", "dflash_targets")


def _resolve_config(algorithm: Optional[str], num_eagle_layers: Optional[int], num_medusa_heads: Optional[int],
                    num_medusa_layers: Optional[int], draft_vocab_size: Optional[int],
                    aux_layers: Optional[List[int]], ttt_steps: Optional[int],
                    peagle: Optional[dict] = None, dflash: Optional[dict] = None,
                    options: Optional[dict] = None) -> SpeculativeConfig:
    """Build a SpeculativeConfig from either spelling, raising ConfigError on contradictions."""
    options = {k: v for k, v in (options or {}).items() if v is not None}
    peagle = {k: v for k, v in (peagle or {}).items() if v is not None}
    dflash = {k: v for k, v in (dflash or {}).items() if v is not None}
    if algorithm == "dflash" and "mask_token_id" in peagle:  # shared by P-EAGLE and DFlash
        dflash["mask_token_id"] = peagle.pop("mask_token_id")
    for name in ("block_size", "num_anchors"):
        v = dflash.get(name)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ConfigError(f"SpeculativeTransform: {name} must be a positive int, got {v!r}")
    for name, v in (("num_eagle_layers", num_eagle_layers), ("num_medusa_heads", num_medusa_heads),
                    ("num_medusa_layers", num_medusa_layers), ("draft_vocab_size", draft_vocab_size),
                    ("ttt_steps", ttt_steps), ("parallel_depth", peagle.get("parallel_depth")),
                    ("mask_token_id", peagle.get("mask_token_id", dflash.get("mask_token_id")))):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise ConfigError(f"SpeculativeTransform: {name} must be a non-negative int, got {v!r}")
    eagle = num_eagle_layers or 0
    medusa = num_medusa_heads or 0
    if algorithm is None:
        if eagle > 0 and medusa > 0:
            raise ConfigError(f"SpeculativeTransform: both EAGLE (num_eagle_layers={eagle}) and Medusa "
                              f"(num_medusa_heads={medusa}) requested; choose one")
        if eagle == 0 and medusa == 0:
            raise ConfigError("SpeculativeTransform: neither EAGLE nor Medusa requested "
                              f"(num_eagle_layers={num_eagle_layers!r}, num_medusa_heads={num_medusa_heads!r}); "
                              "set one of them > 0 or pass algorithm=")
        algorithm = "eagle3" if eagle > 0 else "medusa"
    if algorithm not in ALGORITHMS:
        raise ConfigError(f"SpeculativeTransform: unknown algorithm {algorithm!r}; choose one of {ALGORITHMS}")
    if algorithm == "medusa":
        if eagle > 0:
            raise ConfigError(f"SpeculativeTransform: algorithm='medusa' but num_eagle_layers={eagle} also requested")
        if num_medusa_heads is not None and num_medusa_heads == 0:
            raise ConfigError("SpeculativeTransform: num_medusa_heads must be > 0 for medusa, got 0")
        if aux_layers is not None:
            raise ConfigError("SpeculativeTransform: aux_layers is only used by eagle3")
    else:
        if medusa > 0:
            raise ConfigError(f"SpeculativeTransform: algorithm={algorithm!r} but num_medusa_heads={medusa} also "
                              "requested; choose one")
        if num_eagle_layers is not None and num_eagle_layers == 0:
            raise ConfigError(f"SpeculativeTransform: num_eagle_layers must be > 0 for {algorithm}, got 0")
        if algorithm == "eagle1" and aux_layers is not None:
            raise ConfigError("SpeculativeTransform: aux_layers is only used by eagle3 and peagle")
    if peagle and algorithm != "peagle":
        raise ConfigError(f"SpeculativeTransform: {sorted(peagle)} only apply to algorithm='peagle', not {algorithm}")
    if dflash and algorithm != "dflash":
        raise ConfigError(f"SpeculativeTransform: {sorted(dflash)} only apply to algorithm='dflash', not {algorithm}")
    if algorithm == "dflash" and aux_layers is not None:
        raise ConfigError("SpeculativeTransform: dflash takes target_layer_ids (0-based base layers), not aux_layers")
    if peagle.get("parallel_depth") == 0:
        raise ConfigError("SpeculativeTransform: parallel_depth must be > 0, got 0")
    if num_medusa_layers is not None and num_medusa_layers == 0:
        raise ConfigError("SpeculativeTransform: num_medusa_layers must be > 0, got 0")
    if draft_vocab_size is not None and algorithm not in ("eagle3", "peagle"):
        raise ConfigError(f"SpeculativeTransform: draft_vocab_size is only used by eagle3 and peagle, not {algorithm}")
    if draft_vocab_size == 0:
        raise ConfigError("SpeculativeTransform: draft_vocab_size must be > 0, got 0")
    defaults = SpeculativeConfig()
    cfg = SpeculativeConfig(
        algorithm=algorithm,
        num_eagle_layers=(num_eagle_layers or defaults.num_eagle_layers) if algorithm != "medusa" else 0,
        num_medusa_heads=(num_medusa_heads or defaults.num_medusa_heads) if algorithm == "medusa" else 0,
        num_medusa_layers=num_medusa_layers or defaults.num_medusa_layers,
        draft_vocab_size=draft_vocab_size,
        aux_layers=list(aux_layers) if aux_layers is not None else None,
        ttt_steps=ttt_steps or defaults.ttt_steps,
        **peagle,
        **{k: (list(v) if k == "target_layer_ids" else v) for k, v in dflash.items()},
        **options,
    )
    return cfg.validate()


class SpeculativeTransform:
    """Callable that turns a GPTModel (or a module holding one) into a base + draft SpeculativeGPT."""

    def __init__(self, algorithm: Optional[str] = None, num_eagle_layers: Optional[int] = None,
                 num_medusa_heads: Optional[int] = None, num_medusa_layers: Optional[int] = None,
                 draft_vocab_size: Optional[int] = None, aux_layers: Optional[List[int]] = None,
                 ttt_steps: Optional[int] = None, config: Optional[SpeculativeConfig] = None,
                 parallel_depth: Optional[int] = None, mask_token_id: Optional[int] = None,
                 cod_ratio: Optional[float] = None, cod_ratio_min: Optional[float] = None,
                 block_size: Optional[int] = None, num_layers: Optional[int] = None,
                 target_layer_ids: Optional[List[int]] = None, num_anchors: Optional[int] = None,
                 loss_decay_gamma: Optional[float] = None, depth_warmup_steps: Optional[int] = None,
                 dflash_targets: Optional[str] = None, norm_before_fc: Optional[bool] = None,
                 norm_before_residual: Optional[bool] = None, norm_output: Optional[bool] = None) -> None:
        options = dict(norm_before_fc=norm_before_fc, norm_before_residual=norm_before_residual,
                       norm_output=norm_output)
        peagle = dict(parallel_depth=parallel_depth, mask_token_id=mask_token_id, cod_ratio=cod_ratio,
                      cod_ratio_min=cod_ratio_min, depth_warmup_steps=depth_warmup_steps)
        dflash = dict(block_size=block_size, target_layer_ids=target_layer_ids, num_anchors=num_anchors,
                      loss_decay_gamma=loss_decay_gamma, dflash_targets=dflash_targets)
        if num_layers is not None:  # DFlash spelling of the draft decoder layer count
            if num_eagle_layers is not None and num_eagle_layers != num_layers:
                raise ConfigError(f"SpeculativeTransform: num_layers={num_layers!r} and num_eagle_layers="
                                  f"{num_eagle_layers!r} disagree (both name the draft decoder layers)")
            if algorithm not in ("dflash", "peagle", "eagle1", "eagle3"):
                raise ConfigError(f"SpeculativeTransform: num_layers is the draft decoder layer count of "
                                  f"EAGLE / P-EAGLE / DFlash drafts, not of {algorithm!r}")
            num_eagle_layers = num_layers
        if config is not None:
            given = {k: v for k, v in dict(algorithm=algorithm, num_eagle_layers=num_eagle_layers,
                                           num_medusa_heads=num_medusa_heads, num_medusa_layers=num_medusa_layers,
                                           draft_vocab_size=draft_vocab_size, aux_layers=aux_layers,
                                           ttt_steps=ttt_steps, **peagle, **dflash, **options).items()
                     if v is not None}
            if given:
                raise ConfigError(f"SpeculativeTransform: pass either config= or keyword settings, not both "
                                  f"(got config and {sorted(given)})")
            if not isinstance(config, SpeculativeConfig):
                raise ConfigError(f"SpeculativeTransform: config must be a SpeculativeConfig, got {type(config).__name__}")
            self.config = copy.deepcopy(config).validate()
        else:
            self.config = _resolve_config(algorithm, num_eagle_layers, num_medusa_heads, num_medusa_layers,
                                          draft_vocab_size, aux_layers, ttt_steps, peagle, dflash, options)

    def __repr__(self) -> str:
        return f"SpeculativeTransform({self.config})"

    def validate_for(self, model_config: ModelConfig, tp_size: int) -> SpeculativeConfig:
        """Check this draft against the base architecture and TP size (before any heavy work); returns a copy."""
        cfg = copy.deepcopy(self.config).validate(model_config)
        model_config.check_tensor_parallel(tp_size)
        if cfg.algorithm in ("eagle3", "peagle"):
            vd = cfg.draft_vocab_size or model_config.vocab_size
            if vd % tp_size:
                raise ConfigError(f"tensor parallel size {tp_size} does not divide draft_vocab_size={vd} "
                                  "(the EAGLE-3 head is vocab-parallel)")
        if cfg.algorithm in ("peagle", "dflash") and cfg.mask_token_id is None:  # fixed at build time, stored
            cfg = dataclasses.replace(cfg, mask_token_id=cfg.resolved_mask_token_id(model_config))
            log.info("%s mask_token_id not given: using %d", cfg.algorithm, cfg.mask_token_id)
        if cfg.algorithm == "dflash":
            if cfg.target_layer_ids is None:  # fixed at build time too (the fc width depends on it)
                cfg = dataclasses.replace(cfg, target_layer_ids=cfg.resolved_target_layer_ids(model_config.num_layers))
                log.info("DFlash target_layer_ids not given: using %s", cfg.target_layer_ids)
            for name, n in (("num_attention_heads", model_config.num_attention_heads),
                            ("num_query_groups", model_config.num_query_groups)):
                if n % tp_size:
                    raise ConfigError(f"tensor parallel size {tp_size} does not divide {name}={n} (DFlash layers "
                                      "have the base's attention shape)")
        return cfg

    def __call__(self, model: torch.nn.Module) -> torch.nn.Module:
        """Attach the draft; see the module docstring for what ``model`` may be."""
        if isinstance(model, SpeculativeGPT):
            return self._reapply(model)
        if isinstance(model, GPTModel):
            new_model = self._transform_gpt(model)
            _swap_in_holders(model, new_model)
            return new_model
        parent, name, found = _find_holder(model)
        if found is None:
            raise TypeError(f"SpeculativeTransform: no megatron-core GPTModel found inside {type(model).__name__} "
                            "(apply it after the model is built, e.g. in configure_model)")
        new = self._reapply(found) if isinstance(found, SpeculativeGPT) else self._transform_gpt(found)
        if new is not found:
            setattr(parent, name, new)
            log.info("replaced %s.%s with a SpeculativeGPT", type(parent).__name__, name)
        return model

    def conflict(self, old: SpeculativeConfig, model_cfg: ModelConfig, tp: int) -> Optional[str]:
        """Why this transform cannot re-apply to a model already carrying the draft ``old`` (None: it is the same
        draft, re-applying is a no-op but for soft settings)."""
        new = self.config
        if old.algorithm != new.algorithm:
            return f"model already carries a {old.algorithm} draft; refusing to stack {new.algorithm} on it"
        new_checked = self.validate_for(model_cfg, tp)
        diff = [f for f in ARCH_FIELDS[old.algorithm] if getattr(old, f) != getattr(new_checked, f)
                and not (f == "aux_layers" and new_checked.aux_layers is None)
                and not (f == "draft_vocab_size" and new_checked.draft_vocab_size is None)
                and not (f == "mask_token_id" and self.config.mask_token_id is None)
                and not (f == "target_layer_ids" and self.config.target_layer_ids is None)]
        if diff:
            detail = ", ".join(f"{f}: {getattr(old, f)!r} -> {getattr(new_checked, f)!r}" for f in diff)
            return f"model already carries a {old.algorithm} draft with a different shape ({detail})"
        return None

    def _reapply(self, model: SpeculativeGPT) -> SpeculativeGPT:
        """Idempotence: same draft -> no-op; a different draft/algorithm -> ConfigError (no stacking)."""
        old = model.spec_config
        why = self.conflict(old, model.model_config, parallel.tp_size())
        if why:
            raise ConfigError(why)
        new_checked = self.validate_for(model.model_config, parallel.tp_size())
        changed = {f: getattr(new_checked, f) for f in _SOFT_FIELDS if getattr(old, f) != getattr(new_checked, f)}
        if changed:
            log.info("speculative transform re-applied: %s", ", ".join(f"{f} -> {v}" for f, v in changed.items()))
            model.spec_config = dataclasses.replace(old, **changed)
        return model

    def _transform_gpt(self, gpt: GPTModel) -> SpeculativeGPT:
        """Build the draft for a plain GPTModel."""
        for flag, what in (("pre_process", "the embedding"), ("post_process", "the output layer")):
            if not getattr(gpt, flag, True):
                raise ConfigError(f"{type(gpt).__name__} has {flag}=False (a pipeline stage without {what}): the "
                                  f"draft needs the whole model's embedding and output layer; build the model "
                                  f"without pipeline parallelism")
        model_config = getattr(gpt, "nemo_spec_config", None)
        derived = model_config is None
        if derived:
            model_config = model_config_from_megatron(gpt)
        cfg = self.validate_for(model_config, parallel.tp_size())
        if derived:  # so that models.unwrap()/model_config() work on the result
            gpt.nemo_spec_config = model_config
            log.info("derived ModelConfig from the megatron config of %s: %s", type(gpt).__name__, model_config)
        return SpeculativeGPT(gpt, cfg, model_config)


def _swap_in_holders(old: torch.nn.Module, new: torch.nn.Module) -> None:
    """Replace ``old`` by ``new`` in every module that holds it as a child (e.g. ``transform(lightning_module.module)``:
    without this the holder would keep the now-frozen base and train nothing)."""
    import gc

    for ref in gc.get_referrers(old):
        if not isinstance(ref, dict) or ref is vars(new):
            continue
        names = [k for k, v in ref.items() if v is old]
        holders = []
        for r in gc.get_referrers(ref):  # the holder itself, or its instance __dict__ (then the holder refers to it)
            cands = [r] if isinstance(r, torch.nn.Module) else (
                gc.get_referrers(r) if isinstance(r, dict) and r.get("_modules") is ref else [])
            holders += [m for m in cands if isinstance(m, torch.nn.Module) and getattr(m, "_modules", None) is ref]
        for holder in holders:
            if holder is not new:
                for name in names:
                    holder._modules[name] = new
                    log.info("replaced %s.%s with the SpeculativeGPT (the transform was given the submodule)",
                             type(holder).__name__, name)


def _find_holder(root: torch.nn.Module) -> Tuple[Optional[torch.nn.Module], str, Optional[torch.nn.Module]]:
    """(parent, attribute, module) of the first SpeculativeGPT or GPTModel inside ``root``."""
    for qual, mod in root.named_modules():
        if isinstance(mod, (SpeculativeGPT, GPTModel)) and qual:
            parent_name, _, leaf = qual.rpartition(".")
            parent = root.get_submodule(parent_name) if parent_name else root
            return parent, leaf, mod
    return None, "", None


def model_config_from_megatron(gpt: GPTModel) -> ModelConfig:
    """Best-effort ModelConfig for a GPTModel not built by nemo_spec (e.g. NeMo 2's ``module``)."""
    c = gpt.config
    tp = c.tensor_model_parallel_size
    vocab = getattr(gpt, "vocab_size", None) or gpt.embedding.word_embeddings.weight.shape[0] * tp
    rope_scaling = None
    if hasattr(c, "nemo_rope"):  # built from our layer spec: RoPE lives in the core attention
        rope, rope_base, rope_scaling = c.nemo_rope, c.nemo_rope_theta, c.nemo_rope_scaling
    else:
        rope = getattr(gpt, "position_embedding_type", "rope") == "rope"
        rope_base = 10000.0
    if not hasattr(c, "nemo_rope") and rope and getattr(gpt, "rotary_pos_emb", None) is not None:
        inv = gpt.rotary_pos_emb.inv_freq
        if inv.numel() > 1:  # inv_freq[1] = base^(-2/d) (a high frequency: no Llama-3 scaling applies to it)
            rope_base = _round_theta(float(inv[1].double() ** (-c.kv_channels / 2.0)), inv, c.kv_channels)
        rotary_base = getattr(c, "rotary_base", None) or getattr(gpt.rotary_pos_emb, "rotary_base", None)
        if rotary_base:
            rope_base = float(rotary_base)
        if getattr(c, "scale_factor", None) and getattr(c, "old_context_len", None):
            # NeMo's Llama31Config scales inv_freq after building (nemo/collections/llm/gpt/model/llama.py
            # apply_rope_scaling), with the HF 'llama3' rule
            rope_scaling = {"rope_type": "llama3", "factor": float(c.scale_factor),
                            "low_freq_factor": float(getattr(c, "low_freq_factor", 1.0)),
                            "high_freq_factor": float(getattr(c, "high_freq_factor", 4.0)),
                            "original_max_position_embeddings": int(c.old_context_len)}
        elif getattr(gpt.rotary_pos_emb, "seq_len_interpolation_factor", None):
            # megatron divides the positions by it (rotary_pos_embedding.py): HF 'linear' scaling
            rope_scaling = {"rope_type": "linear", "factor": float(gpt.rotary_pos_emb.seq_len_interpolation_factor)}
    # None: none of ours computes it (squared ReLU, ...). The model still trains through its own forward; a
    # conversion to our layer spec (generation, save, export) is refused naming it (foreign.conversion_problems).
    activation = mcore_activation(getattr(c.activation_func, "__name__", ""), bool(c.gated_linear_unit),
                                  bool(getattr(c, "bias_activation_fusion", False))) or "gelu"
    return ModelConfig(
        vocab_size=int(vocab), hidden_size=c.hidden_size, num_layers=c.num_layers,
        num_attention_heads=c.num_attention_heads, ffn_hidden_size=c.ffn_hidden_size,
        num_query_groups=c.num_query_groups or c.num_attention_heads, head_dim=c.kv_channels,
        max_position_embeddings=int(getattr(gpt, "max_sequence_length", 2048)),
        family="llama" if rope else "gpt2", normalization=c.normalization, norm_eps=c.layernorm_epsilon,
        activation=activation, position_embedding="rope" if rope else "learned", rope_theta=round(rope_base, 3),
        rope_scaling=dict(rope_scaling) if rope_scaling else None,
        add_bias_linear=c.add_bias_linear, add_qkv_bias=bool(getattr(c, "add_qkv_bias", False)),
        tie_word_embeddings=gpt.share_embeddings_and_output_weights, init_method_std=c.init_method_std,
        qk_layernorm=bool(getattr(c, "qk_layernorm", False)))


def _round_theta(theta: float, inv: torch.Tensor, head_dim: int) -> float:
    """The RoPE base read back from a model's (float32) inv_freq is off in its last digits (999997.4 for 1e6): the
    shortest decimal whose frequencies are the model's own."""
    from nemo_spec.models.attention import rope_inv_freq

    for digits in range(1, 10):
        cand = float(f"{theta:.{digits}g}")
        ours = rope_inv_freq(head_dim, cand, None)
        if ours.shape == inv.shape and torch.allclose(ours, inv.float().cpu(), rtol=1e-6, atol=0):
            return cand
    return theta
