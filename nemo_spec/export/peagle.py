"""P-EAGLE draft export in the vllm-project/speculators format (``speculators_model_type: "peagle"``), as vLLM 0.33.0
reads it (``transformers_utils/configs/speculators/{base,algos}.py``; the engine is the authority here).

Directory: ``config.json`` + ``model.safetensors`` with tensors ``fc.weight``, ``layers.{i}.*`` (HF Llama names;
layer 0 with ``hidden_norm`` and a 2h-input qkv), ``norm.weight``, ``lm_head.weight``, ``embed_tokens.weight``,
``mask_hidden`` [1, 1, 3h], and ``d2t`` / ``t2d`` for a reduced draft vocabulary only (vLLM builds no
``draft_id_to_target_id`` for a full vocabulary and its loader raises on one: llama_eagle3.py:338-345).

Where the references disagree we follow vLLM:
* aux-layer ids are written in vLLM's numbering (id j = the residual entering layer j = output of 0-based layer
  j - 1: llama.py:428-441), sorted and distinct (vLLM de-duplicates and sorts the captured layers, and reads the
  fc width as 3 * hidden when ``num_aux_hidden_states`` is absent: llama_eagle3.py:209-221), so a P-EAGLE export
  needs three distinct aux layers;
* ``norm_before_residual`` is written false: our first layer's residual is the fused feature itself, vLLM's
  ``_norm_after_residual`` (llama_eagle3.py:101-122; algos.py:71-73 defaults it to false for peagle anyway);
* the mask placeholder's embedding is our learned ``mask_embed``: ``embed_tokens`` is the base table with that row
  replaced; vLLM keeps a draft's embed_tokens that differ from the target's (llm_base_proposer.py:1438-1466).
"""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Tuple

import torch

from nemo_spec.config import ModelConfig, SpeculativeConfig

log = logging.getLogger(__name__)

SPECULATORS_ARCH = "PEagleSpeculator"  # speculators peagle/config.py ``architectures`` default


def peagle_to_speculators(neutral: Mapping[str, torch.Tensor], cfg: ModelConfig, spec: SpeculativeConfig,
                          base_embed: torch.Tensor, num_speculative_tokens: Optional[int] = None,
                          verifier: str = "../base") -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """Neutral P-EAGLE draft tensors (draft-module names, TP-gathered) -> (tensors, config.json dict)."""
    from nemo_spec.export.eagle import _llama_fields, captured_layers, eagle3_to_engine
    from nemo_spec.export.formats import ExportError

    if spec.algorithm != "peagle":
        raise ExportError(f"peagle export needs a peagle draft, got {spec.algorithm!r}")
    aux = spec.resolved_aux_layers(cfg.num_layers)
    uniq = captured_layers(aux)
    if len(uniq) != 3:
        raise ExportError(f"P-EAGLE aux layers {aux} name {len(uniq)} distinct base layers; the speculators format "
                          f"as vLLM reads it fuses 3 (llama_eagle3.py:209-221): transform with aux_layers= of 3 "
                          f"distinct layers")
    as_eagle3 = dataclasses.replace(spec, algorithm="eagle3", mask_token_id=None)
    tensors, _, _ = eagle3_to_engine(neutral, cfg, as_eagle3, "vllm")
    tensors = {k.replace("midlayer.", "layers.0."): v for k, v in tensors.items()}  # speculators: layers.{i}.*
    h = cfg.hidden_size
    mh = neutral["mask_hidden"].reshape(3, h)  # blocks in our aux order -> vLLM's sorted captured order
    tensors["mask_hidden"] = torch.cat([mh[aux.index(layer)] for layer in uniq]).reshape(1, 1, 3 * h).contiguous()
    mask_id = spec.resolved_mask_token_id(cfg)
    emb = base_embed.detach().clone().to(tensors["fc.weight"].dtype)
    emb[mask_id] = neutral["mask_embed"].to(emb.dtype)
    tensors["embed_tokens.weight"] = emb
    k = int(num_speculative_tokens or spec.parallel_depth)
    vd = int(tensors["lm_head.weight"].shape[0])
    layer_conf = _llama_fields(cfg, spec.num_eagle_layers)
    layer_conf["architectures"] = ["LlamaForCausalLM"]
    conf: Dict[str, Any] = {
        "architectures": [SPECULATORS_ARCH],
        "speculators_model_type": "peagle",
        "speculators_version": "0.3.0",
        "transformer_layer_config": layer_conf,
        "draft_vocab_size": vd,
        "norm_before_residual": False,
        "norm_before_fc": False,
        "mask_token_id": int(mask_id),
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in uniq],
        "speculators_config": {
            "algorithm": "peagle",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": ["LlamaForCausalLM"]},
        },
        "nemo_spec_aux": {"aux_layers": list(aux), "captured": list(uniq), "engine": "vllm",
                          "parallel_depth": int(spec.parallel_depth)},
    }
    return tensors, conf


