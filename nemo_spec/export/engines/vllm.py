"""vLLM 0.33.0 conformance reader: what vLLM builds from an exported EAGLE-3 / EAGLE-1 / DFlash / P-EAGLE draft
directory (DFlash: engines/dflash.py; P-EAGLE, speculators format with parallel drafting: engines/vllm_peagle.py).

Written from the released wheel ``vllm==0.33.0`` (``pip download --no-deps vllm==0.33.0``); line numbers below
are of that wheel's files. vLLM 0.33 has no Medusa: ``"medusa"`` is not a ``SpeculativeMethod``
(config/speculative.py:71-82), so Medusa is not claimed. vLLM 0.34.0 reads the EAGLE-3, EAGLE-1 and DFlash exports the
same way (every cited file diffed against 0.33.0: only P-EAGLE's code changed — it is removed, see export/peagle.py).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

import torch

from nemo_spec.export.engines._eagle import eagle1_forward, eagle3_forward, layer_names
from nemo_spec.export.engines._llama import (
    BaseRun, EngineMismatch, Unsupported, read_config, read_dir, require, scatter_draft_logits,
)

NAME = "vllm"
VERSION = "0.33.0"
FORMATS = ("eagle3", "eagle1", "dflash", "peagle")

# model_executor/models/registry.py:661,700-702 (architectures vLLM maps to its EAGLE drafts)
_EAGLE3_ARCHS = {"Eagle3LlamaForCausalLM", "LlamaForCausalLMEagle3"}
_EAGLE1_ARCHS = {"EagleLlamaForCausalLM"}


def _eagle3_arch(arch: str) -> str:
    # transformers_utils/configs/eagle.py:59-64: method eagle3 keeps "...Eagle3"/"Eagle3..." names, else prefixes
    return arch if arch.startswith("Eagle3") or arch.endswith("Eagle3") else f"Eagle3{arch}"


def _eagle1_arch(arch: str) -> str:
    # transformers_utils/configs/eagle.py:46-53: method eagle prefixes "Eagle" unless already there
    return arch if arch.startswith("Eagle") else f"Eagle{arch}"


def aux_layer_ids(conf: Mapping) -> Optional[List[int]]:
    """The aux ids vLLM captures for an EAGLE-3 draft: the top-level ``eagle_aux_hidden_state_layer_ids`` only.
    EAGLE-3 runs on the V2 model runner by default (config/vllm.py:731-760, 3066-3075: only parallel drafting and a
    few other features fall back to V1), whose v1/worker/gpu/spec_decode/eagle/eagle3_utils.py:113-124
    ``get_eagle3_aux_layers_from_config`` never reads ``eagle_config``'s ids (the V1 runner's fallback to them,
    gpu_model_runner.py:5207-5225, is gone in vLLM 0.34.0); without the key it captures the model's default."""
    ids = conf.get("eagle_aux_hidden_state_layer_ids")
    return list(ids) if ids else None


