"""GGUF (llama.cpp) files: import into our megatron-core GPTModel, read with the ``gguf`` package (not transformers).

A GGUF file holds the model config (``<arch>.*`` metadata), the tokenizer (``tokenizer.ggml.*``: vocabulary,
merges, token types, special ids, ``tokenizer.chat_template``) and the tensors under llama.cpp's names,
each in its own storage type. Import:

- tensors are dequantized with ``gguf.quants.dequantize`` (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
  Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) to float32, then cast to the requested dtype;
- llama.cpp names (``blk.N.attn_q.weight``, ``token_embd.weight`` ...) map to the Hugging Face Llama / Qwen2 /
  Qwen3 / Qwen3-MoE names, and the Hugging Face -> megatron layout mapping of :mod:`nemo_spec.checkpoint.hf` does
  the rest; a Qwen3-MoE layer's experts, stacked by llama.cpp's converter into one [experts, rows, cols] tensor per
  projection (``ffn_{gate,up,down}_exps``), are split back into one tensor per expert;
- for ``llama`` files, llama.cpp's converter permuted the rows of ``attn_q`` / ``attn_k`` from the rotate-half
  RoPE layout to its interleaved one (``convert_hf_to_gguf.py`` ``LlamaModel.permute``); that is undone here.
  Qwen2 / Qwen3 / Qwen3-MoE files use llama.cpp's NEOX RoPE and are stored unpermuted;
- the ``gpt2``-model (byte-level BPE) and ``llama``-model (SentencePiece BPE with byte fallback: Llama-2,
  Mistral, TinyLlama) tokenizers are rebuilt with ``tokenizers`` as transformers builds them from the same file,
  and written as a Hugging Face tokenizer directory (``tokenizer.json``, ``tokenizer_config.json`` with the
  file's chat template and add_bos/add_eos flags).

Tensor parallelism: :func:`load_gguf` builds the model for the current parallel state and loads this rank's
shard, like :func:`nemo_spec.checkpoint.hf.load_hf`.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from nemo_spec import parallel
from nemo_spec.checkpoint.megatron import CheckpointError
from nemo_spec.config import ConfigError, ModelConfig
from nemo_spec.fsutil import default_modes

log = logging.getLogger(__name__)

PathLike = Union[str, os.PathLike]
GGUF_MAGIC = b"GGUF"
#: GGUF ``general.architecture`` -> Hugging Face architecture it is imported as
SUPPORTED_ARCHITECTURES: Dict[str, str] = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                           "qwen3": "Qwen3ForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM"}
#: GGUF architecture -> Hugging Face ``model_type`` where the two names differ
_MODEL_TYPES: Dict[str, str] = {"qwen3moe": "qwen3_moe"}
#: architectures whose layers are mixtures of experts (llama.cpp ``moe_mandatory``: every layer routed, no shared
#: expert for qwen3moe)
_MOE_ARCHITECTURES = ("qwen3moe",)
#: architectures with per-head q/k RMSNorm weights (``attn_q_norm`` / ``attn_k_norm``)
_QK_NORM_ARCHITECTURES = ("qwen3", "qwen3moe")
#: storage types dequantized on import (names of ``gguf.GGMLQuantizationType``)
SUPPORTED_TYPES: Tuple[str, ...] = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                                    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
#: token types of ``tokenizer.ggml.token_type`` (llama.cpp ``llama_token_type``)
TOKEN_CONTROL, TOKEN_USER_DEFINED = 3, 4


#: what a user whose GGUF tokenizer cannot be rebuilt does instead
TOKENIZER_HINT = 'pass a Hugging Face tokenizer directory instead (convert_hf.py import MODEL.gguf CKPT --tokenizer_dir DIR; generate.py / benchmark.py --tokenizer DIR)'


class GGUFError(CheckpointError, ValueError):
    """A GGUF file is unreadable, not a GGUF file, or uses an unsupported architecture / tensor type (names it)."""


def _gguf_module() -> Any:
    try:
        import gguf
    except ImportError as e:
        raise GGUFError("reading GGUF files needs the 'gguf' package: pip install gguf==0.19.0 "
                        "(or pip install -e .[gguf])") from e
    return gguf


def is_gguf_file(path: PathLike) -> bool:
    """True if ``path`` is a regular file that starts with the GGUF magic bytes."""
    p = Path(path).expanduser()
    if not p.is_file():
        return False
    try:
        with open(p, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def check_gguf_file(path: PathLike) -> Path:
    """Return ``path`` if it is a readable GGUF file; raise GGUFError naming the file and what is wrong."""
    p = Path(path).expanduser()
    if not p.exists():
        raise GGUFError(f"GGUF file {p} does not exist")
    if not p.is_file():
        raise GGUFError(f"{p} is not a file (pass the .gguf file itself)")
    try:
        with open(p, "rb") as f:
            head = f.read(4)
    except OSError as e:
        raise GGUFError(f"{p}: cannot read ({e})") from e
    if head != GGUF_MAGIC:
        raise GGUFError(f"{p} is not a GGUF file: it starts with {head!r}, a GGUF file starts with {GGUF_MAGIC!r}")
    return p


def open_gguf(path: PathLike) -> Any:
    """A ``gguf.GGUFReader`` (memory-mapped) for ``path``; raise GGUFError when the file is not valid GGUF."""
    p = check_gguf_file(path)
    gguf = _gguf_module()
    try:
        return gguf.GGUFReader(str(p), "r")
    except Exception as e:  # noqa: BLE001 - the reader raises ValueError/struct.error/... on corrupt files
        raise GGUFError(f"{p}: not a valid GGUF file ({type(e).__name__}: {e})") from e


# --------------------------------------------------------------------------------------------------------------
# metadata -> Hugging Face config dict -> ModelConfig
# --------------------------------------------------------------------------------------------------------------

def read_metadata(reader: Any, skip: Sequence[str] = ()) -> Dict[str, Any]:
    """Every metadata key of the file with its Python value (strings decoded, arrays as lists)."""
    out: Dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in skip:
            continue
        try:
            out[key] = field.contents()
        except Exception as e:  # noqa: BLE001
            raise GGUFError(f"{reader.data.filename if hasattr(reader.data, 'filename') else 'GGUF file'}: "
                            f"cannot decode metadata key {key!r} ({e})") from e
    return out


def _arch(meta: Mapping[str, Any], source: str) -> str:
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise GGUFError(f"{source}: metadata key 'general.architecture' is missing")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(f"{source}: general.architecture={arch!r} is not supported; supported GGUF architectures: "
                        f"{sorted(SUPPORTED_ARCHITECTURES)}")
    return arch


def _uniform(value: Any, key: str, source: str) -> Any:
    """A per-layer array that must hold a single value (e.g. head_count_kv) -> that value."""
    if isinstance(value, (list, tuple)):
        if not value or any(v != value[0] for v in value):
            raise GGUFError(f"{source}: metadata {key}={list(value)[:8]} varies per layer, which is not supported")
        return value[0]
    return value


def gguf_hf_config(meta: Mapping[str, Any], tensor_names: Sequence[str], source: str) -> Dict[str, Any]:
    """The Hugging Face config.json dict equivalent to a GGUF file's metadata (llama / qwen2 / qwen3 / qwen3moe)."""
    arch = _arch(meta, source)

    def get(key: str, default: Any = None, required: bool = False) -> Any:
        full = f"{arch}.{key}"
        if full in meta:
            return _uniform(meta[full], full, source)
        if required:
            raise GGUFError(f"{source}: required metadata key {full!r} is missing")
        return default

    def count(key: str, default: Any = None, required: bool = False) -> Optional[int]:
        """The key's whole number >= 1; ``default`` (None: None) when it is absent and not required."""
        v = get(key, default, required)
        if v is None:
            return None
        try:
            n = int(v)
        except (TypeError, ValueError):
            raise GGUFError(f"{source}: metadata {arch}.{key}={v!r} is not an integer") from None
        if n < 1 or n != v:
            raise GGUFError(f"{source}: metadata {arch}.{key}={v!r} must be a whole number >= 1")
        return n

    names = set(tensor_names)
    if "rope_freqs.weight" in names:
        raise GGUFError(f"{source}: tensor 'rope_freqs.weight' (per-frequency RoPE factors, Llama-3.1 style "
                        f"scaling) is not supported")
    moe = arch in _MOE_ARCHITECTURES
    if not moe and any("_exps." in n or ".ffn_gate_inp." in n for n in names):
        # llama.cpp writes Mixtral as general.architecture=llama with expert tensors (ffn_*_exps, ffn_gate_inp)
        raise GGUFError(f"{source}: this {arch!r} file holds mixture-of-experts tensors (ffn_*_exps, ffn_gate_inp, as "
                        f"llama.cpp writes Mixtral); MoE GGUF files are supported for qwen3moe only (convert the "
                        f"Hugging Face checkpoint instead)")
    shared = sorted(n for n in names if "_shexp" in n)
    if shared:
        raise GGUFError(f"{source}: tensor {shared[0]!r} is a shared expert, which {arch!r} does not have")
    hidden = count("embedding_length", required=True)
    heads = count("attention.head_count", required=True)
    key_length = get("attention.key_length")
    head_dim = count("attention.key_length") if key_length else hidden // heads
    if hidden % heads and not key_length:
        raise GGUFError(f"{source}: {arch}.embedding_length={hidden} is not a multiple of "
                        f"{arch}.attention.head_count={heads} (and no {arch}.attention.key_length gives the head dim)")
    if count("attention.value_length", head_dim) != head_dim:
        raise GGUFError(f"{source}: {arch}.attention.value_length != key_length is not supported")
    rot = get("rope.dimension_count")
    if rot is not None and int(rot) != head_dim:
        raise GGUFError(f"{source}: {arch}.rope.dimension_count={rot} != head dim {head_dim} (partial rotary "
                        f"embeddings) is not supported")
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = get("vocab_size")
    if vocab is None:
        if "token_embd.weight" not in names and not tokens:
            raise GGUFError(f"{source}: cannot tell the vocabulary size ({arch}.vocab_size and tokenizer.ggml.tokens "
                            f"are missing)")
        vocab = len(tokens) if tokens else None
    cfg: Dict[str, Any] = {
        "architectures": [SUPPORTED_ARCHITECTURES[arch]], "model_type": _MODEL_TYPES.get(arch, arch),
        "hidden_size": hidden, "num_hidden_layers": count("block_count", required=True),
        "num_attention_heads": heads, "num_key_value_heads": count("attention.head_count_kv", heads),
        "head_dim": head_dim, "intermediate_size": count("feed_forward_length", required=not moe),
        "max_position_embeddings": count("context_length", 2048),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(get("rope.freq_base", 10000.0)), "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in names, "vocab_size": int(vocab) if vocab is not None else None,
    }
    scaling = get("rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise GGUFError(f"{source}: {arch}.rope.scaling.type={scaling!r} is not supported (none, linear)")
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(get("rope.scaling.factor", required=True))}
    if arch == "llama":
        cfg["attention_bias"] = "blk.0.attn_q.bias" in names
        cfg["mlp_bias"] = "blk.0.ffn_up.bias" in names
    if arch in _QK_NORM_ARCHITECTURES:
        cfg["attention_bias"] = "blk.0.attn_q.bias" in names
    if moe:
        # llama.cpp's qwen3moe graph renormalises the top-k weights unconditionally (build_moe_ffn's norm_w = true;
        # transformers' GGUF loader sets norm_topk_prob=True for the same reason, integrations/ggml.py "qwen3_moe")
        cfg.update(num_experts=count("expert_count", required=True),
                   num_experts_per_tok=count("expert_used_count", required=True),
                   moe_intermediate_size=count("expert_feed_forward_length"),  # None: from the tensors
                   norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
        if cfg["intermediate_size"] is None:
            cfg.pop("intermediate_size")
    for ours, theirs in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                         ("pad_token_id", "padding_token_id")):
        v = _token_id(meta, theirs, vocab, source)
        if v is not None:
            cfg[ours] = v
    eog = end_of_generation_ids(meta, tokens or [], vocab, source)
    eos = cfg.get("eos_token_id")
    ids = ([eos] if eos is not None else []) + [i for i in eog if i != eos]
    if len(ids) > 1:  # config.json style: every id that ends generation, eos first
        cfg["eos_token_id"] = ids
    return cfg


