"""Megatron distributed checkpoints (``torch_dist``) with a self-describing config, and format dispatch for loading.

A checkpoint written by :func:`save_checkpoint` is a directory holding exactly what
``megatron.core.dist_checkpointing.save`` writes (``common.pt``, ``__<rank>_<thread>.distcp``,
``.metadata``, ``metadata.json``) plus ``nemo_spec_config.json`` (model config, optional
speculative config, the TP size it was saved with) and, optionally, ``tokenizer/``.
Tensors are stored with their global shapes, so any saved TP size loads at any current TP size.

:func:`load_model` also accepts Megatron-LM checkpoint directories (legacy ``mp_rank_XX`` files and
``torch_dist`` iteration directories, see :mod:`nemo_spec.checkpoint.legacy`) and Hugging Face
directories (``nemo_spec.checkpoint.hf.load_hf``) and llama.cpp GGUF files (``nemo_spec.checkpoint.gguf``).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

import torch

from nemo_spec import parallel
from nemo_spec._cpu import apply_cpu_workarounds
from nemo_spec._threads import serial_helper_threads
from nemo_spec.config import ConfigError, ModelConfig, SpeculativeConfig, dump_json
from nemo_spec.fsutil import is_displaced_directory, publish_directory

log = logging.getLogger(__name__)

CONFIG_NAME = "nemo_spec_config.json"
TOKENIZER_SUBDIR = "tokenizer"
FORMAT_NAME = "nemo_spec"
DIST_METADATA = "metadata.json"  # written last by megatron dist_checkpointing
TEMP_SUFFIX = ".nemo_spec-partial"
#: tokenizer / chat-template files: what marks a tokenizer directory and what is copied along with a checkpoint
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "vocab.txt", "chat_template.jinja",
                   "chat_template.json")

PathLike = Union[str, os.PathLike]


class CheckpointError(Exception):
    """A checkpoint directory is missing, unrecognised, incomplete or inconsistent; the message names the file."""


class CheckpointConfigError(CheckpointError, ConfigError):
    """A checkpoint's config is invalid for this model/TP size (both a CheckpointError and a ConfigError)."""


# ----------------------------------------------------------------------------------------------------------------
# small distributed helpers (all no-ops without torch.distributed)
# ----------------------------------------------------------------------------------------------------------------

def _dist() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _barrier() -> None:
    if _dist():
        torch.distributed.barrier()


def _all_ok(ok: bool) -> bool:
    """Collective AND of ``ok`` over all ranks (so one rank's failure stops every rank instead of hanging)."""
    if not _dist():
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int64,
                        device="cuda" if torch.distributed.get_backend() == "nccl" else "cpu")
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
    return bool(flag.item())


# ----------------------------------------------------------------------------------------------------------------
# format detection
# ----------------------------------------------------------------------------------------------------------------

def _check_dir(path: PathLike) -> Path:
    p = Path(path).expanduser()
    if not p.exists():
        raise CheckpointError(f"checkpoint directory {p} does not exist")
    if not p.is_dir():
        raise CheckpointError(f"checkpoint path {p} is not a directory")
    if p.name.endswith(TEMP_SUFFIX) or is_displaced_directory(p):
        raise CheckpointError(f"{p} is the temporary directory of an unfinished (or interrupted) save, "
                              f"not a checkpoint")
    return p


def _gguf_file_format(p: Path) -> Optional[str]:
    """'gguf' when ``p`` is a GGUF file; raise for a ``.gguf`` file without the GGUF magic; None otherwise."""
    if not p.is_file():
        return None
    from nemo_spec.checkpoint import gguf

    if gguf.is_gguf_file(p):
        return "gguf"
    if p.suffix.lower() == ".gguf":
        gguf.check_gguf_file(p)  # raises GGUFError naming the bad magic
    return None


#: what marks a training checkpoint of scripts/train.py (nemo_spec.training.strategy.META_NAME)
TRAIN_META_NAME = "nemo_spec_train.json"


