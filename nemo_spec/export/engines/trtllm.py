"""TensorRT-LLM (PyTorch backend, EAGLE-3 through ``EagleDecodingConfig``) conformance reader.

The wheel is too large to download here; written from the stored public NVIDIA/TensorRT-LLM sources:
  [S] tensorrt_llm/_torch/models/modeling_speculative.py, 2026 main snapshot (Eagle3DecoderLayer,
      Eagle3DraftModel, Eagle3ForCausalLM.load_weights; line numbers not pinned: cited by function)
  [E] tensorrt_llm/_torch/speculative/eagle3.py @ 001e67005b4f (Eagle3SpecMetadata.__post_init__,
      maybe_capture_hidden_states)
  [A] tensorrt_llm/_torch/models/modeling_auto.py @ cf44a1ccee7d L12-43 (EAGLE-3 architecture rewrite)
  [L] tensorrt_llm/llmapi/llm_args.py, EagleDecodingConfig.num_capture_layers / eagle3_layers_to_capture
EAGLE-1 and Medusa drafts of this layout are not claimed (TensorRT-LLM's EAGLE-1/Medusa paths use their own
checkpoint conversion).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import torch

from nemo_spec.export.engines._eagle import eagle3_forward, layer_names
from nemo_spec.export.engines._llama import (
    BaseRun, EngineMismatch, Unsupported, read_config, read_dir, require, scatter_draft_logits,
)

NAME = "trtllm"
VERSION = "main@2026 (sources above)"
FORMATS = ("eagle3",)


def capture_layers(launch: Mapping[str, Any], num_layers: int) -> list:
    """Base layers TensorRT-LLM captures: ``eagle3_layers_to_capture`` of the launch config, sorted as a set, else
    (1, L//2-1, L-4), which needs L > 5 ([E] Eagle3SpecMetadata.__post_init__)."""
    layers = launch.get("eagle3_layers_to_capture")
    if layers is None:
        if num_layers <= 5:
            raise EngineMismatch("trtllm: 'Not enough hidden layers for default EAGLE3 capture' (L <= 5); pass "
                                 "eagle3_layers_to_capture")
        return [1, num_layers // 2 - 1, num_layers - 4]
    return sorted(set(int(i) for i in layers))


def _rename(w: Mapping[str, torch.Tensor], n: int) -> dict:
    # [S] Eagle3ForCausalLM.load_weights: one layer: layers.0.* -> midlayer.*; several: layers.X.* -> midlayer.X.*
    out = {}
    for k, v in w.items():
        k = re.sub(r"^layers\.0\.", "midlayer.", k) if n == 1 else re.sub(r"^layers\.(\d+)\.", r"midlayer.\1.", k)
        out[k] = v
    return out


def eagle3_logits(draft_dir: Path, base: BaseRun, ids: torch.Tensor, launch: Mapping[str, Any]) -> torch.Tensor:
    """Draft logits [b, s-1, V] TensorRT-LLM computes for tokens ids[:, 1:] and features at ids[:, :-1]."""
    conf = read_config(draft_dir)
    if "draft_vocab_size" not in conf:
        raise EngineMismatch("trtllm: no draft_vocab_size in config.json, so the EAGLE-3 architecture is not "
                             "selected ([A] modeling_auto.py L12-43)")
    arch = "EAGLE3" + (conf.get("architectures") or [""])[0].replace("Eagle3", "")
    if arch != "EAGLE3LlamaForCausalLM":
        raise EngineMismatch(f"trtllm: architecture resolves to {arch!r}, not 'EAGLE3LlamaForCausalLM' ([A])")
    n, h, vocab = int(conf["num_hidden_layers"]), int(conf["hidden_size"]), int(conf["vocab_size"])
    vd = int(conf["draft_vocab_size"])
    w = _rename(read_dir(draft_dir, ["model.safetensors"]), n)
    layers = capture_layers(launch, base.num_layers)
    if layers[0] < 0 or layers[-1] >= base.num_layers:
        raise EngineMismatch(f"trtllm: capture layers {layers} outside the base's 0..{base.num_layers - 1}")
    fc_in = h * len(layers)  # [S] Eagle3DraftModel: fc [hidden_size_in * num_capture_layers -> hidden]
    if tuple(w["fc.weight"].shape) != (h, fc_in):
        raise EngineMismatch(f"trtllm: fc.weight {tuple(w['fc.weight'].shape)} != [{h}, {fc_in}] for capture "
                             f"layers {layers} ([L] num_capture_layers = len(eagle3_layers_to_capture))")
    pre = ["midlayer."] if n == 1 else [f"midlayer.{i}." for i in range(n)]
    if n > 1 and any(k.startswith("midlayer.") and not re.match(r"^midlayer\.\d+\.", k) for k in w):
        raise EngineMismatch("trtllm: a multi-layer draft needs layers.N.* names; 'midlayer.*' does not map to "
                             "midlayer.0 ([S] Eagle3ForCausalLM.load_weights)")
    need = ["fc.weight", "norm.weight"]
    for i, p in enumerate(pre):
        # [S] Eagle3DecoderLayer: every layer has hidden_norm; only the first has input_layernorm
        # (next_layer_regular) and a 2h qkv input
        need += layer_names(p, "hidden_norm", input_norm=i == 0)
    if vd != vocab:
        need.append("d2t")  # [S] Eagle3DraftModel: d2t int32 parameter only for a reduced vocabulary
    require(w, need, "trtllm", "parameters the draft builds but the file lacks")
    extra = sorted(k for k in w if k not in need and k not in ("lm_head.weight", "t2d", "embed_tokens.weight"))
    if extra:
        raise EngineMismatch(f"trtllm: no parameter for {extra[:5]} ([S] Eagle3DecoderLayer builds no "
                             f"input_layernorm after the first layer and d2t only for a reduced vocabulary)")
    ren = {"fc.weight": w["fc.weight"], "norm.weight": w["norm.weight"]}
    for i, p in enumerate(pre):
        for k, v in w.items():
            if k.startswith(p):
                ren[f"layers.{i}." + k[len(p):]] = v
    emb = base.embed[ids[:, 1:]]  # [S] load_weights_from_target_model: embed_tokens shared
    feat = torch.cat([base.stream[j + 1] for j in layers], -1)[:, :-1]  # [E] captures each layer's output
    hidden = eagle3_forward(ren, conf, emb, feat, later_norm="hidden_norm")
    head = w.get("lm_head.weight", base.lm_head)  # [S] lm_head from the draft if stored, else the target's
    logits = hidden @ head.T
    base_ids = (torch.arange(vd) + w["d2t"].long()) if vd != vocab else None
    return scatter_draft_logits(logits, base_ids, vocab)


def draft_logits(fmt: str, draft_dir: Path, base: BaseRun, ids: torch.Tensor,
                 launch: Optional[Mapping[str, Any]] = None) -> torch.Tensor:
    """TensorRT-LLM's draft logits for an exported ``fmt`` draft."""
    if fmt != "eagle3":
        raise Unsupported(f"trtllm: only EAGLE-3 drafts of this layout are claimed, not {fmt}")
    return eagle3_logits(draft_dir, base, ids, launch or {})


def launch_command(fmt: str, base_dir: Path, draft_dir: Path, k: int = 3,
                   capture: Optional[Sequence[int]] = None, **_: Any) -> str:
    """Python LLM-API snippet for this export."""
    layers = "{" + ", ".join(str(i) for i in capture) + "}" if capture else "None"
    return ("from tensorrt_llm import LLM\nfrom tensorrt_llm.llmapi import EagleDecodingConfig\n"
            f"spec = EagleDecodingConfig(max_draft_len={k}, speculative_model_dir='{draft_dir}',\n"
            f"                           eagle3_one_model=False, eagle3_layers_to_capture={layers})\n"
            f"llm = LLM(model='{base_dir}', speculative_config=spec)")
