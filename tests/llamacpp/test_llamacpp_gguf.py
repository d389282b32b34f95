"""GGUF import checked against llama.cpp itself: llama-cpp-python 0.3.16 (llama.cpp built from source in a side
environment, make test-llamacpp) runs the GGUF files the GGUF tests write (llama.cpp's converter layout, see
tests/gguf_utils.py) and files llama.cpp's own quantizer makes from them (``llama_model_quantize``, what
``llama-quantize`` runs: the K-quant mixes users download), and our import must give llama.cpp's logits, its
tokenization (every pre-tokenizer group, SentencePiece with byte fallback and prefix space, special tokens inside the
text, BOS/EOS flags) and its end-of-generation set.

How close "the same logits" can be: F32 files (KV cache forced to f32) agree to float32 summation order. For F16 /
BF16 weights llama.cpp's CPU matmul rounds the activations to that type too, and for quantized weights it quantizes
them (Q8_0 / Q8_K blocks, ``vec_dot_*_q8_*``), so those files agree to that rounding: a few percent of the largest
logit (measured 0.06% F16, 0.6% BF16, 1.6-3.3% Q2_K-Q8_0 on these random tiny models) — a wrong tensor layout or
dequantization is off by the size of the logits themselves. A mixture-of-experts layer turns that rounding into a
different expert now and then (a near tie in the router): a few positions of a quantized Qwen3-MoE file differ by more.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Dict, List

import numpy as np
import pytest
import torch

from nemo_spec.checkpoint import gguf as G
from nemo_spec.checkpoint import load_model
from nemo_spec.models import gpt_forward
from tests.gguf_utils import SPM_EXTRA, TEXT, spm_vocab_size, tiny_hf_model, write_gguf

PYTHON = os.environ.get("NEMO_SPEC_LLAMACPP_PYTHON")
pytestmark = pytest.mark.skipif(not PYTHON, reason="needs llama.cpp: make test-llamacpp (builds llama-cpp-python "
                                                   "0.3.16 from source in .venv-llamacpp, ~8 min once)")

#: files the tests write: name -> (model kind, write_gguf keyword arguments)
FILES: Dict[str, tuple] = {
    "llama-f32": ("llama", {}),
    "qwen2-f16": ("qwen2", {"arch": "qwen2", "pre": "qwen2", "qtypes": {"blk.": "F16"}}),
    "qwen3-f32": ("qwen3", {"arch": "qwen3", "pre": "qwen2"}),
    "qwen3moe-f32": ("qwen3_moe", {"arch": "qwen3moe", "pre": "qwen2"}),
    "spm": ("llama", {"tokenizer": "llama"}),
    "spm-no-prefix": ("llama", {"tokenizer": "llama", "add_space_prefix": False, "add_bos": None}),
    "smollm": ("llama", {"pre": "smollm"}),
    "llama-bpe": ("llama", {"pre": "llama-bpe"}),
    "default-pre": ("llama", {"pre": "default"}),
}
#: files llama.cpp's quantizer writes from one of FILES: name -> (source, LLAMA_FTYPE_* suffix)
QUANTIZED: Dict[str, tuple] = {
    **{f"llama-{q}": ("llama-f32", f"MOSTLY_{q}") for q in ("Q4_K_M", "Q2_K", "Q3_K_M", "Q5_K_M", "Q6_K", "Q8_0",
                                                           "Q4_0", "Q4_1", "Q5_0", "Q5_1", "F16", "BF16")},
    "qwen3-Q4_K_M": ("qwen3-f32", "MOSTLY_Q4_K_M"), "qwen3-Q5_K_M": ("qwen3-f32", "MOSTLY_Q5_K_M"),
    "qwen3moe-Q4_K_M": ("qwen3moe-f32", "MOSTLY_Q4_K_M"), "qwen3moe-Q8_0": ("qwen3moe-f32", "MOSTLY_Q8_0"),
}
BPE_TEXTS = [TEXT[:300], "  two leading spaces and 1234567 digits, x=3.14159;\n\n\tindented\r\n", "héllo wörld naïve café —"
             " ünïcödé 你好 🙂", "<|im_start|>user\nWrite a function.<|im_end|>\n<|im_start|>assistant\n",
             "don't won't they're I'm we'll it's", "a<|endoftext|>b<|im_end|>"]
SPM_TEXTS = [TEXT[:300], SPM_EXTRA, "  leading spaces", "[INST] hi [/INST] héllo</s><s>[INST] again [/INST]",
             "tabs\tand\nnewlines\n\n x", "<think>user defined</think> after"]


@pytest.fixture(scope="module")
def files_and_llamacpp(tmp_path_factory):
    """{name: (hf model, path)}, llama.cpp's result per file."""
    d = tmp_path_factory.mktemp("llamacpp")
    files, manifest = {}, []
    models = {}
    for name, (kind, kw) in FILES.items():
        key = (kind, "spm" if kw.get("tokenizer") == "llama" else "bpe")
        if key not in models:
            models[key] = tiny_hf_model(kind, **({"vocab_size": spm_vocab_size()} if key[1] == "spm" else {}))
        m = models[key]
        path = d / f"{name}.gguf"
        write_gguf(path, m, **kw)
        files[name] = (m, path)
        g = torch.Generator().manual_seed(len(manifest))
        ids = [torch.randint(0, m.config.vocab_size, (n,), generator=g).tolist() for n in (1, 17, 40)]
        texts = SPM_TEXTS if key[1] == "spm" else BPE_TEXTS
        manifest.append({"name": name, "path": str(path), "ids": ids, "texts": texts})
    for name, (src, ftype) in QUANTIZED.items():
        m, src_path = files[src]
        path = d / f"{name}.gguf"
        files[name] = (m, path)
        entry = next(e for e in manifest if e["name"] == src)
        manifest.append({"name": name, "path": str(path), "ids": entry["ids"], "texts": [],
                         "quantize_from": str(src_path), "ftype": ftype})
    (d / "manifest.json").write_text(json.dumps(manifest))
    out = d / "out"
    proc = subprocess.run([PYTHON, str(Path(__file__).with_name("run_llamacpp.py")), str(d / "manifest.json"),
                           str(out)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((out / "result.json").read_text())
    return files, {e["name"]: e for e in manifest}, result


@pytest.mark.parametrize("name", list(FILES) + list(QUANTIZED))
def test_logits_equal_llama_cpp(files_and_llamacpp, name):
    files, manifest, result = files_and_llamacpp
    _, path = files[name]
    types = set(result[name]["types"].values())
    if name in QUANTIZED:  # the quantizer really wrote the type asked for (and not, e.g., F32 for a tiny tensor)
        want = QUANTIZED[name][1].split("_", 1)[1].replace("_M", "")
        assert want in types, (name, types)
    exact = types <= {"F32"}
    tol = 1e-4 if exact else 1e-2 if types <= {"F32", "F16", "BF16"} else 5e-2
    model = load_model(path).eval()
    for ids, npy in zip(manifest[name]["ids"], result[name]["logits"]):
        ref = torch.from_numpy(np.load(npy))
        with torch.no_grad():
            ours = gpt_forward(model, torch.tensor([ids])).logits[0]
        per_position = (ours - ref).abs().max(-1).values / ref.abs().max()
        ok = (per_position < tol).float().mean().item()
        # a quantized MoE file: llama.cpp's activation rounding picks another expert at a few positions
        assert ok >= (0.8 if "moe" in name and not exact else 1.0), (name, len(ids), per_position.tolist())
        if exact:
            assert torch.equal(ours.argmax(-1), ref.argmax(-1)), name


def _ours_tokens(path: Path, texts: List[str], tmp: Path) -> List[List[int]]:
    from nemo_spec.data.chat import load_tokenizer

    tok = load_tokenizer(G.write_tokenizer_dir(path, tmp / path.stem))
    return [tok(t)["input_ids"] for t in texts]


@pytest.mark.parametrize("name", ["llama-f32", "qwen2-f16", "spm", "spm-no-prefix", "smollm", "llama-bpe",
                                  "default-pre"])
def test_tokenization_equals_llama_cpp(files_and_llamacpp, name, tmp_path):
    files, manifest, result = files_and_llamacpp
    texts = manifest[name]["texts"]
    ours = _ours_tokens(files[name][1], texts, tmp_path)
    for text, a, b in zip(texts, ours, result[name]["tokens"]):
        assert a == b, (name, text, a, b)


@pytest.mark.parametrize("name", ["llama-f32", "spm", "qwen3-f32"])
def test_end_of_generation_ids_equal_llama_cpp(files_and_llamacpp, name):
    files, _, result = files_and_llamacpp
    path = files[name][1]
    meta = G.read_metadata(G.open_gguf(path))
    tokens = meta["tokenizer.ggml.tokens"]
    assert G.end_of_generation_ids(meta, tokens, len(tokens), str(path)) == result[name]["eog"]