def _token_id(meta: Mapping[str, Any], name: str, vocab: Optional[int], source: str) -> Optional[int]:
    """``tokenizer.ggml.<name>`` as a token id of the vocabulary (None when absent); GGUFError names the key."""
    v = meta.get(f"tokenizer.ggml.{name}")
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise GGUFError(f"{source}: metadata 'tokenizer.ggml.{name}'={v!r} is not a token id")
    if v < 0 or (vocab is not None and v >= int(vocab)):
        raise GGUFError(f"{source}: metadata 'tokenizer.ggml.{name}'={v} is outside the vocabulary [0, {vocab})")
    return int(v)


#: token texts llama.cpp treats as ending generation wherever they are in the vocabulary (llama-cpp-python 0.3.16
#: vendor/llama.cpp/src/llama-vocab.cpp:2312-2325)
EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>", "<|endoftext|>",
             "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>")


def end_of_generation_ids(meta: Mapping[str, Any], tokens: Sequence[str], vocab: Optional[int],
                          source: str) -> List[int]:
    """The ids llama.cpp stops generation at (``llama_vocab::is_eog``, llama-vocab.cpp:2297-2398): the FIM pad /
    repeat / separator ids, every token whose text is in :data:`EOG_TEXTS`, and the eos, eot and eom ids; with
    ``<|return|>`` and ``<|call|>`` among them, ``<|end|>`` is not one (gpt-oss's harmony format)."""
    named = (_token_id(meta, f"{name}_token_id", vocab, source)
             for name in ("fim_pad", "fim_rep", "fim_sep", "eos", "eot", "eom"))
    ids = [i for i in named if i is not None] + [i for i, t in enumerate(tokens) if t in EOG_TEXTS]
    texts = {tokens[i] for i in ids if i < len(tokens)}
    if {"<|return|>", "<|call|>", "<|end|>"} <= texts:
        ids = [i for i in ids if i >= len(tokens) or tokens[i] != "<|end|>"]
    return sorted(set(ids))


