"""EAGLE-1 and EAGLE-3 draft checkpoints in the layouts serving engines and the EAGLE reference code read.

EAGLE-3 (vLLM ``llama_eagle3.py`` / SGLang ``llama_eagle3.py`` / TensorRT-LLM / SafeAILab ``cnets.py``)
  config.json: a Llama config with ``architectures: ["LlamaForCausalLMEagle3"]``, ``model_type: "llama"``,
  ``num_hidden_layers`` = number of draft layers, ``vocab_size`` = the *base* vocabulary, ``draft_vocab_size``,
  ``hidden_act: "silu"``, ``rms_norm_eps``,
  ``rope_theta``/``rope_scaling``, ``max_position_embeddings``, ``tie_word_embeddings: false`` and
  ``eagle_config.eagle_aux_hidden_state_layer_ids`` (vLLM numbering: id j is the *input* of base layer j, i.e. the
  output of 0-based layer j-1, so our 0-based ``aux_layers`` are written +1).
  Tensors (``model.safetensors``):
    ``fc.weight`` [h, 3h] (no bias) fuses the three base features (low, mid, high, concatenated in that order);
    ``midlayer.input_layernorm.weight`` [h] normalises the token embedding,
    ``midlayer.hidden_norm.weight`` [h] normalises the fused feature; attention sees cat([emb, feature]);
    ``midlayer.self_attn.{q,k,v}_proj.weight`` [n*d, 2h] (input is 2h), ``o_proj`` [h, H*d];
    ``midlayer.post_attention_layernorm.weight``, ``midlayer.mlp.{gate,up,down}_proj.weight``;
    ``norm.weight`` [h]; ``lm_head.weight`` [Vd, h]; ``d2t`` int64 [Vd] with base_id = draft_id + d2t[draft_id];
    ``t2d`` bool [V] (True for base ids in the draft vocabulary; vLLM/SGLang skip it, the EAGLE code keeps it).
  The residual stream of the mid layer starts from the fused feature (before ``hidden_norm``); the embedding
  table is not stored (engines share the base's). With several draft layers every layer is ``layers.{i}.*``; per-engine
  differences (aux-id numbering, hidden_norm of layers >= 1, d2t presence) are in :func:`eagle3_to_engine`.
  ``target_hidden_size`` is left out (draft and base widths are equal; engines default it to ``hidden_size``): with
  it set, the EAGLE reference code expects ``embed_tokens`` inside the draft instead of reading the base's through
  the base's ``model.safetensors.index.json`` (which the export therefore writes next to ``base/model.safetensors``).
EAGLE-1 (SafeAILab ``cnets1.py`` ``Model`` loaded by ``EaModel`` from ``pytorch_model.bin``; vLLM
``llama_eagle.py`` ``EagleLlamaForCausalLM`` from safetensors)
  config.json: a plain Llama config (``architectures: ["LlamaForCausalLM"]``) whose ``num_hidden_layers`` is the
  number of draft layers, plus ``bias`` (whether ``fc`` has a bias; EaModel defaults it to true when absent).
  Tensors: ``embed_tokens.weight`` [V, h] (stored; EaModel loads with strict=False, vLLM keeps a stored table, SGLang
  shares the base's), ``fc.weight`` [h, 2h] over cat([embedding, base final hidden]) and ``fc.bias`` [h] when ``bias``;
  ``layers.N.self_attn.{q,k,v,o}_proj.weight``, ``layers.N.mlp.{gate,up,down}_proj.weight``,
  ``layers.N.post_attention_layernorm.weight`` and, for N > 0 only, ``layers.N.input_layernorm.weight`` (layer 0
  has none). There is no final norm and no lm_head: the draft's hidden goes straight into the base's lm_head.

Both are produced from the full (TP-gathered) state dict of ``SpeculativeGPT.draft`` (an ``EagleDraft``:
``fc``, ``layers.N.*`` Megatron layers, ``layers.0.hidden_norm``, ``final_layernorm``, ``output_layer``, ``d2t``)
and read back into it.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Mapping, Tuple

import torch

from nemo_spec.config import SPECULATORS_OPTIONS, ModelConfig, SpeculativeConfig, rope_type
from nemo_spec.export.formats import ExportError, layer_from_hf, layer_hf_names, layer_to_hf

log = logging.getLogger(__name__)

EAGLE3_ARCH = "LlamaForCausalLMEagle3"
EAGLE1_ARCH = "LlamaForCausalLM"


def check_llama_family(cfg: ModelConfig, fmt: str) -> None:
    """EAGLE formats describe Llama layers (RMSNorm, SwiGLU, RoPE, no biases): refuse anything else."""
    bad = []
    if cfg.normalization != "RMSNorm":
        bad.append(f"normalization={cfg.normalization!r}")
    if cfg.activation != "swiglu":
        bad.append(f"activation={cfg.activation!r}")
    if cfg.position_embedding != "rope":
        bad.append(f"position_embedding={cfg.position_embedding!r}")
    if cfg.add_bias_linear:
        bad.append("add_bias_linear=True")
    if bad:
        raise ExportError(f"the {fmt} format stores Llama-style draft layers; this base has {', '.join(bad)}")


def _llama_fields(cfg: ModelConfig, num_layers: int) -> Dict[str, Any]:
    """Llama config.json fields describing draft layers that inherit the base's architecture."""
    d: Dict[str, Any] = {
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_hidden_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_query_groups,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": num_layers,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": _rope_scaling(cfg),
        "attention_bias": bool(cfg.add_qkv_bias),
        "mlp_bias": False,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": False,
        "initializer_range": cfg.init_method_std,
        "pretraining_tp": 1,
        "use_cache": True,
    }
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(cfg, k) is not None:
            d[k] = getattr(cfg, k)
    return d


