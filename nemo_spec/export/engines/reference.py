"""Reference-code conformance reader: SafeAILab/EAGLE ``EaModel`` (EAGLE-3 ``cnets.py``, EAGLE-1 ``cnets1.py``)
and FasterDecoding/Medusa ``MedusaModel``; z-lab/dflash ``DFlashDraftModel`` (reader in engines/dflash.py).

Pinned sources (stored public GitHub snapshots):
  SafeAILab/EAGLE @ cb7e0841fe0c (2026-02-19): eagle/model/ea_model.py, cnets.py, cnets1.py, modeling_llama_kv.py
  FasterDecoding/Medusa @ e2a5d20c048a (2024-04-18): medusa/model/medusa_model.py
  z-lab/dflash @ 44947fbf7111 (2026-04-26): dflash/model.py
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

import torch
import torch.nn.functional as F

from nemo_spec.export.engines._eagle import eagle1_forward, eagle3_forward, layer_names
from nemo_spec.export.engines._llama import (
    BaseRun, EngineMismatch, Unsupported, read_config, read_dir, require, scatter_draft_logits,
)

NAME = "reference"
VERSION = "EAGLE@cb7e0841fe0c, Medusa@e2a5d20c048a, dflash@44947fbf7111"
FORMATS = ("eagle3", "eagle1", "medusa", "dflash")
NOT_SERVED = {
    "peagle": ("no reference reader for P-EAGLE: its reference implementation is vllm-project/speculators (a "
               "training library, no generation loop); vLLM is what serves the speculators layout (vllm reader)"),
}
MEDUSA_HEADS_BUILT = 5  # medusa_model.py:143 ("medusa_num_heads = 5 # TODO")


def capture_layers(num_layers: int) -> list:
    """Base layers whose outputs EaModel feeds EAGLE-3, 0-based: it captures the *inputs* of layers 2, L//2, L-3
    (modeling_llama_kv.py:1137-1139), de-duplicated by the ``or`` and in layer order."""
    return sorted({i - 1 for i in (2, num_layers // 2, num_layers - 3) if 0 <= i < num_layers})


#: base architectures EaModel.from_pretrained (ea_model.py) loads with their own KV model class; every other
#: architecture falls through to its KV Mixtral class (modeling_mixtral_kv.py) and is run as a Mixtral
BASE_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MixtralForCausalLM")


#: the KV models that hand EAGLE-3 its three aux states (modeling_llama_kv.py:1138-1139, modeling_qwen3_kv.py:
#: 582-583); the Qwen2 and Mixtral KV models collect hidden states only under output_hidden_states
#: (modeling_qwen2_kv.py:913-914, modeling_mixtral_kv.py:868-869), which utils.py:250-252 never sets
EAGLE3_BASE_ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM")


def base_unsupported(architecture: str, fmt: str = "eagle1") -> Optional[str]:
    """Why EaModel cannot run a ``fmt`` draft on a base of ``architecture`` (None when it can)."""
    if architecture not in BASE_ARCHITECTURES:
        return (f"EaModel.from_pretrained (ea_model.py) loads {architecture} as its KV Mixtral: base architectures "
                f"{list(BASE_ARCHITECTURES)} only")
    if fmt == "eagle3" and architecture not in EAGLE3_BASE_ARCHITECTURES:
        return (f"EaModel's KV {architecture} does not collect the EAGLE-3 aux hidden states (only the Llama and "
                f"Qwen3 KV models do: modeling_llama_kv.py:1138-1139, modeling_qwen3_kv.py:582-583)")
    return None


def draft_rope_conf(conf: Mapping[str, Any]) -> Mapping[str, Any]:
    """The draft config as EaModel's draft rotates: EConfig takes ``rope_scaling`` None or exactly {type: linear |
    dynamic, factor: float > 1} (eagle/model/configs.py:126-145), and a scaled draft rotary is built without the
    config's base, i.e. theta 10000 (cnets.py:225-231, cnets1.py:230-236; LlamaLinearScalingRotaryEmbedding
    base=10000, cnets.py:149)."""
    sc = conf.get("rope_scaling")
    if sc is None:
        return conf
    if (not isinstance(sc, dict) or len(sc) != 2 or sc.get("type") not in ("linear", "dynamic")
            or not isinstance(sc.get("factor"), float) or sc["factor"] <= 1.0):
        raise EngineMismatch(f"reference: EConfig refuses rope_scaling={sc}: it takes exactly {{type: linear|dynamic, "
                             f"factor: float > 1}} (eagle/model/configs.py:126-145)")
    if sc["type"] == "dynamic":
        raise Unsupported("reference: dynamic NTK RoPE is not implemented by this reader")
    return dict(conf, rope_theta=10000.0)


def _check_base(base: BaseRun, fmt: str) -> None:
    arch = (base.config.get("architectures") or ["LlamaForCausalLM"])[0]
    why = base_unsupported(arch, fmt)
    if why:
        raise Unsupported(f"reference: {why}")


def _weights(draft_dir: Path) -> dict:
    # ea_model.py:124-136: pytorch_model.bin first, then model.safetensors
    return read_dir(draft_dir, ["pytorch_model.bin", "model.safetensors"])


def eagle3_logits(draft_dir: Path, base: BaseRun, ids: torch.Tensor, launch: Mapping[str, Any]) -> torch.Tensor:
    """Draft logits [b, s-1, V] EaModel(use_eagle3=True) computes."""
    _check_base(base, "eagle3")
    conf = draft_rope_conf(read_config(draft_dir))
    w = _weights(draft_dir)
    h, nh = int(conf["hidden_size"]), int(conf["num_attention_heads"])
    if int(conf.get("head_dim") or h // nh) * nh != h:
        raise Unsupported("reference: attention uses head_dim = hidden_size / num_attention_heads (cnets.py:194-212)")
    if int(conf.get("num_hidden_layers", 1)) > 1:
        raise Unsupported("reference: EaModel builds one midlayer (cnets.py:530) and loads with strict=False "
                          "(ea_model.py:76): layers.N.* would be dropped silently")
    vocab, vd = int(conf["vocab_size"]), int(conf["draft_vocab_size"])
    layers = capture_layers(base.num_layers)
    if len(layers) != 3:
        raise Unsupported(f"reference: on a {base.num_layers}-layer base EaModel captures {len(layers)} distinct "
                          f"layers (modeling_llama_kv.py:1138) but fc takes 3 (cnets.py:531-534)")
    if tuple(w["fc.weight"].shape) != (h, 3 * h):
        raise EngineMismatch(f"reference: fc.weight {tuple(w['fc.weight'].shape)} != [{h}, {3 * h}] (cnets.py:534)")
    need = ["fc.weight", "norm.weight", "lm_head.weight"] + layer_names("midlayer.", "hidden_norm")
    if vd != vocab:
        need.append("d2t")  # ea_model.py:74-75 deletes d2t/t2d only for a full vocabulary
    # strict=False (ea_model.py:76): a missing tensor keeps its random init
    require(w, need, "reference", "tensors EaModel loads with strict=False (missing ones stay at random init)")
    biased = [k for k in w if k.startswith("midlayer.self_attn.") and k.endswith(".bias") and w[k].abs().max() > 0]
    if biased:
        raise EngineMismatch(f"reference: attention has no bias (cnets.py:209-212); {biased[:3]} are ignored")
    ren = {k.replace("midlayer.", "layers.0."): v for k, v in w.items()}
    # cnets.py:486-519: embed_tokens from the base's index (file's own wins under strict=False if stored)
    emb_table = w.get("embed_tokens.weight", base.embed)
    feat = torch.cat([base.stream[j + 1] for j in layers], -1)[:, :-1]  # cnets.py:638-640 fc over the cat
    hidden = eagle3_forward(ren, dict(conf, num_hidden_layers=1), emb_table[ids[:, 1:]], feat,
                            later_norm="input_layernorm")
    logits = hidden @ w["lm_head.weight"].T  # cnets.py:700: lm_head(norm(hidden))
    base_ids = (torch.arange(vd) + w["d2t"].long()) if vd != vocab else None  # cnets.py:708-713
    return scatter_draft_logits(logits, base_ids, vocab)


def eagle1_logits(draft_dir: Path, base: BaseRun, ids: torch.Tensor, launch: Mapping[str, Any]) -> torch.Tensor:
    """EAGLE-1 logits [b, s-1, V] EaModel(use_eagle3=False) computes (cnets1.py Model, the base lm_head)."""
    _check_base(base, "eagle1")
    conf = draft_rope_conf(read_config(draft_dir))
    w = _weights(draft_dir)
    fc_bias = bool(conf.get("bias", True))  # ea_model.py:49-54: config "bias", default True; cnets1.py:524
    qkv_bias = bool(conf.get("qkv_bias", False))  # cnets1.py:209-216
    n = int(conf["num_hidden_layers"])
    need = ["fc.weight"] + (["fc.bias"] if fc_bias else [])
    for i in range(n):  # cnets1.py:399-400,428: layer 0 has no input_layernorm
        need += layer_names(f"layers.{i}.", None, qkv_bias=qkv_bias, input_norm=i > 0)
    require(w, need, "reference", "tensors EaModel loads with strict=False (missing ones stay at random init)")
    if not fc_bias and "fc.bias" in w and w["fc.bias"].abs().max() > 0:
        raise EngineMismatch("reference: config bias=false builds fc without bias (cnets1.py:524); fc.bias ignored")
    emb_table = w.get("embed_tokens.weight", base.embed)  # cnets1.py:481-519 (+ the file's under strict=False)
    # q/k/v biased by config qkv_bias, o_proj never (cnets1.py:209-217)
    hidden = eagle1_forward(w, conf, emb_table[ids[:, 1:]], base.final[:, :-1], fc_bias=fc_bias, attn_bias=qkv_bias,
                            o_bias=False)
    return hidden @ base.lm_head.T


def medusa_logits(draft_dir: Path, base: BaseRun, ids: torch.Tensor, launch: Mapping[str, Any]) -> torch.Tensor:
    """Medusa logits [K, b, s, V] MedusaModel computes from ``medusa_lm_head.pt`` for the base's final hidden."""
    conf = read_config(draft_dir)
    if not (Path(draft_dir) / "medusa_lm_head.pt").is_file():
        raise EngineMismatch("reference: MedusaModel loads medusa_lm_head.pt only (medusa_model.py:151-156)")
    w = read_dir(draft_dir, ["medusa_lm_head.pt"])
    k_heads, n_layers = int(conf["medusa_num_heads"]), int(conf["medusa_num_layers"])
    if n_layers > 1:
        raise Unsupported("reference: [ResBlock] * medusa_num_layers repeats one block object (medusa_model.py:114)"
                          ", so heads with more than one residual block cannot hold distinct weights")
    if k_heads > MEDUSA_HEADS_BUILT:
        raise Unsupported(f"reference: MedusaModel builds {MEDUSA_HEADS_BUILT} heads (medusa_model.py:143); heads "
                          f"beyond that are dropped by strict=False (medusa_model.py:157)")
    need = [f"{k}.0.linear.{p}" for k in range(k_heads) for p in ("weight", "bias")]
    need += [f"{k}.1.weight" for k in range(k_heads)]
    require(w, need, "reference", "Medusa head tensors (strict=False load, medusa_model.py:157)")
    x0 = base.final
    outs = []
    for k in range(k_heads):  # medusa_model.py:110-118: Sequential(ResBlock, Linear(h, V, bias=False))
        x = x0 + F.silu(x0 @ w[f"{k}.0.linear.weight"].T + w[f"{k}.0.linear.bias"])
        outs.append(x @ w[f"{k}.1.weight"].T)
    return torch.stack(outs)


