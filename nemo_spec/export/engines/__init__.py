"""Engine conformance readers: what each serving engine computes from an export, in plain torch.

One module per engine (``vllm``, ``sglang``, ``trtllm``, ``reference``; format-specific readers in ``dflash`` and
``vllm_peagle``), each written from that engine's source at
a pinned version with file:line comments. A reader applies *its* engine's rules (names, shapes, config fields,
aux-layer numbering, d2t/t2d, biases, architecture string) and returns the draft logits the engine would compute,
or raises :class:`EngineMismatch` where the engine would fail or load the files silently wrong.
:func:`verify_export` compares every reader with the checkpoint's own draft (and base) logits.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Union

import torch

from nemo_spec.export.engines import reference, sglang, trtllm, vllm
from nemo_spec.export.engines._llama import BaseRun, EngineMismatch, Unsupported, base_forward

log = logging.getLogger(__name__)

ENGINES = {m.NAME: m for m in (vllm, sglang, trtllm, reference)}
TARGETS = tuple(ENGINES) + ("all",)

__all__ = ["ENGINES", "TARGETS", "EngineMismatch", "Unsupported", "VerifyRow", "verify_export", "format_table",
           "engines_for", "not_served", "BaseRun", "base_forward"]


def engines_for(fmt: str) -> List[str]:
    """Engines whose reader claims format ``fmt``."""
    return [n for n, m in ENGINES.items() if fmt in m.FORMATS]


#: base architectures whose model class hands the draft the base's intermediate hidden states (the aux features of
#: EAGLE-3, P-EAGLE and DFlash drafts), per engine and draft format. vLLM 0.34.0: models that implement
#: SupportsEagle3 (eagle3_utils.py:18-19 raises for others; dflash and eagle3 use aux hidden states:
#: v1/worker/gpu/spec_decode/dflash/config.py:50-51, eagle/config.py:69-72) — llama.py:464-470, mistral.py:236
#: (Llama's), qwen2.py:455-456, qwen3.py:280-281, qwen3_moe.py:543-548; not mixtral.py:375 or gpt2.py:269
#: (0.33.0, the readers' pinned version, the same: gpu_model_runner.py:5173-5177, mixtral.py:375).
#: SGLang 0.5.23 (model_runner_components/attention_backend_setup.py:54-71): set_eagle3_layers_to_capture in
#: models/llama.py:929, qwen2.py:781, qwen3.py:778, qwen3_moe.py:1128 (Mistral: mistral.py:33 is Llama's);
#: set_dflash_layers_to_capture in llama.py:943, qwen3.py:793, qwen3_moe.py:1145 (not qwen2.py).
#: TensorRT-LLM (PyTorch backend; its targets capture through SpecMetadata.maybe_capture_hidden_states, called by the
#: decoder layers): Llama, Qwen3 and Qwen3-MoE layers call it and their classes are SpecDecOneEngineForCausalLM (the
#: one-model path, the default); Mistral's layers call it but MistralForCausalLM is a DecoderModelForCausalLM, so
#: EAGLE-3 runs there in the two-model mode only (eagle3_one_model=False, written into its launch snippet; NVIDIA/
#: TensorRT-LLM#6158) and DFlash, which is one-model only (SpecDecOneEngineForCausalLM.__init__ @ 00679c66 attaches
#: the external drafter), not at all. MixtralForCausalLM never passes spec_metadata to its layers
#: (modeling_mixtral.py @ b35ac1b64368: MixtralModel.forward, MixtralForCausalLM); Qwen2's QwenDecoderLayer has no
#: capture call at the pinned commit (added later, TensorRT-LLM#10091); there is no GPT-2 model in the PyTorch
#: backend at all. The reference code is checked by its own reader.
_EAGLE_BASES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                "Qwen3MoeForCausalLM")
_TRTLLM_ONE_MODEL = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
#: bases TensorRT-LLM serves EAGLE-3 drafts on only with the two-model path (``eagle3_one_model=False``)
TRTLLM_TWO_MODEL = ("MistralForCausalLM",)
AUX_CAPTURE = {
    "vllm": {"eagle3": _EAGLE_BASES, "peagle": _EAGLE_BASES, "dflash": _EAGLE_BASES},
    "sglang": {"eagle3": _EAGLE_BASES,
               "dflash": ("LlamaForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")},
    "trtllm": {"eagle3": _TRTLLM_ONE_MODEL + TRTLLM_TWO_MODEL, "dflash": _TRTLLM_ONE_MODEL},
}


def base_unsupported(engine: str, fmt: str, architecture: str) -> Optional[str]:
    """Why ``engine`` cannot run a ``fmt`` draft on a base of ``architecture`` (None when it can or is unchecked)."""
    bases = AUX_CAPTURE.get(engine, {}).get(fmt)
    if bases is None or architecture in bases:
        return None
    return (f"{engine} {ENGINES[engine].VERSION}: its {architecture} does not hand a draft the base's intermediate "
            f"hidden states, which {fmt} drafts read (bases it serves such drafts on: {list(bases)})")


def not_served(engine: str, fmt: str) -> Optional[str]:
    """Why ``engine`` does not serve ``fmt`` at its pinned version (cited), or None when nothing is recorded."""
    return (getattr(ENGINES[engine], "NOT_SERVED", None) or {}).get(fmt)


@dataclass
class VerifyRow:
    """One line of the verification table."""

    engine: str
    path: str
    status: str  # ok | mismatch | unsupported
    max_abs_diff: Optional[float]
    detail: str = ""


def _tolerance(dtype: str, atol: float, ref: torch.Tensor) -> float:
    """fp32 exports: ``atol``. bf16/fp16: their rounding grows with the logits' size and the model's depth, so 2% of
    the largest finite |logit| of ``ref`` (at least 0.15). SmolLM2-135M's bf16 base is off by 0.22 = 0.66% of its
    33.5 (a fixed 0.15 refused it); a wrong layout is off by the size of the logits themselves."""
    if dtype == "float32":
        return atol
    finite = ref[torch.isfinite(ref)]
    return max(atol, 0.15, 0.02 * float(finite.abs().max()) if finite.numel() else 0.0)


def _compare(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max |a - b| over finite entries; inf when the -inf masks (draft vocabularies) differ."""
    if a.shape != b.shape:
        return float("inf")
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    if not torch.equal(fa, fb):
        return float("inf")
    return float((a[fa] - b[fb]).abs().max()) if fa.any() else 0.0


