"""Megatron-LM checkpoints: legacy per-rank files and torch_dist iteration directories.

Layout written by Megatron-LM's ``megatron/training/checkpointing.py``::

    <root>/latest_checkpointed_iteration.txt      # "<iteration>" or "release"
    <root>/iter_0000100/mp_rank_00/model_optim_rng.pt   # legacy ("torch") format, one file per TP rank
    <root>/iter_0000100/mp_rank_01/model_optim_rng.pt
    <root>/iter_0000100/mp_rank_00_001/model_optim_rng.pt   # with pipeline parallelism: mp_rank_<tp>_<pp>
    <root>/release/...                                  # when the tracker says "release"
    <root>/iter_0000100/{common.pt,metadata.json,*.distcp}  # torch_dist format (args inside common.pt)

Each legacy file is a dict with ``args`` (argparse.Namespace of Megatron-LM arguments), ``checkpoint_version``,
``iteration`` and ``model`` (a megatron-core GPTModel state dict, or, for pre-mcore Megatron-LM, the nested
``language_model`` dict of embedding/encoder/output_layer). Both are mapped onto our GPTModel's names, including
Transformer-Engine fused-norm names (``linear_qkv.layer_norm_weight``). Pipeline stages (local layer numbering)
are concatenated, TP shards merged and re-split for the current TP size (:mod:`nemo_spec.checkpoint.tp`).
Not supported (clear error): expert parallelism / MoE, virtual pipeline stages, checkpoint_version < 2.0 QKV order. The files hold a pickled Namespace, so they
are read with ``torch.load(weights_only=False)``: load only checkpoints you trust.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from nemo_spec import parallel
from nemo_spec._mcore import function_changing_settings
from nemo_spec.checkpoint import tp as tp_rules
from nemo_spec.checkpoint.megatron import (
    CheckpointConfigError,
    CheckpointError,
    DIST_METADATA,
    _ensure_parallel,
    checkpoint_target,
    load_dist_into,
)
from nemo_spec.config import ConfigError, ModelConfig

log = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"
MODEL_FILE = "model_optim_rng.pt"
_MP_RE = re.compile(r"^mp_rank_(\d{2})(_\d{3})?(_\d{3})?$")
_ITER_RE = re.compile(r"^iter_(\d{7})$")


@dataclass
class MegatronLMDir:
    """Where a Megatron-LM checkpoint's pieces are."""

    kind: str  # "megatron_legacy" | "megatron_dist"
    iter_dir: Path
    iteration: Optional[int]  # None for "release"
    tracker: Optional[Path] = None
    rank_files: List[List[Path]] = field(default_factory=list)  # legacy: [tp rank][pipeline stage] -> file

    @property
    def first_file(self) -> Path:
        """The TP-rank-0, first-stage file (holds the args)."""
        return self.rank_files[0][0]


def read_tracker(tracker: Path) -> Tuple[Optional[int], bool]:
    """Parse latest_checkpointed_iteration.txt: (iteration, release)."""
    text = tracker.read_text().strip()
    if text == "release":
        return None, True
    try:
        it = int(text)
    except ValueError:
        raise CheckpointError(f"{tracker}: expected an iteration number or 'release', got {text!r}") from None
    if it < 0:
        raise CheckpointError(f"{tracker}: negative iteration {it}")
    return it, False


def _iter_kind(d: Path) -> Optional[str]:
    if any(_MP_RE.match(x.name) for x in d.iterdir() if x.is_dir()):
        return "megatron_legacy"
    if (d / DIST_METADATA).is_file() and (d / "common.pt").is_file():
        return "megatron_dist"
    return None


def _has_args(d: Path) -> bool:
    try:
        common = _torch_load(d / "common.pt", mmap=False)
    except CheckpointError:
        return False
    return isinstance(common, dict) and common.get("args") is not None