def peagle_from_speculators(tensors: Mapping[str, torch.Tensor], conf: Mapping[str, Any], cfg: ModelConfig,
                            spec: SpeculativeConfig, base_embed: torch.Tensor) -> Dict[str, torch.Tensor]:
    """Inverse of :func:`peagle_to_speculators` for the tensors: a speculators P-EAGLE directory's tensors (and its
    config, ``transformer_layer_config`` merged in) -> neutral draft tensors for a model with draft config ``spec``.

    The file must be this draft's: same mask token, same captured aux layers (vLLM numbering), and an
    ``embed_tokens`` that is the base table except the mask row (our draft embeds every other token with the base's).
    """
    from nemo_spec.export.eagle import captured_layers, eagle3_from_reference, file_options
    from nemo_spec.export.formats import ExportError

    h = cfg.hidden_size
    mask_id = spec.resolved_mask_token_id(cfg)
    if int(conf.get("mask_token_id", -1)) != mask_id:
        raise ExportError(f"P-EAGLE draft mask_token_id={conf.get('mask_token_id')} but the model's draft uses "
                          f"{mask_id}")
    aux = spec.resolved_aux_layers(cfg.num_layers)
    uniq = captured_layers(aux)
    want = [i + 1 for i in uniq]
    got = list(conf.get("eagle_aux_hidden_state_layer_ids") or [])
    if sorted(set(got)) != want or len(uniq) != 3:
        raise ExportError(f"P-EAGLE draft captures vLLM layers {got}; the model's aux layers {aux} are vLLM layers "
                          f"{want}")
    for k in ("mask_hidden", "fc.weight"):
        if k not in tensors:
            raise ExportError(f"P-EAGLE draft lacks {k!r}")
    mh = tensors["mask_hidden"]
    if mh.numel() != 3 * h:
        raise ExportError(f"mask_hidden has {mh.numel()} values, expected {3 * h}")
    # the file's fc / mask_hidden are over the sorted captured layers; our draft's over ``aux`` (eagle3 helper).
    # norm_output only picks the hidden state an EAGLE-3 chain feeds back (vllm llama_eagle3.py:285-286); a P-EAGLE
    # forward ends in lm_head(norm(h)) either way (speculators models/peagle/core.py:186-188), and speculators
    # writes norm_output=false into every P-EAGLE config it saves: it had refused them all.
    layer_conf = {k: v for k, v in conf.items() if k != "norm_output"}
    layer_conf["nemo_spec_aux"] = {"aux_layers": list(aux), "captured": list(uniq)}
    opts = file_options(layer_conf)  # absent: false, as vLLM's update_peagle reads them (speculators/algos.py:53-88)
    used = sorted(k for k, v in opts.items() if v)
    if used:  # imported as it was, these drafts drafted other tokens (max logit error 3.1: review)
        why = " (the speculators trainer's P-EAGLE default)" if used == ["norm_before_residual"] else ""
        raise ExportError(f"the P-EAGLE draft was trained with {', '.join(f'{k}=true' for k in used)}{why}, which "
                          f"nemo_spec's P-EAGLE draft does not compute: not supported")
    rest = {k: v for k, v in tensors.items() if k not in ("mask_hidden", "embed_tokens.weight")}
    out = eagle3_from_reference(rest, layer_conf, cfg, options={k: False for k in opts})
    blocks = mh.reshape(3, h)
    out["mask_hidden"] = torch.cat([blocks[uniq.index(layer)] for layer in aux]).reshape(1, 1, 3 * h)
    base = base_embed.detach().cpu()
    emb = tensors.get("embed_tokens.weight")
    if emb is None:  # vLLM then shares the target's table (llm_base_proposer.py:1418-1503): the mask row too
        out["mask_embed"] = base[mask_id].clone()
        return out
    if tuple(emb.shape) != tuple(base.shape):
        raise ExportError(f"embed_tokens.weight has shape {tuple(emb.shape)}, the base table {tuple(base.shape)}")
    others = torch.ones(base.shape[0], dtype=torch.bool)
    others[mask_id] = False
    if not torch.equal(emb[others], base[others].to(emb.dtype)):
        raise ExportError("embed_tokens.weight differs from the base's table outside the mask row: vLLM would embed "
                          "every token with it, nemo_spec's P-EAGLE draft embeds them with the base's")
    out["mask_embed"] = emb[mask_id].clone()
    return out


def export_peagle(model: torch.nn.Module, out_dir: Any, num_speculative_tokens: Optional[int] = None,
                  verifier: str = "../base") -> Path:
    """Write ``model``'s P-EAGLE draft to ``out_dir`` (config.json + model.safetensors); every TP rank calls it.

    Low level (the draft directory only, nothing verified); the normal path is ``export_model(model, dir)``
    (base + ``draft/vllm/`` + README + export_info, read back by the vLLM reader)."""
    from safetensors.torch import save_file

    from nemo_spec import parallel
    from nemo_spec.export import _base_embedding, _unwrap_spec, draft_state_dict
    from nemo_spec.export.formats import ExportError

    spec_model = _unwrap_spec(model)
    if getattr(spec_model, "algorithm", None) != "peagle":
        raise ExportError(f"export_peagle needs a model with a peagle draft, got "
                          f"{getattr(spec_model, 'algorithm', type(model).__name__)!r}")
    neutral = draft_state_dict(spec_model)
    embed = _base_embedding(spec_model)
    tensors, conf = peagle_to_speculators(neutral, spec_model.model_config, spec_model.spec_config, embed,
                                          num_speculative_tokens, verifier)
    out = Path(out_dir)
    if parallel.tp_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
        (out / "config.json").write_text(json.dumps(conf, indent=2, sort_keys=True))
        log.info("P-EAGLE draft exported (speculators format, %d tensors) to %s", len(tensors), out)
    return out


def vllm_launch_command(base_dir: Any, draft_dir: Any, k: int = 4) -> str:
    """The ``vllm serve`` command line for a P-EAGLE export (speculators config -> eagle3 + parallel_drafting,
    vllm speculators/base.py:133-134)."""
    spec = json.dumps({"method": "eagle3", "model": str(draft_dir), "num_speculative_tokens": k,
                       "parallel_drafting": True})
    return (f"# vLLM 0.33.x: 0.34.0 removed P-EAGLE (transformers_utils/configs/speculators/algos.py:53-55 raises;\n"
            f"# parallel_drafting is kept for dflash/dspark only, config/speculative.py:1688-1693)\n"
            f"pip install 'vllm==0.33.*'\n"
            f"vllm serve {base_dir} \\\n  --speculative-config '{spec}'")