def _our_logits(model: torch.nn.Module, fmt: str, ids: torch.Tensor) -> Dict[str, torch.Tensor]:
    """The checkpoint's base logits and draft logits in the readers' convention (base vocabulary)."""
    from nemo_spec.export.engines._llama import scatter_draft_logits

    with torch.no_grad():
        out = model.base_forward(ids)
        res = {"base": out.logits.float()}
        if fmt == "medusa":
            res["draft"] = model.medusa_logits(out.hidden).float()
            return res
        if fmt == "peagle":  # vLLM's first parallel-drafting pass (engines/vllm_peagle.py), K = the trained depth
            from nemo_spec.export.engines.vllm_peagle import our_peagle_logits

            res["draft"] = our_peagle_logits(model, ids, int(model.spec_config.parallel_depth))
            return res
        if fmt == "dflash":  # the readers' scenario: context = positions < s-1, block [ids[s-1], MASK...]
            from nemo_spec.speculative.dflash import DFlashContext

            d = model.eagle_module
            b, s = ids.shape
            B = int(model.spec_config.block_size)
            fused = model.fuse(model.base_features(out))[:, : s - 1]
            tok = torch.full((b, B), d.mask_token_id, dtype=ids.dtype)
            tok[:, 0] = ids[:, s - 1]
            ctx = DFlashContext(position_ids=torch.arange(s - 1, s - 1 + B)[None].expand(b, B),
                                target=fused.transpose(0, 1),
                                ctx_position_ids=torch.arange(s - 1)[None].expand(b, s - 1))
            res["draft"] = d(model.gpt, tok, ctx)[1].float()
            return res
        _, logits = model.draft_step(ids[:, 1:], model.fuse(model.base_features(out))[:, :-1])
        logits = logits.float()
        if fmt == "eagle3" and logits.shape[-1] != model.model_config.vocab_size:
            base_ids = model.eagle_module.base_ids_of_draft_vocab().cpu()
            logits = scatter_draft_logits(logits, base_ids, model.model_config.vocab_size)
        res["draft"] = logits
    return res


def _check_vocab(model: torch.nn.Module, draft_dir: Path) -> Optional[str]:
    """d2t/t2d of an EAGLE-3 draft dir against the checkpoint's training vocabulary; a message when they differ."""
    from nemo_spec.export.engines._llama import read_dir

    w = read_dir(draft_dir, ["model.safetensors", "pytorch_model.bin"])
    d2t, t2d = model.eagle_module.d2t.cpu(), model.eagle_module.t2d.cpu()
    if d2t.numel() == model.model_config.vocab_size:
        return None if "d2t" not in w or not torch.any(w["d2t"]) else "full vocabulary but a non-zero d2t"
    if "d2t" not in w or not torch.equal(w["d2t"].long(), d2t):
        return "d2t differs from the checkpoint's draft vocabulary"
    if "t2d" in w and not torch.equal(w["t2d"].bool(), t2d):
        return "t2d differs from the checkpoint's draft vocabulary"
    return None