def detect(p: Path) -> Optional[str]:
    """'megatron_legacy' / 'megatron_dist' if ``p`` is a Megatron-LM checkpoint root or iteration dir, else None."""
    if (p / TRACKER).is_file():
        return locate(p).kind
    if _ITER_RE.match(p.name) or p.name == "release" or any(_MP_RE.match(x.name) for x in p.iterdir() if x.is_dir()):
        kind = _iter_kind(p)
        if kind == "megatron_dist" and not _has_args(p):
            return None
        return kind
    if (p / DIST_METADATA).is_file() and (p / "common.pt").is_file() and _has_args(p):
        return "megatron_dist"
    iters = sorted(x.name for x in p.iterdir() if x.is_dir() and _ITER_RE.match(x.name))
    if iters:
        raise CheckpointError(f"{p} has Megatron-LM iteration directories {iters[-3:]} but no {TRACKER}; "
                              f"pass one iteration directory (e.g. {p / iters[-1]}) instead")
    return None


def locate(p: Path) -> MegatronLMDir:
    """Resolve a Megatron-LM root (with the tracker file) or an iteration directory to its files."""
    tracker = p / TRACKER
    if tracker.is_file():
        iteration, release = read_tracker(tracker)
        it_dir = p / ("release" if release else f"iter_{iteration:07d}")
        if not it_dir.is_dir():
            raise CheckpointError(f"{tracker} points to {it_dir.name}, but {it_dir} does not exist")
    else:
        tracker = None
        it_dir = p
        m = _ITER_RE.match(p.name)
        iteration = int(m.group(1)) if m else None
    kind = _iter_kind(it_dir)
    if kind is None:
        raise CheckpointError(f"{it_dir} holds neither mp_rank_XX/{MODEL_FILE} (legacy) nor "
                              f"common.pt + {DIST_METADATA} (torch_dist)")
    lay = MegatronLMDir(kind=kind, iter_dir=it_dir, iteration=iteration, tracker=tracker)
    if kind == "megatron_legacy":
        names = sorted(x.name for x in it_dir.iterdir() if x.is_dir() and _MP_RE.match(x.name))
        matches = [_MP_RE.match(n) for n in names]
        if any(m.group(3) for m in matches):
            raise CheckpointError(f"{it_dir}: expert-parallel checkpoints ({names[:4]}) are not supported")
        piped = {bool(m.group(2)) for m in matches}
        if len(piped) > 1:
            raise CheckpointError(f"{it_dir}: mixes mp_rank_XX and mp_rank_XX_YYY directories: {names[:6]}")
        tps = sorted({int(m.group(1)) for m in matches})
        pps = sorted({int(m.group(2)[1:]) for m in matches}) if piped == {True} else [None]
        if tps != list(range(len(tps))) or (pps != [None] and pps != list(range(len(pps)))):
            raise CheckpointError(f"{it_dir}: tensor/pipeline rank directories are not contiguous: {names}")
        lay.rank_files = [[it_dir / (f"mp_rank_{t:02d}" if p is None else f"mp_rank_{t:02d}_{p:03d}") / MODEL_FILE
                           for p in pps] for t in tps]
        for files in lay.rank_files:
            for f in files:
                if not f.is_file():
                    raise CheckpointError(f"{f} is missing")
    return lay


def _torch_load(f: Path, mmap: bool = True) -> Any:
    """torch.load a Megatron-LM file (weights_only=False: it pickles an argparse.Namespace; trusted files only)."""
    try:
        try:
            return torch.load(f, map_location="cpu", weights_only=False, mmap=mmap)
        except RuntimeError:
            if not mmap:
                raise
            return torch.load(f, map_location="cpu", weights_only=False)  # pre-zipfile format cannot be mmapped
    except FileNotFoundError as e:
        raise CheckpointError(f"{f} is missing") from e
    except Exception as e:  # noqa: BLE001 - unpickling errors come in many types
        raise CheckpointError(f"{f}: cannot be read as a torch checkpoint ({type(e).__name__}: {e})") from e


# ----------------------------------------------------------------------------------------------------------------
# args -> ModelConfig
# ----------------------------------------------------------------------------------------------------------------

def _arg(args: Any, name: str, default: Any = None) -> Any:
    v = getattr(args, name, default)
    return default if v is None else v