def _rename(w: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    # llama_eagle3.py:290-299: "midlayer." -> "layers.0." (q/k/v and gate/up are stacked, same values)
    return {k.replace("midlayer.", "layers.0."): v for k, v in w.items()}


def eagle3_logits(draft_dir: Path, base: BaseRun, ids: torch.Tensor, launch: Mapping[str, Any]) -> torch.Tensor:
    """Draft logits [b, s-1, V] vLLM computes for tokens ids[:, 1:] paired with the base features at ids[:, :-1]."""
    conf = read_config(draft_dir)
    arch = _eagle3_arch((conf.get("architectures") or ["LlamaForCausalLMEagle3"])[0])
    if arch not in _EAGLE3_ARCHS:
        raise EngineMismatch(f"vllm: architecture {arch!r} is not a registered EAGLE-3 draft "
                             f"(model_executor/models/registry.py:700-704)")
    w = _rename(read_dir(draft_dir, ["model.safetensors"]))
    L, vocab = base.num_layers, int(conf["vocab_size"])
    vd = int(conf.get("draft_vocab_size") or vocab)  # llama_eagle3.py:314-316
    eagle_config = conf.get("eagle_config") or {}
    if not eagle_config.get("use_aux_hidden_state", True):  # llama_eagle3.py:179-183
        raise Unsupported("vllm: use_aux_hidden_state=false drafts are not exported by nemo_spec")
    ids_cfg = aux_layer_ids(conf)
    if ids_cfg is None:  # gpu_model_runner.py:5186: the model's default (interfaces.py get_eagle3_default_...)
        ids_cfg = [2, L // 2, L - 3]
    captured = sorted(set(ids_cfg))  # interfaces.py:1616-1617 (de-duplicated and sorted)
    if captured[0] < 0 or captured[-1] > L:
        raise EngineMismatch(f"vllm: aux ids {ids_cfg} outside [0, {L}] (llama.py:428-441 captures ids 0..L)")
    # llama_eagle3.py:209-221: fc input = target_hidden_size * num_aux_hidden_states, num_aux read from
    # num_aux_hidden_states or len(eagle_config ids) (not the top-level key), default 3
    num_aux = conf.get("num_aux_hidden_states")
    if num_aux is None:
        num_aux = len(eagle_config.get("eagle_aux_hidden_state_layer_ids") or []) or 3
    h = int(conf["hidden_size"])
    fc_in = int(conf.get("target_hidden_size", h)) * int(num_aux)
    if tuple(w["fc.weight"].shape) != (h, fc_in):
        raise EngineMismatch(f"vllm: fc.weight has shape {tuple(w['fc.weight'].shape)}, the draft builds fc "
                             f"[{h}, {fc_in}] (num_aux_hidden_states={num_aux}, llama_eagle3.py:209-250)")
    if len(captured) * base.stream[0].shape[-1] != fc_in:
        raise EngineMismatch(f"vllm: aux ids {ids_cfg} capture {len(captured)} distinct hidden states "
                             f"(de-duplicated, interfaces.py:1617) but fc expects {num_aux}: shape error at run time")
    # weights: d2t -> draft_id_to_target_id, t2d skipped (llama_eagle3.py:425-447); the parameter exists only
    # for a reduced vocabulary (llama_eagle3.py:338-345); an unknown name raises (utils.py:440-448)
    if "d2t" in w and vd == vocab:
        raise EngineMismatch("vllm: d2t stored for a full-vocabulary draft: there is no draft_id_to_target_id "
                             "parameter and the loader raises ValueError (llama_eagle3.py:338-345, utils.py:440-448)")
    qkv_bias = bool(conf.get("attention_bias", False))  # llama_eagle3.py:84-96
    n = int(conf["num_hidden_layers"])
    need = ["fc.weight", "norm.weight", "lm_head.weight"]
    for i in range(n):
        # o_proj bias follows attention_bias (llama.py:267-271); layer 0 uses hidden_norm
        need += layer_names(f"layers.{i}.", "hidden_norm" if i == 0 else None, qkv_bias=qkv_bias, o_bias=qkv_bias)
    if vd != vocab:
        need.append("d2t")
    # speculators options read from the draft config (llama_eagle3.py:101, 184-187, 252; norm_output changes only
    # what the next step reads, not these logits)
    nbfc, nbr = bool(conf.get("norm_before_fc", False)), bool(conf.get("norm_before_residual", False))
    if nbfc:
        need.append("input_norm.weight")  # RMSNorm(fc_input_size) (llama_eagle3.py:223-231)
    # Eagle3LlamaForCausalLM.load_weights returns None, so no missing-weight check runs: an absent tensor keeps
    # its init (torch.empty for linear layers; RMSNorm ones). Treat any absent parameter as a mismatch.
    require(w, need, "vllm", "parameters the draft builds but the file lacks (left uninitialised)")
    # every layer builds a hidden_norm (llama_eagle3.py:98), used only by layer 0 (llama_eagle3.py:131-138)
    known = set(need) | {"t2d", "embed_tokens.weight"} | {f"layers.{i}.hidden_norm.weight" for i in range(n)}
    unknown = sorted(k for k in w if k not in known and not k.endswith(".bias"))  # .bias ignored: utils.py:457-458
    if unknown:
        raise EngineMismatch(f"vllm: no parameter for {unknown[:5]} (AutoWeightsLoader raises, utils.py:440-448)")
    emb = w["embed_tokens.weight"][ids[:, 1:]] if "embed_tokens.weight" in w else base.embed[ids[:, 1:]]
    feat = torch.cat([base.stream[j] for j in captured], -1)[:, :-1]  # llama.py:436-441: stream after layer j-1
    hidden = eagle3_forward(w, conf, emb, feat, later_norm="input_layernorm", qkv_bias=qkv_bias, o_bias=qkv_bias,
                            norm_before_fc=nbfc, norm_before_residual=nbr)
    logits = hidden @ w["lm_head.weight"].T
    base_ids = (torch.arange(vd) + w["d2t"].long()) if vd != vocab else None  # llama_eagle3.py:373-395
    return scatter_draft_logits(logits, base_ids, vocab)


def eagle1_logits(draft_dir: Path, base: BaseRun, ids: torch.Tensor, launch: Mapping[str, Any]) -> torch.Tensor:
    """EAGLE-1 draft logits [b, s-1, V] as vLLM computes them (features: the base's final-normed hidden)."""
    conf = read_config(draft_dir)
    arch = _eagle1_arch((conf.get("architectures") or ["LlamaForCausalLM"])[0])
    if arch not in _EAGLE1_ARCHS:
        raise EngineMismatch(f"vllm: architecture {arch!r} (after the Eagle prefix, transformers_utils/configs/"
                             f"eagle.py:46-53) is not registered (model_executor/models/registry.py:661)")
    w = read_dir(draft_dir, ["model.safetensors"])
    # attention biases: attention_bias or bias (llama.py:267-271) -> q/k/v and o_proj biases
    attn_bias = bool(conf.get("attention_bias", False) or conf.get("bias", False))
    n = int(conf["num_hidden_layers"])
    need = ["fc.weight"]
    for i in range(n):  # layer 0 has no input_layernorm (llama_eagle.py:53-57)
        need += layer_names(f"layers.{i}.", None, qkv_bias=attn_bias, o_bias=attn_bias, input_norm=i > 0)
    require(w, need, "vllm", "parameters the draft builds but the file lacks (torch.empty; load_weights returns "
                             "None so nothing checks, llama_eagle.py:187-196)")
    # fc has no bias (llama_eagle.py:110-118) and an unexpected '.bias' is ignored (utils.py:457-458)
    emb = w["embed_tokens.weight"][ids[:, 1:]] if "embed_tokens.weight" in w else base.embed[ids[:, 1:]]
    hidden = eagle1_forward(w, conf, emb, base.final[:, :-1], fc_bias=False, attn_bias=attn_bias)
    return hidden @ base.lm_head.T  # the target's lm_head (EagleLlamaForCausalLM has none of its own)


def draft_logits(fmt: str, draft_dir: Path, base: BaseRun, ids: torch.Tensor,
                 launch: Optional[Mapping[str, Any]] = None) -> torch.Tensor:
    """vLLM's draft logits for an exported ``fmt`` draft (base-vocabulary logits, -inf outside the draft vocab)."""
    if fmt == "eagle3":
        return eagle3_logits(draft_dir, base, ids, launch or {})
    if fmt == "eagle1":
        return eagle1_logits(draft_dir, base, ids, launch or {})
    if fmt == "dflash":  # model_executor/models/qwen3_dflash.py, v1/spec_decode/dflash.py (engines/dflash.py)
        from nemo_spec.export.engines.dflash import dflash_logits

        return dflash_logits("vllm", draft_dir, base, ids, launch)
    if fmt == "peagle":  # speculators config -> eagle3 + parallel_drafting (engines/vllm_peagle.py)
        from nemo_spec.export.engines.vllm_peagle import peagle_logits, speculative_tokens

        return peagle_logits(draft_dir, base, ids, speculative_tokens(draft_dir, launch))
    raise Unsupported(f"vllm {VERSION} has no {fmt} speculative method (config/speculative.py:71-82)")


def launch_command(fmt: str, base_dir: Path, draft_dir: Path, k: int = 3, **_: Any) -> str:
    """The ``vllm serve`` command line for this export."""
    if fmt == "dflash":
        from nemo_spec.export.engines.dflash import launch_command as dflash_launch

        return dflash_launch("vllm", base_dir, draft_dir, block_size=k)
    if fmt == "peagle":
        from nemo_spec.export.peagle import vllm_launch_command

        return vllm_launch_command(base_dir, draft_dir, k=k)
    spec = json.dumps({"method": "eagle3" if fmt == "eagle3" else "eagle", "model": str(draft_dir),
                       "num_speculative_tokens": k})
    return f"vllm serve {base_dir} \\\n  --speculative-config '{spec}'"
