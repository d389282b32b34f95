"""Run llama.cpp itself (llama-cpp-python 0.3.16, built from source in the side environment) on GGUF files the
project's tests wrote: its logits for given token ids, its tokenization of given texts and its end-of-generation
token set. Reads a JSON manifest, writes a JSON result (logits as .npy files next to it); imports nothing of
nemo_spec, torch or transformers.

    python run_llamacpp.py MANIFEST.json OUT_DIR

manifest: [{"name": str, "path": str, "ids": [[int, ...], ...], "texts": [str, ...],
             "quantize_from": str (optional), "ftype": str (with quantize_from)}, ...]
    an entry with ``quantize_from`` first has llama.cpp's own quantizer (``llama_model_quantize``, what
    ``llama-quantize`` runs) write ``path`` from that file as ``LLAMA_FTYPE_<ftype>`` (e.g. MOSTLY_Q4_K_M)
result (OUT_DIR/result.json): {name: {"logits": [npy path per ids row], "tokens": [[int, ...] per text],
                                       "eog": [ids llama_vocab_is_eog says end generation], "n_vocab": int}}
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import llama_cpp

GGML_TYPE_F32 = 0  # ggml.h enum ggml_type: the KV cache in f32, so F32 files compare without f16 cache rounding


def quantize(src: str, dst: str, ftype: str) -> None:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_{ftype}")
    params.nthread = 1
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src} -> {dst}, {ftype}) returned {rc}")


def run(entry: dict, out: Path) -> dict:
    if entry.get("quantize_from"):
        quantize(entry["quantize_from"], entry["path"], entry["ftype"])
    llm = llama_cpp.Llama(model_path=entry["path"], n_ctx=128, n_batch=128, n_ubatch=128, logits_all=True,
                          n_threads=1, type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32, verbose=False)
    n_vocab = llm.n_vocab()
    logits = []
    for i, ids in enumerate(entry["ids"]):
        llm.reset()
        llm.eval(ids)
        f = out / f"{entry['name']}-{i}.npy"
        np.save(f, np.array(llm.scores[: len(ids), :], dtype=np.float32))
        logits.append(str(f))
    # add_bos=True is llama_tokenize's add_special: BOS / EOS as the file's add_bos_token / add_eos_token say;
    # special=True: special-token texts are matched as tokens (parse_special), as a chat template's output needs
    tokens = [llm.tokenize(t.encode("utf-8"), add_bos=True, special=True) for t in entry["texts"]]
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    eog = [i for i in range(n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, i)]
    return {"logits": logits, "tokens": tokens, "eog": eog, "n_vocab": n_vocab, "types": tensor_types(entry["path"])}


def tensor_types(path: str) -> dict:
    """{tensor name: ggml type name} of a GGUF file (what the quantizer chose for each tensor)."""
    import gguf

    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


def main() -> None:
    manifest, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    result = {e["name"]: run(e, out) for e in manifest}
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