def _rope_scaling(cfg: ModelConfig) -> Dict[str, Any] | None:
    """HF rope_scaling with both ``rope_type`` (transformers/vLLM) and legacy ``type`` (the EAGLE reference code)."""
    if not cfg.rope_scaling:
        return None
    d = dict(cfg.rope_scaling)
    kind = d.get("rope_type", d.get("type"))
    d["rope_type"] = d["type"] = kind
    return d


def _reference_rope(cfg: ModelConfig) -> Tuple[Dict[str, Any] | None, str | None]:
    """(rope_scaling for EaModel's draft config, why it cannot rotate like this base): EConfig takes None or exactly
    {type: linear|dynamic, factor: float > 1} (eagle/model/configs.py:126-145), and its scaled draft rotary ignores
    rope_theta (built with base 10000: cnets.py:225-231, cnets1.py:230-236)."""
    kind = rope_type(cfg.rope_scaling)
    factor = float((cfg.rope_scaling or {}).get("factor", 1.0))
    if kind == "default" or (kind == "linear" and factor == 1.0):
        return None, None
    if kind != "linear":
        return None, (f"EaModel's draft config takes rope_scaling of type linear or dynamic only "
                      f"(eagle/model/configs.py:138-142); this base has {kind!r}")
    if factor < 1.0:
        return None, f"EaModel's draft config takes a linear rope_scaling factor > 1 (configs.py:143-145), got {factor}"
    if cfg.rope_theta != 10000.0:
        return None, (f"EaModel builds a scaled draft rotary with base 10000 whatever rope_theta (cnets.py:225-231); "
                      f"this base has rope_theta={cfg.rope_theta}")
    return {"type": "linear", "factor": factor}, None


def _warn_reference_head_dim(cfg: ModelConfig) -> None:
    if cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size:
        log.warning("head_dim=%d != hidden_size/num_attention_heads: vLLM and SGLang read head_dim from the config, "
                    "the EAGLE reference code assumes hidden_size/num_attention_heads", cfg.head_dim)


def _need(sd: Mapping[str, torch.Tensor], key: str) -> torch.Tensor:
    if key not in sd:
        raise ExportError(f"draft state dict lacks {key!r}")
    return sd[key]


# ------------------------------------------------------------------------------------------------ EAGLE-3
ENGINE_TARGETS = ("vllm", "sglang", "trtllm", "reference")


def captured_layers(aux: List[int]) -> List[int]:
    """The distinct aux layers in layer order: what every engine captures (they all de-duplicate and sort)."""
    return sorted(set(aux))


def _fc_for_captured(fc: torch.Tensor, aux: List[int], h: int) -> torch.Tensor:
    """fc [h, len(aux)*h] over features in ``aux`` order -> the same function over the sorted distinct layers
    (blocks of a repeated layer are summed: W1 x + W2 x = (W1 + W2) x)."""
    uniq = captured_layers(aux)
    blocks = [torch.zeros(fc.shape[0], h, dtype=fc.dtype) for _ in uniq]
    for k, layer in enumerate(aux):
        blocks[uniq.index(layer)] += fc[:, k * h:(k + 1) * h]
    return torch.cat(blocks, dim=1)


def _fc_from_captured(fc: torch.Tensor, aux: List[int], h: int) -> torch.Tensor:
    """Inverse of :func:`_fc_for_captured` up to the function: first occurrence gets the block, repeats zeros."""
    uniq, seen, blocks = captured_layers(aux), set(), []
    for layer in aux:
        j = uniq.index(layer)
        blocks.append(fc[:, j * h:(j + 1) * h] if layer not in seen else torch.zeros(fc.shape[0], h, dtype=fc.dtype))
        seen.add(layer)
    return torch.cat(blocks, dim=1)


def _norm_blocks(w: torch.Tensor, order_from: List[int], order_to: List[int], h: int) -> torch.Tensor:
    """``input_norm`` weight [n*h] with blocks of the layers ``order_from`` -> blocks of ``order_to`` (the same
    distinct layers; an RMSNorm over the concatenation is the same function with its blocks permuted alike)."""
    if sorted(order_from) != sorted(order_to) or len(set(order_from)) != len(order_from):
        raise ExportError(f"norm_before_fc with aux layers {order_from}: input_norm is over the concatenated features "
                          f"of distinct layers, which engines capture as {order_to}; it cannot be rewritten exactly")
    return torch.cat([w[order_from.index(layer) * h:(order_from.index(layer) + 1) * h] for layer in order_to])


def _eagle3_prefixes(n_layers: int, engine: str) -> List[str]:
    """File prefixes of the draft layers: ``midlayer.`` for one layer; several are ``layers.N.`` (vLLM/SGLang/
    reference), ``midlayer.N.`` for TensorRT-LLM @ b35ac1b64368, whose load_weights only prefixes ``model.``
    onto the module list ``midlayer`` (modeling_speculative.py:171-177, 301-305; later snapshots also rename
    ``layers.N.`` to it)."""
    if n_layers == 1:
        return ["midlayer."]
    return [(f"midlayer.{i}." if engine == "trtllm" else f"layers.{i}.") for i in range(n_layers)]