def _model_config(hf_cfg: Dict[str, Any], source: str) -> ModelConfig:
    from nemo_spec.checkpoint import hf

    try:
        return hf.hf_to_model_config(hf_cfg, source)
    except (ConfigError, ValueError) as e:
        raise GGUFError(f"{source}: {e}") from e


def read_gguf_config(path: PathLike) -> Tuple[ModelConfig, Dict[str, Any]]:
    """(ModelConfig, equivalent HF config dict) of a GGUF file, from its metadata only."""
    reader = open_gguf(path)
    source = str(Path(path))
    meta = read_metadata(reader, skip=("tokenizer.ggml.merges", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"))
    hf_cfg = gguf_hf_config(meta, [t.name for t in reader.tensors], source)
    if hf_cfg["vocab_size"] is None:
        emb = next(t for t in reader.tensors if t.name == "token_embd.weight")
        hf_cfg["vocab_size"] = int(emb.shape[1])
    if hf_cfg.get("moe_intermediate_size", 0) is None:  # no expert_feed_forward_length: the experts' own shape says
        gate = next((t for t in reader.tensors if t.name == "blk.0.ffn_gate_exps.weight"), None)
        if gate is None:
            raise GGUFError(f"{source}: cannot tell the experts' feed-forward size (no "
                            f"{meta['general.architecture']}.expert_feed_forward_length, no blk.0.ffn_gate_exps)")
        hf_cfg["moe_intermediate_size"] = int(gate.shape[1])  # ggml order: [n_embd, n_ff_exp, n_expert]
    return _model_config(hf_cfg, source), hf_cfg


# --------------------------------------------------------------------------------------------------------------
# tensors
# --------------------------------------------------------------------------------------------------------------

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias", "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight", "ffn_gate.bias": "mlp.gate_proj.bias",
    "ffn_up.bias": "mlp.up_proj.bias", "ffn_down.bias": "mlp.down_proj.bias",
    # Qwen3 / Qwen3-MoE (gguf-py 0.19.0 tensor_mapping.py ATTN_Q_NORM / ATTN_K_NORM / FFN_GATE_INP)
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
}
#: stacked expert tensors [n_expert, rows, cols] -> the Hugging Face per-expert projection they hold (llama.cpp
#: convert_hf_to_gguf.py Qwen2MoeModel.modify_tensors: ``torch.stack`` of ``mlp.experts.{e}.{w}_proj`` over e)
_EXPERT_NAMES = {"ffn_gate_exps.weight": "gate_proj", "ffn_up_exps.weight": "up_proj",
                 "ffn_down_exps.weight": "down_proj"}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
#: llama.cpp tensors that carry nothing the model needs (precomputed RoPE tables)
_IGNORED = ("attn_rot_embd",)


def hf_name(gguf_name: str, source: str = "GGUF file") -> Optional[str]:
    """The Hugging Face Llama/Qwen2/Qwen3 name of a llama.cpp tensor name (None for tensors that are skipped). A
    stacked expert tensor gives the name pattern of its experts, ``model.layers.N.mlp.experts.{e}.gate_proj.weight``
    (split by :func:`load_gguf_state_dict`)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
        if parts[2] in _LAYER_NAMES:
            return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
        if parts[2] in _EXPERT_NAMES:
            return f"model.layers.{parts[1]}.mlp.experts.{{e}}.{_EXPERT_NAMES[parts[2]]}.weight"
        if any(parts[2].startswith(x) for x in _IGNORED):
            return None
    raise GGUFError(f"{source}: tensor {gguf_name!r} is not a known llama.cpp tensor of a Llama/Qwen2/Qwen3 model")


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs -> rotate-half halves) for ``n_head`` heads."""
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise GGUFError(f"Q/K tensor with {rows} rows cannot hold {n_head} heads of even size")
    rest = w.shape[1:]
    return w.reshape(n_head, rows // n_head // 2, 2, *rest).transpose(1, 2).reshape(rows, *rest).contiguous()


def permute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's Q/K row permutation (the inverse of :func:`unpermute_qk`; used to write test files)."""
    rows = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(n_head, 2, rows // n_head // 2, *rest).transpose(1, 2).reshape(rows, *rest).contiguous()


def dequantize(tensor: Any, dtype: torch.dtype = torch.float32, source: str = "GGUF file") -> torch.Tensor:
    """One ``gguf.ReaderTensor`` as a torch tensor of ``dtype`` in PyTorch [rows, cols] order."""
    gguf = _gguf_module()
    qtype = gguf.GGMLQuantizationType(int(tensor.tensor_type))
    if qtype.name not in SUPPORTED_TYPES:
        raise GGUFError(f"{source}: tensor {tensor.name!r} has storage type {qtype.name}, which is not supported "
                        f"(supported: {', '.join(SUPPORTED_TYPES)})")
    shape = tuple(int(x) for x in reversed(list(tensor.shape)))  # ggml lists ne0 (the contiguous dim) first
    try:
        arr = gguf.quants.dequantize(tensor.data, qtype)
    except Exception as e:  # noqa: BLE001
        raise GGUFError(f"{source}: cannot dequantize tensor {tensor.name!r} ({qtype.name}): {e}") from e
    arr = np.array(arr, dtype=np.float32, copy=True).reshape(shape)  # own the memory: the file is memory-mapped
    return torch.from_numpy(arr).to(dtype)


def load_gguf_state_dict(path: PathLike, hf_cfg: Optional[Dict[str, Any]] = None, dtype: torch.dtype = torch.float32,
                         reader: Any = None) -> Dict[str, torch.Tensor]:
    """A GGUF file's tensors dequantized to ``dtype`` under Hugging Face names (Q/K un-permuted for llama, stacked
    experts split into one tensor per expert)."""
    from tqdm import tqdm

    source = str(Path(path))
    reader = reader if reader is not None else open_gguf(path)
    if hf_cfg is None:
        _, hf_cfg = read_gguf_config(path)
    permuted = hf_cfg["model_type"] == "llama"
    heads, kv_heads = hf_cfg["num_attention_heads"], hf_cfg["num_key_value_heads"]
    names = [t.name for t in reader.tensors]
    dup = sorted({n for n in names if names.count(n) > 1}) if len(set(names)) != len(names) else []
    if dup:
        raise GGUFError(f"{source}: duplicate tensor names {dup[:4]}")
    out: Dict[str, torch.Tensor] = {}
    for t in tqdm(reader.tensors, desc=f"dequantizing {Path(path).name}", disable=None, leave=False):
        name = hf_name(t.name, source)
        if name is None:
            continue
        w = dequantize(t, torch.float32, source)
        if "{e}" in name:
            if w.dim() != 3:
                raise GGUFError(f"{source}: expert tensor {t.name!r} has shape {tuple(w.shape)}, not [experts, rows, "
                                f"cols]")
            out.update({name.format(e=e): w[e].to(dtype) for e in range(w.shape[0])})
            continue
        if permuted and ".attn_q." in t.name:
            w = unpermute_qk(w, heads)
        elif permuted and ".attn_k." in t.name:
            w = unpermute_qk(w, kv_heads)
        out[name] = w.to(dtype)
    return out


def load_gguf(path: PathLike, params_dtype: torch.dtype = torch.float32,
              device: Optional[torch.device] = None) -> torch.nn.Module:
    """Build our megatron-core GPTModel (for the current TP size) from a GGUF file and load its weights."""
    from nemo_spec.checkpoint import hf
    from nemo_spec.checkpoint import tp as tp_mod
    from nemo_spec.models import build_gpt

    p = check_gguf_file(path)
    source = str(p)
    reader = open_gguf(p)
    cfg, hf_cfg = read_gguf_config(p)
    tp_size = parallel.tp_size()
    try:
        cfg.check_tensor_parallel(tp_size)
        if cfg.vocab_size % tp_size:
            raise ConfigError(f"tensor parallel size {tp_size} does not divide vocab_size={cfg.vocab_size}")
    except ConfigError as e:
        raise GGUFError(f"{source}: {e}") from e
    hf_sd = load_gguf_state_dict(p, hf_cfg, torch.float32, reader=reader)
    try:
        hf.check_hf_shapes({k: tuple(v.shape) for k, v in hf_sd.items()}, cfg, hf_cfg["model_type"], source)
    except ValueError as e:
        raise GGUFError(str(e)) from e
    full = {k: v.to(params_dtype) for k, v in hf.megatron_state_dict_from_hf(hf_sd, cfg).items()}
    del hf_sd
    model = build_gpt(cfg, params_dtype=params_dtype, device=torch.device("cpu"))
    tp_mod.load_full_state_dict(model, full, gated=cfg.activation == "swiglu")
    if device is None:
        from nemo_spec._cpu import default_device

        device = default_device()
    model = model.to(device)
    log.info("loaded GGUF %s (%s, %d layers, hidden %d, vocab %d) at TP=%d", p, hf_cfg["architectures"][0],
             cfg.num_layers, cfg.hidden_size, cfg.vocab_size, tp_size)
    return model


# --------------------------------------------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------------------------------------------

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DIGITS_THEN_GPT2 = (r"\p{N}", _GPT2_SPLIT)
#: llama.cpp's LLAMA3 pre-type names (llama-vocab.cpp:2174-2185)
_LLAMA3_NAMES = "llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano"


def _group(names: str, value: Any) -> Dict[str, Any]:
    return {n: value for n in names.split()}


#: ``tokenizer.ggml.pre`` -> split regexes applied in order, as llama.cpp splits them (src/llama-vocab.cpp @
#: ggml-org/llama.cpp 0c1e57098: the pre-type names :2168-2310, their regexes in llm_tokenizer_bpe :284-390). A name
#: not listed is refused: splitting it like GPT-2 gave deepseek-coder / falcon / qwen35 files other token ids.
PRE_TOKENIZER_SPLITS: Dict[str, Tuple[str, ...]] = {
    # llama.cpp's DEFAULT (also what a file without tokenizer.ggml.pre gets, with a warning, :2156-2167): punctuation
    # runs, then GPT-2's split, then digit runs, then three-digit groups (llm_tokenizer_bpe default case, :561-568)
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]"),
    **_group("gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum modern-bert mpt olmo jais "
             "trillion granite-docling exaone4", (_GPT2_SPLIT,)),  # LLAMA_VOCAB_PRE_TYPE_GPT2 and :372-378
    **_group("smollm starcoder refact command-r codeshell exaone minerva-7b mellum2", _DIGITS_THEN_GPT2),  # :362-370
    **_group(f"{_LLAMA3_NAMES} smaug-bpe dbrx", (_LLAMA3_SPLIT,)),  # DBRX / SMAUG :2276-2281: LLAMA3's regex, :284-306
    **_group("qwen2 deepseek-r1-qwen kormo f2llmv2 stablelm2 hunyuan solar-open megrez", (_QWEN2_SPLIT,)),  # :383-390
}
#: pre-types whose BPE looks a whole pre-token up in the vocabulary before merging (llama-vocab.cpp :2184
#: ``ignore_merges = true`` for LLAMA3, used at :633-634; Meta's Llama-3 tokenizer.json sets ``ignore_merges``)
IGNORE_MERGES = frozenset(_LLAMA3_NAMES.split())


def _tokenizer_metadata(reader: Any) -> Dict[str, Any]:
    return {k: v for k, v in read_metadata(reader).items()
            if k.startswith("tokenizer.") or k in ("general.architecture", "general.name")
            or k.endswith(".context_length")}


#: ``tokenizer.ggml.model`` values :func:`build_tokenizer` rebuilds
SUPPORTED_TOKENIZERS: Tuple[str, ...] = ("gpt2", "llama")
#: architectures whose ``llama`` (SentencePiece) vocabulary transformers builds differently (Gemma's respelled
#: spaces and file-order merges, Phi-3's normalizer: transformers 5.24.0 gguf_tokenizer_mapping.py:294-299)
_SPM_OTHER_BUILDERS = ("gemma", "gemma2", "gemma3", "phi3")


def build_tokenizer(meta: Mapping[str, Any], source: str = "GGUF file") -> Any:
    """A ``tokenizers.Tokenizer`` for a GGUF vocabulary from its metadata: ``gpt2`` (byte-level BPE) or ``llama``
    (SentencePiece BPE with byte fallback)."""
    kind = meta.get("tokenizer.ggml.model")
    if kind == "llama":
        return build_sentencepiece_tokenizer(meta, source)
    if kind != "gpt2":
        raise GGUFError(f"{source}: tokenizer.ggml.model={kind!r} is not supported (supported: 'gpt2', byte-level "
                        f"BPE; 'llama', SentencePiece BPE); {TOKENIZER_HINT}")
    return _build_gpt2_tokenizer(meta, source)


def _build_gpt2_tokenizer(meta: Mapping[str, Any], source: str) -> Any:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    tokens: List[str] = list(meta.get("tokenizer.ggml.tokens") or [])
    merges_raw: List[str] = list(meta.get("tokenizer.ggml.merges") or [])
    if not tokens:
        raise GGUFError(f"{source}: metadata 'tokenizer.ggml.tokens' is missing or empty")
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise GGUFError(f"{source}: tokenizer.ggml.tokens holds duplicate tokens")
    merges: List[Tuple[str, str]] = []
    for m in merges_raw:
        pair = m.split(" ")
        if len(pair) != 2:
            raise GGUFError(f"{source}: tokenizer.ggml.merges entry {m!r} is not two space-separated tokens")
        merges.append((pair[0], pair[1]))
    pre = meta.get("tokenizer.ggml.pre") or "default"
    splits = PRE_TOKENIZER_SPLITS.get(pre)
    if splits is None:
        raise GGUFError(f"{source}: tokenizer.ggml.pre={pre!r} (how llama.cpp splits text before BPE) is not one "
                        f"nemo_spec rebuilds; {TOKENIZER_HINT}")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                               ignore_merges=pre in IGNORE_MERGES))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    types = list(meta.get("tokenizer.ggml.token_type") or [])
    special = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == TOKEN_CONTROL]
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == TOKEN_USER_DEFINED]
    if special:
        tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)
    # BOS / EOS around the text as the flags say (llama.cpp appends EOS too: llama-cpp-python 0.3.16
    # vendor/llama.cpp/src/llama-vocab.cpp:2129-2139, 2853-2856; transformers passes add_eos_token on)
    bos, eos = _added_specials(meta, tokens, source)
    tok.post_processor = (_bos_eos_template(bos, eos, vocab, second_type=0) if bos or eos
                          else processors.ByteLevel(trim_offsets=False))
    if tok.get_vocab_size() != len(tokens):
        raise GGUFError(f"{source}: rebuilt tokenizer has {tok.get_vocab_size()} tokens, the file lists {len(tokens)}")
    return tok


