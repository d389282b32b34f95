"""Write tiny llama.cpp-style GGUF files from a transformers Llama/Qwen2/Qwen3/Qwen3-MoE model (for the GGUF import
tests).

Tensors are written the way llama.cpp's ``convert_hf_to_gguf.py`` writes them: llama.cpp names (gguf-py
``tensor_mapping.py``), ggml shape order, ``attn_q`` / ``attn_k`` rows permuted for the ``llama`` architecture
(``LlamaModel.permute``), a MoE layer's experts stacked into one [experts, rows, cols] tensor per projection
(``Qwen2MoeModel.modify_tensors``: ``torch.stack`` over the experts), each tensor in the storage type asked for.
Q*_0/Q*_1/Q8_0/BF16 are quantized with ``gguf.quants.quantize``; the K-quants (which the gguf package can only dequantize) get random blocks with small, finite f16 scales.
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

import numpy as np
import torch

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
LLAMA2_CHAT = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + "
               "' [/INST]' }}{% else %}{{ ' ' + m['content'] + eos_token }}{% endif %}{% endfor %}")
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TEXT = ("def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
        "class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, item):\n"
        "        self.items.append(item)\nimport os\nprint('hello world', 12345)\n") * 4

#: byte offsets of the f16 scale fields inside one K-quant block (gguf/quants.py dequantize_blocks)
_K_F16_OFFSETS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def train_bpe(vocab_size: int = 320) -> Tuple[List[str], List[str]]:
    """(tokens in id order, merges) of a small byte-level BPE trained on Python text; specials first, even count."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT], trainer)
    import json

    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    if len(tokens) % 2:
        tokens.append("<|pad|>")
    return tokens, merges


#: extra text the SentencePiece test vocabulary is trained on (accented letters become whole pieces)
SPM_EXTRA = "héllo wörld naïve café — <s> and </s> [INST] hi [/INST]"
#: control tokens of the SentencePiece test vocabulary beyond <s> / </s> (a Llama-2 chat style pair)
SPM_CONTROLS = ("[INST]", "[/INST]")
#: a USER_DEFINED token of the SentencePiece test vocabulary (matched whole, not special)
SPM_USER = "<think>"


def train_spm(vocab_size: int = 200) -> Tuple[List[str], List[float], List[int]]:
    """(tokens, scores, token types) of a small Llama-style SentencePiece BPE vocabulary, laid out like llama.cpp
    writes Llama-2's: ``<unk>`` (UNKNOWN), ``<s>`` / ``</s>`` (CONTROL), ``<0x00>``..``<0xFF>`` (BYTE), then
    ``\u2581``-marked pieces by merge rank (score -rank), then the single characters; even count. Like Llama-2's, it has no
    pieces holding newlines or tabs: those are encoded as byte tokens (``<0x0A>``)."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    tok.train_from_iterator([TEXT, SPM_EXTRA], trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False))
    model = json.loads(tok.to_str())["model"]
    merged = ["".join(m.split(" ") if isinstance(m, str) else m) for m in model["merges"]]
    alphabet = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1]) if t not in set(merged)]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + list(SPM_CONTROLS) + [SPM_USER]
    scores = [0.0] * len(tokens)
    types = [2, 3, 3] + [6] * 256 + [3] * len(SPM_CONTROLS) + [4]  # llama.cpp llama_token_type
    for rank, t in enumerate(merged + alphabet):
        if t not in tokens and not any(c in t for c in "\n\r\t"):
            tokens.append(t)
            scores.append(-float(rank))
            types.append(1)
    if len(tokens) % 2:
        tokens.append("<pad>")
        scores.append(0.0)
        types.append(3)
    return tokens, scores, types


def spm_vocab_size() -> int:
    """Size of :func:`train_spm`'s vocabulary (a tiny model for a ``tokenizer="llama"`` GGUF needs it)."""
    return len(train_spm()[0])


