"""Hugging Face checkpoints, the generic part: read and write HF directories (config.json, safetensors / torch
weights, tokenizer files) for our megatron-core GPTModel.

What each architecture means (config fields, tensor names and shapes, q/k/v fusing, limits) is declared once per
family in :mod:`nemo_spec.checkpoint.families`; this module only dispatches to those declarations.

Tensor parallelism: :func:`load_hf` builds the model for the current parallel state and takes this rank's shard
(``tp.load_full_state_dict``); :func:`export_hf` all-gathers the shards (``tp.gather_full_state_dict``) and rank 0
writes. Every rank must call both under torchrun.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple, Union

import torch

from nemo_spec import parallel
from nemo_spec.checkpoint import families
from nemo_spec.checkpoint.families import Family, HFCheckpointError, qkv_from_megatron, qkv_to_megatron  # noqa: F401
from nemo_spec.checkpoint.megatron import TOKENIZER_FILES, copy_tokenizer
from nemo_spec.config import ConfigError, ModelConfig
from nemo_spec.fsutil import publish_directory

log = logging.getLogger(__name__)

PathLike = Union[str, os.PathLike]

#: HF ``architectures`` entry -> ``model_type`` of the families we import and export (from the declarations).
SUPPORTED_ARCHITECTURES: Dict[str, str] = {f.architecture: f.model_type for f in families.FAMILIES}
_MODEL_TYPE_TO_ARCH = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}

_DTYPES: Dict[str, torch.dtype] = {
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
}
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def resolve_dtype(dtype: Union[str, torch.dtype], what: str = "dtype",
                  error: type = None) -> torch.dtype:  # type: ignore[assignment]
    """Map 'fp32'/'bf16'/'fp16' (float32, bfloat16, float16, half; 'auto' = bf16 on CUDA, fp32 on CPU) or a
    torch dtype to a torch dtype; anything else raises ``error`` (default HFCheckpointError) naming ``what``."""
    error = error or HFCheckpointError
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPE_NAMES:
            raise error(f"unknown {what} {dtype}; choose one of fp32, bf16, fp16")
        return dtype
    key = str(dtype).strip().lower().replace("torch.", "")
    if key == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    if key not in _DTYPES:
        raise error(f"unknown {what} {dtype!r}; choose one of fp32, bf16, fp16 (or auto)")
    return _DTYPES[key]

# --------------------------------------------------------------------------------------------------------------
# config.json
# --------------------------------------------------------------------------------------------------------------

def read_hf_config(path: PathLike) -> Dict[str, Any]:
    """Parse ``<path>/config.json``; raise HFCheckpointError naming the file when absent or invalid."""
    p = Path(path)
    if not p.is_dir():
        raise HFCheckpointError(f"{p}: not a directory (expected a Hugging Face checkpoint directory)")
    cfg_path = p / "config.json"
    if not cfg_path.is_file():
        raise HFCheckpointError(f"{cfg_path}: missing (a Hugging Face checkpoint directory needs config.json)")
    try:
        data = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise HFCheckpointError(f"{cfg_path}: invalid JSON ({e})") from e
    if not isinstance(data, dict):
        raise HFCheckpointError(f"{cfg_path}: expected a JSON object, got {type(data).__name__}")
    return data

def hf_model_type(hf: Mapping[str, Any], source: str = "config.json") -> str:
    """The supported model_type of an HF config (from ``architectures``, else ``model_type``)."""
    return families.family_of_hf(hf, source).model_type


#: config.json fields whose absence means transformers' class default for the family (which differs between families:
#: Mixtral's rms_norm_eps 1e-5 and rope_theta 1e6, Mistral's 4096-token window, Qwen2's max_window_layers 28 ...)
_DEFAULTED = ("rms_norm_eps", "layer_norm_epsilon", "sliding_window", "use_sliding_window", "max_window_layers",
              "tie_word_embeddings", "hidden_act", "activation_function", "norm_topk_prob", "max_position_embeddings",
              "initializer_range")


def as_transformers_reads_it(hf_config: Mapping[str, Any], fam: Family, source: str) -> Dict[str, Any]:
    """config.json with the fields it leaves out filled as transformers' own config class for the family fills them
    (``_DEFAULTED`` and ``rope_theta``): reading the raw file with generic defaults built other models than
    transformers runs (a review against transformers' own classes). The file's own fields always stand, so the
    result is the same under transformers 4.57 and 5.x (``rope_scaling`` over ``rope_parameters`` is decided in
    ``rope_from_hf``). A ``model_type`` other than the architecture's is refused (transformers builds the model_type's
    class), and so is a Mistral config with ``layer_types`` (transformers reads it as Ministral)."""
    mt = hf_config.get("model_type")
    if mt is not None and mt != fam.model_type:
        raise HFCheckpointError(f"{source}: architectures says {fam.architecture} (model_type {fam.model_type!r}) but "
                                f"model_type is {mt!r}; transformers builds the {mt!r} model, so the two disagree on "
                                f"what this checkpoint is")
    if fam.model_type == "mistral" and "layer_types" in hf_config:
        raise HFCheckpointError(f"{source}: a Mistral config with 'layer_types' is read by transformers as Ministral "
                                f"(alternating sliding-window layers, models/auto/configuration_auto.py), which is not "
                                f"supported")
    from transformers import AutoConfig

    defaults = AutoConfig.for_model(fam.model_type).to_dict()
    out = dict(hf_config)
    out.update({k: defaults[k] for k in _DEFAULTED if k not in out and k in defaults})
    shaped = [k for k in ("num_key_value_heads", "head_dim") if k not in out]
    if shaped:  # class defaults that depend on the file's own sizes (Llama: one KV head per head), or do not
        # (Mistral / Mixtral 8 KV heads, Qwen2 / Qwen3 32, Qwen3 head_dim 128): what the class builds from them
        sizes = {k: out[k] for k in ("num_attention_heads", "hidden_size") if isinstance(out.get(k), int)}
        try:
            built = AutoConfig.for_model(fam.model_type, **sizes)
        except (TypeError, ValueError):  # sizes the class refuses: the family's own reader names the field
            built = None
        for k in shaped:
            v = getattr(built, k, None)
            if isinstance(v, int) and not isinstance(v, bool):
                out[k] = v
    params = out.get("rope_parameters") if isinstance(out.get("rope_parameters"), dict) else {}
    theta = defaults.get("rope_theta") or (defaults.get("rope_parameters") or {}).get("rope_theta")
    scaling = out.get("rope_scaling")
    if isinstance(scaling, dict) and scaling and "rope_theta" not in out and "rope_theta" not in scaling:
        # rope_scaling replaces rope_parameters whole (transformers 5.x modeling_rope_utils.py
        # convert_rope_params_to_dict; 4.x never reads rope_parameters): the theta it held is not used
        if params.get("rope_theta") is not None and theta is not None and float(params["rope_theta"]) != theta:
            log.warning("%s: rope_scaling replaces rope_parameters, so transformers runs this model with the "
                        "%s default rope_theta=%s, not rope_parameters' %s; put rope_theta into rope_scaling (or "
                        "the scaling into rope_parameters) if %s is meant", source, fam.architecture, theta,
                        params["rope_theta"], params["rope_theta"])
        params = {}
    if "rope_theta" not in out and "rope_theta" not in params and theta is not None:
        out["rope_theta"] = theta
    return out


def hf_to_model_config(hf_config: Mapping[str, Any], source: str = "config.json") -> ModelConfig:
    """Translate an HF config.json dict into our ModelConfig through its family's declaration; a field of the
    wrong type or value (a string for a count, a rope_scaling without its factor, zero heads ...) is an
    HFCheckpointError naming ``source``."""
    try:
        fam = families.family_of_hf(hf_config, source)
        return fam.from_hf(as_transformers_reads_it(hf_config, fam, source), source)
    except HFCheckpointError:
        raise
    except (KeyError, TypeError, ValueError, ZeroDivisionError, AttributeError) as e:
        what = f"missing field {e}" if isinstance(e, KeyError) else f"{type(e).__name__}: {e}"
        raise HFCheckpointError(f"{source}: invalid model config ({what})") from e


def check_exportable(cfg: ModelConfig, architecture: Optional[str] = None) -> str:
    """Raise HFCheckpointError naming the field if ``cfg`` cannot be written as an HF model; return the architecture."""
    return families.family_for_export(cfg, architecture).architecture


def model_config_to_hf(cfg: ModelConfig, architecture: Optional[str] = None,
                       dtype: Union[str, torch.dtype] = torch.float32) -> Dict[str, Any]:
    """The HF config.json dict for ``cfg`` (readable by transformers 4.x and 5.x)."""
    fam = families.family_for_export(cfg, architecture)
    dname = _DTYPE_NAMES[resolve_dtype(dtype)]
    return dict(fam.to_hf(cfg), torch_dtype=dname, dtype=dname)


# --------------------------------------------------------------------------------------------------------------
# weights: HF names and shapes (from the family's weight map), reading, and the layout mapping
# --------------------------------------------------------------------------------------------------------------

def _family(cfg: ModelConfig, model_type: Optional[str]) -> Family:
    return families.family_by_model_type(model_type) if model_type else families.family_for_export(cfg)


def expected_hf_shapes(cfg: ModelConfig, model_type: Optional[str] = None) -> Dict[str, Tuple[int, ...]]:
    """Every HF tensor name the checkpoint must hold for ``cfg`` with its shape (biases only where used)."""
    return _family(cfg, model_type).weights.expected_shapes(cfg)

def weight_files(path: PathLike) -> List[Path]:
    """The weight files of an HF directory (single or sharded safetensors, else pytorch_model*.bin)."""
    p = Path(path)
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = p / index_name
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise HFCheckpointError(f"{index}: invalid index file, need a 'weight_map' object ({e})") from e
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not (p / f).is_file()]
            if missing:
                raise HFCheckpointError(f"{index}: shard file(s) {missing} listed in weight_map are missing")
            return [p / f for f in files]
    for single in ("model.safetensors", "pytorch_model.bin"):
        if (p / single).is_file():
            return [p / single]
    raise HFCheckpointError(
        f"{p}: no weights found (expected model.safetensors, model.safetensors.index.json, pytorch_model.bin "
        f"or pytorch_model.bin.index.json)")

def _read_weights(files: Iterable[Path], fam: Family, shapes_only: bool
                  ) -> Dict[str, Union[torch.Tensor, Tuple[int, ...]]]:
    """Tensors (or, for safetensors with ``shapes_only``, just their shapes) keyed by canonical HF name."""
    from safetensors import safe_open

    norm = fam.weights.normalize or (lambda n: n)
    out: Dict[str, Union[torch.Tensor, Tuple[int, ...]]] = {}
    for f in files:
        if f.suffix == ".safetensors":
            try:
                with safe_open(str(f), framework="pt") as sf:
                    for k in sf.keys():
                        out[norm(k)] = tuple(sf.get_slice(k).get_shape()) if shapes_only else sf.get_tensor(k)
            except Exception as e:  # safetensors raises its own error types for corrupt headers
                raise HFCheckpointError(f"{f}: cannot read safetensors file ({e})") from e
        else:
            try:
                try:
                    sd = torch.load(str(f), map_location="cpu", weights_only=True, mmap=True)
                except RuntimeError:  # legacy (non-zip) serialization cannot be memory-mapped
                    sd = torch.load(str(f), map_location="cpu", weights_only=True)
            except Exception as e:
                raise HFCheckpointError(f"{f}: cannot read torch weights file ({e})") from e
            if not isinstance(sd, dict):
                raise HFCheckpointError(f"{f}: expected a state dict, got {type(sd).__name__}")
            for k, v in sd.items():
                if isinstance(v, torch.Tensor):
                    out[norm(k)] = tuple(v.shape) if shapes_only else v
    return out


def check_hf_shapes(shapes: Mapping[str, Tuple[int, ...]], cfg: ModelConfig, model_type: Optional[str],
                    source: str) -> None:
    """Raise HFCheckpointError for a missing, unexpected or wrongly shaped tensor (naming it and both shapes)."""
    fam = _family(cfg, model_type)
    expected = fam.weights.expected_shapes(cfg)
    optional = set(fam.weights.optional_names(cfg))
    ignored = ("rotary_emb.inv_freq",) + tuple(fam.weights.ignored_suffixes)
    missing = [k for k in expected if k not in shapes and k not in optional]
    if missing:
        hint = ""
        if "lm_head.weight" in missing and not cfg.tie_word_embeddings:
            hint = " (config.json says tie_word_embeddings=false but there is no lm_head.weight)"
        raise HFCheckpointError(f"{source}: missing tensor(s) {missing[:8]}{' ...' if len(missing) > 8 else ''}{hint}")
    for k, shape in shapes.items():
        if k in expected:
            if tuple(shape) != tuple(expected[k]):
                raise HFCheckpointError(f"{source}: tensor {k!r} has shape {tuple(shape)} but config.json implies "
                                        f"{tuple(expected[k])}")
        elif k == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # some tied checkpoints also store the (identical) head
        elif not k.endswith(ignored):
            unexpected = sorted(x for x in shapes if x not in expected and not x.endswith(ignored)
                                and not (x == "lm_head.weight" and cfg.tie_word_embeddings))
            raise HFCheckpointError(f"{source}: unexpected tensor(s) {unexpected[:8]} not used by a "
                                    f"{fam.architecture} with this config.json")


def megatron_state_dict_from_hf(hf_sd: Mapping[str, torch.Tensor], cfg: ModelConfig,
                                model_type: Optional[str] = None) -> Dict[str, torch.Tensor]:
    """Full (TP=1) megatron GPTModel state dict from an HF state dict (canonical names) for ``cfg``."""
    return _family(cfg, model_type).weights.to_megatron(hf_sd, cfg)


def hf_state_dict_from_megatron(full_sd: Mapping[str, torch.Tensor], cfg: ModelConfig,
                                model_type: Optional[str] = None) -> Dict[str, torch.Tensor]:
    """HF state dict (the family's names) from a full (TP=1) megatron GPTModel state dict."""
    return _family(cfg, model_type).weights.to_hf(full_sd, cfg)


# --------------------------------------------------------------------------------------------------------------
# import / export
# --------------------------------------------------------------------------------------------------------------

def is_hf_dir(path: PathLike) -> bool:
    """True if ``path`` looks like a Hugging Face model directory (config.json with ``architectures`` or
    ``model_type``)."""
    cfg_path = Path(path) / "config.json"
    if not cfg_path.is_file():
        return False
    try:
        data = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, OSError):
        return False
    return isinstance(data, dict) and (bool(data.get("architectures")) or isinstance(data.get("model_type"), str))