def sentencepiece_merges(tokens: Sequence[str], scores: Sequence[float]) -> List[Tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies: every split of a piece into two pieces, best score first."""
    # transformers 5.24.0 tokenization_utils_base.py:3780-3801 generate_merges(vocab, vocab_scores), as called by
    # integrations/gguf/gguf_tokenizer_mapping.py:180-189 get_merges when the file has no tokenizer.ggml.merges.
    # (4.57.6 integrations/ggml.py:351-367 GGUFTokenizerSkeleton sorts the splits of one piece by their scores,
    # descending, and the merges by score only; the orders differ only among equal-score ties.)
    vocab = {t: i for i, t in enumerate(tokens)}
    by_score = dict(zip(tokens, scores))  # later duplicates win, as dict(zip(...)) does there
    merges: List[Tuple[str, str, float]] = []
    for piece, score in by_score.items():
        local = [(piece[:k], piece[k:], score) for k in range(1, len(piece))
                 if piece[:k] in vocab and piece[k:] in vocab]
        local.sort(key=lambda x: (vocab[x[0]], vocab[x[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _bos_eos_flags(meta: Mapping[str, Any]) -> Tuple[bool, bool]:
    """(add_bos_token, add_eos_token) as transformers reads them: absent, add_eos_token is False
    (tokenization_utils_tokenizers.py:465) and add_bos_token is True for a sentencepiece (``llama``-model) file
    (transformers 5.24.0 gguf_tokenizer_mapping.py:92-94; llama.cpp's default), False for byte-level BPE."""
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    if add_bos is None:
        add_bos = meta.get("tokenizer.ggml.model") == "llama"
    return bool(add_bos), bool(meta.get("tokenizer.ggml.add_eos_token", False))


def _token_text(meta: Mapping[str, Any], tokens: Sequence[str], key: str, source: str) -> Optional[str]:
    """The token ``tokenizer.ggml.<key>`` names (None when absent; GGUFError as :func:`_token_id`)."""
    i = _token_id(meta, key, len(tokens), source)
    return None if i is None else tokens[i]


def _added_specials(meta: Mapping[str, Any], tokens: Sequence[str], source: str) -> Tuple[Optional[str], ...]:
    """(BOS, EOS) the tokenizer puts around a text: each token when its flag is on and the file names it."""
    return tuple(_token_text(meta, tokens, f"{name}_token_id", source) if add else None
                 for name, add in zip(("bos", "eos"), _bos_eos_flags(meta)))


def _bos_eos_template(bos: Optional[str], eos: Optional[str], vocab: Mapping[str, int], second_type: int) -> Any:
    """A post-processor putting ``bos`` / ``eos`` (either may be None) around each sequence; the second sequence of a
    pair takes type id ``second_type``."""
    from tokenizers import processors

    def seq(x: str, t: int) -> str:
        return " ".join(([f"{bos}:{t}"] if bos else []) + [f"{x}:{t}"] + ([f"{eos}:{t}"] if eos else []))

    return processors.TemplateProcessing(single=seq("$A", 0), pair=f"{seq('$A', 0)} {seq('$B', second_type)}",
                                         special_tokens=[(t, vocab[t]) for t in dict.fromkeys((bos, eos)) if t])


def build_sentencepiece_tokenizer(meta: Mapping[str, Any], source: str = "GGUF file") -> Any:
    """A ``tokenizers.Tokenizer`` for a GGUF ``llama``-model (SentencePiece BPE) vocabulary that tokenizes as llama.cpp
    and the model's original SentencePiece tokenizer do (Llama-2, Mistral, TinyLlama ...)."""
    # llama.cpp src/llama-vocab.cpp @ 0c1e57098 (llama_vocab::impl::tokenize, LLAMA_VOCAB_TYPE_SPM, :3433-3468): the
    # special and user-defined tokens are cut out of the text first (tokenizer_st_partition), and every remaining
    # fragment that follows one of them -- or starts the text -- gets a " " in front when add_space_prefix (default
    # true for SPM vocabularies, :2430-2435, then tokenizer.ggml.add_space_prefix, :2457), spaces become U+2581
    # (llama_escape_whitespace) and the fragment is BPE-merged by piece score with byte fallback. That is the
    # SentencePiece library's add_dummy_prefix per fragment, and the normalizer Prepend(U+2581) + Replace(" ",
    # U+2581) of the original Llama-2 / Mistral tokenizer.json (and of transformers 4.57's GGUF loader). transformers
    # 5.x's GGUF loader (integrations/gguf/gguf_tokenizer_mapping.py -> LlamaTokenizer, Metaspace prepend_scheme
    # "first") drops one U+2581 on text that starts with spaces and on every fragment after a special token, so
    # Llama-2 / Mistral chat prompts got other ids than the model was trained on (a review against llama.cpp's own
    # converter and the original tokenizers). Decoding drops the one leading space the prefix added (:3806,
    # remove_space = add_space_prefix).
    # The merges: the file's, else derived from the scores (sentencepiece_merges); bos/eos/unk/pad and CONTROL (3)
    # tokens become special tokens, USER_DEFINED (4) ones plain added tokens (both cut out before normalisation).
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    arch = meta.get("general.architecture")
    if arch in _SPM_OTHER_BUILDERS:
        raise GGUFError(f"{source}: a 'llama' (SentencePiece) tokenizer of architecture {arch!r} is built "
                        f"differently by transformers and is not supported; {TOKENIZER_HINT}")
    tokens: List[str] = list(meta.get("tokenizer.ggml.tokens") or [])
    if not tokens:
        raise GGUFError(f"{source}: metadata 'tokenizer.ggml.tokens' is missing or empty")
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise GGUFError(f"{source}: tokenizer.ggml.tokens holds duplicate tokens")
    if meta.get("tokenizer.ggml.merges"):
        merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]  # get_merges, :182-183
        bad = next((m for m in merges if len(m) != 2), None)
        if bad is not None:
            raise GGUFError(f"{source}: tokenizer.ggml.merges entry {' '.join(bad)!r} is not two space-separated "
                            f"tokens")
    else:
        scores = meta.get("tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            raise GGUFError(f"{source}: a 'llama' tokenizer without tokenizer.ggml.merges needs tokenizer.ggml.scores "
                            f"with one score per token ({len(tokens)}), got "
                            f"{'none' if scores is None else len(scores)}")
        merges = sentencepiece_merges(tokens, [float(x) for x in scores])
    prefix = meta.get("tokenizer.ggml.add_space_prefix") is not False
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None))
    replace = normalizers.Replace(" ", "\u2581")
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), replace]) if prefix else replace
    tok.pre_tokenizer = None
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
                                    + ([decoders.Strip(content=" ", left=1)] if prefix else []))
    types = list(meta.get("tokenizer.ggml.token_type") or [])

    named = [_token_text(meta, tokens, k, source)
             for k in ("unknown_token_id", "bos_token_id", "eos_token_id", "padding_token_id")]
    special_ids = sorted({i for i, ty in enumerate(types) if ty == TOKEN_CONTROL}
                         | {vocab[t] for t in named if t is not None})
    if special_ids:
        tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in special_ids])
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == TOKEN_USER_DEFINED]
    if user:
        tok.add_tokens(user)
    tok.post_processor = _bos_eos_template(*_added_specials(meta, tokens, source), vocab, second_type=1)
    if tok.get_vocab_size() != len(tokens):
        raise GGUFError(f"{source}: rebuilt tokenizer has {tok.get_vocab_size()} tokens, the file lists {len(tokens)}")
    return tok


