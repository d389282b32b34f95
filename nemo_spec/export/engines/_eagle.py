"""The EAGLE-1 / EAGLE-3 draft computations the engines share; each engine's reader decides names, features,
which norm layers >= 1 use, biases and the vocabulary map, then calls these."""
from __future__ import annotations

from typing import Mapping, Optional

import torch

from nemo_spec.export.engines._llama import attention, mlp, rms


def eagle3_forward(w: Mapping[str, torch.Tensor], conf: Mapping, emb: torch.Tensor, feat: torch.Tensor,
                   later_norm: str, qkv_bias: bool = False, o_bias: bool = False,
                   fc_bias: bool = False, norm_before_fc: bool = False,
                   norm_before_residual: bool = False) -> torch.Tensor:
    """EAGLE-3 draft hidden (pre lm_head) from weights named ``layers.{i}.*``/``fc``/``norm``.

    Layer 0 attends over cat(input_layernorm(emb), hidden_norm(fc(feat))) with fc(feat) as residual; layers >= 1
    are Llama layers whose input norm is ``later_norm`` ('input_layernorm' in vLLM, 'hidden_norm' in SGLang);
    TensorRT-LLM's layers are all Eagle3 layers (engines.trtllm); the last residual goes through ``norm``.
    vLLM's speculators options: ``norm_before_fc`` normalises the features with ``input_norm`` before fc
    (llama_eagle3.py:223-231, 405), ``norm_before_residual`` makes hidden_norm(fc(feat)) the residual (:101-120).
    """
    eps = float(conf["rms_norm_eps"])
    hd = int(conf.get("head_dim") or conf["hidden_size"] // conf["num_attention_heads"])
    if norm_before_fc:
        feat = rms(feat, w["input_norm.weight"], eps)
    x = feat @ w["fc.weight"].T
    if fc_bias:
        x = x + w["fc.bias"]
    p = "layers.0."
    normed = rms(x, w[p + "hidden_norm.weight"], eps)
    a = torch.cat([rms(emb, w[p + "input_layernorm.weight"], eps), normed], -1)
    h = (normed if norm_before_residual else x) + attention(a, w, p, conf, hd, qkv_bias, o_bias)
    h = h + mlp(rms(h, w[p + "post_attention_layernorm.weight"], eps), w, p)
    for i in range(1, int(conf["num_hidden_layers"])):
        p = f"layers.{i}."
        h = h + attention(rms(h, w[f"{p}{later_norm}.weight"], eps), w, p, conf, hd, qkv_bias, o_bias)
        h = h + mlp(rms(h, w[p + "post_attention_layernorm.weight"], eps), w, p)
    return rms(h, w["norm.weight"], eps)


def eagle1_forward(w: Mapping[str, torch.Tensor], conf: Mapping, emb: torch.Tensor, hidden: torch.Tensor,
                   fc_bias: bool, attn_bias: bool, embed: Optional[torch.Tensor] = None,
                   o_bias: Optional[bool] = None) -> torch.Tensor:
    """EAGLE-1 draft hidden: fc(cat(emb, hidden)) then Llama layers, layer 0 without input norm, no final norm.
    ``attn_bias``: q/k/v biases; ``o_bias``: o_proj bias (default: the same)."""
    eps = float(conf["rms_norm_eps"])
    hd = int(conf.get("head_dim") or conf["hidden_size"] // conf["num_attention_heads"])
    h = torch.cat([emb, hidden], -1) @ w["fc.weight"].T
    if fc_bias:
        h = h + w["fc.bias"]
    for i in range(int(conf["num_hidden_layers"])):
        p = f"layers.{i}."
        x = h if i == 0 else rms(h, w[p + "input_layernorm.weight"], eps)
        h = h + attention(x, w, p, conf, hd, attn_bias, attn_bias if o_bias is None else o_bias)
        h = h + mlp(rms(h, w[p + "post_attention_layernorm.weight"], eps), w, p)
    return h


def layer_names(prefix: str, later: Optional[str], qkv_bias: bool = False, o_bias: bool = False,
                input_norm: bool = True) -> list:
    """Tensor names an engine builds parameters for in one draft layer."""
    names = [f"{prefix}self_attn.{n}_proj.weight" for n in "qkvo"]
    names += [f"{prefix}mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
    names.append(f"{prefix}post_attention_layernorm.weight")
    if qkv_bias:
        names += [f"{prefix}self_attn.{n}_proj.bias" for n in "qkv"]
    if o_bias:
        names.append(f"{prefix}self_attn.o_proj.bias")
    if input_norm:
        names.append(f"{prefix}input_layernorm.weight")
    if later:
        names.append(f"{prefix}{later}.weight")
    return names
