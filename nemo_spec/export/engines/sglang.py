"""SGLang 0.5.23 conformance reader: what SGLang builds from an exported EAGLE-3 / EAGLE-1 / DFlash draft directory
(DFlash: engines/dflash.py).

Written from the released wheel ``sglang==0.5.23`` (``pip download --no-deps sglang==0.5.23``); line numbers are
of that wheel's ``sglang/srt`` files. SGLang has no Medusa decoding, so Medusa is not claimed.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from nemo_spec.export.engines._eagle import eagle1_forward, eagle3_forward, layer_names
from nemo_spec.export.engines._llama import (
    BaseRun, EngineMismatch, Unsupported, read_config, read_dir, require, scatter_draft_logits,
)

NAME = "sglang"
VERSION = "0.5.23"
FORMATS = ("eagle3", "eagle1", "dflash")
# formats SGLang 0.5.23 does not serve, with the reason (export_model records it; verify_export reports it)
NOT_SERVED = {
    "peagle": ("no P-EAGLE / parallel drafting: its algorithms are DFLASH, UNO, DSPARK, EAGLE, "
               "EAGLE3, FROZEN_KV_MTP, STANDALONE, NGRAM (srt/speculative/spec_info.py:32-47), nothing reads a "
               "speculators config, and served as EAGLE3 its loader drops mask_hidden silently (models/"
               "llama_eagle3.py:325-378) and drafts sequentially - not this draft"),
}

EAGLE3_ARCH = "LlamaForCausalLMEagle3"  # models/llama_eagle3.py:387 (EntryClass; the class name is the arch)
EAGLE1_ARCH = "LlamaForCausalLMEagle"  # models/llama_eagle.py:153; nothing maps LlamaForCausalLM to it


def aux_layer_ids(conf: Mapping) -> Optional[list]:
    """The ids SGLang reads: ``eagle_config.eagle_aux_hidden_state_layer_ids`` only
    (model_executor/model_runner_components/spec_aux_hidden_state.py:186-196)."""
    ids = (conf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return list(ids) if ids else None


def _rename(w: Mapping[str, torch.Tensor]) -> dict:
    # models/llama_eagle3.py:337-348: legacy "midlayer" -> "layers.0"
    return {k.replace("midlayer", "layers.0"): v for k, v in w.items()}


def eagle3_logits(draft_dir: Path, base: BaseRun, ids: torch.Tensor, launch: Mapping[str, Any]) -> torch.Tensor:
    """Draft logits [b, s-1, V] SGLang computes for tokens ids[:, 1:] and the base features at ids[:, :-1]."""
    conf = read_config(draft_dir)
    arch = (conf.get("architectures") or [None])[0]
    if arch != EAGLE3_ARCH:
        raise EngineMismatch(f"sglang: architecture {arch!r} is not {EAGLE3_ARCH!r} (models/llama_eagle3.py:387)")
    w = _rename(read_dir(draft_dir, ["model.safetensors"]))
    L, vocab, h = base.num_layers, int(conf["vocab_size"]), int(conf["hidden_size"])
    cfg_ids = aux_layer_ids(conf)
    # models/llama.py:929-941: capture = [2, L//2, L-3] by default, else ids + 1; layer i captures its *input*
    # (models/llama.py:486-493), so id j means the output of 0-based layer j; i ranges over the L layers only
    capture = [2, L // 2, L - 3] if cfg_ids is None else [j + 1 for j in cfg_ids]
    captured = sorted({i for i in capture if 0 <= i < L})
    # models/llama_eagle3.py:156-167: fc in = hidden_size_in * num_aux (len of eagle_config ids, default 3)
    num_aux = conf.get("num_aux_hidden_states") or (len(cfg_ids) if cfg_ids else 3)
    fc_in = int(conf.get("target_hidden_size", h)) * int(num_aux)
    if tuple(w["fc.weight"].shape) != (h, fc_in):
        raise EngineMismatch(f"sglang: fc.weight {tuple(w['fc.weight'].shape)} != [{h}, {fc_in}] "
                             f"(num_aux={num_aux}, models/llama_eagle3.py:156-167)")
    if len(captured) != num_aux:
        raise EngineMismatch(f"sglang: capture layers {capture} (eagle_config ids + 1, models/llama.py:941) yield "
                             f"{len(captured)} distinct hidden states inside layers 0..{L - 1}, fc expects {num_aux}")
    fc_bias = bool(conf.get("bias", False))  # models/llama_eagle3.py:166
    n = int(conf["num_hidden_layers"])
    need = ["fc.weight", "norm.weight"] + (["fc.bias"] if fc_bias else [])
    if not conf.get("tie_word_embeddings", False):
        need.append("lm_head.weight")  # models/llama_eagle3.py:303-314: own lm_head [draft_vocab_size, h]
    for i in range(n):
        # layers >= 1 normalise their input with hidden_norm (models/llama_eagle3.py:103-105); input_layernorm is
        # used by layer 0 only (models/llama_eagle3.py:97-102); qkv has no bias (models/llama_eagle3.py:67-75)
        need += layer_names(f"layers.{i}.", "hidden_norm", input_norm=i == 0)
    # unknown names are skipped silently (models/llama_eagle3.py:370-378), missing ones keep their init
    require(w, need, "sglang", "parameters the draft builds but the file lacks (left at init)")
    biases = [k for k in w if k.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")) and w[k].abs().max() > 0]
    if biases:
        raise EngineMismatch(f"sglang: qkv_proj is built without bias (models/llama_eagle3.py:67-75); {biases[:3]} "
                             f"are skipped silently")
    emb = base.embed[ids[:, 1:]]  # speculative/eagle_worker_v2.py:353-363: set_embed(target embed)
    feat = torch.cat([base.stream[i] for i in captured], -1)[:, :-1]
    if feat.shape[-1] == emb.shape[-1]:  # fc runs only when the features are wider than the embedding
        # (models/llama_eagle3.py:238-247): one captured layer goes into the draft as it is
        w = dict(w, **{"fc.weight": torch.eye(h)})
        fc_bias = False
    hidden = eagle3_forward(w, conf, emb, feat, later_norm="hidden_norm", fc_bias=fc_bias)
    logits = hidden @ (w["lm_head.weight"] if "lm_head.weight" in w else base.embed).T
    # d2t -> hot_token_id = d2t + arange (models/llama_eagle3.py:350-353); none -> draft ids are target ids
    base_ids = (w["d2t"].long() + torch.arange(w["d2t"].numel())) if "d2t" in w else None
    if base_ids is None and logits.shape[-1] != vocab:
        raise EngineMismatch(f"sglang: reduced draft vocabulary ({logits.shape[-1]} of {vocab}) without d2t")
    return scatter_draft_logits(logits, base_ids, vocab)


def eagle1_logits(draft_dir: Path, base: BaseRun, ids: torch.Tensor, launch: Mapping[str, Any]) -> torch.Tensor:
    """EAGLE-1 draft logits [b, s-1, V] as SGLang computes them."""
    conf = read_config(draft_dir)
    arch = (conf.get("architectures") or [None])[0]
    if arch != EAGLE1_ARCH:
        raise EngineMismatch(f"sglang: architecture {arch!r} loads as a plain model, not {EAGLE1_ARCH!r} "
                             f"(models/llama_eagle.py:117,153); every draft tensor would be skipped")
    w = read_dir(draft_dir, ["model.safetensors", "pytorch_model.bin"])
    # attention bias = attention_bias or bias (models/llama.py:337-341), on qkv and o_proj (models/llama.py:212,219)
    attn_bias = bool(conf.get("attention_bias", False) or conf.get("bias", False))
    n = int(conf["num_hidden_layers"])
    need = ["fc.weight", "fc.bias"]  # fc = nn.Linear(2h, h), bias on (models/llama_eagle.py:91)
    for i in range(n):  # layer 0 drops input_layernorm (models/llama_eagle.py:52-55)
        need += layer_names(f"layers.{i}.", None, qkv_bias=attn_bias, o_bias=attn_bias, input_norm=i > 0)
    require(w, need, "sglang", "parameters the draft builds but the file lacks (left at init)")
    # embedding and lm_head are the target's (speculative/eagle_worker_v2.py:370-377)
    hidden = eagle1_forward(w, conf, base.embed[ids[:, 1:]], base.final[:, :-1], fc_bias=True, attn_bias=attn_bias)
    return hidden @ base.lm_head.T


def draft_logits(fmt: str, draft_dir: Path, base: BaseRun, ids: torch.Tensor,
                 launch: Optional[Mapping[str, Any]] = None) -> torch.Tensor:
    """SGLang's draft logits for an exported ``fmt`` draft (base vocabulary, -inf outside the draft vocab)."""
    if fmt == "eagle3":
        return eagle3_logits(draft_dir, base, ids, launch or {})
    if fmt == "eagle1":
        return eagle1_logits(draft_dir, base, ids, launch or {})
    if fmt == "dflash":  # srt/models/dflash.py, srt/speculative/dflash_{utils,worker_v2}.py (engines/dflash.py)
        from nemo_spec.export.engines.dflash import dflash_logits

        return dflash_logits("sglang", draft_dir, base, ids, launch)
    raise Unsupported(f"sglang {VERSION} has no {fmt} speculative algorithm")


def launch_command(fmt: str, base_dir: Path, draft_dir: Path, k: int = 3, **_: Any) -> str:
    """The ``sglang.launch_server`` command line for this export."""
    if fmt == "dflash":
        from nemo_spec.export.engines.dflash import launch_command as dflash_launch

        return dflash_launch("sglang", base_dir, draft_dir, block_size=k)
    algo = "EAGLE3" if fmt == "eagle3" else "EAGLE"
    return (f"python -m sglang.launch_server --model-path {base_dir} \\\n"
            f"  --speculative-algorithm {algo} --speculative-draft-model-path {draft_dir} \\\n"
            f"  --speculative-num-steps {k} --speculative-eagle-topk 4 --speculative-num-draft-tokens 16")
