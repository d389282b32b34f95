"""Export test helpers: transformed tiny models and *independent* readers of the exported draft formats.

The readers below re-implement, in plain torch and from the published descriptions of the formats, what the
EAGLE reference code / vLLM / SGLang compute from an exported draft directory (Llama attention with rotate-half
RoPE and repeated KV heads, RMSNorm, SwiGLU). They never touch megatron or nemo_spec modules, so agreement with
our ``draft_step`` / ``medusa_logits`` shows the exported tensors *mean* the same thing, not just that an
export/import round trip is self-consistent.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List

import torch
import torch.nn.functional as F

from nemo_spec.config import ModelConfig
from nemo_spec.models import build_gpt
from nemo_spec.speculative import SpeculativeTransform

# EAGLE-1 with 2 layers (layer 0 without input norm, layer 1 with); EAGLE-3 with distinct aux layers and a
# reduced draft vocabulary; Medusa with 3 heads of one residual block (what the reference code can hold).
ALGS: Dict[str, dict] = {
    "eagle3": dict(algorithm="eagle3", num_eagle_layers=1, draft_vocab_size=48, aux_layers=[0, 1, 2]),
    "eagle1": dict(algorithm="eagle1", num_eagle_layers=2),
    "medusa": dict(algorithm="medusa", num_medusa_heads=3, num_medusa_layers=1),
}


def base_config(**kw) -> ModelConfig:
    """Tiny Llama base with GQA (4 heads, 2 groups) and 4 layers, shardable at TP=2."""
    d = dict(vocab_size=96, hidden_size=64, num_layers=4, num_attention_heads=4, num_query_groups=2,
             ffn_hidden_size=128, max_position_embeddings=128, rope_theta=10000.0)
    d.update(kw)
    return ModelConfig(**d)


def make_model(alg: str, seed: int = 0, **alg_kw):
    """Transformed tiny model with randomised draft weights (and a frequency-based EAGLE-3 draft vocabulary)."""
    torch.manual_seed(seed)
    kw = dict(ALGS[alg], **alg_kw)
    model = SpeculativeTransform(**kw)(build_gpt(base_config()))
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for p in model.draft_parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    if alg == "eagle3":
        counts = torch.rand(model.model_config.vocab_size, generator=torch.Generator().manual_seed(seed + 7))
        model.set_draft_vocab(counts, reinit_head=False)
    return model


def our_draft_logits(model, ids: torch.Tensor, hidden_or_features: torch.Tensor) -> torch.Tensor:
    """Our draft's logits for fixed inputs: EAGLE -> draft_step(ids, fuse(features)) [b,s,Vd]; Medusa -> [K,b,s,V]."""
    with torch.no_grad():
        if model.algorithm == "medusa":
            return model.medusa_logits(hidden_or_features)
        return model.draft_step(ids, model.fuse(hidden_or_features))[1]


def feature_width(model) -> int:
    """Width of the features the draft's fc / heads consume."""
    h = model.model_config.hidden_size
    return 3 * h if model.algorithm == "eagle3" else h


