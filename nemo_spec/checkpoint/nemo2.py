"""NeMo 2 checkpoint directories (``context/`` + ``weights/``), read without NeMo installed.

Layout (as NeMo 2.7 writes it, nemo/lightning/io/pl.py ``MegatronCheckpointIO`` + ``TrainerContext``)::

    <ckpt>/context/model.yaml      the LightningModule's config tree (``config:`` = its GPTConfig fields)
    <ckpt>/context/io.json         the same, fiddle-serialised (not read here)
    <ckpt>/context/<dir>/          the tokenizer artifacts (HF files), named by ``tokenizer.pretrained_model_name``
    <ckpt>/weights/                megatron ``torch_dist`` (keys ``module.<GPTModel key>``, layers stacked,
                                   local-spec norms under TE names ``linear_qkv.layer_norm_weight``)

The architecture comes from ``model.yaml`` (anything nemo_spec's layer spec cannot represent is refused, naming
the field), the padded vocabulary from the weights' metadata; weights load at any TP size through
``dist_checkpointing`` with our keys mapped onto the checkpoint's (``legacy._dist_sharded_state_dict``).
A draft trained through NeMo (``module.eagle_module.*`` / ``module.medusa_heads.*``) is not restored from here
(its settings are not in the checkpoint): the base loads and a warning says so.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from nemo_spec._mcore import activation, function_changing_settings
from nemo_spec.config import ConfigError, ModelConfig

log = logging.getLogger(__name__)

#: key of nemo_spec's record (the draft's SpeculativeConfig) in a NeMo checkpoint's common state
CHECKPOINT_KEY = "nemo_spec"


def is_nemo2_dir(p: Path) -> bool:
    """Whether ``p`` is a NeMo 2 checkpoint directory (``context/`` and a complete ``weights/``)."""
    return (p / "context").is_dir() and (p / "weights" / "metadata.json").is_file()


def _errors():
    from nemo_spec.checkpoint.megatron import CheckpointConfigError, CheckpointError

    return CheckpointError, CheckpointConfigError


def yaml_with(f: Path, key: str, what: str) -> Dict[str, Any]:
    """The YAML document in ``f``, which must hold a mapping under ``key`` (``what``, for the error)."""
    import yaml

    CheckpointError, _ = _errors()
    try:
        doc = yaml.safe_load(f.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise CheckpointError(f"{f}: cannot parse ({e})") from e
    if not isinstance(doc, dict) or not isinstance(doc.get(key), dict):
        raise CheckpointError(f"{f}: no {key!r} mapping ({what})")
    return doc


def _read_yaml(p: Path) -> Dict[str, Any]:
    CheckpointError, _ = _errors()
    f = p / "context" / "model.yaml"
    if not f.is_file():
        raise CheckpointError(f"{p} looks like a NeMo 2 checkpoint but has no context/model.yaml")
    return yaml_with(f, "config", "the model's GPTConfig")


def _target(v: Any) -> str:
    return str(v.get("_target_", "")) if isinstance(v, dict) else str(v or "")


def saved_settings(c: Dict[str, Any]) -> Dict[str, Any]:
    """The parameter dtype and TP size a GPTConfig / model provider (``c``) was saved with."""
    dtype = _target(c.get("params_dtype")) or ("torch.bfloat16" if c.get("bf16") else "torch.float32")
    return {"params_dtype": dtype.replace("torch.", ""), "tp_size_saved": int(c.get("tensor_model_parallel_size") or 1)}


def _vocab_from_weights(wdir: Path, source: str) -> int:
    from megatron.core import dist_checkpointing

    CheckpointError, _ = _errors()
    try:
        meta = dist_checkpointing.load_tensors_metadata(str(wdir))
    except Exception as e:  # noqa: BLE001 - any reader failure is an unreadable checkpoint
        raise CheckpointError(f"{wdir}: cannot read the torch_dist metadata ({type(e).__name__}: {e})") from e
    for k, v in meta.items():
        if k.endswith("embedding.word_embeddings.weight") and not k.startswith("optimizer."):  # not Adam's copies
            return int(v.global_shape[0])
    raise CheckpointError(f"{wdir}: no embedding.word_embeddings.weight tensor (is {source} a GPT checkpoint?)")


def model_config_from_yaml(c: Dict[str, Any], vocab: int, source: str) -> ModelConfig:
    """Map a NeMo GPTConfig (``model.yaml`` ``config:``) to a ModelConfig; unsupported features raise naming them.
    Qwen3's per-head q/k norms (``qk_layernorm``) are read (checked against NeMo 2.7.3's and Megatron Bridge's own
    Qwen3 checkpoints)."""
    _, CheckpointConfigError = _errors()

    def unsupported(what: str, fld: str) -> Exception:
        return CheckpointConfigError(f"{source}: unsupported architecture: {what} (config.{fld}={c.get(fld)!r})")

    for fld in ("num_layers", "hidden_size", "num_attention_heads"):
        if not isinstance(c.get(fld), int):
            raise CheckpointConfigError(f"{source}: config.{fld} is missing or not an int")
    refused = [("num_moe_experts", "mixture of experts"), ("multi_latent_attention", "multi-latent attention"),
               ("rotary_interleaved", "interleaved RoPE"),
               ("apply_residual_connection_post_layernorm", "post-norm residuals")]
    for fld, what in refused:
        if c.get(fld):
            raise unsupported(what, fld)
    # settings megatron applies that the project spec does not have (e.g. MistralConfig7B's window_size [4096, 0]):
    # loading without them gave another model's logits
    gated = bool(c.get("gated_linear_unit", False))
    for fld, _, what in function_changing_settings(c.get, gated, gated and bool(c.get("bias_activation_fusion"))):
        raise unsupported(what, fld)
    if float(c.get("rotary_percent", 1.0) or 1.0) != 1.0:
        raise unsupported("partial RoPE", "rotary_percent")
    pos = c.get("position_embedding_type", "rope")
    if pos not in ("rope", "learned_absolute"):
        raise unsupported(f"position embedding {pos!r}", "position_embedding_type")
    norm = c.get("normalization", "LayerNorm")
    if norm not in ("LayerNorm", "RMSNorm"):
        raise unsupported(f"normalization {norm!r}", "normalization")
    act_name = _target(c.get("activation_func")).rsplit(".", 1)[-1]
    act = activation(act_name, gated, bool(c.get("bias_activation_fusion")))
    if act is None:
        raise unsupported(f"gated MLP with {act_name}" if gated else
                          f"activation {act_name or c.get('activation_func')!r}", "activation_func")
    rope_scaling = None
    if c.get("rope_scaling") and c.get("seq_len_interpolation_factor"):
        raise unsupported("Llama 3 RoPE scaling (config.rope_scaling=True) and a sequence length interpolation together",
                          "seq_len_interpolation_factor")
    if "scale_factor" in c and "old_context_len" in c:  # Llama31Config and subclasses (llama.py apply_rope_scaling)
        rope_scaling = {"rope_type": "llama3", "factor": float(c["scale_factor"]),
                        "low_freq_factor": float(c.get("low_freq_factor", 1.0)),
                        "high_freq_factor": float(c.get("high_freq_factor", 4.0)),
                        "original_max_position_embeddings": int(c["old_context_len"])}
    elif c.get("rope_scaling"):
        # Megatron Bridge's providers: megatron-core's own switch, RotaryEmbedding(rope_scaling=True,
        # rope_scaling_factor=f) -> _apply_scaling(inv_freq, factor=f) with its defaults low_freq_factor=1,
        # high_freq_factor=4, original_max_position_embeddings=8192
        rope_scaling = {"rope_type": "llama3", "factor": float(c.get("rope_scaling_factor", 8.0)),
                        "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    elif c.get("seq_len_interpolation_factor"):
        rope_scaling = {"rope_type": "linear", "factor": float(c["seq_len_interpolation_factor"])}
    learned = pos == "learned_absolute"
    heads = int(c["num_attention_heads"])
    d = dict(
        vocab_size=vocab, hidden_size=int(c["hidden_size"]), num_layers=int(c["num_layers"]),
        num_attention_heads=heads, ffn_hidden_size=int(c.get("ffn_hidden_size") or 4 * int(c["hidden_size"])),
        num_query_groups=int(c["num_query_groups"]) if c.get("num_query_groups") else None,
        head_dim=int(c["kv_channels"]) if c.get("kv_channels") else None,
        max_position_embeddings=int(c.get("seq_length") or c.get("max_position_embeddings") or 2048),
        family="gpt2" if (learned and norm == "LayerNorm" and not gated) else "llama",
        normalization=norm, norm_eps=float(c.get("layernorm_epsilon", 1e-5)), activation=act,
        position_embedding="learned" if learned else "rope", rope_theta=float(c.get("rotary_base", 10000)),
        rope_scaling=rope_scaling, add_bias_linear=bool(c.get("add_bias_linear", True)),
        add_qkv_bias=bool(c.get("add_qkv_bias", False)),
        tie_word_embeddings=bool(c.get("share_embeddings_and_output_weights", True)),
        init_method_std=float(c.get("init_method_std", 0.02)), qk_layernorm=bool(c.get("qk_layernorm", False)),
    )
    try:
        return ModelConfig(**d)
    except ConfigError as e:
        raise CheckpointConfigError(f"{source}: {e}") from e


def tokenizer_dir(p: Path) -> Optional[Path]:
    """The HF tokenizer directory inside ``context/`` (named by ``tokenizer.pretrained_model_name``), or None."""
    from nemo_spec.checkpoint.megatron import TOKENIZER_FILES

    ctx = p / "context"
    cands = []
    try:
        tok = _read_yaml(p).get("tokenizer") or {}
        name = tok.get("pretrained_model_name") if isinstance(tok, dict) else None
        if isinstance(name, str) and name:
            cands.append(ctx / name)
    except Exception:  # noqa: BLE001 - a tokenizer is optional
        pass
    cands += [ctx / "nemo_tokenizer"] + sorted(x for x in ctx.iterdir() if x.is_dir())
    for d in cands:
        if d.is_dir() and any((d / f).is_file() for f in TOKENIZER_FILES):
            return d
    return None


def read_config(p: Path) -> Dict[str, Any]:
    """{"format": "nemo2", "model": ModelConfig dict, "params_dtype", "tp_size_saved", "source", "target",
    "draft_modules" (draft tensors stored), ["speculative"] (the recorded draft)}."""
    doc = _read_yaml(p)
    source = str(p / "context" / "model.yaml")
    c = doc["config"]
    cfg = model_config_from_yaml(c, _vocab_from_weights(p / "weights", source), source)
    drafts = draft_modules(p / "weights")
    out = {"format": "nemo2", "model": cfg.to_dict(), **saved_settings(c), "source": source, "target": _target(doc),
           "draft_modules": drafts}
    if drafts:
        spec = recorded_draft(p / "weights", cfg, source)
        if spec is not None:
            out["speculative"] = spec.to_dict()
    return out


def draft_modules(wdir: Path) -> List[str]:
    """The draft modules whose tensors a dist checkpoint stores ('eagle_module', 'medusa_heads'; under NeMo's
    ``module.`` prefix or not)."""
    from megatron.core import dist_checkpointing

    keys = (k[len("module."):] if k.startswith("module.") else k
            for k in dist_checkpointing.load_tensors_metadata(str(wdir)))
    return sorted({k.split(".")[0] for k in keys if k.startswith(("eagle_module.", "medusa_heads."))})


def recorded_draft(wdir: Path, cfg: ModelConfig, source: str) -> Optional[Any]:
    """The SpeculativeConfig nemo_spec's NeMo integration recorded in the checkpoint's common state
    (``weights/common.pt``, key :data:`CHECKPOINT_KEY`), or None."""
    from megatron.core import dist_checkpointing

    from nemo_spec.checkpoint.megatron import speculative_config_from

    try:
        common = dist_checkpointing.load_common_state_dict(str(wdir))
    except Exception as e:  # noqa: BLE001 - no readable common state: nothing recorded
        log.debug("%s: no common state (%s)", wdir, e)
        return None
    rec = common.get(CHECKPOINT_KEY) if isinstance(common, dict) else None
    if not isinstance(rec, dict) or not rec.get("speculative"):
        return None
    return speculative_config_from({"speculative": rec["speculative"]}, cfg, f"{source} ({CHECKPOINT_KEY} record)")


def load_nemo2(p: Path, tp_size: Optional[int] = None, dtype: Optional[torch.dtype] = None,
               base_only: bool = False) -> torch.nn.Module:
    """Load a NeMo 2 checkpoint at the current TP (any saved TP): the base GPTModel, or base + draft (a
    SpeculativeGPT) when the checkpoint holds a draft trained with nemo_spec's NeMo integration (its settings
    recorded in the common state) and ``base_only`` is False."""
    from nemo_spec.checkpoint import legacy
    from nemo_spec.checkpoint.megatron import _ensure_parallel, build_for_checkpoint, checkpoint_target, load_dist_into

    info = read_config(p)
    source = info["source"]
    cfg, tp, dtype = checkpoint_target(info, tp_size, dtype)
    wdir = p / "weights"
    drafts = info["draft_modules"]
    spec = None
    if not base_only and info.get("speculative"):
        from nemo_spec.checkpoint.megatron import speculative_config_from

        spec = speculative_config_from(info, cfg, source)
    _ensure_parallel(tp)
    model = build_for_checkpoint(cfg, spec, dtype, source)
    load_dist_into(model, wdir, source, sharded_sd=legacy._dist_sharded_state_dict(model, wdir))
    if drafts and spec is None and not base_only:
        log.warning("%s also holds a %s draft trained through NeMo but not its settings (saved before nemo_spec "
                    "recorded them, or not by nemo_spec.integrations.nemo); only the base is loaded", p, drafts[0])
    log.info("loaded NeMo 2 checkpoint %s (%s%s, saved tp=%d) at tp=%d", p, info["target"],
             f" + {spec.algorithm} draft" if spec is not None else "", info["tp_size_saved"], tp)
    return model