def legacy_model(args: Any) -> bool:
    """Did Megatron-LM build its legacy (``megatron/legacy``) GPT rather than megatron-core's? ``--use-legacy-models``
    since it became the opt-out; before that the default unless ``--use-mcore-models``."""
    if hasattr(args, "use_legacy_models"):
        return bool(args.use_legacy_models)
    return not bool(getattr(args, "use_mcore_models", False))


def _rope_scaling(args: Any, source: str) -> Optional[Dict[str, Any]]:
    """RoPE scaling of the model Megatron-LM built, which is not always what its arguments say: its megatron-core GPT
    builder passes ``rope_scaling=args.use_rope_scaling`` only (gpt_builders.py @ core_v0.16.1, pretrain_gpt.py since
    core_v0.10), so the model scales Llama-3.1-style with megatron-core's default factor 8 whatever
    ``--rope-scaling-factor`` says, and never interpolates positions (``--rotary-seq-len-interpolation-factor``
    reaches only the legacy model, megatron/legacy/model/language_model.py, which has no Llama-3.1 scaling)."""
    use_scaling = bool(getattr(args, "use_rope_scaling", False))
    interp = _arg(args, "rotary_seq_len_interpolation_factor", None)
    if legacy_model(args):
        if use_scaling:
            log.warning("%s: --use-rope-scaling is ignored by Megatron-LM's legacy GPT model; loading without it",
                        source)
        return {"rope_type": "linear", "factor": float(interp)} if interp else None
    if interp:
        log.warning("%s: --rotary-seq-len-interpolation-factor=%s never reached the megatron-core model (Megatron-LM's "
                    "GPT builder does not pass it); loading without position interpolation, as it was trained",
                    source, interp)
    if not use_scaling:
        return None
    factor = float(_arg(args, "rope_scaling_factor", 8.0))
    if factor != 8.0:
        log.warning("%s: --rope-scaling-factor=%s never reached the megatron-core model (Megatron-LM's GPT builder "
                    "passes only --use-rope-scaling, so GPTModel scaled by its default 8); loading with factor 8, as "
                    "it was trained", source, factor)
    return {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}