def detect_format(path: PathLike) -> str:
    """Which checkpoint format ``path`` holds: 'nemo_spec', 'megatron_legacy', 'megatron_dist', 'megatron_bridge',
    'nemo2', 'hf' or 'gguf' (a llama.cpp GGUF file)."""
    if _gguf_file_format(Path(path).expanduser()) is not None:
        return "gguf"
    p = _check_dir(path)
    if (p / CONFIG_NAME).is_file():
        return FORMAT_NAME
    from nemo_spec.checkpoint import nemo2

    if nemo2.is_nemo2_dir(p):
        return "nemo2"
    from nemo_spec.checkpoint import bridge, legacy

    if bridge.is_bridge_dir(p):  # before Megatron-LM's: the same tracker file, but no 'args' in common.pt
        return bridge.FORMAT
    kind = legacy.detect(p)
    if kind is not None:
        return kind
    cfg_json = p / "config.json"
    if cfg_json.is_file():
        try:
            hf_cfg = json.loads(cfg_json.read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{cfg_json}: not valid JSON ({e})") from e
        if isinstance(hf_cfg, dict) and (hf_cfg.get("architectures") or isinstance(hf_cfg.get("model_type"), str)):
            return "hf"  # model_type alone: transformers' AutoModelForCausalLM loads it, so do we (its family)
        raise CheckpointError(f"{cfg_json} has neither an 'architectures' nor a 'model_type' field, so {p} is not a "
                              f"Hugging Face model directory")
    found = sorted(x.name for x in p.iterdir())[:12]
    if (p / TRAIN_META_NAME).is_file():
        raise CheckpointError(
            f"{p} is a checkpoint of a training run (the draft and its optimizer state, for resuming with "
            f"resume=...), not a model: generation, export and serving take the run's final/ directory, which "
            f"training writes when it ends ({p.parent.parent / 'final'} if this is <run_dir>/checkpoints/...). To "
            f"write final/ from this checkpoint, run the training command again with resume={p} and trainer.max_steps "
            f"set to the checkpoint's step: it trains nothing and saves final/")
    if (p / DIST_METADATA).is_file():
        raise CheckpointError(
            f"{p} is a Megatron distributed (torch_dist) checkpoint without a model config: it has no {CONFIG_NAME}, "
            f"no {bridge.RUN_CONFIG} (Megatron Bridge) and its common.pt holds no Megatron-LM 'args'")
    if (p / "context").is_dir() and (p / "weights").is_dir():
        raise CheckpointError(f"{p} looks like a NeMo 2 checkpoint (context/ + weights/) but weights/{DIST_METADATA} "
                              f"is missing: the save did not finish")
    raise CheckpointError(
        f"unrecognised checkpoint directory {p}: looked for {CONFIG_NAME} (nemo_spec torch_dist), "
        f"latest_checkpointed_iteration.txt / iter_XXXXXXX/mp_rank_XX/model_optim_rng.pt (Megatron-LM), "
        f"iter_XXXXXXX/{bridge.RUN_CONFIG} (Megatron Bridge), "
        f"context/ + weights/ (NeMo 2), "
        f"config.json with 'architectures' (Hugging Face); found {found}")


# ----------------------------------------------------------------------------------------------------------------
# config / tokenizer
# ----------------------------------------------------------------------------------------------------------------

def _read_own_config(p: Path) -> Dict[str, Any]:
    f = p / CONFIG_NAME
    try:
        cfg = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{f}: cannot read checkpoint config ({e})") from e
    if not isinstance(cfg, dict) or cfg.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{f}: field 'format' must be {FORMAT_NAME!r}, got {cfg.get('format') if isinstance(cfg, dict) else cfg!r}")
    if not isinstance(cfg.get("model"), dict):
        raise CheckpointError(f"{f}: field 'model' (the ModelConfig) is missing")
    if not (p / DIST_METADATA).is_file():
        raise CheckpointError(f"{p} is incomplete: {DIST_METADATA} (written last by dist_checkpointing) is missing")
    return cfg


def read_checkpoint_config(path: PathLike) -> Dict[str, Any]:
    """The checkpoint's config dict: {"format", "model": ModelConfig dict, ["speculative"], "tp_size_saved", ...}."""
    p = Path(path).expanduser()
    fmt = detect_format(p)
    if fmt == FORMAT_NAME:
        return _read_own_config(p)
    if fmt in ("megatron_legacy", "megatron_dist"):
        from nemo_spec.checkpoint import legacy

        return legacy.read_config(p)
    if fmt == "nemo2":
        from nemo_spec.checkpoint import nemo2

        return nemo2.read_config(p)
    if fmt == "megatron_bridge":
        from nemo_spec.checkpoint import bridge

        return bridge.read_config(p)
    if fmt == "gguf":
        from nemo_spec.checkpoint import gguf

        cfg, hf_cfg = gguf.read_gguf_config(p)
        return {"format": "gguf", "model": cfg.to_dict(), "architectures": hf_cfg["architectures"]}
    hf_cfg, cfg = _import_hf().read_hf_dir_config(p)
    return {"format": "hf", "model": cfg.to_dict(), "architectures": hf_cfg.get("architectures")}


def model_config_from(cfg: Dict[str, Any], source: str) -> ModelConfig:
    """Build the ModelConfig stored in a checkpoint config dict (errors name ``source``)."""
    try:
        return ModelConfig.from_dict(cfg["model"], source=f"{source}: field 'model'")
    except ConfigError as e:
        msg = str(e)
        raise CheckpointConfigError(msg if source in msg else f"{source}: field 'model': {msg}") from e


def speculative_config_from(cfg: Dict[str, Any], model_cfg: ModelConfig, source: str) -> Optional[SpeculativeConfig]:
    """The SpeculativeConfig stored in a checkpoint config dict, or None."""
    spec = cfg.get("speculative")
    if not spec:
        return None
    try:
        return SpeculativeConfig.from_dict(spec, source=f"{source}: field 'speculative'").validate(model_cfg)
    except (ConfigError, TypeError) as e:
        raise CheckpointConfigError(f"{source}: field 'speculative': {e}") from e


def check_tp(cfg: ModelConfig, tp: int, source: str, ep: Optional[int] = None) -> None:
    """Raise CheckpointConfigError (naming ``source``) if TP size ``tp`` (or EP size ``ep``, default: the current
    one) cannot shard ``cfg``."""
    try:
        cfg.check_tensor_parallel(tp)
        if cfg.vocab_size % tp:
            raise ConfigError(f"tensor parallel size {tp} does not divide vocab_size={cfg.vocab_size}")
        cfg.check_expert_parallel(parallel.ep_size() if ep is None else ep)
    except ConfigError as e:
        raise CheckpointConfigError(f"{source}: {e}") from e


def find_tokenizer_dir(path: PathLike) -> Optional[Path]:
    """The directory holding the checkpoint's tokenizer files, or None."""
    p = Path(path).expanduser()
    if p.is_file() and _gguf_file_format(p) == "gguf":
        from nemo_spec.checkpoint import gguf

        try:
            return gguf.gguf_tokenizer_dir(p)
        except gguf.GGUFError as e:
            log.warning("%s", e)
            return None
    if not p.is_dir():
        return None
    from nemo_spec.checkpoint import bridge

    if bridge.is_bridge_dir(p):  # its iteration directory's tokenizer/ may hold another library's files
        return bridge.tokenizer_dir(p)
    for cand in (p / TOKENIZER_SUBDIR, p / "context" / "nemo_tokenizer", p):
        if cand.is_dir() and any((cand / f).is_file() for f in TOKENIZER_FILES):
            return cand
    try:
        fmt = detect_format(p)
    except CheckpointError:
        return None
    if fmt in ("megatron_legacy", "megatron_dist"):
        from nemo_spec.checkpoint import legacy

        return legacy.tokenizer_dir_from_args(p)
    if fmt == "nemo2":
        from nemo_spec.checkpoint import nemo2

        return nemo2.tokenizer_dir(p)
    return None


#: never copied along with a tokenizer (the source may be a model or checkpoint directory)
_NOT_TOKENIZER = ("config.json", "nemo_spec_config.json", "metadata.json", "common.pt", "export_info.json")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".distcp", ".gguf", ".h5", ".msgpack")