def read_hf_dir_config(path: PathLike) -> Tuple[Dict[str, Any], ModelConfig]:
    """(config.json dict, ModelConfig) of an HF directory; the ModelConfig takes generation_config.json's
    end-of-sequence ids."""
    p = Path(path)
    hf_config = read_hf_config(p)
    return hf_config, with_generation_eos(hf_to_model_config(hf_config, str(p / "config.json")), p)


def with_generation_eos(cfg: ModelConfig, path: PathLike) -> ModelConfig:
    """``cfg`` with the end-of-sequence ids of ``<path>/generation_config.json`` when it has one: generation stops
    at any of them, as vLLM 0.34.0 adds them to every request's stop ids (v1/engine/input_processor.py:63, 484;
    sampling_params.py:793-807) and transformers' generate() stops at them (a config.json without the file: its own
    list)."""
    from nemo_spec.checkpoint.families._llama_like import id_list

    f = Path(path) / "generation_config.json"
    if not f.is_file():
        return cfg
    try:
        gen = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HFCheckpointError(f"{f}: not valid JSON ({e})") from e
    if not isinstance(gen, dict) or gen.get("eos_token_id") is None:
        return cfg
    try:
        ids = id_list(gen["eos_token_id"], "eos_token_id", str(f))
    except families.FamilyError as e:
        raise HFCheckpointError(str(e)) from e
    bad = [i for i in ids if not 0 <= i < cfg.vocab_size]
    if bad:
        raise HFCheckpointError(f"{f}: eos_token_id {bad} outside the vocabulary [0, {cfg.vocab_size})")
    if ids:  # the file's ids replace config.json's (a single one too), as they do in transformers and vLLM
        cfg.eos_token_ids = None if ids == [cfg.eos_token_id] else ids
        if cfg.eos_token_id is None:
            cfg.eos_token_id = ids[0]
    return cfg