def _k_quant_blocks(shape: Tuple[int, ...], qname: str, rng: np.random.Generator) -> np.ndarray:
    import gguf

    qtype = gguf.GGMLQuantizationType[qname]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    cols = shape[-1]
    assert cols % block == 0, (cols, block)
    n = int(np.prod(shape)) // block
    blocks = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    for off in _K_F16_OFFSETS[qname]:
        scale = rng.uniform(2e-4, 1e-3, size=n).astype(np.float16)
        blocks[:, off:off + 2] = scale.view(np.uint8).reshape(n, 2)
    return blocks.reshape(*shape[:-1], cols // block * size)


def _gguf_tensors(model: torch.nn.Module, arch: str) -> Dict[str, np.ndarray]:
    """llama.cpp name -> float32 array (PyTorch [rows, cols] order) of a transformers Llama/Qwen2/Qwen3/Qwen3-MoE
    model."""
    from nemo_spec.checkpoint.gguf import permute_qk

    cfg = model.config
    sd = {k: v.detach().float() for k, v in model.state_dict().items()}
    out: Dict[str, torch.Tensor] = {"token_embd.weight": sd["model.embed_tokens.weight"],
                                    "output_norm.weight": sd["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["output.weight"] = sd["lm_head.weight"]
    names = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
             "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
             "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
             "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
             "self_attn.v_proj.bias": "attn_v.bias", "mlp.gate_proj.weight": "ffn_gate.weight",
             "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
             # Qwen3 per-head norms and the MoE router (gguf-py tensor_mapping.py ATTN_Q_NORM / ATTN_K_NORM /
             # FFN_GATE_INP)
             "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
             "mlp.gate.weight": "ffn_gate_inp.weight"}
    for i in range(cfg.num_hidden_layers):
        experts = f"model.layers.{i}.mlp.experts."
        if experts + "gate_up_proj" in sd:  # transformers 5: experts fused as [E, 2 * ff, h] (gate rows first)
            gate, up = sd[experts + "gate_up_proj"].chunk(2, dim=1)
            out.update({f"blk.{i}.ffn_gate_exps.weight": gate, f"blk.{i}.ffn_up_exps.weight": up,
                        f"blk.{i}.ffn_down_exps.weight": sd[experts + "down_proj"]})
        elif experts + "0.gate_proj.weight" in sd:  # transformers 4: one module per expert
            for proj in ("gate", "up", "down"):
                out[f"blk.{i}.ffn_{proj}_exps.weight"] = torch.stack(
                    [sd[f"{experts}{e}.{proj}_proj.weight"] for e in range(cfg.num_experts)])
        for ours, theirs in names.items():
            k = f"model.layers.{i}.{ours}"
            if k not in sd:
                continue
            w = sd[k]
            if arch == "llama" and theirs.startswith("attn_q."):
                w = permute_qk(w, cfg.num_attention_heads)
            elif arch == "llama" and theirs.startswith("attn_k."):
                w = permute_qk(w, cfg.num_key_value_heads)
            out[f"blk.{i}.{theirs}"] = w
    return {k: v.numpy() for k, v in out.items()}


def write_gguf(path: Path, model: torch.nn.Module, arch: str = "llama", qtypes: Optional[Dict[str, str]] = None,
               tokenizer: Union[bool, str] = True, pre: str = "gpt-2", seed: int = 0,
               metadata_arch: Optional[str] = None, add_space_prefix: Optional[bool] = None,
               add_bos: Optional[bool] = True, meta_fn: Optional[Any] = None,
               omit: Tuple[str, ...] = ()) -> Dict[str, np.ndarray]:
    """Write ``model`` as a GGUF file; ``qtypes`` maps tensor-name prefixes to storage types (default F32);
    ``tokenizer``: True / "gpt2" (byte-level BPE of :func:`train_bpe`), "llama" (SentencePiece vocabulary of
    :func:`train_spm`, no merges, as llama.cpp writes Llama-2's), or False; returns the float32 source arrays by
    llama.cpp name. ``meta_fn(writer)`` adds metadata of its own after the tokenizer's; ``omit`` leaves out the
    optional ``<arch>.feed_forward_length`` / ``<arch>.expert_feed_forward_length`` keys it names."""
    import gguf

    cfg = model.config
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), metadata_arch or arch)
    w.add_name("tiny-test")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    if "feed_forward_length" not in omit:
        w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_rope_dimension_count(head_dim)
    if getattr(cfg, "head_dim", None):  # TextModel.set_gguf_parameters writes these when config.json has head_dim
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if getattr(cfg, "num_experts", None):  # TextModel / Qwen2MoeModel.set_gguf_parameters
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        if "expert_feed_forward_length" not in omit:
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_vocab_size(cfg.vocab_size)
    if tokenizer == "llama":
        tokens, scores, types = train_spm()
        assert len(tokens) == cfg.vocab_size, (len(tokens), cfg.vocab_size)
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        if "<pad>" in tokens:
            w.add_pad_token_id(tokens.index("<pad>"))
        if add_bos is not None:
            w.add_add_bos_token(add_bos)
        w.add_add_eos_token(False)
        if add_space_prefix is not None:
            w.add_add_space_prefix(add_space_prefix)
        w.add_chat_template(LLAMA2_CHAT)
    elif tokenizer:
        tokens, merges = train_bpe()
        assert len(tokens) == cfg.vocab_size, (len(tokens), cfg.vocab_size)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        types = [gguf.TokenType.CONTROL if t in SPECIALS or t == "<|pad|>" else gguf.TokenType.NORMAL
                 for t in tokens]
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_pad_token_id(0)
        w.add_add_bos_token(False)
        w.add_chat_template(CHATML)
    if meta_fn is not None:
        meta_fn(w)
    arrays = _gguf_tensors(model, arch)
    for name, arr in arrays.items():
        qname = "F32"
        for sub, q in (qtypes or {}).items():
            if name.startswith(sub):
                qname = q
        if arr.ndim == 1 or qname == "F32":
            w.add_tensor(name, arr.astype(np.float32))
        elif qname == "F16":
            w.add_tensor(name, arr.astype(np.float16))
        elif qname in _K_F16_OFFSETS:
            blocks = _k_quant_blocks(arr.shape, qname, rng)
            w.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=gguf.GGMLQuantizationType[qname])
        else:
            qt = gguf.GGMLQuantizationType[qname]
            data = gguf.quants.quantize(arr.astype(np.float32), qt)
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return arrays


