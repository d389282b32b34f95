"""Whether llama.cpp serves an export, and how: the ``llamacpp`` entry of export_info.json and the export README.

llama.cpp (checked: the source in the llama-cpp-python 0.3.36 sdist, commit 0c1e570) has no layout of its own for
our drafts: its converter ``convert_hf_to_gguf.py`` reads the vLLM-layout EAGLE-3 directory and the z-lab DFlash
directory, with ``--target-model-dir`` = the exported base. ``make test-llamacpp`` runs both in llama.cpp itself
(tests/llamacpp/test_llamacpp_spec.py). Its limits, from its source (file:line in that commit):

EAGLE-3: detected only with ``draft_vocab_size`` and one layer (conversion/llama.py:50; src/models/eagle3.cpp:156
asserts one layer); exactly three aux layers (eagle3.cpp:9-11); an aux id equal to the base's layer count is read
from the "nextn" buffer (common/speculative.cpp:544, 630), which Llama and Qwen3 graphs never fill; no bias tensors
are created (eagle3.cpp:79-99); the draft's pre-norm state is always fed back (speculative.cpp:797, 832-833), so a
``norm_output`` draft differs. DFlash: the block is ``--spec-draft-n-max`` + 1 slots (speculative.cpp:1014-1021,
default n_max 3), so the trained block needs n_max = block_size - 1; its conversion writes no ``rope_freqs``
(conversion/qwen.py DFlashModel), so Llama 3.1+ RoPE scaling is not applied there. Qwen2 and GPT-2 bases hand
neither draft their layers' inputs: src/models/qwen2.cpp and gpt2.cpp set no layer-input tensor, and llama.cpp aborts
(src/llama-graph.cpp:1384 "layer input tensor is null").
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

from nemo_spec.config import ModelConfig, rope_type

VERSION = "llama.cpp 0c1e570 (llama-cpp-python 0.3.36)"
_NO_LAYER_INPUTS = ("Qwen2ForCausalLM", "GPT2LMHeadModel")


def llamacpp_entry(fmt: str, files: Mapping[str, Any], entries: Mapping[str, Any], cfg: ModelConfig,
                   architecture: Optional[str]) -> Optional[Dict[str, Any]]:
    """{"dir", "unsupported" (reason or None), "notes", "spec_type", "n_max"} for an EAGLE-3 / DFlash export, or
    None for other formats. ``files``: sub-directory -> (tensors, config.json dict) as written."""
    if fmt not in ("eagle3", "dflash"):
        return None
    entry: Dict[str, Any] = {"dir": None, "unsupported": None, "notes": [], "spec_type": f"draft-{fmt}"}
    src = entries.get("vllm") if fmt == "eagle3" else next(iter(entries.values()))  # DFlash: one format for all
    if src is None:
        entry["unsupported"] = ("llama.cpp's converter reads the vLLM layout of an EAGLE-3 draft: export with "
                                "--target vllm or all")
        return entry
    entry["dir"] = src["dir"]
    conf = files[src["dir"]][1]
    why: List[str] = []
    if architecture in _NO_LAYER_INPUTS:
        why.append(f"its {architecture} graph hands a draft no layer inputs: llama.cpp aborts "
                   f"(src/llama-graph.cpp:1384)")
    if fmt == "eagle3":
        ids = list(conf.get("eagle_aux_hidden_state_layer_ids") or [])
        if int(conf.get("num_hidden_layers", 1)) != 1:
            why.append(f"{conf['num_hidden_layers']} draft layers: its converter detects an EAGLE-3 draft only with "
                       f"one (conversion/llama.py:50)")
        if len(ids) != 3:
            why.append(f"{len(ids)} distinct aux layers {ids}: it needs exactly 3 (src/models/eagle3.cpp:9-11)")
        if cfg.num_layers in ids:
            why.append(f"aux id {cfg.num_layers} (the base's last layer's output): it reads that from a buffer "
                       f"Llama/Qwen3 graphs never fill (common/speculative.cpp:544, 630), so it would draft garbage")
        if conf.get("attention_bias"):
            why.append("q/k/v biases: its EAGLE-3 layer has none (src/models/eagle3.cpp:79-99)")
        if conf.get("norm_output"):
            why.append("norm_output: it feeds the draft's pre-norm state back (common/speculative.cpp:797, 832-833)")
        entry["n_max"] = 4
    else:
        entry["n_max"] = int(conf["block_size"]) - 1
        entry["notes"].append(f"--spec-draft-n-max {entry['n_max']} = block_size - 1: llama.cpp's block is n_max + 1 "
                              f"slots attending both ways (common/speculative.cpp:1014-1021), so another n_max "
                              f"changes every slot")
        if rope_type(cfg.rope_scaling) == "llama3":
            entry["notes"].append("Llama 3.1+ RoPE scaling: llama.cpp's DFlash conversion writes no rope_freqs, so "
                                  "the draft ropes unscaled there and drafts differ from ours (still lossless)")
    entry["unsupported"] = "; ".join(why) or None
    return entry


def readme_section(root: Path, base: Path, entry: Mapping[str, Any]) -> List[str]:
    """The export README's llama.cpp section: the converter and server commands with the real paths, or why not."""
    lines = ["## llama.cpp", ""]
    if entry.get("unsupported"):
        return lines + [f"Not served by {VERSION}: {entry['unsupported']}.", ""]
    draft = root / entry["dir"]
    lines += [f"Checked by running {VERSION} itself (`make test-llamacpp`). Its converter is "
              f"`convert_hf_to_gguf.py` of the same llama.cpp source (gguf-py of that source on `PYTHONPATH`; "
              f"transformers 4.57, sentencepiece); the base's tokenizer must be one it recognises.", "",
              "```bash",
              f"python convert_hf_to_gguf.py {base} --outtype f16 --outfile base.gguf",
              f"python convert_hf_to_gguf.py {draft} --target-model-dir {base} --outtype f16 --outfile draft.gguf",
              f"llama-server -m base.gguf -md draft.gguf --spec-type {entry['spec_type']} "
              f"--spec-draft-n-max {entry['n_max']}",
              "```", ""]
    lines += [f"- {n}" for n in entry.get("notes") or []]
    return lines + ([""] if entry.get("notes") else [])