def load_hf_state_dict(path: PathLike, cfg: Optional[ModelConfig] = None) -> Dict[str, torch.Tensor]:
    """Read (and shape-check against config.json) an HF directory's weights; canonical HF names, CPU tensors."""
    p = Path(path)
    hf = read_hf_config(p)
    source = str(p / "config.json")
    fam = families.family_of_hf(hf, source)
    mt = fam.model_type
    cfg = cfg or hf_to_model_config(hf, source)
    files = weight_files(p)
    if all(f.suffix == ".safetensors" for f in files):  # cheap header-only check before reading any tensor
        check_hf_shapes(_read_weights(files, fam, shapes_only=True), cfg, mt, str(p))  # type: ignore[arg-type]
    sd = _read_weights(files, fam, shapes_only=False)
    check_hf_shapes({k: tuple(v.shape) for k, v in sd.items()}, cfg, mt, str(p))  # type: ignore[union-attr]
    head = sd.get("lm_head.weight")
    if cfg.tie_word_embeddings and head is not None:  # the family's name for the embedding (its weight rules)
        emb = next(sd[n] for rule in fam.weights.model if rule.ours == "embedding.word_embeddings.weight"
                   for n in rule.theirs)
        if not torch.equal(head, emb):  # type: ignore[arg-type]
            raise HFCheckpointError(f"{source}: tie_word_embeddings is true but the stored lm_head.weight differs from "
                                    f"the embedding (transformers 5 runs the stored head, 4.x the embedding); set "
                                    f"tie_word_embeddings to false if the head is the model's own")
    return sd  # type: ignore[return-value]