def eagle3_unsupported(cfg: ModelConfig, spec: SpeculativeConfig, engine: str) -> str | None:
    """Why ``engine`` cannot run this EAGLE-3 draft exactly (None when it can); see nemo_spec.export.engines."""
    from nemo_spec.export.engines import reference

    full_aux = spec.resolved_aux_layers(cfg.num_layers)
    aux = captured_layers(full_aux)
    on = [k for k, v in model_options(spec).items() if v]
    if spec.norm_before_fc and len(aux) != len(full_aux):
        return (f"norm_before_fc over the repeated aux layers {full_aux}: engines capture each layer once, an RMSNorm "
                f"over fewer features is another function")
    if on and engine != "vllm":
        return (f"the draft options {on} (vLLM's speculators options, model_executor/models/llama_eagle3.py:101, "
                f"184-187, 252) are checked for vLLM only")
    if engine == "sglang":
        if cfg.num_layers - 1 in aux:
            return (f"aux layer {cfg.num_layers - 1} is the base's last layer; SGLang captures layer inputs only "
                    f"(srt/models/llama.py:486-493, 941); use aux_layers below {cfg.num_layers - 1}")
        if cfg.add_qkv_bias:
            return "SGLang builds the EAGLE-3 qkv without bias (srt/models/llama_eagle3.py:67-75)"
        if len(aux) == 1:
            return (f"SGLang applies fc only to features wider than the embedding (srt/models/llama_eagle3.py:"
                    f"238-247): with the single captured layer {aux} its draft skips this draft's fc")
    if engine == "trtllm":  # TensorRT-LLM @ b35ac1b64368, see nemo_spec.export.engines.trtllm
        if cfg.add_qkv_bias:
            return ("TensorRT-LLM's Eagle3 attention takes one attention_bias for q/k/v and o_proj "
                    "(modeling_speculative.py:40, 58); a q/k/v-only bias is not written for it")
        if len(aux) < 2:
            return (f"TensorRT-LLM builds fc only for more than one captured layer (modeling_speculative.py:164-168,"
                    f" 337-338): with the single captured layer {aux} its draft skips this draft's fc")
    if engine == "reference":
        from nemo_spec.checkpoint.families import family_for_export

        why = reference.base_unsupported(family_for_export(cfg).architecture, "eagle3") or _reference_rope(cfg)[1]
        if why:
            return why
        if spec.num_eagle_layers > 1:
            return "EaModel builds a single midlayer (eagle/model/cnets.py:530)"
        if cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size:
            return "EaModel assumes head_dim = hidden_size / num_attention_heads"
        if cfg.add_qkv_bias:
            return "EaModel's EAGLE-3 attention has no bias (eagle/model/cnets.py:209-212)"
        want = reference.capture_layers(cfg.num_layers)
        if len(want) != 3:
            return (f"EaModel captures the inputs of layers 2, L//2, L-3 (eagle/model/modeling_llama_kv.py:1138): "
                    f"only {len(want)} distinct layers on a {cfg.num_layers}-layer base, its fc takes 3")
        if aux != want:
            return (f"EaModel hard-codes the aux layers (eagle/model/modeling_llama_kv.py:1138): {want} on a "
                    f"{cfg.num_layers}-layer base, this draft uses {aux}; transform with aux_layers={want}")
    return None