def _engine_dirs(export_dir: Path, info: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """engine -> {dir, launch} from export_info.json; older exports: every claiming engine reads draft/."""
    eng = info.get("engines")
    if eng:
        return {k: v for k, v in eng.items() if v.get("dir")}
    return {n: {"dir": "draft", "launch": {}} for n in engines_for(info["format"])}


def verify_export(export_dir: Union[str, os.PathLike], checkpoint: Optional[Union[str, os.PathLike]] = None,
                  model: Optional[torch.nn.Module] = None, num_inputs: int = 2, seq_len: int = 9,
                  atol: float = 1e-3, engines: Optional[Sequence[str]] = None, seed: int = 0) -> List[VerifyRow]:
    """Read an export back through each engine's reader and compare with the checkpoint's logits.

    ``atol`` applies to fp32 exports; bf16/fp16 exports are compared with a tolerance scaled to their precision and
    to the logits' size (:func:`_tolerance`).
    Returns one row per engine directory plus a ``base`` row (the HF base against the checkpoint's base).
    """
    from nemo_spec.checkpoint import load_model
    from nemo_spec.export.formats import ExportError, read_json
    from nemo_spec.models.gpt import unwrap_speculative

    root = Path(export_dir)
    info = read_json(root / "export_info.json")
    fmt = info.get("format")
    if not isinstance(fmt, str) or not fmt:
        raise ExportError(f"{root / 'export_info.json'} names no export format ('format'); is {root} an export "
                          f"written by nemo_spec?")
    eng = info.get("engines")
    if eng is not None and not (isinstance(eng, dict) and all(isinstance(v, dict) for v in eng.values())):
        raise ExportError(f"{root / 'export_info.json'}: 'engines' must map engine names to their entries, got "
                          f"{eng!r:.80}")
    if model is None:
        if checkpoint is None:
            raise ExportError("verify_export needs the checkpoint (or the model) the export came from")
        model = load_model(Path(checkpoint))
    model = unwrap_speculative(model) or model
    model.eval()
    dtype = info.get("dtype", "float32")
    cfg = model.model_config if hasattr(model, "model_config") else model.nemo_spec_config
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (num_inputs, seq_len), generator=g)
    base_dir = root / "base" if info.get("base") else None
    if base_dir is None:
        raise ExportError(f"{root} has no base/ directory; verification runs the readers on the exported base")
    run = base_forward(base_dir, ids)
    ours = _our_logits(model, fmt, ids) if fmt != "base" else {"base": model.base_forward(ids).logits.float()
                                                                 if hasattr(model, "base_forward") else None}
    rows = []
    if ours["base"] is not None:
        d = _compare(run.logits, ours["base"])
        rows.append(VerifyRow("base", "base", "ok" if d <= _tolerance(dtype, atol, ours["base"]) else "mismatch", d,
                              "HF base vs checkpoint base"))
    if fmt == "base":
        return rows
    tol = _tolerance(dtype, atol, ours["draft"])
    for name, entry in _engine_dirs(root, info).items():
        if engines and name not in engines:
            continue
        path = root / entry["dir"]
        try:
            theirs = ENGINES[name].draft_logits(fmt, path, run, ids, entry.get("launch") or {})
            d = _compare(theirs, ours["draft"])
            status, detail = ("ok" if d <= tol else "mismatch"), ""
            if fmt == "eagle3":
                problem = _check_vocab(model, path)
                if problem:
                    status, detail = "mismatch", problem
        except Unsupported as e:
            status, d, detail = "unsupported", None, str(e)
        except (EngineMismatch, KeyError) as e:
            status, d, detail = "mismatch", None, str(e)
        rows.append(VerifyRow(name, entry["dir"], status, d, detail))
    for name, why in (info.get("skipped_engines") or {}).items():
        if not engines or name in engines:
            rows.append(VerifyRow(name, "-", "unsupported", None, why))
    return rows


def format_table(rows: Sequence[VerifyRow]) -> str:
    """The verification rows as a fixed-width text table."""
    lines = [f"{'engine':<10} {'status':<12} {'max_abs_diff':<13} {'path':<18} detail"]
    for r in rows:
        d = "-" if r.max_abs_diff is None else f"{r.max_abs_diff:.3g}"
        version = getattr(ENGINES.get(r.engine), "VERSION", "")
        lines.append(f"{r.engine:<10} {r.status:<12} {d:<13} {r.path:<18} {version + ' ' if version else ''}"
                     f"{r.detail}".rstrip())
    return "\n".join(lines)


def rows_ok(rows: Sequence[VerifyRow]) -> bool:
    """True when no row is a mismatch (unsupported engines are reported, not failures)."""
    return not any(r.status == "mismatch" for r in rows)


def dump_rows(rows: Sequence[VerifyRow]) -> str:
    """JSON of the rows (for export_info / logs)."""
    return json.dumps([r.__dict__ for r in rows], indent=2)