def load_hf(path: PathLike, params_dtype: torch.dtype = torch.float32,
            device: Optional[torch.device] = None) -> "torch.nn.Module":
    """Build our megatron-core GPTModel (for the current TP/EP sizes) from a Hugging Face directory and load its weights."""
    from nemo_spec.checkpoint import tp as tp_mod
    from nemo_spec.models import build_gpt

    p = Path(path)
    source = str(p / "config.json")
    hf, cfg = read_hf_dir_config(p)
    tp_size = parallel.tp_size()
    try:
        cfg.check_tensor_parallel(tp_size)
        cfg.check_expert_parallel(parallel.ep_size())
    except ConfigError as e:
        raise HFCheckpointError(f"{source}: {e}") from e
    if cfg.vocab_size % tp_size:
        raise HFCheckpointError(f"{source}: tensor parallel size {tp_size} does not divide vocab_size={cfg.vocab_size}")
    hf_sd = load_hf_state_dict(p, cfg)
    mt = hf_model_type(hf, source)
    full = {k: v.to(params_dtype) for k, v in megatron_state_dict_from_hf(hf_sd, cfg, mt).items()}
    del hf_sd
    model = build_gpt(cfg, params_dtype=params_dtype, device=torch.device("cpu"))
    tp_mod.load_full_state_dict(model, full, gated=cfg.activation == "swiglu")
    if device is not None:
        model = model.to(device)
    else:
        from nemo_spec._cpu import default_device

        model = model.to(default_device())
    log.info("loaded %s (%s, %d layers, hidden %d, vocab %d) at TP=%d EP=%d", p, _MODEL_TYPE_TO_ARCH[mt],
             cfg.num_layers, cfg.hidden_size, cfg.vocab_size, tp_size, parallel.ep_size())
    return model