def eagle3_to_engine(neutral: Mapping[str, torch.Tensor], cfg: ModelConfig, spec: SpeculativeConfig,
                     engine: str) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any], Dict[str, Any]]:
    """Neutral EAGLE-3 draft tensors -> (tensors, config.json dict, launch options) for ``engine``."""
    check_llama_family(cfg, "eagle3")
    why = eagle3_unsupported(cfg, spec, engine)
    if why:
        raise ExportError(f"EAGLE-3 export for {engine}: {why}")
    n_layers, h = spec.num_eagle_layers, cfg.hidden_size
    aux = spec.resolved_aux_layers(cfg.num_layers)
    uniq = captured_layers(aux)
    out: Dict[str, torch.Tensor] = {"fc.weight": _fc_for_captured(_need(neutral, "fc.weight"), aux, h)}
    prefixes = _eagle3_prefixes(n_layers, engine)
    for i, dst in enumerate(prefixes):
        layer = layer_to_hf(neutral, f"layers.{i}.", dst, cfg, input_norm=True)
        if i > 0 and engine == "sglang":  # layers >= 1 normalise with hidden_norm there
            layer[dst + "hidden_norm.weight"] = layer.pop(dst + "input_layernorm.weight")
        elif i > 0 and engine == "trtllm":
            # TensorRT-LLM @ b35ac1b64368: every layer is an Eagle3DecoderLayer whose qkv reads
            # cat(input_layernorm(embeds), hidden_norm(stream)) with 2h inputs (modeling_speculative.py:55-56,
            # 97-107, 119-122); later snapshots build it so with eagle_config.next_layer_regular false (below).
            # Our layer i >= 1 reads input_layernorm(stream) only: zero qkv columns for the embedding half and
            # our input norm as hidden_norm give the same function exactly, in both.
            layer[dst + "hidden_norm.weight"] = layer.pop(dst + "input_layernorm.weight")
            layer[dst + "input_layernorm.weight"] = torch.ones(h, dtype=layer[dst + "hidden_norm.weight"].dtype)
            for x in "qkv":
                wt = layer[f"{dst}self_attn.{x}_proj.weight"]
                layer[f"{dst}self_attn.{x}_proj.weight"] = torch.cat([torch.zeros_like(wt), wt], dim=1)
        if engine == "vllm" and cfg.add_qkv_bias:
            # vLLM builds o_proj with a bias whenever attention_bias is set (llama.py:267-271) and leaves an
            # absent one as torch.empty (load_weights checks nothing): our o_proj has none, so zeros
            layer[dst + "self_attn.o_proj.bias"] = torch.zeros(h, dtype=layer[dst + "self_attn.o_proj.weight"].dtype)
        out.update(layer)
    first = prefixes[0]
    out[first + "hidden_norm.weight"] = _need(neutral, "layers.0.hidden_norm.weight")
    out["norm.weight"] = _need(neutral, "final_layernorm.weight")
    out["lm_head.weight"] = _need(neutral, "output_layer.weight")
    vd = out["lm_head.weight"].shape[0]
    d2t = neutral.get("d2t")
    d2t = torch.zeros(vd, dtype=torch.long) if d2t is None else d2t.to(torch.long)
    if d2t.shape != (vd,):
        raise ExportError(f"d2t has shape {tuple(d2t.shape)}, expected ({vd},) = draft vocab size")
    base_ids = d2t + torch.arange(vd)
    if int(base_ids.min()) < 0 or int(base_ids.max()) >= cfg.vocab_size:
        raise ExportError(f"d2t maps draft ids outside the base vocabulary [0, {cfg.vocab_size})")
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[base_ids] = True
    reduced = vd != cfg.vocab_size
    # vLLM / TensorRT-LLM have no d2t parameter for a full vocabulary (vllm llama_eagle3.py:338-345 raises on it;
    # TensorRT-LLM @ b35ac1b64368 modeling_speculative.py:183-186 builds d2t only when vocab_size != draft_vocab_size)
    if reduced or engine == "reference":
        out["d2t"] = d2t
        if engine != "trtllm":
            out["t2d"] = t2d
    conf = {"architectures": [EAGLE3_ARCH], **_llama_fields(cfg, n_layers), "draft_vocab_size": int(vd)}
    # vLLM reads each option from the draft config (llama_eagle3.py:101, 184-187, 252)
    conf.update({k: True for k, v in model_options(spec).items() if v})
    if spec.norm_before_fc:  # over the features in the captured (sorted) order, like fc
        out["input_norm.weight"] = _norm_blocks(_need(neutral, "input_norm.weight"), list(aux), uniq, h)
    launch: Dict[str, Any] = {}
    if engine == "vllm":  # vLLM id j = input of layer j = output of 0-based layer j-1 (vllm llama.py:428-441)
        ids = [i + 1 for i in uniq]
        conf["eagle_aux_hidden_state_layer_ids"] = ids
        conf["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}
    elif engine == "sglang":  # SGLang adds 1 itself (srt/models/llama.py:941): write 0-based layer ids
        conf["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(uniq), "use_aux_hidden_state": True}
    elif engine == "trtllm":  # EagleDecodingConfig.eagle3_layers_to_capture: 0-based layer outputs (engines.trtllm)
        launch["eagle3_layers_to_capture"] = list(uniq)
        if n_layers > 1:
            # later TensorRT-LLM builds layers >= 1 as regular layers (h-wide qkv, no input_layernorm) unless
            # eagle_config.next_layer_regular is false (modeling_speculative.py @ 00679c66c3e3,
            # Eagle3DecoderLayer.__init__); b35ac1b64368 reads no eagle_config and builds the 2h layers written here
            conf["eagle_config"] = {"next_layer_regular": False}
    elif engine == "reference":
        conf["rope_scaling"] = _reference_rope(cfg)[0]
    conf["nemo_spec_aux"] = {"aux_layers": list(aux), "captured": list(uniq), "engine": engine}
    if uniq != list(aux):
        log.info("EAGLE-3 aux layers %s written as the distinct sorted layers %s (fc columns merged/reordered: "
                 "engines de-duplicate and sort the captured layers)", aux, uniq)
    return out, conf, launch


def eagle3_to_reference(neutral: Mapping[str, torch.Tensor], cfg: ModelConfig,
                        spec: SpeculativeConfig) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """Neutral EAGLE-3 draft tensors -> (EaModel tensors, config.json dict)."""
    tensors, conf, _ = eagle3_to_engine(neutral, cfg, spec, "reference")
    return tensors, conf


#: eagle_config keys only NVIDIA Model Optimizer writes (modelopt/torch/export/plugins/hf_spec_configs.py:18-56 @
#: nvidia-modelopt 0.47.0); its ids are 0-based layer outputs (speculative/plugins/hf_eagle.py:208-232, 402-406)
MODELOPT_EAGLE_KEYS = ("use_input_layernorm_in_first_layer", "next_layer_regular", "use_last_layernorm",
                       "use_mtp_layernorm", "parallel_draft_step")


def _refuse_unread_biases(tensors: Mapping[str, torch.Tensor], cfg: ModelConfig) -> None:
    """A draft layer's attention biases our layers do not have (o_proj always; q/k/v unless the base has them):
    zeros are the same function (vLLM drafts on q/k/v-biased bases carry a zero o_proj bias, see eagle3_to_engine),
    anything else would be dropped silently."""
    names = ("o_proj",) if cfg.add_qkv_bias else ("o_proj", "q_proj", "k_proj", "v_proj")
    bad = sorted(k for k, v in tensors.items()
                 if k.endswith(tuple(f"self_attn.{n}.bias" for n in names)) and bool(v.abs().max() > 0))
    if bad:
        raise ExportError(f"the draft file has nonzero attention biases this draft's layers do not have: {bad[:4]} "
                          f"(nemo_spec's draft layers follow the base: q/k/v bias {cfg.add_qkv_bias}, no o_proj bias)")


#: what a draft file's tensors may hold besides its layers (d2t/t2d: vocabulary maps; embed_tokens: the base's table,
#: stored by speculators / EAGLE-1 layouts; biases are checked by _refuse_unread_biases)
_TOP_LEVEL = {"fc.weight", "fc.bias", "norm.weight", "lm_head.weight", "d2t", "t2d", "embed_tokens.weight"}
_HINTS = {"input_norm.weight": "an RMSNorm over the features before fc without norm_before_fc in the config",
          "fc_norm.": "a per-feature norm before fc (fc_norm)"}


def _refuse_unknown_tensors(tensors: Mapping[str, torch.Tensor], prefixes: List[str], cfg: ModelConfig,
                            options: Mapping[str, bool]) -> None:
    """Every tensor of the file must be one this draft reads: one it does not (a norm before fc, q/k norms the
    base's layers lack, ...) is part of the function the draft was trained as, and dropping it gave another one."""
    known = set(_TOP_LEVEL) | ({"input_norm.weight"} if options.get("norm_before_fc") else set())
    for p in prefixes:
        known |= layer_hf_names(p, cfg) | {p + "hidden_norm.weight"}
    unknown = sorted(k for k in tensors if k not in known and not k.endswith(
        ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias", "self_attn.o_proj.bias",
         "rotary_emb.inv_freq")))
    if unknown:
        hints = sorted({h for k in unknown for pre, h in _HINTS.items() if k.startswith(pre)})
        raise ExportError(f"the draft file has tensors this EAGLE-3 draft does not have: {unknown[:6]}"
                          + (f" ({'; '.join(hints)}): not supported" if hints else ""))


def model_options(spec: SpeculativeConfig) -> Dict[str, bool]:
    """A draft config's speculators options (SpeculativeConfig.norm_before_fc / norm_before_residual / norm_output)."""
    return {k: bool(getattr(spec, k)) for k in SPECULATORS_OPTIONS}


def file_options(conf: Mapping[str, Any]) -> Dict[str, bool]:
    """The speculators draft options (SpeculativeConfig.norm_before_fc / norm_before_residual / norm_output) a file
    says, read as vLLM reads them: from a speculators config with its defaults (norm_before_residual true when absent,
    the others false: vllm transformers_utils/configs/speculators/algos.py:33-38), else from the Llama-style config
    (all false when absent: model_executor/models/llama_eagle3.py:101, 184-187, 252)."""
    speculators = conf.get("speculators_model_type") == "eagle3"
    ec = conf.get("eagle_config") if isinstance(conf.get("eagle_config"), dict) else {}
    return {"norm_before_fc": bool(ec.get("norm_before_fc", conf.get("norm_before_fc", False))),  # eagle_config's
            # first (llama_eagle3.py:184-187)
            "norm_before_residual": bool(conf.get("norm_before_residual", speculators)),
            "norm_output": bool(conf.get("norm_output", False))}


def _check_options(conf: Mapping[str, Any], cfg: ModelConfig, model_options: Mapping[str, bool] | None
                   ) -> Dict[str, bool]:
    """The file's draft options, checked against the model's (``model_options``: its SpeculativeConfig's); what no
    nemo_spec draft computes is refused by name (fc_norm, a foreign target_hidden_size, SpecForge's norm_output=false)."""
    speculators = conf.get("speculators_model_type") == "eagle3"
    bad = []
    if conf.get("fc_norm"):
        bad.append("fc_norm")
    if not speculators and conf.get("norm_output") is False:  # SpecForge: logits without the final norm
        bad.append("norm_output=false")  # (modeling/draft/llama3_eagle.py:1690, 1773; nemo_spec writes only true)
    th = conf.get("target_hidden_size")
    if th not in (None, cfg.hidden_size):
        bad.append(f"target_hidden_size={th} (the base's hidden size is {cfg.hidden_size})")
    if bad:
        raise ExportError(f"the draft was trained with {', '.join(bad)}, which no nemo_spec EAGLE-3 draft computes: "
                          f"not supported")
    opts = file_options(conf)
    if model_options is not None:
        diff = {k: v for k, v in opts.items() if bool(model_options.get(k, False)) != v}
        if diff:
            how = " (norm_before_residual: vLLM reads an absent one as true for speculators configs, " \
                  "speculators/algos.py:33-35)" if speculators and "norm_before_residual" not in conf and \
                  "norm_before_residual" in diff else ""
            raise ExportError(f"the draft was trained with {', '.join(f'{k}={v}' for k, v in diff.items())}, this "
                              f"model's draft with {', '.join(f'{k}={not v}' for k, v in diff.items())}{how}: "
                              f"transform the base with SpeculativeTransform(..., "
                              f"{', '.join(f'{k}={v}' for k, v in diff.items())})")
    window = conf.get("sliding_window") if conf.get("use_sliding_window", True) else None
    if window and "sliding_attention" in (conf.get("layer_types") or []) and int(window) < cfg.max_position_embeddings:
        log.warning("the draft was trained with a %d-token sliding window (layer_types); nemo_spec's draft attends "
                    "to the whole context: the same function for contexts up to %d tokens, another beyond", window,
                    window)
    return opts


def _note_differences(conf: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], cfg: ModelConfig) -> None:
    """Warn where an imported file says something the draft, as nemo_spec (and vLLM / SGLang) runs it, does not do."""
    ec = conf.get("eagle_config") or {}
    if ec.get("use_input_layernorm_in_first_layer") and "layers.0.hidden_norm.weight" in tensors:
        # ModelOpt's HF flow (layers.0.*): its EagleModule's layer 0 is a LlamaDecoderLayer whose input_layernorm
        # runs on the fused feature before the hook applies hidden_norm (modeling_eagle.py:77-80, 114-125 @ 0.47.0)
        log.warning("this EAGLE-3 draft comes from ModelOpt's Hugging Face flow, whose training forward normalises "
                    "layer 0's fused feature with input_layernorm and then hidden_norm; nemo_spec, vLLM and SGLang "
                    "apply hidden_norm only, so its acceptance here can be lower than in ModelOpt's own evaluation")
    sc = conf.get("rope_scaling") or {}
    base = cfg.rope_scaling or {}
    kind, base_kind = rope_type(sc), rope_type(base)
    if kind != base_kind or (kind != "default" and float(sc.get("factor", 1)) != float(base.get("factor", 1))):
        log.warning("the draft's config.json says rope_scaling=%s but the base rotates with %s: nemo_spec runs the "
                    "draft with the base's RoPE (as it was trained), an engine would apply the file's (ModelOpt "
                    "writes eagle_export_rope_scaling, YaRN by default, into exported drafts)", dict(sc) or None,
                    dict(base) or "no scaling")