def args_to_model_config(args: Any, source: str) -> ModelConfig:
    """Map Megatron-LM arguments (argparse.Namespace) to a ModelConfig; unsupported features raise naming the field."""
    if args is None:
        raise CheckpointError(f"{source}: no 'args' saved, so the model architecture is unknown")

    def unsupported(what: str, fld: str) -> CheckpointConfigError:
        return CheckpointConfigError(f"{source}: unsupported architecture: {what} (args.{fld}={getattr(args, fld)!r})")

    for fld in ("num_layers", "hidden_size", "num_attention_heads"):
        if getattr(args, fld, None) is None:
            raise CheckpointError(f"{source}: args.{fld} is missing")
    if getattr(args, "num_experts", None):
        raise unsupported("mixture of experts", "num_experts")
    if getattr(args, "multi_latent_attention", False):
        raise unsupported("multi-latent attention", "multi_latent_attention")
    if getattr(args, "squared_relu", False):
        raise unsupported("squared-ReLU MLP", "squared_relu")
    if getattr(args, "apply_residual_connection_post_layernorm", False):
        raise unsupported("post-norm residuals", "apply_residual_connection_post_layernorm")
    if getattr(args, "qk_layernorm", False):
        raise unsupported("QK layer norm", "qk_layernorm")
    if getattr(args, "rotary_interleaved", False):
        raise unsupported("interleaved RoPE", "rotary_interleaved")
    if float(_arg(args, "rotary_percent", 1.0)) != 1.0:
        raise unsupported("partial RoPE", "rotary_percent")
    pos = getattr(args, "position_embedding_type", None)
    if pos is None:
        pos = "rope" if getattr(args, "use_rotary_position_embeddings", False) else (
            "learned_absolute" if _arg(args, "add_position_embedding", True) else "none")
    if pos not in ("rope", "learned_absolute"):
        raise unsupported(f"position embedding {pos!r}", "position_embedding_type")
    rope_scaling = _rope_scaling(args, source)
    add_bias = bool(_arg(args, "add_bias_linear", True))
    swiglu = bool(_arg(args, "swiglu", False))
    fused_glu = swiglu and bool(_arg(args, "bias_swiglu_fusion", True)) and not getattr(args, "use_te_activation_func",
                                                                                        False)
    local = _arg(args, "transformer_impl", "transformer_engine") == "local"
    for fld, _, what in function_changing_settings(lambda f: getattr(args, f, None), swiglu, fused_glu,
                                                   qk_l2_norm_applies=not local):
        raise unsupported(what, fld)
    if swiglu:
        act = "swiglu"
    elif getattr(args, "openai_gelu", False) or (add_bias and bool(_arg(args, "bias_gelu_fusion", True))):
        act = "gelu"  # tanh approximation (openai_gelu, or megatron's fused bias-GELU kernel)
    else:
        act = "gelu_exact"
    norm = _arg(args, "normalization", "LayerNorm")
    if norm not in ("LayerNorm", "RMSNorm"):
        raise unsupported(f"normalization {norm!r}", "normalization")
    gqa = bool(_arg(args, "group_query_attention", False))
    vocab = getattr(args, "padded_vocab_size", None)
    if vocab is None:
        raise CheckpointError(f"{source}: args.padded_vocab_size is missing")
    learned = pos == "learned_absolute"
    d = dict(
        vocab_size=int(vocab),
        hidden_size=int(args.hidden_size),
        num_layers=int(args.num_layers),
        num_attention_heads=int(args.num_attention_heads),
        ffn_hidden_size=int(_arg(args, "ffn_hidden_size", 4 * int(args.hidden_size))),
        num_query_groups=int(args.num_query_groups) if gqa else None,
        head_dim=int(args.kv_channels) if getattr(args, "kv_channels", None) else None,
        max_position_embeddings=int(_arg(args, "max_position_embeddings", _arg(args, "seq_length", 2048))),
        family="gpt2" if (learned and norm == "LayerNorm" and not swiglu) else "llama",
        normalization=norm,
        norm_eps=float(_arg(args, "norm_epsilon", _arg(args, "layernorm_epsilon", 1e-5))),
        activation=act,
        position_embedding="learned" if learned else "rope",
        rope_theta=float(_arg(args, "rotary_base", 10000)),
        rope_scaling=rope_scaling,
        add_bias_linear=add_bias,
        add_qkv_bias=bool(_arg(args, "add_qkv_bias", False)),
        tie_word_embeddings=not bool(_arg(args, "untie_embeddings_and_output_weights", False)),
        init_method_std=float(_arg(args, "init_method_std", 0.02)),
    )
    try:
        return ModelConfig(**d)
    except ConfigError as e:
        raise CheckpointConfigError(f"{source}: {e}") from e


def _saved_tp(args: Any) -> int:
    return int(_arg(args, "tensor_model_parallel_size", _arg(args, "model_parallel_size", 1)))


def _read_header(lay: MegatronLMDir) -> Tuple[Dict[str, Any], Path]:
    """The first file's (or common.pt's) top-level dict and its path."""
    f = lay.first_file if lay.kind == "megatron_legacy" else lay.iter_dir / "common.pt"
    obj = _torch_load(f, mmap=lay.kind == "megatron_legacy")
    if not isinstance(obj, dict):
        raise CheckpointError(f"{f}: expected a dict, got {type(obj).__name__}")
    return obj, f