def write_tokenizer_dir(path: PathLike, out_dir: PathLike) -> Path:
    """Write a GGUF file's tokenizer + chat template as a Hugging Face tokenizer directory (atomically)."""
    src = check_gguf_file(path)
    out = Path(out_dir).expanduser()
    meta = _tokenizer_metadata(open_gguf(src))
    tok = build_tokenizer(meta, str(src))
    tokens = meta["tokenizer.ggml.tokens"]

    specials = {f"{name}_token": _token_text(meta, tokens, f"{key}_token_id", str(src))
                for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding"))}
    # the added tokens of tokenizer.json, by id (for sentencepiece files the named specials are among them)
    added = {str(t["id"]): {k: t[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")}
             for t in json.loads(tok.to_str())["added_tokens"]}
    arch = meta.get("general.architecture")
    add_bos, add_eos = _bos_eos_flags(meta)
    config: Dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast", "added_tokens_decoder": added,
        # what transformers 4.x reads; 5.x drops these next to a tokenizer.json, whose post-processor adds BOS/EOS
        # (tokenization_utils_base.py:1818-1820)
        "add_bos_token": add_bos, "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False, "model_max_length": int(meta.get(f"{arch}.context_length", 2048)),
        **specials,
    }
    template = meta.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        tok.save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                                   encoding="utf-8")
        (tmp / "special_tokens_map.json").write_text(
            json.dumps({k: v for k, v in specials.items() if v is not None}, indent=2, ensure_ascii=False) + "\n",
            encoding="utf-8")
        if template:
            (tmp / "chat_template.jinja").write_text(template, encoding="utf-8")
        if out.exists():
            shutil.rmtree(out)
        default_modes(tmp)  # mkdtemp made it 0o700
        try:
            os.replace(tmp, out)
        except OSError:
            if not (out / "tokenizer.json").is_file():  # not another process finishing the same directory first
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("wrote the tokenizer of %s (%d tokens, pre-tokenizer %r%s) to %s", src.name, len(tokens),
             meta.get("tokenizer.ggml.pre"), ", chat template" if template else "", out)
    return out


#: the rebuilt tokenizers' version in the cache key: bumped whenever build_tokenizer changes what it builds, so that
#: tokenizers cached by an older nemo_spec are rebuilt (v2: llama.cpp's SentencePiece prefix, pre-type table)
TOKENIZER_BUILD = "v2"


def gguf_tokenizer_dir(path: PathLike, cache_dir: Optional[PathLike] = None) -> Path:
    """A Hugging Face tokenizer directory for a GGUF file, built once into the cache and reused."""
    from nemo_spec.base.build import resolve_cache_dir

    p = check_gguf_file(path).resolve()
    st = p.stat()
    key = hashlib.sha256(f"{p}|{st.st_size}|{st.st_mtime_ns}|{TOKENIZER_BUILD}".encode()).hexdigest()[:16]
    out = resolve_cache_dir(cache_dir) / "gguf_tokenizers" / f"{p.stem}-{key}"
    if (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file():
        return out
    return write_tokenizer_dir(p, out)


# --------------------------------------------------------------------------------------------------------------
# conversion (scripts/convert_hf.py import)
# --------------------------------------------------------------------------------------------------------------

def convert_gguf_to_checkpoint(src: PathLike, out_dir: PathLike, params_dtype: torch.dtype = torch.float32,
                               overwrite: bool = False, tokenizer_dir: Optional[PathLike] = None) -> Path:
    """Import a GGUF file (current TP size) and save it as our torch_dist checkpoint with its tokenizer (all ranks):
    the one rebuilt from the file's metadata, or ``tokenizer_dir`` (a Hugging Face tokenizer directory)."""
    from nemo_spec.checkpoint import save_checkpoint

    from nemo_spec.checkpoint.hf import _refuse_nonempty

    p = check_gguf_file(src).resolve()
    _refuse_nonempty(Path(out_dir), overwrite)
    if tokenizer_dir is not None and not Path(tokenizer_dir).is_dir():
        raise GGUFError(f"tokenizer_dir {tokenizer_dir} is not a directory (a Hugging Face tokenizer directory)")
    model = load_gguf(p, params_dtype=params_dtype)
    with tempfile.TemporaryDirectory(prefix="nemo_spec_gguf_tok-") as tmp:
        tok: Optional[Path] = Path(tokenizer_dir) if tokenizer_dir is not None else None
        try:
            tok = tok or write_tokenizer_dir(p, Path(tmp) / "tokenizer")
        except GGUFError as e:
            log.warning("%s; the checkpoint is saved without a tokenizer", e)
        return save_checkpoint(model, out_dir, tokenizer_dir=tok, overwrite=overwrite,
                               extra={"converted_from_gguf": str(p)})