# ------------------------------------------------------------------------------------------ format readers
def load_dir_tensors(d: Path, names: List[str]) -> Dict[str, torch.Tensor]:
    """First existing weight file among ``names`` in ``d``, as float32 / index tensors."""
    from safetensors.torch import load_file

    for n in names:
        p = d / n
        if p.is_file():
            sd = load_file(str(p)) if p.suffix == ".safetensors" else torch.load(str(p), weights_only=True)
            return {k: (v.float() if v.is_floating_point() else v) for k, v in sd.items()}
    raise FileNotFoundError(f"none of {names} in {d}")


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = pos.double()[..., None] * inv  # [b, s, d/2]
    cos = torch.cat([ang.cos(), ang.cos()], -1).float()[:, None]
    sin = torch.cat([ang.sin(), ang.sin()], -1).float()[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _attention(x: torch.Tensor, w: Dict[str, torch.Tensor], p: str, conf: dict) -> torch.Tensor:
    b, s, _ = x.shape
    nh, ng = conf["num_attention_heads"], conf["num_key_value_heads"]
    hd = conf.get("head_dim") or conf["hidden_size"] // nh
    q = (x @ w[p + "self_attn.q_proj.weight"].T).view(b, s, nh, hd).transpose(1, 2)
    k = (x @ w[p + "self_attn.k_proj.weight"].T).view(b, s, ng, hd).transpose(1, 2)
    v = (x @ w[p + "self_attn.v_proj.weight"].T).view(b, s, ng, hd).transpose(1, 2)
    pos = torch.arange(s)[None].expand(b, s)
    q, k = _rope(q, pos, conf["rope_theta"]), _rope(k, pos, conf["rope_theta"])
    k = k.repeat_interleave(nh // ng, dim=1)
    v = v.repeat_interleave(nh // ng, dim=1)
    att = (q @ k.transpose(-1, -2)) / hd ** 0.5
    att = att.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
    o = (att @ v).transpose(1, 2).reshape(b, s, nh * hd)
    return o @ w[p + "self_attn.o_proj.weight"].T


def _mlp(x: torch.Tensor, w: Dict[str, torch.Tensor], p: str) -> torch.Tensor:
    g = x @ w[p + "mlp.gate_proj.weight"].T
    u = x @ w[p + "mlp.up_proj.weight"].T
    return (F.silu(g) * u) @ w[p + "mlp.down_proj.weight"].T


def _llama_layer(h: torch.Tensor, w: Dict[str, torch.Tensor], p: str, conf: dict, input_norm: bool) -> torch.Tensor:
    eps = conf["rms_norm_eps"]
    x = _rms(h, w[p + "input_layernorm.weight"], eps) if input_norm else h
    h = h + _attention(x, w, p, conf)
    return h + _mlp(_rms(h, w[p + "post_attention_layernorm.weight"], eps), w, p)


def reference_eagle3(draft_dir: Path, base_embed: torch.Tensor, ids: torch.Tensor, features: torch.Tensor):
    """EAGLE-3 draft logits [b,s,Vd] and base-vocab ids of the draft vocab, computed from the exported files."""
    conf = json.loads((draft_dir / "config.json").read_text())
    w = load_dir_tensors(draft_dir, ["model.safetensors", "pytorch_model.bin"])
    eps = conf["rms_norm_eps"]
    emb = base_embed[ids]
    feat = features @ w["fc.weight"].T
    p = "midlayer." if "midlayer.fc" in w or "midlayer.hidden_norm.weight" in w else "layers.0."
    h = feat + _attention(torch.cat([_rms(emb, w[p + "input_layernorm.weight"], eps),
                                     _rms(feat, w[p + "hidden_norm.weight"], eps)], -1), w, p, conf)
    h = h + _mlp(_rms(h, w[p + "post_attention_layernorm.weight"], eps), w, p)
    for i in range(1, conf["num_hidden_layers"]):
        h = _llama_layer(h, w, f"layers.{i}.", conf, input_norm=True)
    logits = _rms(h, w["norm.weight"], eps) @ w["lm_head.weight"].T
    base_ids = torch.arange(w["lm_head.weight"].shape[0]) + w.get("d2t", 0)
    return logits, base_ids, w


def reference_eagle1(draft_dir: Path, base_lm_head: torch.Tensor, ids: torch.Tensor, hidden: torch.Tensor):
    """EAGLE-1 logits [b,s,V]: the draft's own embed_tokens + fc(+bias) + layers, then the base lm_head."""
    conf = json.loads((draft_dir / "config.json").read_text())
    w = load_dir_tensors(draft_dir, ["pytorch_model.bin"])
    h = torch.cat([w["embed_tokens.weight"][ids], hidden], -1) @ w["fc.weight"].T
    if conf.get("bias", True):
        h = h + w["fc.bias"]
    for i in range(conf["num_hidden_layers"]):
        h = _llama_layer(h, w, f"layers.{i}.", conf, input_norm=i > 0)
    return h @ base_lm_head.T, w


def reference_medusa(draft_dir: Path, hidden: torch.Tensor):
    """Medusa logits [K,b,s,V] from medusa_lm_head.* (reference layout)."""
    conf = json.loads((draft_dir / "config.json").read_text())
    w = load_dir_tensors(draft_dir, ["medusa_lm_head.safetensors"])
    outs = []
    for k in range(conf["medusa_num_heads"]):
        x = hidden
        for j in range(conf["medusa_num_layers"]):
            x = x + F.silu(x @ w[f"{k}.{j}.linear.weight"].T + w[f"{k}.{j}.linear.bias"])
        outs.append(x @ w[f"{k}.{conf['medusa_num_layers']}.weight"].T)
    return torch.stack(outs), w


def make_tokenizer_dir(path: Path, vocab_size: int = 96) -> Path:
    """A small word-level HF tokenizer (vocab_size entries) with a chat template, saved with save_pretrained."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    vocab = {t: i for i, t in enumerate(specials + [f"w{i}" for i in range(vocab_size - len(specials))])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
    fast.save_pretrained(str(path))
    return path