def read_config(p: Path) -> Dict[str, Any]:
    """Checkpoint config dict of a Megatron-LM checkpoint: {"format", "model", "tp_size_saved", "iteration", ...}."""
    lay = locate(p)
    head, f = _read_header(lay)
    args = head.get("args")
    cfg = args_to_model_config(args, str(f))
    tp_saved = _saved_tp(args)
    pp_saved = int(_arg(args, "pipeline_model_parallel_size", 1))
    if lay.kind == "megatron_legacy":
        if tp_saved != len(lay.rank_files):
            raise CheckpointError(f"{f}: args.tensor_model_parallel_size={tp_saved} but {lay.iter_dir} has "
                                  f"{len(lay.rank_files)} mp_rank_XX directories")
        if pp_saved != len(lay.rank_files[0]):
            raise CheckpointError(f"{f}: args.pipeline_model_parallel_size={pp_saved} but {lay.iter_dir} has "
                                  f"{len(lay.rank_files[0])} pipeline stage(s) per TP rank")
    elif pp_saved > 1:
        log.info("%s: torch_dist checkpoint saved with pipeline_model_parallel_size=%d (global keys, no merge needed)",
                 f, pp_saved)
    dtype = getattr(args, "params_dtype", None)
    return {
        "format": lay.kind,
        "model": cfg.to_dict(),
        "tp_size_saved": tp_saved,
        "pp_size_saved": pp_saved,
        "iteration": head.get("iteration", lay.iteration),
        "checkpoint_version": head.get("checkpoint_version"),
        "params_dtype": str(dtype).replace("torch.", "") if isinstance(dtype, torch.dtype) else None,
        "source": str(f),
    }


def tokenizer_dir_from_args(p: Path) -> Optional[Path]:
    """A local HF tokenizer directory named by the Megatron-LM args (tokenizer_model), if it exists."""
    try:
        head, _ = _read_header(locate(p))
    except CheckpointError:
        return None
    tok = getattr(head.get("args"), "tokenizer_model", None)
    if tok and Path(tok).is_dir():
        return Path(tok)
    return None


# ----------------------------------------------------------------------------------------------------------------
# state-dict names
# ----------------------------------------------------------------------------------------------------------------

_TE_RENAMES = [
    (re.compile(r"\.self_attention\.linear_qkv\.layer_norm_(weight|bias)$"), r".input_layernorm.\1"),
    (re.compile(r"\.mlp\.linear_fc1\.layer_norm_(weight|bias)$"), r".pre_mlp_layernorm.\1"),
]
_LEGACY_LAYER = [
    (re.compile(r"^(input_norm|input_layernorm)\."), "input_layernorm."),
    (re.compile(r"^(post_attention_norm|post_attention_layernorm)\."), "pre_mlp_layernorm."),
    (re.compile(r"^(self_attention|attention)\.query_key_value\."), "self_attention.linear_qkv."),
    (re.compile(r"^(self_attention|attention)\.dense\."), "self_attention.linear_proj."),
    (re.compile(r"^mlp\.dense_h_to_4h\."), "mlp.linear_fc1."),
    (re.compile(r"^mlp\.dense_4h_to_h\."), "mlp.linear_fc2."),
]
_LEGACY_LAYER_RE = re.compile(r"^language_model\.(encoder|transformer)\.layers\.(\d+)\.(.*)$")
_LEGACY_FINAL_RE = re.compile(r"^language_model\.(encoder|transformer)\.(final_norm|final_layernorm)\.(weight|bias)$")


def _flatten(d: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for k, v in d.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, name + "."))
        else:
            out[name] = v
    return out


def _legacy_name(k: str, source: str) -> Optional[str]:
    """Map a pre-mcore Megatron-LM (language_model.*) name to the megatron-core GPTModel name."""
    if k in ("language_model.embedding.word_embeddings.weight", "language_model.embedding.position_embeddings.weight"):
        return k[len("language_model."):]
    if k == "language_model.output_layer.weight":
        return "output_layer.weight"
    m = _LEGACY_FINAL_RE.match(k)
    if m:
        return f"decoder.final_layernorm.{m.group(3)}"
    m = _LEGACY_LAYER_RE.match(k)
    if m:
        rest = m.group(3)
        for pat, rep in _LEGACY_LAYER:
            if pat.match(rest):
                return f"decoder.layers.{m.group(2)}.{pat.sub(rep, rest, count=1)}"
    raise CheckpointConfigError(f"{source}: unsupported architecture: tensor {k!r} has no megatron-core equivalent")