def draft_logits(fmt: str, draft_dir: Path, base: BaseRun, ids: torch.Tensor,
                 launch: Optional[Mapping[str, Any]] = None) -> torch.Tensor:
    """The reference code's draft logits for an exported ``fmt`` draft."""
    if fmt == "dflash":  # z-lab/dflash model.py @ 44947fb (engines/dflash.py)
        from nemo_spec.export.engines.dflash import dflash_logits

        return dflash_logits("reference", draft_dir, base, ids, launch)
    fn = {"eagle3": eagle3_logits, "eagle1": eagle1_logits, "medusa": medusa_logits}.get(fmt)
    if fn is None:
        raise Unsupported(f"reference: no {fmt} reader")
    return fn(draft_dir, base, ids, launch or {})


def launch_command(fmt: str, base_dir: Path, draft_dir: Path, k: int = 3, **_: Any) -> str:
    """How to load this export with the reference code."""
    if fmt == "dflash":
        from nemo_spec.export.engines.dflash import launch_command as dflash_launch

        return dflash_launch("reference", base_dir, draft_dir, block_size=k)
    if fmt == "medusa":
        return f"python -m medusa.inference.cli --model {draft_dir}"
    return ("from eagle.model.ea_model import EaModel\n"
            f"m = EaModel.from_pretrained(base_model_path='{base_dir}', ea_model_path='{draft_dir}', "
            f"use_eagle3={fmt == 'eagle3'})")