def file_captured_layers(conf: Mapping[str, Any], num_layers: int) -> List[Tuple[List[int], str]]:
    """The readings of which 0-based base layers (outputs, in fc block order) the file's fc reads: [(layers, how)].

    Every engine captures the distinct layers in layer order, so fc's blocks are sorted. The ids' numbering depends
    on who wrote them: our ``nemo_spec_aux``; a top-level ``eagle_aux_hidden_state_layer_ids`` is vLLM's (id j =
    the input of layer j = the output of layer j-1: vllm gpu_model_runner.py:5207, llama.py:428-441); ids only in
    ``eagle_config`` are 0-based outputs for SGLang (it adds 1 to capture layer inputs: srt/models/llama.py:941) and
    for ModelOpt (recognised by its own keys), but inputs for vLLM (gpu_model_runner.py:5217-5219): both readings;
    no ids: the engines' default, the inputs of layers 2, L//2, L-3 (vllm llama.py, srt/models/llama.py:929-941).
    """
    meta = conf.get("nemo_spec_aux") or {}
    if meta.get("captured"):
        return [([int(i) for i in meta["captured"]], "nemo_spec_aux")]
    if meta.get("aux_layers"):
        return [(captured_layers([int(i) for i in meta["aux_layers"]]), "nemo_spec_aux")]
    top = conf.get("eagle_aux_hidden_state_layer_ids")
    if top:
        return [(sorted({int(i) - 1 for i in top}), f"eagle_aux_hidden_state_layer_ids={list(top)}, vLLM's inputs")]
    ec = conf.get("eagle_config") or {}
    ids = ec.get("eagle_aux_hidden_state_layer_ids")
    where = f"eagle_config.eagle_aux_hidden_state_layer_ids={list(ids or [])}"
    if ids and any(k in ec for k in MODELOPT_EAGLE_KEYS):
        return [(sorted({int(i) for i in ids}), f"{where}, ModelOpt's outputs")]
    if ids:
        return [(sorted({int(i) for i in ids}), f"{where} read as SGLang reads them (outputs)"),
                (sorted({int(i) - 1 for i in ids}), f"{where} read as vLLM reads them (inputs)")]
    L = num_layers
    return [(sorted({i - 1 for i in (2, L // 2, L - 3) if 0 < i < L}),
             f"no aux layer ids: the engines' default on this {L}-layer base")]


def eagle3_from_reference(tensors: Mapping[str, torch.Tensor], conf: Mapping[str, Any], cfg: ModelConfig,
                          aux: List[int] | None = None, base_lm_head: Callable[[], torch.Tensor] | None = None,
                          d2t: torch.Tensor | None = None,
                          options: Mapping[str, bool] | None = None) -> Dict[str, torch.Tensor]:
    """EAGLE-3 draft files of any engine layout (+ config.json) -> draft tensors (layer 0 as ``midlayer.*`` or
    ``layers.0.*``; layers >= 1 normalised by ``input_layernorm`` or ``hidden_norm``). ``aux``: the model's aux layers;
    the file's fc must read the same base layers (:func:`file_captured_layers`), its blocks are put in ``aux`` order.
    ``base_lm_head``: returns the base's output weight (called, on every rank alike, only for a full-vocabulary file
    without ``lm_head``: it may gather over TP); ``d2t``: the draft
    vocabulary map, for a reduced-vocabulary file without one; ``options``: the model's speculators draft options
    (SpeculativeConfig), which the file's must equal."""
    n_layers = int(conf.get("num_hidden_layers", 1))
    if "fc.weight" not in tensors:
        raise ExportError("EAGLE-3 draft lacks 'fc.weight' (drafts without aux-hidden-state fusion are not supported)")
    if "midlayer.self_attn.q_proj.weight" in tensors:
        prefixes = ["midlayer."]
    elif "midlayer.0.self_attn.q_proj.weight" in tensors:  # TensorRT-LLM's multi-layer names
        prefixes = [f"midlayer.{i}." for i in range(n_layers)]
    else:
        prefixes = [f"layers.{i}." for i in range(n_layers)]
    first = prefixes[0]
    fc = tensors["fc.weight"]
    h = cfg.hidden_size
    if aux is None:  # no model to compare with: our own export's record, else the file's order as it is
        aux = list((conf.get("nemo_spec_aux") or {}).get("aux_layers") or [])
    if aux:
        want = captured_layers(aux)
        readings = file_captured_layers(conf, cfg.num_layers)
        if all(have != want for have, _ in readings):
            have = readings[0][0]
            fix = (f"transform the base with aux_layers={(have + have[-1:] * 3)[:3]}" if 1 <= len(have) <= 3
                   else f"nemo_spec drafts fuse at most 3 layers, this one {len(have)}")
            said = " or ".join(f"{layers} ({how})" for layers, how in readings)
            raise ExportError(f"the draft's fc reads base layers {said} (0-based layer outputs) but this model's "
                              f"draft is fed layers {want} (aux_layers={list(aux)}): {fix}")
        if fc.shape[1] == len(want) * h and want != list(aux):  # sorted distinct blocks -> aux order
            fc = _fc_from_captured(fc, list(aux), h)
    out: Dict[str, torch.Tensor] = {"fc.weight": fc}
    if "fc.bias" in tensors:
        out["fc.bias"] = tensors["fc.bias"]
    for i in range(n_layers):
        src = prefixes[i]
        sd = dict(tensors)
        if i > 0 and src + "input_layernorm.weight" not in sd and src + "hidden_norm.weight" in sd:
            sd[src + "input_layernorm.weight"] = sd[src + "hidden_norm.weight"]
        q = sd.get(src + "self_attn.q_proj.weight")
        if i > 0 and q is not None and q.shape[1] == 2 * h:  # TensorRT-LLM layout: [embedding half | stream half]
            for x in "qkv":
                wt = sd[f"{src}self_attn.{x}_proj.weight"]
                if wt[:, :h].abs().max() > 0:
                    raise ExportError(f"{src}self_attn.{x}_proj.weight reads the embedding (nonzero first {h} "
                                      f"columns): layer {i} is not a Llama layer of this draft")
                sd[f"{src}self_attn.{x}_proj.weight"] = wt[:, h:]
            sd[src + "input_layernorm.weight"] = sd[src + "hidden_norm.weight"]
        out.update(layer_from_hf(sd, src, f"layers.{i}.", cfg, input_norm=True))
    opts = _check_options(conf, cfg, options)
    _refuse_unread_biases(tensors, cfg)
    _refuse_unknown_tensors(tensors, prefixes, cfg, opts)
    if opts["norm_before_fc"]:
        if "input_norm.weight" not in tensors:
            raise ExportError("the draft's config says norm_before_fc but the file has no input_norm.weight")
        w = tensors["input_norm.weight"]
        out["input_norm.weight"] = _norm_blocks(w, captured_layers(aux), list(aux), h) if aux else w
    tensors = dict(tensors)
    if "lm_head.weight" not in tensors and base_lm_head is not None and \
            int(conf.get("draft_vocab_size") or cfg.vocab_size) == cfg.vocab_size:
        # a full-vocabulary draft without its own head predicts with the base's (ModelOpt's Megatron export writes
        # no lm_head then: unified_export_megatron.py:917-918, megatron_eagle.py:507-526 @ nvidia-modelopt 0.47.0)
        log.info("EAGLE-3 draft has no lm_head.weight and the full vocabulary: using the base's output layer")
        tensors["lm_head.weight"] = base_lm_head()
    for src, dst in ((first + "hidden_norm.weight", "layers.0.hidden_norm.weight"),
                     ("norm.weight", "final_layernorm.weight"), ("lm_head.weight", "output_layer.weight")):
        if src not in tensors:
            raise ExportError(f"EAGLE-3 draft lacks {src!r}")
        out[dst] = tensors[src]
    vd = out["output_layer.weight"].shape[0]
    if int(conf.get("draft_vocab_size") or vd) != vd:
        raise ExportError(f"config draft_vocab_size={conf.get('draft_vocab_size')} but lm_head has {vd} rows")
    if d2t is not None:
        if "d2t" in tensors and not torch.equal(tensors["d2t"].long(), d2t.long()):
            raise ExportError("the draft file stores a d2t that differs from the one passed (d2t=)")
        tensors["d2t"] = d2t
    if "d2t" in tensors:
        out["d2t"] = tensors["d2t"].to(torch.long)
        if tuple(out["d2t"].shape) != (vd,):
            raise ExportError(f"d2t has shape {tuple(out['d2t'].shape)}, expected ({vd},) = the draft vocabulary")
    elif vd == cfg.vocab_size:
        out["d2t"] = torch.zeros(vd, dtype=torch.long)
    else:
        raise ExportError(f"EAGLE-3 draft has a reduced vocabulary ({vd} of {cfg.vocab_size}) but no 'd2t' mapping "
                          f"(ModelOpt's Megatron export drops it: unified_export_megatron.py:919 tests 'dt2'); pass "
                          f"the draft vocabulary cache: import_draft(model, path, d2t=<draft_vocab_cache .pt>)")
    _note_differences(conf, tensors, cfg)
    if "embed_tokens.weight" in tensors:
        log.info("EAGLE-3 draft stores embed_tokens.weight; ignored (the draft embeds tokens with the base's table)")
    return out


# ------------------------------------------------------------------------------------------------ EAGLE-1
EAGLE1_ARCHS = {"vllm": "LlamaForCausalLM", "sglang": "LlamaForCausalLMEagle", "reference": "LlamaForCausalLM"}


def eagle1_to_engine(neutral: Mapping[str, torch.Tensor], cfg: ModelConfig, spec: SpeculativeConfig,
                     embedding: torch.Tensor, engine: str) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """Neutral EAGLE-1 draft tensors (+ the base's embedding table) -> (tensors, config.json dict) for ``engine``.

    vLLM builds fc without a bias (llama_eagle.py:110-118) and reads ``bias``/``attention_bias`` as attention bias
    (llama.py:267-271): fc's bias b is folded exactly into layer 0 (no input norm there), q/k/v bias = W b and
    o_proj bias = b, with zero biases elsewhere. SGLang needs ``LlamaForCausalLMEagle`` and always has fc.bias; the
    reference code reads ``bias`` as fc's bias (ea_model.py:49-54). No config carries ``bias`` except the
    reference's.
    """
    check_llama_family(cfg, "eagle1")
    if engine not in EAGLE1_ARCHS:
        raise ExportError(f"EAGLE-1 export for {engine}: not supported (claimed by {sorted(EAGLE1_ARCHS)})")
    n_layers = spec.num_eagle_layers
    if "layers.0.input_layernorm.weight" in neutral:
        raise ExportError("this EAGLE-1 draft normalises the input of its first layer, which the EAGLE-1 format "
                          "(layer 0 without input_layernorm) cannot represent")
    if "final_layernorm.weight" in neutral:
        raise ExportError("this EAGLE-1 draft has a final norm, which the EAGLE-1 format (draft hidden goes "
                          "straight to the base lm_head) cannot represent")
    if engine == "reference" and cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size:
        raise ExportError("EAGLE-1 export for reference: EaModel assumes head_dim = hidden_size / num_heads")
    ref_scaling, why = _reference_rope(cfg) if engine == "reference" else (None, None)
    if why:
        raise ExportError(f"EAGLE-1 export for reference: {why}")
    out: Dict[str, torch.Tensor] = {"embed_tokens.weight": embedding, "fc.weight": _need(neutral, "fc.weight")}
    bias = neutral.get("fc.bias")
    for i in range(n_layers):
        out.update(layer_to_hf(neutral, f"layers.{i}.", f"layers.{i}.", cfg, input_norm=i > 0))
    conf = {"architectures": [EAGLE1_ARCHS[engine]], **_llama_fields(cfg, n_layers)}
    qkv_bias = bool(cfg.add_qkv_bias)
    conf["attention_bias"] = qkv_bias
    if engine == "reference":
        conf["rope_scaling"] = ref_scaling
        conf["bias"] = bias is not None
        conf.pop("attention_bias")
        if qkv_bias:
            conf["qkv_bias"] = True  # cnets1.py:209-216
        if bias is not None:
            out["fc.bias"] = bias
    elif engine == "sglang":
        out["fc.bias"] = bias if bias is not None else torch.zeros(cfg.hidden_size)
        if qkv_bias:  # attention_bias also builds o_proj biases there (srt/models/llama.py:212,219)
            for i in range(n_layers):
                out[f"layers.{i}.self_attn.o_proj.bias"] = torch.zeros(cfg.hidden_size)
    else:  # vllm
        fold = bias is not None and bool(bias.abs().max() > 0)
        if fold or qkv_bias:
            conf["attention_bias"] = True
            for i in range(n_layers):
                p = f"layers.{i}.self_attn."
                for name in ("q_proj", "k_proj", "v_proj"):
                    out.setdefault(p + name + ".bias", torch.zeros(out[p + name + ".weight"].shape[0]))
                out[p + "o_proj.bias"] = torch.zeros(cfg.hidden_size)
        if fold:
            p = "layers.0.self_attn."
            for name in ("q_proj", "k_proj", "v_proj"):
                out[p + name + ".bias"] = out[p + name + ".bias"] + out[p + name + ".weight"].float() @ bias.float()
            out[p + "o_proj.bias"] = bias.clone()
            conf["nemo_spec_fc_bias_folded"] = True
    return out, conf


def eagle1_to_reference(neutral: Mapping[str, torch.Tensor], cfg: ModelConfig, spec: SpeculativeConfig,
                        embedding: torch.Tensor) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """Neutral EAGLE-1 draft tensors (+ the base's embedding table) -> (EaModel tensors, config.json dict)."""
    return eagle1_to_engine(neutral, cfg, spec, embedding, "reference")


def eagle1_from_reference(tensors: Mapping[str, torch.Tensor], conf: Mapping[str, Any],
                          cfg: ModelConfig) -> Dict[str, torch.Tensor]:
    """EAGLE-1 draft files of any engine layout (+ config.json) -> neutral draft tensors (embedding dropped)."""
    n_layers = int(conf.get("num_hidden_layers", 1))
    if "fc.weight" not in tensors:
        raise ExportError("EAGLE-1 draft lacks 'fc.weight'")
    sd = dict(tensors)
    out: Dict[str, torch.Tensor] = {"fc.weight": sd["fc.weight"]}
    if conf.get("nemo_spec_fc_bias_folded"):  # undo the vLLM fold (see eagle1_to_engine)
        if cfg.add_qkv_bias:
            raise ExportError("cannot unfold fc.bias from a vLLM EAGLE-1 export of a qkv-biased base")
        out["fc.bias"] = sd["layers.0.self_attn.o_proj.bias"]
        sd = {k: v for k, v in sd.items() if not k.endswith(("_proj.bias",))}
    elif "fc.bias" in sd:
        out["fc.bias"] = sd["fc.bias"]
    elif not cfg.add_qkv_bias:
        out["fc.bias"] = torch.zeros(cfg.hidden_size)  # vLLM layout without a fold: fc had a zero bias
    if not cfg.add_qkv_bias:
        sd = {k: v for k, v in sd.items() if not k.endswith("o_proj.bias")}
    for i in range(n_layers):
        out.update(layer_from_hf(sd, f"layers.{i}.", f"layers.{i}.", cfg, input_norm=i > 0))
    return out