def _generation_config(cfg: ModelConfig) -> Dict[str, Any]:
    out: Dict[str, Any] = {"_from_model_config": True}
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(cfg, k) is not None:
            out[k] = getattr(cfg, k)
    if cfg.eos_token_ids:
        out["eos_token_id"] = list(cfg.eos_token_ids)
    try:
        import transformers

        out["transformers_version"] = transformers.__version__
    except ImportError:  # pragma: no cover
        pass
    return out


def _write_hf_dir(tmp: Path, hf_config: Dict[str, Any], tensors: Dict[str, torch.Tensor], cfg: ModelConfig,
                  tokenizer_dir: Optional[Path]) -> None:
    from safetensors.torch import save_file

    (tmp / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    copied: List[str] = []
    if tokenizer_dir is not None:
        copied = copy_tokenizer(tokenizer_dir, tmp)
    if not (tmp / "generation_config.json").exists():
        (tmp / "generation_config.json").write_text(json.dumps(_generation_config(cfg), indent=2) + "\n")
    log.info("wrote config.json, model.safetensors (%d tensors), generation_config.json%s", len(tensors),
             f", tokenizer files {copied}" if copied else "")


def _replace_dir(tmp: Path, out: Path, overwrite: bool) -> None:
    """Move ``tmp`` to ``out`` atomically; an existing non-empty ``out`` is replaced only with ``overwrite``."""
    if out.exists():
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        elif not overwrite:
            raise HFCheckpointError(f"{out}: exists and is not empty (pass overwrite=True, or --overwrite, to replace it)")
        elif not (out.is_dir() and (out / "config.json").is_file() and not (out / "nemo_spec_config.json").exists()
                  and not (out / "metadata.json").exists()):
            raise HFCheckpointError(f"{out}: exists and is not a Hugging Face model directory (config.json, no "
                                    f"nemo_spec checkpoint files): overwrite replaces an earlier HF export only; "
                                    f"refusing to replace it")
    publish_directory(tmp, out)


def export_hf(model: torch.nn.Module, out_dir: PathLike, tokenizer_dir: Optional[PathLike] = None,
              dtype: Union[str, torch.dtype] = torch.float32, architecture: Optional[str] = None,
              overwrite: bool = False) -> Path:
    """Write ``model`` (any TP/EP; all ranks call) as an HF directory transformers loads; rank 0 writes atomically."""
    import torch.distributed as dist

    from nemo_spec.checkpoint import tp as tp_mod
    from nemo_spec.models import unwrap

    out = Path(out_dir).resolve()
    gpt = unwrap(model)
    cfg: ModelConfig = gpt.nemo_spec_config
    torch_dtype = resolve_dtype(dtype)
    hf_config = model_config_to_hf(cfg, architecture, torch_dtype)  # validates before any communication
    tok = Path(tokenizer_dir) if tokenizer_dir is not None else None
    if tok is not None and not tok.is_dir():
        raise HFCheckpointError(f"tokenizer_dir {tok}: not a directory")
    _refuse_nonempty(out, overwrite)
    full = tp_mod.gather_full_state_dict(gpt, gated=cfg.activation == "swiglu")
    error: Optional[BaseException] = None
    if parallel.is_rank_zero():
        tmp: Optional[Path] = None
        try:
            tensors = {}
            for k, v in hf_state_dict_from_megatron(full, cfg, hf_config["model_type"]).items():
                t = v.detach().to("cpu", torch_dtype).contiguous()
                if t.is_floating_point() and not bool(torch.isfinite(t).all()) and bool(torch.isfinite(v).all()):
                    raise HFCheckpointError(f"{k}: values up to {float(v.abs().max()):.4g} do not fit "
                                            f"{_DTYPE_NAMES[torch_dtype]} (they would be written as inf); export "
                                            f"in bf16 or fp32")
                tensors[k] = t
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
            _write_hf_dir(tmp, hf_config, tensors, cfg, tok)
            _replace_dir(tmp, out, overwrite)
            tmp = None
            log.info("exported %s (%s, %s) to %s", hf_config["architectures"][0], cfg.family,
                     _DTYPE_NAMES[torch_dtype], out)
        except BaseException as e:  # noqa: BLE001 - re-raised below after the barrier
            error = e
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
    if dist.is_initialized() and dist.get_world_size() > 1:
        flag = [error is not None]
        dist.broadcast_object_list(flag, src=0)
        if flag[0] and error is None:
            raise HFCheckpointError(f"{out}: export failed on rank 0")
    if error is not None:
        raise error
    return out


# --------------------------------------------------------------------------------------------------------------
# conversions used by scripts/convert_hf.py
# --------------------------------------------------------------------------------------------------------------

def has_tokenizer_files(path: PathLike) -> bool:
    """True if ``path`` holds at least one tokenizer file."""
    p = Path(path)
    return p.is_dir() and any((p / n).is_file() for n in TOKENIZER_FILES)


def convert_hf_to_checkpoint(hf_dir: PathLike, out_dir: PathLike,
                             params_dtype: torch.dtype = torch.float32, overwrite: bool = False) -> Path:
    """Import an HF directory (current TP size) and save it as our torch_dist checkpoint (all ranks call);
    ``overwrite`` replaces an existing checkpoint at ``out_dir`` (checked before the model is loaded)."""
    from nemo_spec.checkpoint import save_checkpoint  # type: ignore[attr-defined]  # written by the checkpoint helper

    src = Path(hf_dir).resolve()
    _refuse_nonempty(Path(out_dir), overwrite)
    model = load_hf(src, params_dtype=params_dtype)
    with tempfile.TemporaryDirectory(prefix="nemo_spec_hf_tok-") as tmp:
        tok: Optional[Path] = None
        if has_tokenizer_files(src):  # only tokenizer files (and the generation config), never the weights
            tok = Path(tmp)
            copy_tokenizer(src, tok)
        return save_checkpoint(model, out_dir, tokenizer_dir=tok, overwrite=overwrite,
                               extra={"converted_from_hf": str(src)})


def _refuse_nonempty(out: Path, overwrite: bool) -> None:
    """A destination must be new or empty unless ``overwrite`` (checked before anything is loaded or gathered; what
    overwrite may replace is checked where it is replaced)."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise HFCheckpointError(f"{out}: exists and is not empty (pass overwrite=True, or --overwrite, to replace it)")


def convert_checkpoint_to_hf(ckpt_dir: PathLike, out_dir: PathLike, dtype: Union[str, torch.dtype] = torch.float32,
                             tokenizer_dir: Optional[PathLike] = None, architecture: Optional[str] = None,
                             overwrite: bool = False) -> Path:
    """Export the base model of any checkpoint ``load_model`` reads (or an HF dir) as an HF directory (all ranks)."""
    src = Path(ckpt_dir)
    resolve_dtype(dtype)  # fail before loading anything
    out = Path(out_dir)
    _refuse_nonempty(out, overwrite)
    if is_hf_dir(src):
        model = load_hf(src)
        tok = Path(tokenizer_dir) if tokenizer_dir else (src if has_tokenizer_files(src) else None)
    else:
        from nemo_spec.checkpoint import find_tokenizer_dir, load_model  # type: ignore[attr-defined]

        model = load_model(src)
        tok = Path(tokenizer_dir) if tokenizer_dir else find_tokenizer_dir(src)
    return export_hf(model, out, tokenizer_dir=tok, dtype=dtype, architecture=architecture, overwrite=overwrite)