def to_mcore_state_dict(model_sd: Dict[str, Any], checkpoint_version: Optional[float], source: str
                        ) -> Dict[str, torch.Tensor]:
    """Flatten and rename a Megatron-LM ``model`` state dict to our GPTModel's names (tensors only)."""
    flat = _flatten(model_sd)
    legacy = any(k.startswith("language_model.") for k in flat)
    if legacy and checkpoint_version is not None and float(checkpoint_version) < 2.0:
        raise CheckpointConfigError(f"{source}: checkpoint_version={checkpoint_version} stores QKV in an old order; "
                                    f"only versions >= 2.0 are supported")
    out: Dict[str, torch.Tensor] = {}
    for k, v in flat.items():
        if k.endswith("_extra_state") or not isinstance(v, torch.Tensor):
            continue
        if k.startswith("word_embeddings_for_head."):
            continue  # pre-mcore last pipeline stage's copy of the tied word embeddings
        if legacy:
            k = _legacy_name(k, source)
        for pat, rep in _TE_RENAMES:
            k = pat.sub(rep, k)
        out[k] = v
    return out


def _model_entry(head: Dict[str, Any], f: Path) -> Dict[str, Any]:
    if "model" not in head:
        extra = sorted(k for k in head if re.match(r"^model\d+$", str(k)))
        if extra:
            raise CheckpointError(f"{f}: virtual-pipeline checkpoints ({extra}) are not supported")
        raise CheckpointError(f"{f}: no 'model' entry (keys: {sorted(map(str, head))[:10]})")
    return head["model"]


def _full_shape(shapes: List[torch.Size], kind: str) -> Tuple[int, ...]:
    if kind == tp_rules.REPLICATED or len(shapes) == 1:
        return tuple(shapes[0])
    dim = 1 if kind == tp_rules.ROW else 0
    s = list(shapes[0])
    s[dim] = sum(x[dim] for x in shapes)
    return tuple(s)


def _check_against_model(own: Dict[str, torch.Tensor], shards: List[Dict[str, torch.Tensor]], gated: bool,
                         files: List[Path], tp_now: int) -> None:
    """Names and full (TP=1) shapes of the checkpoint shards vs the model; raise naming tensor, shapes, file."""
    names = set(shards[0])
    for i, s in enumerate(shards[1:], 1):
        if set(s) != names:
            diff = sorted(names.symmetric_difference(s))
            raise CheckpointError(f"{files[i]}: tensors differ from {files[0]}: {diff[:6]}")
    missing, unexpected = sorted(set(own) - names), sorted(names - set(own))
    if missing:
        raise CheckpointError(f"{files[0]}: tensor(s) {missing[:6]} required by the model are missing")
    if unexpected:
        raise CheckpointConfigError(f"{files[0]}: unsupported architecture: tensor(s) {unexpected[:6]} are not part "
                                    f"of the model built from the checkpoint's args")
    for k, v in own.items():
        kind = tp_rules.shard_kind(k, gated)
        want = _full_shape([v.shape] * tp_now, kind)
        got = _full_shape([s[k].shape for s in shards], kind)
        if want != got:
            raise CheckpointError(f"{files[0]}: tensor {k!r} has (TP-merged) shape {got} in the checkpoint but "
                                  f"{want} in the model built from its args")


_LAYER_IDX_RE = re.compile(r"^decoder\.layers\.(\d+)\.")


def _tp_rank_state_dict(stage_files: List[Path], version: Any, tied: bool) -> Dict[str, torch.Tensor]:
    """One TP rank's tensors in our names, pipeline stages concatenated (local layer indices offset)."""
    out: Dict[str, torch.Tensor] = {}
    offset = 0
    last = len(stage_files) - 1
    for stage, f in enumerate(stage_files):
        head = _torch_load(f)
        sd = to_mcore_state_dict(_model_entry(head, f), head.get("checkpoint_version", version), str(f))
        idx = sorted({int(m.group(1)) for m in map(_LAYER_IDX_RE.match, sd) if m})
        if idx != list(range(len(idx))):
            raise CheckpointError(f"{f}: layer indices {idx} are not 0..n-1 (virtual pipeline layouts are not "
                                  f"supported)")
        for k, v in sd.items():
            if tied and stage == last and last > 0 and k == "output_layer.weight":
                continue  # the last stage's copy of the tied word embeddings
            m = _LAYER_IDX_RE.match(k)
            if m and offset:
                k = f"decoder.layers.{int(m.group(1)) + offset}.{k[m.end():]}"
            if k in out:
                raise CheckpointError(f"{f}: tensor {k!r} also appears in an earlier pipeline stage")
            out[k] = v
        offset += len(idx)
    return out


