"""Export a transformed model (base + draft) to the formats serving engines read, and import drafts back.

An export directory holds::

    base/              the base model as a Hugging Face directory (config.json, model.safetensors, tokenizer files,
                       generation_config.json) written by nemo_spec.checkpoint.hf.export_hf, plus a
                       model.safetensors.index.json (the EAGLE reference code finds the embedding through it)
    draft/<engine>/    target 'all' (default): the draft laid out for each engine that can run it (vllm, sglang,
                       trtllm, reference), each checked by that engine's conformance reader (export.engines)
    draft/             a single ``target``: the draft for that engine only
    draft_vllm_legacy/ Medusa only: the heads in the layout of older vLLM releases (vLLM 0.33 has no Medusa)
    README.md          per engine: the exact launch command with these paths and the version it was checked against
    export_info.json   what was exported, from which checkpoint, in which dtype

Formats are documented in :mod:`nemo_spec.export.eagle`, :mod:`nemo_spec.export.medusa`,
:mod:`nemo_spec.export.dflash` and :mod:`nemo_spec.export.peagle` (the speculators layout, vLLM only). Every export is
written into a temp directory next to the target and renamed into place when complete, so a failed export
leaves nothing behind. Under tensor parallelism every rank calls the export (tensors are gathered across the TP
group) and rank 0 writes.
"""
from __future__ import annotations

import datetime
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch

from nemo_spec import parallel
from nemo_spec.checkpoint.hf import resolve_dtype
from nemo_spec.config import ModelConfig, SpeculativeConfig
from nemo_spec.export import eagle as eagle_fmt
from nemo_spec.export import medusa as medusa_fmt
from nemo_spec.export.formats import (
    ExportError,
    cast_tensors,
    check_export_dir,
    hf_dtype_name,
    load_tensors,
    read_json,
    read_safetensors_prefix,
    save_safetensors,
    write_json,
)
from nemo_spec.export.readme import render_readme
from nemo_spec.fsutil import publish_directory
from nemo_spec.models.gpt import is_speculative, unwrap_speculative

log = logging.getLogger(__name__)

DRAFT_FORMATS = ("eagle3", "eagle1", "medusa", "dflash", "peagle")
FORMATS = ("auto", "base") + DRAFT_FORMATS
EXPORT_INFO = "export_info.json"

PathLike = Union[str, os.PathLike]

__all__ = ["ExportError", "FORMATS", "DRAFT_FORMATS", "export_model", "export_checkpoint", "import_draft",
           "detect_draft_format", "draft_state_dict", "resolve_format"]


# ------------------------------------------------------------------------------------------------ helpers
def _unwrap_spec(model: torch.nn.Module) -> torch.nn.Module:
    """The SpeculativeGPT inside Lightning/DDP wrappers, else the model as given."""
    return unwrap_speculative(model) or model


def resolve_format(fmt: str, algorithm: Optional[str], source: str = "model") -> str:
    """Validate ``fmt`` against the model's speculative algorithm ('auto' picks it); returns the format name."""
    if fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}; choose one of {list(FORMATS)}")
    if fmt == "base":
        return fmt
    if algorithm is None:
        if fmt == "auto":
            return "base"
        raise ExportError(f"{source} has no draft (it was not transformed with SpeculativeTransform), so it cannot "
                          f"be exported as a {fmt} draft; use format 'base' or transform and train it first")
    if fmt == "auto":
        return algorithm
    if fmt != algorithm:
        raise ExportError(f"{source} carries a {algorithm} draft; it cannot be exported as {fmt}")
    return fmt