def tiny_hf_model(kind: str = "llama", seed: int = 0, **kw) -> torch.nn.Module:
    """A random tiny transformers Llama (GQA), Qwen2 (qkv bias, tied), Qwen3 (q/k norms, head_dim 128 != hidden /
    heads as in the real Qwen3 models, tied) or Qwen3-MoE (4 experts, top 2, renormalised) model with hidden 256
    (fits K-quants)."""
    import transformers

    tokens, _ = train_bpe()
    base = dict(vocab_size=len(tokens), hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1,
                eos_token_id=2, pad_token_id=0, rms_norm_eps=1e-5)
    torch.manual_seed(seed)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**{**base, "tie_word_embeddings": False,
                                          "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, **kw})
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(**{**base, "tie_word_embeddings": True,
                                          "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, **kw})
        model = transformers.Qwen2ForCausalLM(cfg)
    elif kind == "qwen3":
        cfg = transformers.Qwen3Config(**{**base, "tie_word_embeddings": True, "head_dim": 128,
                                          "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, **kw})
        model = transformers.Qwen3ForCausalLM(cfg)
    elif kind == "qwen3_moe":
        # norm_topk_prob: llama.cpp's qwen3moe graph always renormalises (transformers' GGUF loader sets it too);
        # moe_intermediate_size: transformers 5.25's GGUF loader does not read expert_feed_forward_length (ggml.py
        # "qwen3_moe" mapping), so only Qwen3MoeConfig's default, 768 (Qwen3-30B-A3B's), loads there
        cfg = transformers.Qwen3MoeConfig(**{**base, "tie_word_embeddings": False, "head_dim": 64, "num_experts": 4,
                                             "num_experts_per_tok": 2, "moe_intermediate_size": 768,
                                             "norm_topk_prob": True,
                                             "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, **kw})
        model = transformers.Qwen3MoeForCausalLM(cfg)
    else:
        raise ValueError(kind)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.05 * noise)
    return model.eval()
