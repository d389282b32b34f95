"""TensorRT-LLM (PyTorch backend, EAGLE-3 through ``EagleDecodingConfig``) conformance reader.

Written from two stored public snapshots of NVIDIA/TensorRT-LLM (the wheel is too large to download here; the
repository too large to fetch); an export must load the same function in both:
  [S] tensorrt_llm/_torch/models/modeling_speculative.py @ b35ac1b64368 (Eagle3Attention L27-67,
      Eagle3DecoderLayer L70-140, Eagle3DraftModel L143-252, Eagle3ForCausalLM L256-341), cited ``[S] L<n>``.
  [N] the same file @ 00679c66c3e3 (2026), cited by class and function: Eagle3DecoderLayer.__init__ reads
      ``eagle_config.next_layer_regular`` (default True) and builds every layer after the first as a *regular*
      layer (no input_layernorm, hidden_norm over the stream, qkv over hidden_size inputs) unless it is false;
      Eagle3DraftModel.__init__ reads ``eagle_config.norm_before_fc`` / ``eh_proj_before_attn`` and ``fc_norm``;
      Eagle3ForCausalLM.load_weights renames ``layers.0.*`` -> ``midlayer.*`` (one layer) and ``layers.N.*`` ->
      ``midlayer.N.*`` before prefixing ``model.``.
  [I] tensorrt_llm/_torch/speculative/interface.py @ b35ac1b (SpecMetadata.maybe_capture_hidden_states hook).
Cited by function from the nearest stored snapshot, flagged "(unpinned)" where used:
  [E] tensorrt_llm/_torch/speculative/eagle3.py, Eagle3SpecMetadata.__post_init__ (default capture layers,
      sorting) and maybe_capture_hidden_states (saves hidden_states + residual = the layer's output)
  [A] tensorrt_llm/_torch/models/modeling_auto.py (EAGLE-3 architecture rewrite on draft_vocab_size)
  [L] tensorrt_llm/llmapi/llm_args.py, EagleDecodingConfig.num_capture_layers / eagle3_layers_to_capture
      (``speculative_model_dir`` is an alias of ``speculative_model`` there; ``eagle3_one_model`` defaults to True,
      the one-model path; False, the two-model path, is what Mistral bases need: engines/__init__.py)
At [S], load_weights only prefixes ``model.`` ([S] L301-305), so the names are the module names, ``midlayer.*``
for one layer and ``midlayer.{i}.*`` for several ([S] L171-177); it reads no ``eagle_config`` and EVERY draft
layer has input_layernorm, hidden_norm and a 2h-input qkv ([S] L56, L97-107, L119-122). A multi-layer draft
written that way loads at [N] only with ``eagle_config: {"next_layer_regular": false}`` (what the exporter
writes); fc exists only for more than one captured layer ([S] L164-168, L337-338; unchanged at [N]).
EAGLE-1 and Medusa drafts of this layout are not claimed (TensorRT-LLM's EAGLE-1/Medusa paths use their own
checkpoint conversion). DFlash drafts (the z-lab format) are read by engines/dflash.py.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch

from nemo_spec.export.engines._llama import (
    BaseRun, EngineMismatch, Unsupported, attention, mlp, read_config, read_dir, require, rms,
    scatter_draft_logits,
)

NAME = "trtllm"
COMMIT = "b35ac1b64368513d215c57d2ed01d62d910df8da"
NEW_COMMIT = "00679c66c3e38f6d2651ad0a5bef0f94d862e36c"
#: the snapshots an export is read against, in order (each must give the same logits)
SNAPSHOTS = (COMMIT[:12], NEW_COMMIT[:12])
VERSION = (f"NVIDIA/TensorRT-LLM@{COMMIT[:12]} and @{NEW_COMMIT[:12]} (modeling_speculative.py; "
           f"eagle3/modeling_auto/llm_args unpinned)")
FORMATS = ("eagle3", "dflash")
NOT_SERVED = {
    "peagle": ("no P-EAGLE / parallel drafting: Eagle3DraftModel builds no "
               "mask_hidden and drafts one token per forward ([S] L143-252; [N] Eagle3DraftModel); no reader is "
               "claimed"),
}


def capture_layers(launch: Mapping[str, Any], num_layers: int) -> list:
    """Base layers TensorRT-LLM captures: ``eagle3_layers_to_capture`` of the launch config, sorted as a set, else
    (1, L//2-1, L-4), which needs L > 5 ([E] Eagle3SpecMetadata.__post_init__, unpinned)."""
    layers = launch.get("eagle3_layers_to_capture")
    if layers is None:
        if num_layers <= 5:
            raise EngineMismatch("trtllm: 'Not enough hidden layers for default EAGLE3 capture' (L <= 5); pass "
                                 "eagle3_layers_to_capture")
        return [1, num_layers // 2 - 1, num_layers - 4]
    return sorted(set(int(i) for i in layers))


def layer_prefixes(n: int) -> list:
    """Module names of the draft layers under ``model.`` ([S] L171-177, L301-305; [N] Eagle3DraftModel)."""
    return ["midlayer."] if n == 1 else [f"midlayer.{i}." for i in range(n)]


def regular_layers(conf: Mapping[str, Any], n: int, snapshot: str) -> List[bool]:
    """Per draft layer: is it a *regular* layer (hidden_norm only, qkv over hidden_size inputs)?"""
    if snapshot == SNAPSHOTS[0]:
        return [False] * n  # [S] L97-107, L119-122: every layer reads cat(input_layernorm(embeds), hidden_norm(x))
    ec = conf.get("eagle_config") or {}
    if ec.get("eh_proj_before_attn"):
        raise Unsupported("trtllm: eagle_config.eh_proj_before_attn (an enorm/eh_proj before attention, [N] "
                          "Eagle3DraftModel) is not claimed")
    regular = bool(ec.get("next_layer_regular", True))  # [N] Eagle3DecoderLayer.__init__
    return [regular and i > 0 for i in range(n)]


def file_names(w: Mapping[str, torch.Tensor], n: int, snapshot: str) -> Dict[str, torch.Tensor]:
    """The file's tensors under the names the snapshot's load_weights gives them (before ``model.``)."""
    if snapshot == SNAPSHOTS[0]:
        stray = sorted(k for k in w if re.match(r"^layers\.\d+\.", k))
        if stray:
            raise EngineMismatch(f"trtllm@{snapshot}: {stray[:3]} name no module: load_weights only prefixes "
                                 f"'model.' ([S] L301-305) and the layers are model.midlayer / model.midlayer.N "
                                 f"([S] L171-177)")
        return dict(w)
    # [N] Eagle3ForCausalLM.load_weights: layers.0.* -> midlayer.* (one layer), layers.N.* -> midlayer.N.*
    if n == 1:
        return {re.sub(r"^layers\.0\.", "midlayer.", k): v for k, v in w.items()}
    return {re.sub(r"^layers\.(\d+)\.", r"midlayer.\1.", k): v for k, v in w.items()}


def expected_names(n: int, num_capture: int, reduced: bool, attn_bias: bool, fc_bias: bool,
                   regular: Sequence[bool]) -> list:
    """Tensor names the draft builds parameters for (lm_head/embed_tokens handled separately); ``regular``: per
    layer, whether it is a regular layer (:func:`regular_layers`)."""
    need = ["norm.weight"]  # [S] L179-181
    if num_capture > 1:  # [S] L164-168: fc only for more than one captured layer, bias from config 'bias'
        need.append("fc.weight")
        if fc_bias:
            need.append("fc.bias")
    for p, reg in zip(layer_prefixes(n), regular):
        need += [f"{p}self_attn.{x}_proj.weight" for x in "qkvo"]  # [S] L55-66 (qkv fused from q/k/v), L35-48 (o_proj)
        if attn_bias:  # [S] L58 qkv bias = attention_bias; [S] L40 passes it to Attention (o_proj)
            need += [f"{p}self_attn.{x}_proj.bias" for x in "qkvo"]
        need += [f"{p}mlp.{x}_proj.weight" for x in ("gate", "up", "down")]  # [S] L88-96, mlp_bias L91
        # [S] L97-107: every layer has input_layernorm, hidden_norm, post_attention_layernorm; [N] a regular
        # layer builds no input_layernorm
        need += [f"{p}{x}.weight" for x in (("hidden_norm", "post_attention_layernorm") if reg else
                                            ("input_layernorm", "hidden_norm", "post_attention_layernorm"))]
    if reduced:
        need.append("d2t")  # [S] L183-186: int32 d2t parameter only when vocab_size != draft_vocab_size
    return need


def _forward(w: Mapping[str, torch.Tensor], conf: Mapping, emb: torch.Tensor, x: torch.Tensor,
             attn_bias: bool, regular: Sequence[bool]) -> torch.Tensor:
    """Draft hidden before lm_head, as Eagle3DraftModel.forward composes its layers ([S] L208-252)."""
    eps = float(conf["rms_norm_eps"])
    hd = int(conf.get("head_dim") or conf["hidden_size"] // conf["num_attention_heads"])
    for p, reg in zip(layer_prefixes(int(conf["num_hidden_layers"])), regular):
        # [S] L236-237 + L117/L130-131: the layer input is the previous layer's mlp output + residual (the
        # residual stream); [S] L119-122: attention reads cat(input_layernorm(embeds), hidden_norm(stream));
        # [N] Eagle3DecoderLayer.forward: a regular layer reads hidden_norm(stream) alone
        a = rms(x, w[p + "hidden_norm.weight"], eps)
        if not reg:
            a = torch.cat([rms(emb, w[p + "input_layernorm.weight"], eps), a], -1)
        x = x + attention(a, w, p, conf, hd, attn_bias, attn_bias)
        x = x + mlp(rms(x, w[p + "post_attention_layernorm.weight"], eps), w, p)  # [S] L130-132
    return rms(x, w["norm.weight"], eps)  # [S] L250-251: norm(hidden_states, residual)


def eagle3_logits(draft_dir: Path, base: BaseRun, ids: torch.Tensor, launch: Mapping[str, Any],
                  snapshot: Optional[str] = None) -> torch.Tensor:
    """Draft logits [b, s-1, V] TensorRT-LLM computes for tokens ids[:, 1:] and features at ids[:, :-1]; with
    ``snapshot`` None, read against every snapshot (they must agree) and return the first one's logits."""
    if snapshot is None:
        outs = [eagle3_logits(draft_dir, base, ids, launch, s) for s in SNAPSHOTS]
        for s, o in zip(SNAPSHOTS[1:], outs[1:]):
            if not torch.allclose(o, outs[0], atol=1e-4, rtol=1e-4):
                raise EngineMismatch(f"trtllm: the draft computes another function at {s} than at {SNAPSHOTS[0]} "
                                     f"(max logit difference {(o - outs[0]).abs().max():.3g})")
        return outs[0]
    tag = f"trtllm@{snapshot}"
    conf = read_config(draft_dir)
    if "draft_vocab_size" not in conf and snapshot == SNAPSHOTS[0]:
        raise EngineMismatch(f"{tag}: no draft_vocab_size in config.json, so the EAGLE-3 architecture is not "
                             "selected ([A] modeling_auto.py, unpinned) and Eagle3ForCausalLM reads "
                             "pretrained_config.draft_vocab_size ([S] L265-266)")
    arch = "EAGLE3" + (conf.get("architectures") or [""])[0].replace("Eagle3", "")
    if arch != "EAGLE3LlamaForCausalLM":  # [S] L256 registers 'EAGLE3LlamaForCausalLM'; rewrite in [A] (unpinned)
        raise EngineMismatch(f"{tag}: architecture resolves to {arch!r}, not 'EAGLE3LlamaForCausalLM' ([S] L256)")
    n, h, vocab = int(conf["num_hidden_layers"]), int(conf["hidden_size"]), int(conf["vocab_size"])
    vd = int(conf.get("draft_vocab_size") or vocab)  # [N] _ensure_draft_vocab_size: absent -> vocab_size
    reduced = vd != vocab  # [S] L183
    attn_bias, fc_bias = bool(conf.get("attention_bias", False)), bool(conf.get("bias", False))
    h_in = int(conf.get("target_hidden_size", h))  # [S] L159-162
    if h_in != int(base.config["hidden_size"]):
        raise EngineMismatch(f"{tag}: target_hidden_size {h_in} != the base's hidden_size "
                             f"{base.config['hidden_size']} ([S] L159-162)")
    if snapshot != SNAPSHOTS[0] and ((conf.get("eagle_config") or {}).get("norm_before_fc") or conf.get("fc_norm")):
        raise Unsupported(f"{tag}: norm_before_fc / fc_norm drafts ([N] Eagle3DraftModel) are not claimed")
    regular = regular_layers(conf, n, snapshot)
    w = file_names(read_dir(draft_dir, ["model.safetensors"]), n, snapshot)
    layers = capture_layers(launch, base.num_layers)
    if layers[0] < 0 or layers[-1] >= base.num_layers:
        raise EngineMismatch(f"{tag}: capture layers {layers} outside the base's 0..{base.num_layers - 1} (-1, "
                             f"the final-normed output, is not claimed here)")
    if n > 1 and any(k.startswith("midlayer.") and not re.match(r"^midlayer\.\d+\.", k) for k in w):
        raise EngineMismatch(f"{tag}: a multi-layer draft is an nn.ModuleList 'midlayer.N.*' ([S] L171-175); "
                             "'midlayer.*' names no module")
    need = expected_names(n, len(layers), reduced, attn_bias, fc_bias, regular)
    require(w, need, tag, "parameters the draft builds but the file lacks")
    for p, reg in zip(layer_prefixes(n), regular):
        # [S] L55-56: qkv takes 2 * hidden_size inputs in every layer; [N] Eagle3Attention: only in a layer that is
        # not regular (the first one, or all with next_layer_regular false), hidden_size otherwise
        q, want = w[p + "self_attn.q_proj.weight"], (h if reg else 2 * h)
        if q.shape[1] != want:
            why = ("a regular layer: eagle_config.next_layer_regular defaults to true, [N] Eagle3DecoderLayer" if reg
                   else "2*hidden_size, [S] L55-56 / [N] Eagle3Attention")
            raise EngineMismatch(f"{tag}: {p}self_attn.q_proj.weight {tuple(q.shape)} has {q.shape[1]} inputs; "
                                 f"Eagle3Attention's qkv takes {want} there ({why})")
    optional = {"lm_head.weight"} | ({"embed_tokens.weight"} if h_in != h else set())
    extra = sorted(k for k in w if k not in need and k not in optional)
    if extra:
        raise EngineMismatch(f"{tag}: no parameter for {extra[:5]} ([S] L143-206 builds fc only for several "
                             f"captured layers, d2t only for a reduced vocabulary; [N] no input_layernorm in a "
                             f"regular layer)")
    if len(layers) > 1:  # [S] L164-168: fc [hidden_size_in * num_capture_layers -> hidden_size]
        fc_in = h_in * len(layers)
        if tuple(w["fc.weight"].shape) != (h, fc_in):
            raise EngineMismatch(f"{tag}: fc.weight {tuple(w['fc.weight'].shape)} != [{h}, {fc_in}] for capture "
                                 f"layers {layers} ([S] L164-168; [L] num_capture_layers = "
                                 f"len(eagle3_layers_to_capture), unpinned)")
    if h_in != h:  # [S] L188-203: own embedding when the target's width differs, else shared ([S] L206, L320-321)
        require(w, ["embed_tokens.weight"], tag, "target_hidden_size != hidden_size needs the draft's embedding")
        emb = w["embed_tokens.weight"][ids[:, 1:]]
    else:
        emb = base.embed[ids[:, 1:]]
    # [E] maybe_capture_hidden_states (unpinned) saves hidden_states + residual: 0-based layer j's output
    feat = torch.cat([base.stream[j + 1] for j in layers], -1)[:, :-1]
    x = feat @ w["fc.weight"].T if len(layers) > 1 else feat  # [S] L336-338: fc only when width != hidden_size
    if len(layers) > 1 and fc_bias:
        x = x + w["fc.bias"]
    hidden = _forward(w, conf, emb, x, attn_bias, regular)
    if "lm_head.weight" in w:  # [S] L304-307: any lm_head key -> loaded from the draft
        head = w["lm_head.weight"]
        if head.shape[0] != vd:  # [S] L267-270: lm_head has draft_vocab_size rows
            raise EngineMismatch(f"{tag}: lm_head.weight has {head.shape[0]} rows, draft_vocab_size is {vd}")
    elif reduced:
        raise EngineMismatch(f"{tag}: no lm_head.weight, so the target's full-vocabulary head is used ([S] "
                             f"L322-323), which d2t (draft ids) does not index")
    else:
        head = base.lm_head  # [S] L322-323
    logits = hidden @ head.T
    base_ids = (torch.arange(vd) + w["d2t"].long()) if reduced else None
    return scatter_draft_logits(logits, base_ids, vocab)


def draft_logits(fmt: str, draft_dir: Path, base: BaseRun, ids: torch.Tensor,
                 launch: Optional[Mapping[str, Any]] = None) -> torch.Tensor:
    """TensorRT-LLM's draft logits for an exported ``fmt`` draft."""
    if fmt == "dflash":  # modeling_dflash.py / speculative/dflash.py (engines/dflash.py)
        from nemo_spec.export.engines.dflash import dflash_logits

        return dflash_logits("trtllm", draft_dir, base, ids, launch)
    if fmt != "eagle3":
        raise Unsupported(f"trtllm: only EAGLE-3 and DFlash drafts are claimed, not {fmt}")
    return eagle3_logits(draft_dir, base, ids, launch or {})


def launch_command(fmt: str, base_dir: Path, draft_dir: Path, k: int = 3,
                   capture: Optional[Sequence[int]] = None, one_model: bool = True, **_: Any) -> str:
    """Python LLM-API snippet for this export (``one_model=False``: the two-model path, for bases whose
    TensorRT-LLM class holds no draft)."""
    if fmt == "dflash":
        from nemo_spec.export.engines.dflash import launch_command as dflash_launch

        return dflash_launch("trtllm", base_dir, draft_dir, block_size=k)
    layers = "{" + ", ".join(str(i) for i in capture) + "}" if capture else "None"
    two = "" if one_model else ",\n                           eagle3_one_model=False"
    note = "" if one_model else "# this base's TensorRT-LLM class runs EAGLE-3 drafts in the two-model mode only\n"
    return ("from tensorrt_llm import LLM\nfrom tensorrt_llm.llmapi import EagleDecodingConfig\n" + note +
            f"spec = EagleDecodingConfig(max_draft_len={k}, speculative_model_dir='{draft_dir}',\n"
            f"                           eagle3_layers_to_capture={layers}{two})\n"
            f"llm = LLM(model='{base_dir}', speculative_config=spec)")
