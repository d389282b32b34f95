"""Plain-torch Llama pieces the conformance readers share (no megatron, no nemo_spec model code).

What every engine computes for a Llama layer: RMSNorm, rotate-half RoPE (default rope only), grouped-query
attention with repeated KV heads and a causal mask, SwiGLU MLP. A reader composes these the way its engine does;
:func:`base_forward` runs an exported Hugging Face base (``base/``) and returns the residual stream at every
layer boundary, from which each engine's aux-hidden-state capture rule picks its features.

The base may be any Llama-style family the project exports: q/k/v biases (Qwen2), per-head q/k RMSNorm (Qwen3
``q_norm``/``k_norm``, transformers modeling_qwen3.py ``Qwen3Attention.forward``), sliding-window layers
(``kv_idx > q_idx - sliding_window``, transformers masking_utils.py ``sliding_window_overlay``; which layers slide
follows each model's config: Mistral/Mixtral every layer, Qwen2/Qwen3 ``layer_types`` behind
``use_sliding_window``, Qwen3-MoE every layer behind ``use_sliding_window``) and MoE MLPs (softmax router, top-k,
renormalised for Mixtral and Qwen3-MoE ``norm_topk_prob``; transformers modeling_mixtral.py / modeling_qwen3_moe.py
``*TopKRouter``). It reads only config.json and the tensors, never the project's family declarations.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Mapping, Optional

import torch
import torch.nn.functional as F

from nemo_spec.config import rope_type
from nemo_spec.export.formats import ExportError, load_tensors

Tensors = Dict[str, torch.Tensor]


class EngineMismatch(ExportError):
    """An engine would load this export wrongly or not at all; the message says which rule, field or tensor."""


class Unsupported(EngineMismatch):
    """The engine cannot represent this draft (a limitation of the engine, not of the files)."""


def read_dir(d: Path, names: List[str]) -> Tensors:
    """Tensors of the first existing weight file among ``names`` in ``d`` (floats as float32)."""
    for n in names:
        if (Path(d) / n).is_file():
            sd = load_tensors(Path(d) / n)
            return {k: (v.float() if v.is_floating_point() else v) for k, v in sd.items()}
    raise EngineMismatch(f"{d} has none of the weight files {names}")


def read_config(d: Path) -> dict:
    """config.json of a draft / base directory."""
    p = Path(d) / "config.json"
    if not p.is_file():
        raise EngineMismatch(f"{p} does not exist")
    return json.loads(p.read_text())


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama RMSNorm."""
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@dataclass(frozen=True)
class Rope:
    """A draft config's RoPE: base ``theta``, its type and its ``rope_scaling`` (None: default)."""
    theta: float
    kind: str = "default"
    scaling: Optional[Mapping] = None

    def inv_freq(self, d: int) -> torch.Tensor:
        """Inverse frequencies (float64) as vLLM 0.33.0 computes them (SGLang 0.5.23 the same formulas,
        srt/layers/rotary_embedding/rope_variant.py:557): default ``base ** (-2i/d)``; ``linear`` divides the
        positions by ``factor`` (rotary_embedding/linear_scaling_rope.py:91-92), i.e. the frequencies; ``llama3``
        keeps wavelengths under ``orig/high_freq_factor``, divides those over ``orig/low_freq_factor`` by
        ``factor`` and blends between (rotary_embedding/llama3_rope.py:33-54)."""
        inv = 1.0 / (self.theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        if self.kind == "default":
            return inv
        factor = float(self.scaling["factor"])
        if self.kind == "linear":
            return inv / factor
        low, high = float(self.scaling["low_freq_factor"]), float(self.scaling["high_freq_factor"])
        orig = float(self.scaling["original_max_position_embeddings"])
        wave = 2 * math.pi / inv
        smooth = (orig / wave - low) / (high - low) if low != high else torch.zeros_like(inv)
        return torch.where(wave < orig / high, inv,
                           torch.where(wave > orig / low, inv / factor, (1 - smooth) * inv / factor + smooth * inv))

    def rotate(self, x: torch.Tensor, pos: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Rotate-half RoPE of x [..., n, d] at positions ``pos`` [n] (default 0..n-1)."""
        d, n = x.shape[-1], x.shape[-2]
        pos = torch.arange(n) if pos is None else pos
        ang = pos.to(torch.float64)[:, None] * self.inv_freq(d)
        cos = torch.cat([ang.cos(), ang.cos()], -1).float()
        sin = torch.cat([ang.sin(), ang.sin()], -1).float()
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin


def check_rope(conf: Mapping) -> Rope:
    """The RoPE of a config, where the readers implement its type (default, linear, llama3)."""
    scaling = conf.get("rope_scaling") or None
    kind = rope_type(scaling)
    if kind not in ("default", "linear", "llama3"):
        raise Unsupported(f"the conformance readers implement default, linear and llama3 RoPE; config has "
                          f"rope_scaling={scaling}")
    theta = float(conf.get("rope_theta", (conf.get("rope_parameters") or {}).get("rope_theta", 10000.0)))
    return Rope(theta, kind, None if kind == "default" else scaling)


def attention(x: torch.Tensor, w: Mapping[str, torch.Tensor], p: str, conf: Mapping, head_dim: int,
              qkv_bias: bool = False, o_bias: bool = False, window: Optional[int] = None) -> torch.Tensor:
    """Causal GQA self-attention of ``x`` [b, s, in] with weights under prefix ``p`` (HF names); q/k RMSNorm per
    head when the layer stores ``q_norm``/``k_norm``; keys limited to the last ``window`` positions when given."""
    b, s, _ = x.shape
    nh, ng = int(conf["num_attention_heads"]), int(conf["num_key_value_heads"])

    def proj(name: str, n: int, bias: bool) -> torch.Tensor:
        y = x @ w[f"{p}self_attn.{name}.weight"].T
        if bias:
            y = y + w[f"{p}self_attn.{name}.bias"]
        y = y.view(b, s, n, head_dim)
        norm = f"{p}self_attn.{name[0]}_norm.weight"  # Qwen3: q_norm / k_norm on [.., head_dim] before RoPE
        if name != "v_proj" and norm in w:
            y = rms(y, w[norm], float(conf["rms_norm_eps"]))
        return y.transpose(1, 2)

    rope = check_rope(conf)
    q, k, v = proj("q_proj", nh, qkv_bias), proj("k_proj", ng, qkv_bias), proj("v_proj", ng, qkv_bias)
    q, k = rope.rotate(q), rope.rotate(k)
    k, v = k.repeat_interleave(nh // ng, dim=1), v.repeat_interleave(nh // ng, dim=1)
    att = (q @ k.transpose(-1, -2)) / head_dim ** 0.5
    allowed = torch.ones(s, s, dtype=torch.bool).tril()
    if window is not None:
        i = torch.arange(s)
        allowed &= i[None, :] > i[:, None] - window  # masking_utils.py sliding_window_overlay
    att = att.masked_fill(~allowed, float("-inf")).softmax(-1)
    o = (att @ v).transpose(1, 2).reshape(b, s, nh * head_dim) @ w[f"{p}self_attn.o_proj.weight"].T
    return o + w[f"{p}self_attn.o_proj.bias"] if o_bias else o


def mlp(x: torch.Tensor, w: Mapping[str, torch.Tensor], p: str) -> torch.Tensor:
    """SwiGLU MLP with HF names under ``p``."""
    return (F.silu(x @ w[p + "mlp.gate_proj.weight"].T) * (x @ w[p + "mlp.up_proj.weight"].T)) @ \
        w[p + "mlp.down_proj.weight"].T


def moe(x: torch.Tensor, w: Mapping[str, torch.Tensor], p: str, conf: Mapping) -> Optional[torch.Tensor]:
    """The MoE MLP of a Mixtral / Qwen3-MoE layer under ``p`` (None when the layer's MLP is dense)."""
    if p + "block_sparse_moe.gate.weight" in w:  # Mixtral: w1 gate, w3 up, w2 down; always renormalised
        router, ex, names, renorm = p + "block_sparse_moe.gate.weight", p + "block_sparse_moe.experts.", \
            ("w1", "w3", "w2"), True
    elif p + "mlp.gate.weight" in w:  # Qwen3-MoE: renormalised when norm_topk_prob
        router, ex, names, renorm = p + "mlp.gate.weight", p + "mlp.experts.", ("gate_proj", "up_proj", "down_proj"), \
            bool(conf.get("norm_topk_prob", False))
    else:
        return None
    probs = torch.softmax((x @ w[router].T).float(), dim=-1)
    top, idx = torch.topk(probs, int(conf["num_experts_per_tok"]), dim=-1)
    if renorm:
        top = top / top.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for e in range(w[router].shape[0]):
        g, u, d = (w[f"{ex}{e}.{n}.weight"] for n in names)
        y = (F.silu(x @ g.T) * (x @ u.T)) @ d.T
        out = out + y * (top * (idx == e)).sum(-1, keepdim=True).to(y.dtype)
    return out


def window_layers(conf: Mapping) -> Dict[int, int]:
    """0-based layer -> sliding-window size, from a base config.json as transformers reads it."""
    n, sw = int(conf["num_hidden_layers"]), conf.get("sliding_window")
    mt = conf.get("model_type")
    if mt in ("qwen2", "qwen3", "qwen3_moe") and not conf.get("use_sliding_window", False):
        sw = None  # configuration_qwen2.py / _qwen3.py / _qwen3_moe.py: sliding_window only with use_sliding_window
    if sw is None:
        return {}
    if mt in ("qwen2", "qwen3"):
        types = conf.get("layer_types") or ["sliding_attention" if i >= int(conf.get("max_window_layers", 0))
                                            else "full_attention" for i in range(n)]
        return {i: int(sw) for i, t in enumerate(types) if t == "sliding_attention"}
    return {i: int(sw) for i in range(n)}


def require(w: Mapping[str, torch.Tensor], names: List[str], engine: str, why: str) -> None:
    """Raise EngineMismatch naming the tensors ``engine`` builds parameters for but the file lacks."""
    missing = [n for n in names if n not in w]
    if missing:
        raise EngineMismatch(f"{engine}: {why}: {missing[:6]}")


@dataclass
class BaseRun:
    """The base's forward on fixed ids: residual stream at every layer boundary and the head weights.

    ``stream[j]`` is the input of 0-based layer j (``stream[0]`` = embeddings, ``stream[L]`` = the last layer's
    output before the final norm); ``final`` is the final-normed hidden; ``logits`` the base logits.
    """

    stream: List[torch.Tensor]
    final: torch.Tensor
    logits: torch.Tensor
    embed: torch.Tensor
    lm_head: torch.Tensor
    config: dict

    @property
    def num_layers(self) -> int:
        """Base depth L."""
        return len(self.stream) - 1


def base_forward(base_dir: Path, ids: torch.Tensor, tensors: Optional[Tensors] = None) -> BaseRun:
    """Run the exported HF base in ``base_dir`` on ``ids`` [b, s] (how transformers/vLLM/SGLang compute it)."""
    conf = read_config(base_dir)
    if "rms_norm_eps" not in conf:  # GPT-2: LayerNorm, GELU, learned positions
        raise Unsupported(f"the engine readers run Llama-style bases (RMSNorm, RoPE); this base is "
                          f"{conf.get('architectures') or conf.get('model_type')}, whose run is not modelled here")
    w = tensors if tensors is not None else read_dir(base_dir, ["model.safetensors"])
    eps = float(conf["rms_norm_eps"])
    hd = int(conf.get("head_dim") or conf["hidden_size"] // conf["num_attention_heads"])
    bias = bool(conf.get("attention_bias", False))
    windows = window_layers(conf)
    x = w["model.embed_tokens.weight"][ids]
    stream = [x]
    for i in range(int(conf["num_hidden_layers"])):
        p = f"model.layers.{i}."
        qkv_bias = bias or p + "self_attn.q_proj.bias" in w  # Qwen2: q/k/v biases without attention_bias
        x = x + attention(rms(x, w[p + "input_layernorm.weight"], eps), w, p, conf, hd, qkv_bias=qkv_bias,
                          o_bias=bias, window=windows.get(i))
        h = rms(x, w[p + "post_attention_layernorm.weight"], eps)
        y = moe(h, w, p, conf)
        x = x + (mlp(h, w, p) if y is None else y)
        stream.append(x)
    final = rms(x, w["model.norm.weight"], eps)
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return BaseRun(stream, final, final @ head.T, w["model.embed_tokens.weight"], head, conf)


def scatter_draft_logits(logits: torch.Tensor, base_ids: Optional[torch.Tensor], vocab: int) -> torch.Tensor:
    """Draft-vocab logits [..., Vd] -> base-vocab logits [..., V] (-inf outside the draft vocabulary)."""
    if base_ids is None:
        return logits
    if base_ids.numel() and (int(base_ids.min()) < 0 or int(base_ids.max()) >= vocab):
        raise EngineMismatch(f"draft-to-target ids leave the base vocabulary [0, {vocab})")
    out = logits.new_full(logits.shape[:-1] + (vocab,), float("-inf"))
    out[..., base_ids] = logits
    return out