def draft_state_dict(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """Full (TP-gathered, CPU) state dict of the model's draft module; every TP rank must call it.

    Keys are the draft module's own names; TP merge rules are looked up under the checkpoint prefix
    (``eagle_module.`` / ``medusa_heads.``) the speculative package registered them for.
    """
    from nemo_spec.checkpoint.tp import is_tensor_entry

    spec = _unwrap_spec(model)
    if not is_speculative(spec):
        raise ExportError(f"{type(model).__name__} has no draft")
    prefix = spec.draft_prefix
    local = {prefix + k: v.detach().cpu() for k, v in spec.draft.state_dict().items() if is_tensor_entry(k, v)}
    local = _gather_tp(local, gated=spec.model_config.activation == "swiglu")
    return {k[len(prefix):]: v for k, v in local.items()}


def _load_draft_full(spec: torch.nn.Module, full: Dict[str, torch.Tensor]) -> None:
    """Load a full draft state dict (draft-module names) into this rank's shard of the draft, strictly."""
    from nemo_spec.checkpoint.tp import is_tensor_entry, split_state_dict

    prefix = spec.draft_prefix
    gated = spec.model_config.activation == "swiglu"
    shard = split_state_dict({prefix + k: v for k, v in full.items()}, parallel.tp_rank(), parallel.tp_size(), gated)
    shard = {k[len(prefix):]: v for k, v in shard.items()}
    own = {k: v for k, v in spec.draft.state_dict().items() if is_tensor_entry(k, v)}
    missing, unexpected = sorted(set(own) - set(shard)), sorted(set(shard) - set(own))
    if missing or unexpected:
        raise ExportError(f"draft tensors do not match the model: missing {missing[:8]}, unexpected {unexpected[:8]}")
    for k, v in shard.items():
        if tuple(v.shape) != tuple(own[k].shape):
            raise ExportError(f"draft tensor {k}: file shape {tuple(v.shape)} (TP shard) != model shape "
                              f"{tuple(own[k].shape)}")
    spec.draft.load_state_dict({k: v.to(own[k].dtype) for k, v in shard.items()}, strict=False)


def _read_d2t(d2t: Union[None, PathLike, torch.Tensor]) -> Optional[torch.Tensor]:
    """``import_draft``'s d2t: a tensor, or a file holding one (ModelOpt's draft vocabulary cache is ``torch.save(d2t)``:
    speculative/utils.py calibrate_frequent_vocab, plugins/hf_eagle.py:318-337 @ 0.47.0), or a dict with 'd2t'."""
    if d2t is None or isinstance(d2t, torch.Tensor):
        return d2t
    p = Path(d2t)
    if not p.is_file():
        raise ExportError(f"d2t file {p} does not exist")
    try:
        obj = torch.load(str(p), map_location="cpu", weights_only=True)
    except Exception as e:
        raise ExportError(f"{p} is not a torch tensor file ({type(e).__name__})") from e
    if isinstance(obj, dict):
        obj = obj.get("d2t")
    if not isinstance(obj, torch.Tensor) or obj.dim() != 1 or obj.is_floating_point():
        raise ExportError(f"{p}: expected a 1-D integer d2t tensor (or a dict with one under 'd2t')")
    return obj


def _base_embedding(spec: torch.nn.Module) -> torch.Tensor:
    """The base's full word-embedding table [V, h] (gathered over the vocab-parallel TP split)."""
    key = "embedding.word_embeddings.weight"
    w = spec.gpt.embedding.word_embeddings.weight.detach().cpu()
    return _gather_tp({key: w}, gated=False)[key]


def _gather_tp(local: Dict[str, torch.Tensor], gated: bool) -> Dict[str, torch.Tensor]:
    """Merge per-rank TP shards of ``local`` (keys named as in the checkpoint, so the TP rules apply)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from nemo_spec.checkpoint.tp import merge_state_dicts

    size = parallel.tp_size()
    if size == 1:
        return local
    shards: list = [None] * size
    dist.all_gather_object(shards, local, group=parallel_state.get_tensor_model_parallel_group())
    return merge_state_dicts(shards, gated)


def _broadcast(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (identity without a multi-process group)."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return obj


def _on_rank0(fn: Callable[[], None], what: str) -> None:
    """Run ``fn`` on rank 0 only; if it fails, every rank raises (rank 0 re-raises the original error)."""
    err: Optional[BaseException] = None
    if parallel.is_rank_zero():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below once all ranks know
            err = e
    msg = _broadcast(None if err is None else f"{type(err).__name__}: {err}")
    if err is not None:
        raise err
    if msg is not None:
        raise ExportError(f"{what} failed on rank 0: {msg}")


def _new_tmp_dir(target: Path) -> Path:
    """Create (rank 0) a fresh temp dir next to ``target`` and return its path on every rank."""
    path = None
    if parallel.is_rank_zero():
        target.parent.mkdir(parents=True, exist_ok=True)
        path = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        path.mkdir()
    return Path(_broadcast(str(path) if path else None))


# ------------------------------------------------------------------------------------------------ writers
def resolve_targets(target: str, fmt: str) -> List[str]:
    """Engines to write for ``target`` ('all' = every engine whose reader claims ``fmt``)."""
    from nemo_spec.export.engines import TARGETS, engines_for

    if target not in TARGETS:
        raise ExportError(f"unknown export target {target!r}; choose one of {list(TARGETS)}")
    claimed = engines_for(fmt)
    if target == "all":
        return claimed
    if target not in claimed:
        from nemo_spec.export.engines import ENGINES, not_served

        eng = ENGINES[target]
        why = not_served(target, fmt)
        raise ExportError(f"{target} {eng.VERSION} cannot serve a {fmt} draft (its reader claims {list(eng.FORMATS)})"
                          + (f": {why}" if why else "")
                          + (f"; engines that serve it: {claimed}" if claimed else ""))
    return [target]


def _draft_files(fmt: str, neutral: Dict[str, torch.Tensor], cfg: ModelConfig, spec: SpeculativeConfig,
                 embedding: Optional[torch.Tensor], target: str
                 ) -> Tuple[Dict[str, Tuple[Dict[str, torch.Tensor], Dict[str, Any]]], Dict[str, Any], Dict[str, str],
                            Optional[Dict[str, Any]]]:
    """(sub-directory -> (tensors, config.json), engines -> {dir, launch}, skipped engine -> reason, whether and how
    llama.cpp serves one of those directories: :func:`nemo_spec.export.llamacpp.llamacpp_entry`) for ``fmt``.

    A single target writes ``draft/``; 'all' writes ``draft/<engine>/`` for every engine that can run the draft.
    """
    engines = resolve_targets(target, fmt)
    files: Dict[str, Tuple[Dict[str, torch.Tensor], Dict[str, Any]]] = {}
    entries: Dict[str, Any] = {}
    skipped: Dict[str, str] = {}
    from nemo_spec.checkpoint.families import FamilyError, family_for_export
    from nemo_spec.export.engines import TRTLLM_TWO_MODEL, base_unsupported

    try:
        arch: Optional[str] = family_for_export(cfg).architecture
    except FamilyError:  # a base no family writes: the base export names the field
        arch = None
    for eng in engines:
        sub = "draft" if target != "all" else f"draft/{eng}"
        launch: Dict[str, Any] = {}
        try:
            why = base_unsupported(eng, fmt, arch) if arch is not None else None
            if why:
                raise ExportError(why)
            if fmt == "eagle3":
                tensors, conf, launch = eagle_fmt.eagle3_to_engine(neutral, cfg, spec, eng)
                if eng == "trtllm" and arch in TRTLLM_TWO_MODEL:  # its class holds no draft (engines/__init__.py)
                    launch["eagle3_one_model"] = False
            elif fmt == "eagle1":
                tensors, conf = eagle_fmt.eagle1_to_engine(neutral, cfg, spec, embedding, eng)
            elif fmt == "dflash":  # one z-lab-format directory that every claiming engine reads as is
                from nemo_spec.export.dflash import dflash_to_hf

                tensors, conf = dflash_to_hf(neutral, cfg, spec)
                launch = {"block_size": int(spec.block_size)}
            elif fmt == "peagle":  # the speculators layout; vLLM is the only engine with parallel drafting
                from nemo_spec.export.peagle import peagle_to_speculators

                tensors, conf = peagle_to_speculators(neutral, cfg, spec, embedding)
                launch = {"num_speculative_tokens": int(spec.parallel_depth)}
            else:
                tensors, conf = medusa_fmt.medusa_to_reference(neutral, cfg, spec)
        except ExportError as e:
            if target != "all":
                raise
            skipped[eng] = str(e)
            log.warning("not writing a %s draft for %s: %s", fmt, eng, e)
            continue
        files[sub] = (tensors, conf)
        entries[eng] = {"dir": sub, "launch": launch}
    if target == "all":  # engines that do not serve the format at all, with their reason (README, verify table)
        from nemo_spec.export.engines import ENGINES, not_served

        for eng in ENGINES:
            why = not_served(eng, fmt)
            if why and eng not in engines:
                skipped[eng] = why
    if not files:
        raise ExportError(f"no engine can serve this {fmt} draft: {skipped}")
    if fmt == "medusa":  # the layout of older vLLM releases' Medusa; vLLM 0.33 has no Medusa (not verified)
        files["draft_vllm_legacy"] = medusa_fmt.medusa_to_vllm(neutral, cfg, spec)
    from nemo_spec.export.llamacpp import llamacpp_entry

    return files, entries, skipped, llamacpp_entry(fmt, files, entries, cfg, arch)


def _write_safetensors_index(base_dir: Path) -> None:
    """Add ``model.safetensors.index.json`` for a single-file base (the EAGLE reference code finds the base's
    embedding table through it; transformers and vLLM read the single file either way)."""
    from safetensors import safe_open

    single, index = base_dir / "model.safetensors", base_dir / "model.safetensors.index.json"
    if not single.is_file() or index.exists():
        return
    total = 0
    with safe_open(str(single), framework="pt") as f:
        keys = list(f.keys())
        for k in keys:
            sl = f.get_slice(k)
            total += _numel(sl.get_shape()) * _itemsize(sl.get_dtype())
    write_json(index, {"metadata": {"total_size": int(total)}, "weight_map": {k: single.name for k in keys}})


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _itemsize(dtype: str) -> int:
    return {"F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "BOOL": 1, "F64": 8, "I8": 1, "U8": 1}.get(dtype, 4)


def _write_draft_dir(out: Path, fmt: str, sub: str, tensors: Dict[str, torch.Tensor], conf: Dict[str, Any],
                     dtype: torch.dtype) -> None:
    out.mkdir(parents=True)
    tensors = cast_tensors(tensors, dtype)
    conf = dict(conf, torch_dtype=hf_dtype_name(dtype), dtype=hf_dtype_name(dtype))  # transformers 4 / 5 names
    try:
        import transformers

        conf["transformers_version"] = transformers.__version__
    except ImportError:  # pragma: no cover
        pass
    write_json(out / "config.json", conf)
    if fmt == "medusa" and not sub.startswith("draft_vllm"):
        save_safetensors(tensors, out / "medusa_lm_head.safetensors")
        torch.save(tensors, out / "medusa_lm_head.pt")  # MedusaModel reads only this (medusa_model.py:151-156)
    else:
        save_safetensors(tensors, out / "model.safetensors")
        if fmt == "eagle1" and sub in ("draft", "draft/reference") and conf.get("bias") is not None:
            torch.save(tensors, out / "pytorch_model.bin")  # EaModel tries pytorch_model.bin first (ea_model.py:124)
    log.info("wrote %s draft (%d tensors, %s) to %s", fmt, len(tensors), hf_dtype_name(dtype), out)


def export_model(model: torch.nn.Module, export_dir: PathLike, fmt: str = "auto",
                 dtype: Union[str, torch.dtype] = "bf16", overwrite: bool = False,
                 tokenizer_dir: Optional[PathLike] = None, include_base: bool = True,
                 base_name: Optional[str] = None, source: Optional[str] = None, target: str = "all",
                 verify: bool = False) -> Path:
    """Write the base (HF) and/or the draft of ``model`` to ``export_dir`` (all TP ranks call); returns the dir.

    ``fmt``: 'auto' (the model's draft algorithm, or 'base' for an untransformed model), 'base', 'eagle3',
    'eagle1', 'medusa', 'dflash', 'peagle'. ``target``: 'vllm', 'sglang', 'trtllm', 'reference' (one ``draft/`` for
    that engine) or 'all' (``draft/<engine>/`` for every engine that can run the draft; engines that do not serve the
    format are recorded in export_info.json ``skipped_engines`` with the reason). ``base_name`` is recorded as
    ``base_model_name_or_path`` in the draft config (default: the absolute path of ``export_dir/base`` when the base
    is exported, else ``source``). ``verify``: read the export back through every engine's conformance reader and
    raise ExportError on a mismatch (needs the base; TP=1).
    """
    from nemo_spec.checkpoint.hf import export_hf
    from nemo_spec.models.foreign import to_project_spec

    out_dir = Path(export_dir).absolute()
    torch_dtype = resolve_dtype(dtype, "export dtype", ExportError)
    model = to_project_spec(model)  # another layer spec's base: converted and checked (or refused by name) first
    spec_model = _unwrap_spec(model)
    transformed = is_speculative(spec_model)
    algorithm = spec_model.spec_config.algorithm if transformed else None
    fmt = resolve_format(fmt, algorithm, source or type(model).__name__)
    if fmt == "base" and not include_base:
        raise ExportError("nothing to export: format 'base' with include_base=False")
    check_export_dir(out_dir, overwrite)
    if fmt in DRAFT_FORMATS:
        resolve_targets(target, fmt)  # fail before gathering weights
    if tokenizer_dir is not None and not Path(tokenizer_dir).is_dir():
        raise ExportError(f"tokenizer_dir {tokenizer_dir} is not a directory")
    cfg: ModelConfig = spec_model.model_config if transformed else spec_model.nemo_spec_config
    if fmt in ("eagle1", "eagle3", "peagle"):
        eagle_fmt.check_llama_family(cfg, fmt)

    # collective part: gather the draft (and, for EAGLE-1, the base embedding) on every rank
    neutral = draft_state_dict(spec_model) if fmt in DRAFT_FORMATS else {}
    embedding = _base_embedding(spec_model) if fmt in ("eagle1", "peagle") else None  # P-EAGLE: embed_tokens
    base_ref = base_name or (str(out_dir / "base") if include_base else (source or ""))
    files: Dict[str, Tuple[Dict[str, torch.Tensor], Dict[str, Any]]] = {}
    entries: Dict[str, Any] = {}
    skipped: Dict[str, str] = {}
    llamacpp: Optional[Dict[str, Any]] = None
    if fmt in DRAFT_FORMATS:
        files, entries, skipped, llamacpp = _draft_files(fmt, neutral, cfg, spec_model.spec_config, embedding,
                                                         target)
        for _, conf in files.values():
            conf["base_model_name_or_path"] = base_ref
            if fmt == "peagle":  # speculators' own record of the verifier (speculators/base.py:76-84)
                conf["speculators_config"]["verifier"]["name_or_path"] = base_ref
            conf["nemo_spec"] = {"algorithm": fmt, "source_checkpoint": source,
                                 "base_dir": None if not include_base else ("../base" if target != "all"
                                                                            else "../../base"),
                                 "speculative": spec_model.spec_config.to_dict()}

    check = verify and fmt in DRAFT_FORMATS
    if check and (parallel.tp_size() > 1 or parallel.ep_size() > 1):
        log.warning("verification skipped under tensor/expert parallelism; run scripts/verify_export.py %s "
                    "--checkpoint <ckpt>", out_dir)
        check = False
    elif check and not include_base:
        log.warning("verification skipped: no base/ exported (the readers run the exported base)")
        check = False
    tmp = _new_tmp_dir(out_dir)
    try:
        if include_base:
            base_model = spec_model.gpt if transformed else spec_model
            export_hf(base_model, tmp / "base", tokenizer_dir=tokenizer_dir, dtype=torch_dtype)
            _on_rank0(lambda: _write_safetensors_index(tmp / "base"), "writing the base's safetensors index")

        def write_rest() -> None:
            for sub, (tensors, conf) in files.items():
                _write_draft_dir(tmp / sub, fmt, sub, tensors, conf, torch_dtype)
            info = {
                "format": fmt,
                "dtype": hf_dtype_name(torch_dtype),
                "base": "base" if include_base else None,
                "draft": "draft" if files else None,
                "target": target if files else None,
                "engines": entries,
                "skipped_engines": skipped,
                "llamacpp": llamacpp,  # llama.cpp reads one of those directories (nemo_spec/export/llamacpp.py)
                "extra": sorted(k for k in files if not k.startswith("draft/") and k != "draft"),
                "base_model_name_or_path": base_ref,
                "source_checkpoint": source,
                "model": cfg.to_dict(),
                "speculative": spec_model.spec_config.to_dict() if transformed else None,
                "exported_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            }
            write_json(tmp / EXPORT_INFO, info)
            (tmp / "README.md").write_text(render_readme(out_dir, info))
            if check:  # before publishing: an export that fails it never appears under out_dir
                from nemo_spec.export.engines import format_table, rows_ok, verify_export

                rows = verify_export(tmp, model=spec_model)
                log.info("export verification (engine conformance readers):\n%s", format_table(rows))
                if not rows_ok(rows):
                    raise ExportError(f"export {out_dir} does not load as our draft in every engine (nothing was "
                                      f"written to {out_dir}):\n{format_table(rows)}")
            publish_directory(tmp, out_dir)

        _on_rank0(write_rest, f"export to {out_dir}")
    finally:
        if parallel.is_rank_zero() and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    if parallel.is_rank_zero():
        log.info("exported %s (%s) to %s", fmt, hf_dtype_name(torch_dtype), out_dir)
    return out_dir


def export_checkpoint(checkpoint: PathLike, export_dir: PathLike, fmt: str = "auto",
                      dtype: Union[str, torch.dtype] = "bf16", overwrite: bool = False, include_base: bool = True,
                      base_name: Optional[str] = None, target: str = "all", verify: bool = False) -> Path:
    """Load a saved checkpoint (any saved TP) under the current parallel state and export it (all ranks call)."""
    from nemo_spec.checkpoint import find_tokenizer_dir, load_model, read_checkpoint_config

    ckpt = Path(checkpoint)
    saved = read_checkpoint_config(ckpt)
    algorithm = (saved.get("speculative") or {}).get("algorithm") if isinstance(saved, dict) else None
    real = resolve_format(fmt, algorithm, f"checkpoint {ckpt}")  # fail before loading weights
    if real in DRAFT_FORMATS:
        resolve_targets(target, real)
    resolve_dtype(dtype, "export dtype", ExportError)
    check_export_dir(Path(export_dir), overwrite)
    model = load_model(ckpt)
    return export_model(model, export_dir, fmt=fmt, dtype=dtype, overwrite=overwrite,
                        tokenizer_dir=find_tokenizer_dir(ckpt), include_base=include_base, base_name=base_name,
                        source=str(ckpt.absolute()), target=target, verify=verify)


# ------------------------------------------------------------------------------------------------ import
def _draft_dir(path: Path) -> Path:
    """The draft directory of an export dir (or ``path`` itself when it is one)."""
    if (path / "config.json").is_file():
        return path
    if (path / "draft" / "config.json").is_file():
        return path / "draft"
    for eng in ("reference", "vllm", "sglang", "trtllm"):
        if (path / "draft" / eng / "config.json").is_file():
            return path / "draft" / eng
    raise ExportError(f"{path} holds no draft: neither {path / 'config.json'} nor {path / 'draft' / 'config.json'}")


def detect_draft_format(path: PathLike) -> str:
    """'eagle3', 'eagle1', 'dflash', 'peagle', 'medusa', 'medusa_vllm' or 'medusa_modelopt' for an exported draft
    directory (or an export dir)."""
    d = _draft_dir(Path(path))
    conf = read_json(d / "config.json")
    arch = (conf.get("architectures") or [None])[0]
    if conf.get("speculators_model_type") == "peagle":  # before eagle3: it also has draft_vocab_size
        return "peagle"
    if conf.get("speculators_model_type") == "eagle3":  # vllm-project/speculators (models/eagle3/config.py)
        return "eagle3"
    if conf.get("speculators_model_type"):
        raise ExportError(f"{d / 'config.json'}: speculators_model_type {conf['speculators_model_type']!r} is not "
                          f"imported (only 'eagle3' and 'peagle')")
    if isinstance(conf.get("medusa"), dict) and "num_medusa_heads" in conf["medusa"]:
        return "medusa_modelopt"  # ModelOpt's export_hf_checkpoint of a Medusa model (plugins/hf_medusa.py:63-80)
    if "medusa_num_heads" in conf or conf.get("model_type") == "medusa":
        if (d / "medusa_lm_head.safetensors").is_file() or (d / "medusa_lm_head.pt").is_file():
            return "medusa"
        return "medusa_vllm"
    if arch == eagle_fmt.EAGLE3_ARCH or "draft_vocab_size" in conf:
        return "eagle3"
    if arch == eagle_fmt.EAGLE1_ARCH:
        return "eagle1"
    from nemo_spec.export.dflash import DFLASH_ARCH

    if arch == DFLASH_ARCH or "dflash_config" in conf:
        return "dflash"
    raise ExportError(f"{d / 'config.json'}: cannot tell the draft format (architectures={conf.get('architectures')})")


def _read_draft_tensors(d: Path, fmt: str) -> Dict[str, torch.Tensor]:
    if fmt == "medusa_modelopt":  # the whole model: read only the heads, from one file or an index's shards
        return read_safetensors_prefix(d, "medusa_heads.")
    names = (["medusa_lm_head.safetensors", "medusa_lm_head.pt"] if fmt == "medusa"
             else ["model.safetensors", "pytorch_model.bin"])  # every layout writes model.safetensors
    for n in names:
        if (d / n).is_file():
            return load_tensors(d / n)
    raise ExportError(f"{d} has none of the weight files {names}")


def import_draft(model: torch.nn.Module, path: PathLike, d2t: Union[None, PathLike, torch.Tensor] = None) -> str:
    """Load an exported draft (export dir or draft dir) into a transformed model's draft (TP-aware); returns its format.

    Every tensor of the draft must be present and match in shape; the file's draft must be the same algorithm as
    the model's. Reads every layout nemo_spec writes, EAGLE-3 drafts of vLLM / SGLang / TensorRT-LLM / SpecForge /
    NVIDIA Model Optimizer (Hugging Face and Megatron flows) and ModelOpt's Medusa exports. ``d2t``: an EAGLE-3 draft
    vocabulary map (tensor, or a ``torch.save``d one such as ModelOpt's draft vocabulary cache) for a
    reduced-vocabulary file that does not store it.
    """
    from nemo_spec.speculative.eagle import _base_output_weight, _gather_rows

    spec = _unwrap_spec(model)
    if not is_speculative(spec):
        raise ExportError(f"import_draft needs a transformed model (SpeculativeGPT), got {type(model).__name__}")
    d = _draft_dir(Path(path))
    fmt = detect_draft_format(d)
    algorithm = spec.spec_config.algorithm
    if fmt.split("_")[0] != algorithm:
        raise ExportError(f"{d} holds a {fmt} draft but the model's draft is {algorithm}")
    if d2t is not None and fmt != "eagle3":
        raise ExportError(f"d2t= applies to EAGLE-3 drafts; {d} holds a {fmt} draft")
    conf = read_json(d / "config.json")
    cfg: ModelConfig = spec.model_config
    if conf.get("speculators_model_type"):  # the draft's Llama config is nested (speculators format)
        conf = dict(conf.get("transformer_layer_config") or {}, **conf)
    if "hidden_size" in conf and int(conf["hidden_size"]) != cfg.hidden_size:
        raise ExportError(f"{d / 'config.json'}: hidden_size={conf['hidden_size']} but the model has {cfg.hidden_size}")
    tensors = _read_draft_tensors(d, fmt)
    if fmt == "eagle3":
        neutral = eagle_fmt.eagle3_from_reference(tensors, conf, cfg,
                                                  spec.spec_config.resolved_aux_layers(cfg.num_layers),
                                                  base_lm_head=lambda: _gather_rows(_base_output_weight(spec.gpt)).cpu(),
                                                  d2t=_read_d2t(d2t),
                                                  options=eagle_fmt.model_options(spec.spec_config))
    elif fmt == "eagle1":
        neutral = eagle_fmt.eagle1_from_reference(tensors, conf, cfg)
    elif fmt == "dflash":
        from nemo_spec.export.dflash import dflash_from_hf

        neutral = dflash_from_hf(tensors, conf, cfg, spec.spec_config)
    elif fmt == "peagle":
        from nemo_spec.export.peagle import peagle_from_speculators

        neutral = peagle_from_speculators(tensors, conf, cfg, spec.spec_config, _base_embedding(spec))
    elif fmt == "medusa":
        neutral = medusa_fmt.medusa_from_reference(tensors, conf)
    elif fmt == "medusa_modelopt":
        neutral = medusa_fmt.medusa_from_modelopt(tensors, conf)
    else:
        neutral = medusa_fmt.medusa_from_vllm(tensors, conf)
    try:
        _load_draft_full(spec, neutral)
    except ValueError as e:
        raise ExportError(f"{d}: {e}") from e
    log.info("imported %s draft from %s", fmt, d)
    return fmt