def _load_legacy_weights(model: torch.nn.Module, lay: MegatronLMDir, cfg: ModelConfig, version: Any) -> None:
    gated = cfg.activation == "swiglu"
    tied = cfg.tie_word_embeddings
    own = {k: v for k, v in model.state_dict().items() if tp_rules.is_tensor_entry(k, v)}
    tp_now, rank = parallel.tp_size(), parallel.tp_rank()
    files = lay.rank_files
    if len(files) == tp_now:  # same TP: every rank reads only its own file(s)
        shard = _tp_rank_state_dict(files[rank], version, tied)
        _check_against_model(own, [shard], gated=False, files=[files[rank][0]], tp_now=1)
    else:
        shards = [_tp_rank_state_dict(stage_files, version, tied) for stage_files in files]
        _check_against_model(own, shards, gated, [fs[0] for fs in files], tp_now)
        full = tp_rules.merge_state_dicts(shards, gated)
        del shards
        shard = tp_rules.split_state_dict(full, rank, tp_now, gated)
    model.load_state_dict(shard, strict=False)


# ----------------------------------------------------------------------------------------------------------------
# torch_dist (Megatron-LM / NeMo 2 sharded keys)
# ----------------------------------------------------------------------------------------------------------------

def _dist_sharded_state_dict(model: torch.nn.Module, ckpt_dir: Path) -> Dict[str, Any]:
    """Our sharded state dict re-keyed to a Megatron-LM checkpoint's keys (TE fused-norm names, key prefix)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedObject

    meta = dist_checkpointing.load_tensors_metadata(str(ckpt_dir))
    prefix = next((k[: -len("embedding.word_embeddings.weight")] for k in meta  # the model's, not the optimizer's
                   if k.endswith("embedding.word_embeddings.weight") and not k.startswith("optimizer.")), "")
    sd = model.sharded_state_dict()
    out: Dict[str, Any] = {}
    for name, v in sd.items():
        if isinstance(v, ShardedObject) or name.endswith("_extra_state"):
            continue  # megatron extra state (TE fp8 metadata); our local layers keep none
        key = prefix + v.key
        if key not in meta:
            for pat, te in ((r"\.input_layernorm\.(weight|bias)$", r".self_attention.linear_qkv.layer_norm_\1"),
                            (r"\.pre_mlp_layernorm\.(weight|bias)$", r".mlp.linear_fc1.layer_norm_\1")):
                alt = re.sub(pat, te, key)
                if alt != key and alt in meta:
                    key = alt
                    break
        v.key = key
        out[name] = v
    return out


def load_megatron_lm(path: Path, tp_size: Optional[int] = None, dtype: Optional[torch.dtype] = None
                     ) -> torch.nn.Module:
    """Load a Megatron-LM checkpoint (legacy mp_rank_XX files or torch_dist) into a GPTModel at the current TP."""
    from nemo_spec.models import build_gpt

    lay = locate(Path(path))
    info = read_config(Path(path))
    source = info["source"]
    cfg, tp, dtype = checkpoint_target(info, tp_size, dtype)
    _ensure_parallel(tp)
    model = build_gpt(cfg, params_dtype=dtype)
    if lay.kind == "megatron_legacy":
        _load_legacy_weights(model, lay, cfg, info.get("checkpoint_version"))
    else:
        load_dist_into(model, lay.iter_dir, source, sharded_sd=_dist_sharded_state_dict(model, lay.iter_dir))
    log.info("loaded Megatron-LM %s checkpoint %s (iteration %s, saved tp=%d) at tp=%d", lay.kind, lay.iter_dir,
             info.get("iteration"), info["tp_size_saved"], tp)
    return model