def copy_tokenizer(src: PathLike, dst: Path) -> List[str]:
    """Copy the tokenizer files of directory ``src`` into ``dst``: every regular file except model weights,
    checkpoint data and model configs (so ``src`` may be a model directory; sentencepiece / tiktoken files and
    tokenizer code are kept); returns the names copied."""
    src = Path(src).expanduser()
    if not src.is_dir():
        raise CheckpointError(f"tokenizer_dir {src} is not a directory")
    names = sorted(f.name for f in src.iterdir()
                   if f.is_file() and not f.name.startswith(".") and f.name not in _NOT_TOKENIZER
                   and not f.name.endswith(_WEIGHT_SUFFIXES) and not f.name.endswith(".index.json"))
    if not names:
        raise CheckpointError(f"tokenizer_dir {src} holds no tokenizer files")
    dst.mkdir(parents=True, exist_ok=True)
    for n in names:
        shutil.copy2(src / n, dst / n)
    return names


# ----------------------------------------------------------------------------------------------------------------
# model helpers
# ----------------------------------------------------------------------------------------------------------------

def _checkpoint_module(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose sharded_state_dict() is saved: a SpeculativeGPT or the GPTModel (unwrapping wrappers), its
    base in nemo_spec's layer spec (another spec's model is converted, its logits checked: what load_model builds)."""
    from nemo_spec.models import unwrap, unwrap_speculative
    from nemo_spec.models.foreign import to_project_spec

    model = to_project_spec(model)
    return unwrap_speculative(model) or unwrap(model)


def _params_dtype(m: torch.nn.Module) -> torch.dtype:
    for p in m.parameters():
        return p.dtype
    return torch.float32


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ----------------------------------------------------------------------------------------------------------------
# save
# ----------------------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def dcp_io() -> Iterator[None]:
    """Around a ``dist_checkpointing`` load/save: torch DCP's FutureWarnings about the ShardedTensor API megatron
    still uses are silenced, and torch runs at one CPU thread (:func:`serial_helper_threads`): the call
    all-gathers tensor metadata, and a gloo worker copying it with a parallel op would start a second CPU thread
    team, slowing every later forward of this process (nemo_spec._threads)."""
    with warnings.catch_warnings(), serial_helper_threads():
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed\.checkpoint")
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"megatron\.core\.dist_checkpointing")
        yield


def _save_strategy():
    """Synchronous torch_dist save strategy (works on gloo/CPU and nccl/GPU)."""
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy

    return get_default_save_sharded_strategy("torch_dist", 1)


def _write_config(tmp: Path, cfg: Dict[str, Any]) -> None:
    """Write nemo_spec_config.json (the last file of a checkpoint) into the temp dir."""
    f = tmp / CONFIG_NAME
    f.write_text(dump_json(cfg))


def _commit(tmp: Path, target: Path, overwrite: bool) -> None:
    """Atomically move the finished temp dir to ``target`` (replacing an old one only when ``overwrite``)."""
    if target.exists() and not overwrite:
        raise CheckpointError(f"{target} appeared while saving; not replacing it (overwrite=False)")
    publish_directory(tmp, target)


def save_checkpoint(model: torch.nn.Module, path: PathLike, tokenizer_dir: Optional[PathLike] = None,
                    extra: Optional[Dict[str, Any]] = None, overwrite: bool = False) -> Path:
    """Save ``model`` (GPTModel or SpeculativeGPT, any TP) as a torch_dist checkpoint dir; all ranks must call it.

    Written atomically: everything goes to a temporary sibling directory that rank 0 renames to ``path``
    once every rank has finished. An existing ``path`` is replaced only when ``overwrite`` is True.
    """
    from megatron.core import dist_checkpointing

    apply_cpu_workarounds()
    target = Path(path).expanduser().absolute()
    module = _checkpoint_module(model)
    from nemo_spec.models import model_config

    cfg = model_config(module)
    if target.exists() and not overwrite:
        raise CheckpointError(f"{target} already exists; pass overwrite=True to replace it")
    if target.exists() and not target.is_dir():
        raise CheckpointError(f"{target} exists and is not a directory")
    if target.exists() and any(target.iterdir()):
        try:  # overwrite replaces checkpoints only, never an unrelated directory
            detect_format(target)
        except CheckpointError as e:
            raise CheckpointError(f"{target} exists and is not a checkpoint; refusing to replace it ({e})") from e
    if tokenizer_dir is not None and not Path(tokenizer_dir).expanduser().is_dir():
        raise CheckpointError(f"tokenizer_dir {tokenizer_dir} is not a directory")
    meta: Dict[str, Any] = {
        "format": FORMAT_NAME,
        "model": cfg.to_dict(),
        "tp_size_saved": parallel.tp_size(),
        "ep_size_saved": parallel.ep_size(),
        "params_dtype": str(_params_dtype(module)).replace("torch.", ""),
        "checkpoint_format": "torch_dist",
    }
    from nemo_spec.models import is_speculative

    if is_speculative(module):
        meta["speculative"] = module.spec_config.to_dict()
        if module.trained_seq_len:
            meta["trained_seq_len"] = int(module.trained_seq_len)
    for k, v in (extra or {}).items():
        if k in meta:
            raise CheckpointError(f"extra key {k!r} would overwrite a reserved {CONFIG_NAME} field")
        meta[k] = v
    try:
        json.dumps(meta)  # fail early (before writing anything) on non-JSON extras
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"extra must be JSON-serialisable for {CONFIG_NAME}: {e}") from e
    sharded_sd = module.sharded_state_dict()
    tmp = target.with_name(target.name + TEMP_SUFFIX)
    _barrier()  # every rank has checked the target before anyone writes
    rank0 = parallel.is_rank_zero()
    err: Optional[BaseException] = None
    try:
        if rank0:
            target.parent.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                log.warning("removing stale temporary directory %s from an interrupted save", tmp)
                shutil.rmtree(tmp)
            tmp.mkdir()
    except BaseException as e:  # noqa: BLE001 - re-raised below after all ranks agree
        err = e
    if not _all_ok(err is None):
        raise err if err is not None else CheckpointError(f"rank 0 could not create {tmp}")
    try:
        with serial_helper_threads():  # its collectives must not give gloo workers their own CPU thread teams
            dist_checkpointing.save(sharded_sd, str(tmp), sharded_strategy=_save_strategy())
        if rank0:
            if tokenizer_dir is not None:
                copy_tokenizer(tokenizer_dir, tmp / TOKENIZER_SUBDIR)
            _write_config(tmp, meta)
    except BaseException as e:  # noqa: BLE001
        err = e
    ok = _all_ok(err is None)
    if ok and rank0:
        try:
            _commit(tmp, target, overwrite)
        except BaseException as e:  # noqa: BLE001
            err = e
    ok = _all_ok(ok and err is None)
    if not ok:
        if rank0 and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, (CheckpointError, KeyboardInterrupt, SystemExit)):
            raise err
        if isinstance(err, EOFError):  # the writer's helper process died while starting
            raise CheckpointError(
                f"saving {target} failed: megatron-core's checkpoint writer could not start its helper process "
                f"(EOFError; usually because it uses multiprocessing 'spawn', which imports the calling script "
                f"again: a script that saves must run its code under `if __name__ == \"__main__\":`); nothing was "
                f"written") from err
        if err is not None:
            raise CheckpointError(f"saving {target} failed ({type(err).__name__}: {err}); nothing was written") from err
        raise CheckpointError(f"saving {target} failed on another rank; nothing was written")
    log.info("saved %s checkpoint to %s (tp=%d, ep=%d)", FORMAT_NAME, target, parallel.tp_size(), parallel.ep_size())
    return target


# ----------------------------------------------------------------------------------------------------------------
# load
# ----------------------------------------------------------------------------------------------------------------

def _import_hf():
    try:
        from nemo_spec.checkpoint import hf
    except ImportError as e:
        raise CheckpointError(f"Hugging Face checkpoint support (nemo_spec.checkpoint.hf) is unavailable: {e}") from e
    return hf


def _target_tp(tp_size: Optional[int]) -> int:
    if tp_size is not None:
        if not isinstance(tp_size, int) or tp_size < 1:
            raise CheckpointConfigError(f"tp_size must be a positive int, got {tp_size!r}")
        return tp_size
    return parallel.tp_size()


def _target_ep(ep_size: Optional[int]) -> int:
    if ep_size is not None:
        if not isinstance(ep_size, int) or ep_size < 1:
            raise CheckpointConfigError(f"ep_size must be a positive int, got {ep_size!r}")
        return ep_size
    return parallel.ep_size()


def _ensure_parallel(tp: int, ep: Optional[int] = None) -> None:
    """Parallel state at TP ``tp`` and EP ``ep`` (default: keep the current EP size)."""
    from megatron.core import parallel_state

    ep = parallel.ep_size() if ep is None else ep
    if not parallel_state.model_parallel_is_initialized() or parallel.tp_size() != tp or parallel.ep_size() != ep:
        try:
            parallel.initialize(tensor_parallel_size=tp, expert_parallel_size=ep)
        except ValueError as e:
            raise CheckpointConfigError(f"cannot load at tp_size={tp}, ep_size={ep}: {e}") from e


def checkpoint_target(info: Dict[str, Any], tp_size: Optional[int], dtype: Optional[torch.dtype]
                      ) -> Tuple[ModelConfig, int, torch.dtype]:
    """For a reader's ``read_config`` result: its ModelConfig, the TP size to load at (checked against it) and the
    dtype to build in (default: the saved ``params_dtype``, float32 when unknown)."""
    source = info["source"]
    cfg = ModelConfig.from_dict(info["model"], source=source)
    tp = _target_tp(tp_size)
    check_tp(cfg, tp, source)
    return cfg, tp, dtype or _DTYPES.get(str(info.get("params_dtype")), torch.float32)


def build_for_checkpoint(cfg: ModelConfig, spec: Optional[SpeculativeConfig], dtype: torch.dtype,
                         source: str) -> torch.nn.Module:
    """Build the (TP-sharded) base model and, when ``spec`` is given, apply SpeculativeTransform to it."""
    from nemo_spec.models import build_gpt

    base = build_gpt(cfg, params_dtype=dtype)
    if spec is None:
        return base
    try:
        from nemo_spec.speculative import SpeculativeTransform
    except ImportError as e:
        raise CheckpointError(f"{source} holds a {spec.algorithm} draft but nemo_spec.speculative is unavailable: "
                              f"{e}") from e
    return SpeculativeTransform(config=spec)(base)


def _flat_sharded_tensors(sharded_sd: Dict[str, Any]) -> Dict[str, Any]:
    """ShardedTensors of a (factory-applied) sharded state dict, by checkpoint key (first occurrence)."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    out: Dict[str, Any] = {}
    for v in nested_values(sharded_sd):
        if isinstance(v, ShardedTensor):
            out.setdefault(v.key, v)
    return out


