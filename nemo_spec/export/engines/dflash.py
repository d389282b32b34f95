"""DFlash conformance readers: what SGLang 0.5.23, vLLM 0.33.0, TensorRT-LLM and the z-lab reference compute from
an exported ``DFlashDraftModel`` directory, in plain torch (no megatron, no nemo_spec model code).

Sources (line numbers of those files): the released wheels ``sglang==0.5.23`` and ``vllm==0.33.0``
(``pip download --no-deps``), and z-lab/dflash at commit 44947fb ``dflash/model.py``. TensorRT-LLM (its wheel and
repository are too large to fetch here) is read from stored public snapshots and cited by function:
``tensorrt_llm/_torch/models/modeling_dflash.py`` @ 7c7504c08f1f (DFlashForCausalLM: __init__, load_weights,
load_weights_from_target_model, precompute_context_kv, dflash_forward, _get_attention_mask_args; the math is the
same @ 009d8fa431bd), ``_torch/speculative/dflash.py`` @ 00679c66c3e3 (DFlashSpecMetadata, DFlashWorker:
_draft_block_width, _lazy_init_ctx_buffers, prepare_1st_drafter_inputs) and ``llmapi/llm_args.py`` @ 7c7504c08f1f
(DFlashDecodingConfig; TorchLlmArgs.validate_speculative_config fills target_layer_ids / mask_token_id from the
draft's dflash_config). It projects the context with each layer's k/v weights, k_norm and RoPE at the context
positions (precompute_context_kv), which is the formula below; embeddings and LM head are always the target's.

The scenario each reader evaluates: context = the base's hidden states at positions 0 .. s-2 of ``ids`` [b, s],
block = [ids[:, s-1], MASK x (B - 1)] at positions s-1 .. s+B-2, one forward; the logits of every block slot
[b, B, V] are returned (the engines sample slots 1 .. B-1: vLLM v1/spec_decode/utils.py:730-743, z-lab
model.py:112-121, SGLang takes the block's mask slots the same way).

The draft forward every engine implements (z-lab model.py:185-347; SGLang models/dflash.py:373-427 ``forward``,
429-463 ``kv_proj_only`` / ``apply_k_norm`` / ``apply_k_rope``, 825-845 ``prepare_context_hidden_for_kv`` (the
context unchanged) / ``project_target_hidden``, dflash_worker_v2.py:1964-1972; vLLM qwen3_dflash.py:581-708
``_project_context_kv`` (hidden_norm of fc(features), one K/V GEMM), ``precompute_and_store_context_kv``)::

    ctx = hidden_norm(fc(cat(features)))
    per layer: a = input_layernorm(x); q = q_norm(q_proj a); k = k_norm(k_proj [ctx ; a]); v = v_proj [ctx ; a]
               RoPE(q at block positions, k at [context ; block] positions); attention not causal
               x = x + o_proj(attn); x = x + mlp(post_attention_layernorm(x))
    logits = target lm_head(norm(x)), token embeddings = target embed_tokens

Engine rules that differ and are checked here: which hidden states the ids name (z-lab ``hidden_states[id+1]``,
SGLang/vLLM the input of layer id+1), vLLM's precedence of ``eagle_aux_hidden_state_layer_ids`` (no +1),
causality switches, the mask token lookup, a draft ``mask_hidden`` (vLLM asserts), fc shapes.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

import torch

from nemo_spec.export.engines._llama import (
    BaseRun, EngineMismatch, Rope, check_rope, mlp, read_config, read_dir, require, rms,
)

ARCH = "DFlashDraftModel"


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> List[int]:
    """The reference default (z-lab model.py:27-36 == SGLang dflash_utils.py:348-385)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    if end < start:
        raise EngineMismatch(f"DFlash layer selection requires num_target_layers >= 4 (dflash_utils.py:373-378), "
                             f"got {num_target_layers}")
    return [int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def _forward(w: Mapping[str, torch.Tensor], conf: Mapping[str, Any], features: torch.Tensor, block: torch.Tensor,
             embed: torch.Tensor, lm_head: torch.Tensor, causal: bool, rope: Rope) -> torch.Tensor:
    """The draft forward above: features [b, S, F] (positions 0..S-1), block tokens [b, q] (positions S..S+q-1)."""
    eps = float(conf["rms_norm_eps"])
    nh, ng = int(conf["num_attention_heads"]), int(conf["num_key_value_heads"])
    h = int(conf["hidden_size"])
    hd = int(conf.get("head_dim") or h // nh)
    b, S = features.shape[:2]
    q_len = block.shape[1]
    ctx = rms(features @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    x = embed[block]
    pos_c, pos_q = torch.arange(S), torch.arange(S, S + q_len)
    allowed = torch.ones(q_len, S + q_len, dtype=torch.bool)
    if causal:
        allowed[:, S:] = torch.ones(q_len, q_len, dtype=torch.bool).tril()
    for i in range(int(conf["num_hidden_layers"])):
        p = f"layers.{i}."
        a = rms(x, w[p + "input_layernorm.weight"], eps)
        kv_in = torch.cat([ctx, a], 1)
        q = (a @ w[p + "self_attn.q_proj.weight"].T).view(b, q_len, nh, hd)
        k = (kv_in @ w[p + "self_attn.k_proj.weight"].T).view(b, S + q_len, ng, hd)
        v = (kv_in @ w[p + "self_attn.v_proj.weight"].T).view(b, S + q_len, ng, hd)
        q = rms(q, w[p + "self_attn.q_norm.weight"], eps).transpose(1, 2)
        k = rms(k, w[p + "self_attn.k_norm.weight"], eps).transpose(1, 2)
        v = v.transpose(1, 2)
        # rotate-half RoPE (neox style: vLLM qwen3_dflash.py:330-331, SGLang ``rope_is_neox_style`` default True,
        # models/dflash.py:265-269; HF rotate_half)
        q = rope.rotate(q, pos_q)
        k = rope.rotate(k, torch.cat([pos_c, pos_q]))
        k, v = k.repeat_interleave(nh // ng, dim=1), v.repeat_interleave(nh // ng, dim=1)
        att = (q @ k.transpose(-1, -2)) / hd ** 0.5
        att = att.masked_fill(~allowed, float("-inf")).softmax(-1)
        o = (att @ v).transpose(1, 2).reshape(b, q_len, nh * hd) @ w[p + "self_attn.o_proj.weight"].T
        x = x + o
        x = x + mlp(rms(x, w[p + "post_attention_layernorm.weight"], eps), w, p)
    return rms(x, w["norm.weight"], eps) @ lm_head.T


def _weights(draft_dir: Path, conf: Mapping[str, Any], engine: str) -> Dict[str, torch.Tensor]:
    w = read_dir(draft_dir, ["model.safetensors"])
    n = int(conf["num_hidden_layers"])
    need = ["fc.weight", "hidden_norm.weight", "norm.weight"]
    for i in range(n):
        p = f"layers.{i}."
        need += [p + s for s in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                 "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                                 "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                                 "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")]
    require(w, need, engine, "tensors the draft builds but the file lacks")
    return w


def _mask_id(conf: Mapping[str, Any], vocab: int, engine: str) -> int:
    dc = conf.get("dflash_config") or {}
    mid = dc.get("mask_token_id", conf.get("mask_token_id"))
    if mid is None:
        raise EngineMismatch(f"{engine}: no dflash_config.mask_token_id (z-lab model.py:320 reads it; SGLang falls "
                             f"back to looking up the '<|MASK|>' token in the tokenizer, dflash_worker_v2.py:1424-1440)")
    if not isinstance(mid, int) or isinstance(mid, bool) or not 0 <= mid < vocab:
        raise EngineMismatch(f"{engine}: mask_token_id {mid!r} outside the target vocabulary [0, {vocab}) "
                             f"(SGLang dflash_worker_v2.py:1399-1408)")
    return int(mid)


def _features(base: BaseRun, stream_ids: List[int], engine: str, s: int, post_norm_last: bool = False
              ) -> torch.Tensor:
    L = base.num_layers
    feats = []
    for j in stream_ids:
        if j == L and post_norm_last:  # HF hidden_states[L] is after the final norm
            feats.append(base.final)
        elif 0 <= j < L:
            feats.append(base.stream[j])
        else:
            raise EngineMismatch(f"{engine}: no capture point {j} in a {L}-layer target (the input of a layer; "
                                 f"a target_layer_id of the last layer has none)")
    return torch.cat(feats, -1)[:, : s - 1]


def _refuse_trtllm_variants(conf: Mapping[str, Any]) -> None:
    """Config keys that make TensorRT-LLM's DFlash drafter another function than the one read here."""
    dc = conf.get("dflash_config") or {}
    types = conf.get("layer_types") or []
    windowed = (any("sliding" in str(t) for t in types) or dc.get("use_swa")
                or (conf.get("use_sliding_window") is not False and conf.get("sliding_window") is not None))
    if windowed:  # modeling_dflash.py _get_attention_mask_args / dspark_layer_window_size (causal or windowed)
        raise EngineMismatch("trtllm: sliding-window / use_swa DFlash layers (a causal or windowed block mask in "
                             "DFlashForCausalLM) are not claimed")
    dspark = [k for k in ("dspark_config", "projector_type", "shift_label", "use_confidence_head", "markov_rank")
              if conf.get(k) or dc.get(k)]
    if dspark:  # modeling_dflash.py declares_dspark_heads: _build_dflash_draft raises, DSpark is another config
        raise EngineMismatch(f"trtllm: {dspark} declare DSpark heads, which the DFlash drafter refuses")
    if conf.get("attention_bias"):
        raise EngineMismatch("trtllm: attention_bias DFlash layers are not claimed")


def _check_arch(conf: Mapping[str, Any], engine: str, where: str) -> None:
    arch = (conf.get("architectures") or [None])[0]
    if arch != ARCH:
        raise EngineMismatch(f"{engine}: architecture {arch!r} is not {ARCH!r} ({where})")


def dflash_logits(engine: str, draft_dir: Path, base: BaseRun, ids: torch.Tensor,
                  launch: Optional[Mapping[str, Any]] = None) -> torch.Tensor:
    """Block logits [b, B, V] ``engine`` ('sglang' | 'vllm' | 'trtllm' | 'reference') computes for the export
    (TensorRT-LLM: B = ``launch['max_draft_len']`` + 1, by default the checkpoint's block_size)."""
    draft_dir = Path(draft_dir)
    conf = read_config(draft_dir)
    dc = conf.get("dflash_config") or {}
    L = base.num_layers
    vocab = int(base.embed.shape[0])
    n = int(conf["num_hidden_layers"])
    b, s = ids.shape
    rope = check_rope(conf)
    if engine == "reference":
        _check_arch(conf, engine, "model.py:302")
        tids = dc.get("target_layer_ids") or build_target_layer_ids(int(conf["num_target_layers"]), n)  # :312-314
        stream = [i + 1 for i in tids]  # extract_context_feature: hidden_states[layer_id + 1] (model.py:39-45)
        post_last = True
        block_size = int(conf["block_size"])  # model.py:319
        causal = False  # is_causal = False (model.py:194); generation passes no mask (model.py:112-119)
    elif engine == "sglang":
        _check_arch(conf, engine, "models/dflash.py:671, EntryClass :1317")
        tids = dc.get("target_layer_ids", conf.get("target_layer_ids"))  # dflash_utils.py:656-675
        if tids is None:
            ntl = dc.get("num_target_layers", conf.get("num_target_layers"))  # models/dflash.py:750-755
            tids = build_target_layer_ids(int(ntl) if ntl is not None else n, n)
        for t in tids:  # resolve_target_layer_ids, dflash_utils.py:573-585
            if not 0 <= t < L:
                raise EngineMismatch(f"sglang: target_layer_id {t} out of range for {L} layers (dflash_utils.py:580)")
        stream = [i + 1 for i in tids]  # set_dflash_layers_to_capture: ids + 1 (qwen3.py:793-805, llama.py:943-953)
        post_last = False  # layer i captures its input (llama.py:485-494): id L - 1 is never captured
        block_size = int(dc.get("block_size", conf.get("block_size", 16)))  # dflash_utils.py:608-616, dflash.py:702
        types = conf.get("layer_types")
        causal = conf.get("is_causal")  # models/dflash.py:157-163
        if causal is None:  # full_attention / no layer_types -> ENCODER_ONLY (non-causal), :166-191
            causal = bool(types) and any(t == "sliding_attention" for t in types)
    elif engine == "vllm":
        _check_arch(conf, engine, "model_executor/models/registry.py:664")
        aux = conf.get("eagle_aux_hidden_state_layer_ids")
        if not aux:  # eagle3_utils.py:113-124: DFlash ids + 1 unless eagle_aux_hidden_state_layer_ids is set
            aux = [i + 1 for i in (dc.get("target_layer_ids") or [])]
        if not aux:
            raise EngineMismatch("vllm: no target_layer_ids / eagle_aux_hidden_state_layer_ids: the fc input size "
                                 "falls back to num_hidden_layers * hidden (qwen3_dflash.py:84-91)")
        stream = list(aux)  # the residual entering layer id (llama.py:428-441 aux_hidden_state_layers)
        post_last = False
        block_size = int(conf.get("block_size", 16))
        causal = conf.get("is_causal")  # _dflash_layer_causal, qwen3_dflash.py:62-71
        if causal is None:
            causal = dc.get("causal")
        if causal is None:
            types = conf.get("layer_types")
            causal = bool(types) and types[0] == "sliding_attention"
        if "rope_theta" not in conf and "rope_parameters" not in conf:
            # set_default_rope_theta(config, default_theta=1000000), qwen3_dflash.py:311
            rope = dataclasses.replace(rope, theta=1e6)
    elif engine == "trtllm":
        # TensorRT-LLM's DFlashForCausalLM (tensorrt_llm/_torch/models/modeling_dflash.py @ 7c7504c08f1f) and
        # DFlashWorker (_torch/speculative/dflash.py @ 00679c66c3e3), cited by function (see the module docstring):
        # DFlashDraftModel is not registered, so __init__ falls back to the class named by model_type
        if conf.get("model_type") != "qwen3":  # 'qwen3' -> Qwen3ForCausalLM (q/k norm attention)
            raise EngineMismatch(f"trtllm: model_type {conf.get('model_type')!r} does not build the Qwen3 block "
                                 f"drafter (DFlashForCausalLM.__init__ resolves the class from model_type)")
        _refuse_trtllm_variants(conf)
        # llm_args.py TorchLlmArgs.validate_speculative_config: the launch's target_layer_ids, else the draft's
        # dflash_config.target_layer_ids; nothing else (no default): none -> no capture, a draft without context
        tids = (launch or {}).get("target_layer_ids") or dc.get("target_layer_ids")
        if not tids:
            raise EngineMismatch("trtllm: no target_layer_ids (DFlashDecodingConfig or dflash_config): "
                                 "DFlashSpecMetadata captures nothing and the draft runs without context")
        for t in tids:
            if not 0 <= int(t) < L:
                raise EngineMismatch(f"trtllm: target_layer_id {t} is not a layer of the {L}-layer target")
        # DFlashSpecMetadata.__post_init__ sorts the ids; the target layer's maybe_capture_hidden_states saves
        # hidden_states + residual after its MLP, i.e. the OUTPUT of layer id = the input of layer id + 1
        stream = [int(i) + 1 for i in sorted(set(int(t) for t in tids))]
        post_last = False
        trained = int(dc.get("block_size", conf.get("block_size", 16)))
        k = int((launch or {}).get("max_draft_len", trained - 1))
        if k <= 0 or k + 1 > trained:  # DFlashWorker._draft_block_width = max_draft_len + 1; larger raises
            raise EngineMismatch(f"trtllm: max_draft_len {k}: the block is max_draft_len + 1 slots "
                                 f"(DFlashWorker._draft_block_width), at most the checkpoint's block_size "
                                 f"{trained} (_lazy_init_ctx_buffers raises beyond)")
        block_size = k + 1
        causal = False  # full_attention layers, no sliding window: _get_attention_mask_args gives no mask
    else:
        raise EngineMismatch(f"no DFlash reader for engine {engine!r}")
    w = _weights(draft_dir, conf, engine)
    if engine == "vllm" and any("mask_hidden" in k for k in w):
        raise EngineMismatch("vllm: a DFlash draft must not ship mask_hidden (qwen3_dflash.py:856-860 asserts)")
    h = int(conf["hidden_size"])
    fc_in = h * len(stream)
    if tuple(w["fc.weight"].shape) != (h, fc_in):
        raise EngineMismatch(f"{engine}: fc.weight {tuple(w['fc.weight'].shape)} != ({h}, {fc_in}) for "
                             f"{len(stream)} context features (SGLang models/dflash.py:955-975, vLLM :84-91)")
    mask_id = _mask_id(conf, vocab, engine)
    embed = w["embed_tokens.weight"] if "embed_tokens.weight" in w and engine == "vllm" else base.embed
    head = w["lm_head.weight"] if "lm_head.weight" in w and engine == "vllm" else base.lm_head
    features = _features(base, stream, engine, s, post_last)
    block = torch.full((b, block_size), mask_id, dtype=ids.dtype)
    block[:, 0] = ids[:, s - 1]
    return _forward(w, conf, features, block, embed, head, bool(causal), rope)


def launch_command(engine: str, base_dir: Path, draft_dir: Path, block_size: int = 16) -> str:
    """How to serve a DFlash export (z-lab README.md:55-80)."""
    import json

    if engine == "vllm":
        spec = json.dumps({"method": "dflash", "model": str(draft_dir), "num_speculative_tokens": block_size - 1})
        return f"vllm serve {base_dir} \\\n  --speculative-config '{spec}' --attention-backend flash_attn"
    if engine == "sglang":
        return (f"python -m sglang.launch_server --model-path {base_dir} \\\n  --speculative-algorithm DFLASH "
                f"--speculative-draft-model-path {draft_dir} --speculative-num-draft-tokens {block_size}")
    if engine == "trtllm":  # llm_args.py DFlashDecodingConfig; its block is max_draft_len + 1 slots
        return ("# TensorRT-LLM with DFlash: merged 2026-04-27 (NVIDIA/TensorRT-LLM#12794), in the 1.3.0 release\n"
                "# candidates from 1.3.0rc14 on; the 1.2.x releases have no DFlashDecodingConfig\n"
                "from tensorrt_llm import LLM\nfrom tensorrt_llm.llmapi import DFlashDecodingConfig\n"
                f"spec = DFlashDecodingConfig(max_draft_len={block_size - 1}, speculative_model='{draft_dir}')\n"
                f"llm = LLM(model='{base_dir}', speculative_config=spec)")
    return ("from dflash.model import DFlashDraftModel  # z-lab/dflash\n"
            f"draft = DFlashDraftModel.from_pretrained('{draft_dir}')\n"
            f"out = draft.spec_generate(target, input_ids, max_new_tokens=256, stop_token_ids=None, temperature=0.0)")