def check_sharded_shapes(sharded_sd: Dict[str, Any], ckpt_dir: Path, source: str) -> None:
    """Compare the model's global tensor shapes with the checkpoint's metadata; raise naming the tensor and shapes."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_outplace
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    try:
        meta = dist_checkpointing.load_tensors_metadata(str(ckpt_dir))
    except Exception as e:  # noqa: BLE001 - any reader failure means an unreadable checkpoint
        raise CheckpointError(f"{ckpt_dir}: cannot read the torch_dist metadata ({type(e).__name__}: {e})") from e
    probe = dict_list_map_outplace(lambda x: x.build() if isinstance(x, ShardedTensorFactory) else x, sharded_sd)
    want = _flat_sharded_tensors(probe)
    missing = sorted(k for k in want if k not in meta)
    if missing:
        raise CheckpointError(f"{ckpt_dir}: tensor(s) {missing[:6]} required by the model built from {source} are "
                              f"not in the checkpoint")
    for k, st in want.items():
        got = tuple(meta[k].global_shape)
        if got != tuple(st.global_shape):
            raise CheckpointError(
                f"{ckpt_dir}: tensor {k!r} has shape {got} in the checkpoint but {tuple(st.global_shape)} in the "
                f"model built from {source}")
    extra = sorted(k for k in meta if k not in want)
    if extra:
        log.warning("%s: ignoring %d checkpoint tensor(s) the model does not use, e.g. %s", ckpt_dir, len(extra),
                    extra[:4])


def load_dist_into(module: torch.nn.Module, ckpt_dir: Path, source: str,
                   sharded_sd: Optional[Dict[str, Any]] = None,
                   key_map: Optional[Callable[[Dict[str, Any]], Dict[str, Any]]] = None) -> None:
    """Load a torch_dist checkpoint into ``module`` (any saved TP -> current TP), checking shapes first.

    ``sharded_sd`` overrides ``module.sharded_state_dict()`` (e.g. re-keyed for a Megatron-LM checkpoint);
    ``key_map`` maps the loaded state dict onto ``module.state_dict()`` names.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.api import CheckpointException

    if sharded_sd is None:
        sharded_sd = module.sharded_state_dict()
    check_sharded_shapes(sharded_sd, ckpt_dir, source)
    try:  # every file the checkpoint's metadata names must be there (else megatron/torch fail deep inside)
        files = {"common.pt"} | {str(v.relative_path) for v in
                                 FileSystemReader(str(ckpt_dir)).read_metadata().storage_data.values()}
    except Exception as e:  # noqa: BLE001 - any unreadable .metadata
        raise CheckpointError(f"{ckpt_dir}: cannot read the torch_dist metadata (.metadata): {e}") from e
    missing = sorted(f for f in files if not (Path(ckpt_dir) / f).is_file())
    if missing:
        raise CheckpointError(f"{ckpt_dir}: checkpoint files missing: {missing} (an incomplete copy?)")
    try:
        with dcp_io():
            loaded = dist_checkpointing.load(sharded_sd, str(ckpt_dir), strict=StrictHandling.LOG_UNEXPECTED)
    except (Exception, CheckpointException) as e:  # torch's CheckpointException is a BaseException
        first = str(e).strip().splitlines()
        sizes = ", ".join(f"{f} ({(Path(ckpt_dir) / f).stat().st_size} bytes)" for f in sorted(files))
        raise CheckpointError(f"{ckpt_dir}: cannot read the checkpoint's tensors ({type(e).__name__}: "
                              f"{first[0][:200] if first else ''}); a truncated or damaged file among: {sizes}") from None
    if key_map is not None:
        loaded = key_map(loaded)
    result = module.load_state_dict(loaded, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing:
        raise CheckpointError(f"{ckpt_dir}: no value loaded for {missing[:6]}")


def _load_own(p: Path, tp_size: Optional[int], dtype: Optional[torch.dtype], base_only: bool,
              ep_size: Optional[int] = None) -> torch.nn.Module:
    cfg_dict = _read_own_config(p)
    source = str(p / CONFIG_NAME)
    cfg = model_config_from(cfg_dict, source)
    spec = None if base_only else speculative_config_from(cfg_dict, cfg, source)
    tp, ep = _target_tp(tp_size), _target_ep(ep_size)
    check_tp(cfg, tp, source, ep)
    saved = cfg_dict.get("params_dtype", "float32")
    if saved not in _DTYPES:  # checked even when dtype= overrides it: a damaged config is not loaded silently
        raise CheckpointConfigError(f"{source}: field 'params_dtype' must be one of {sorted(_DTYPES)}, got {saved!r}")
    if dtype is None:
        dtype = _DTYPES[saved]
    _ensure_parallel(tp, ep)
    module = build_for_checkpoint(cfg, spec, dtype, source)
    load_dist_into(module, p, source)
    if spec is not None and cfg_dict.get("trained_seq_len") is not None:
        n = cfg_dict["trained_seq_len"]
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise CheckpointConfigError(f"{source}: field 'trained_seq_len' must be an int >= 1, got {n!r}")
        module.trained_seq_len = n
    log.info("loaded %s checkpoint %s (saved at tp=%s, ep=%s) at tp=%d ep=%d", FORMAT_NAME, p,
             cfg_dict.get("tp_size_saved"), cfg_dict.get("ep_size_saved", 1), tp, ep)
    return module


def load_model(path: PathLike, tp_size: Optional[int] = None, dtype: Optional[torch.dtype] = None,
               base_only: bool = False, ep_size: Optional[int] = None) -> torch.nn.Module:
    """Load a GPTModel (or SpeculativeGPT) from a nemo_spec, Megatron-LM, Megatron Bridge, NeMo 2 or Hugging Face
    checkpoint directory,
    or a llama.cpp GGUF file.

    The model is built for the current tensor-parallel size (``tp_size`` re-initialises the parallel state
    when it differs; ``ep_size`` likewise for the expert-parallel size of a MoE model, default: keep the current
    one); weights are resharded exactly from whatever TP/EP sizes the checkpoint was saved with.
    ``dtype`` defaults to the saved parameter dtype (float32 when unknown). ``base_only`` loads just the
    base GPTModel of a checkpoint that also holds a speculative draft.
    """
    apply_cpu_workarounds()
    p = Path(path).expanduser()
    fmt = detect_format(p)
    if fmt == FORMAT_NAME:
        return _load_own(p, tp_size, dtype, base_only, ep_size)
    if fmt in ("megatron_legacy", "megatron_dist", "megatron_bridge", "nemo2") and ep_size not in (None, 1):
        raise CheckpointError(f"{p}: ep_size={ep_size} given for a {fmt} checkpoint, whose reader loads dense models "
                              "only (expert parallelism is for MoE models: nemo_spec, Hugging Face and GGUF "
                              "checkpoints)")
    if fmt in ("megatron_legacy", "megatron_dist"):
        from nemo_spec.checkpoint import legacy

        return legacy.load_megatron_lm(p, tp_size=tp_size, dtype=dtype)
    if fmt == "nemo2":
        from nemo_spec.checkpoint import nemo2

        return nemo2.load_nemo2(p, tp_size=tp_size, dtype=dtype, base_only=base_only)
    if fmt == "megatron_bridge":
        from nemo_spec.checkpoint import bridge

        return bridge.load_bridge(p, tp_size=tp_size, dtype=dtype)
    if fmt == "gguf":
        from nemo_spec.checkpoint import gguf

        tp, ep = _target_tp(tp_size), _target_ep(ep_size)
        cfg, _ = gguf.read_gguf_config(p)
        check_tp(cfg, tp, str(p), ep)
        _ensure_parallel(tp, ep)
        return gguf.load_gguf(p, params_dtype=dtype or torch.float32)
    hf = _import_hf()
    tp, ep = _target_tp(tp_size), _target_ep(ep_size)
    cfg = read_checkpoint_config(p)
    check_tp(model_config_from(cfg, str(p / "config.json")), tp, str(p / "config.json"), ep)
    _ensure_parallel(tp, ep)
    return hf.load_hf(p, params_dtype=dtype or torch.float32)
