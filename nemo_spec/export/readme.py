"""The README.md written into every export: what is there and how to serve it (vLLM, SGLang, reference code)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List


def _vllm(base: Path, method: str, draft: Path, k: int) -> str:
    spec = json.dumps({"method": method, "model": str(draft), "num_speculative_tokens": k})
    return f"vllm serve {base} \\\n  --speculative-config '{spec}'"


def _sglang(base: Path, algo: str, draft: Path) -> str:
    return (f"python -m sglang.launch_server --model-path {base} \\\n"
            f"  --speculative-algorithm {algo} --speculative-draft-model-path {draft} \\\n"
            f"  --speculative-num-steps 3 --speculative-eagle-topk 4 --speculative-num-draft-tokens 16")


def render_readme(root: Path, info: Dict[str, Any]) -> str:
    """Markdown for an export at ``root`` described by ``info`` (the export_info.json dict)."""
    fmt, dtype = info["format"], info["dtype"]
    spec = info.get("speculative") or {}
    model = info.get("model") or {}
    base = root / "base"
    base_ref = info.get("base_model_name_or_path") or str(base)
    draft = root / "draft"
    lines: List[str] = [f"# nemo_spec export: {fmt} ({dtype})", ""]
    if info.get("source_checkpoint"):
        lines += [f"Exported from `{info['source_checkpoint']}` at {info.get('exported_at', '')}.", ""]
    lines += ["| path | content |", "|---|---|"]
    if info.get("base"):
        lines.append(f"| `base/` | base model, Hugging Face format ({model.get('family', '')}, "
                     f"{model.get('num_layers', '?')} layers, hidden {model.get('hidden_size', '?')}) |")
    if fmt == "eagle3":
        lines.append(f"| `draft/` | EAGLE-3 draft (`LlamaForCausalLMEagle3`, {spec.get('num_eagle_layers')} layer(s), "
                     f"draft vocab {spec.get('draft_vocab_size') or model.get('vocab_size')}) |")
    elif fmt == "eagle1":
        lines.append(f"| `draft/` | EAGLE-1 draft (EAGLE reference layout, {spec.get('num_eagle_layers')} layer(s)) |")
    elif fmt == "medusa":
        lines.append(f"| `draft/` | Medusa heads, reference layout ({spec.get('num_medusa_heads')} heads x "
                     f"{spec.get('num_medusa_layers')} residual block(s)) |")
        lines.append("| `draft_vllm/` | the same Medusa heads in vLLM's layout |")
    lines += ["| `export_info.json` | what was exported, from where, in which dtype |", ""]
    lines += [f"The draft config records its base as `base_model_name_or_path = {base_ref}`.", ""]
    if not info.get("base"):
        base = Path(base_ref) if base_ref else Path("<base model>")

    if fmt == "eagle3":
        k = spec.get("ttt_steps") or 3
        lines += ["## vLLM", "", "```bash", _vllm(base, "eagle3", draft, k), "```", "",
                  "## SGLang", "", "```bash", _sglang(base, "EAGLE3", draft), "```", "",
                  "## TensorRT-LLM (PyTorch LLM API)", "", "```python",
                  "from tensorrt_llm import LLM",
                  "from tensorrt_llm.llmapi import EagleDecodingConfig",
                  f"spec = EagleDecodingConfig(max_draft_len={k}, speculative_model_dir='{draft}', "
                  "eagle3_one_model=False)",
                  f"llm = LLM(model='{base}', speculative_config=spec)", "```", "",
                  "## EAGLE reference code", "", "```python", "from eagle.model.ea_model import EaModel",
                  f"m = EaModel.from_pretrained(base_model_path='{base}', ea_model_path='{draft}', use_eagle3=True)",
                  "```", ""]
        if (spec.get("num_eagle_layers") or 1) > 1:
            lines += ["Note: more than one draft layer is stored in vLLM's layout (`layers.N.*`); SGLang and the "
                      "EAGLE reference code load a single `midlayer`.", ""]
    elif fmt == "eagle1":
        lines += ["## vLLM", "", "```bash", _vllm(base, "eagle", draft, 3), "```", "",
                  "vLLM's EAGLE-1 loader builds `fc` without a bias and skips `fc.bias`; SGLang and the EAGLE "
                  "reference code use it.", "",
                  "## SGLang", "", "```bash", _sglang(base, "EAGLE", draft), "```", "",
                  "## EAGLE reference code", "", "```python", "from eagle.model.ea_model import EaModel",
                  f"m = EaModel.from_pretrained(base_model_path='{base}', ea_model_path='{draft}', use_eagle3=False)",
                  "```", ""]
    elif fmt == "medusa":
        k = spec.get("num_medusa_heads") or 3
        lines += ["## vLLM", "", "```bash", _vllm(base, "medusa", root / "draft_vllm", k), "```", "",
                  "## SGLang", "", "SGLang has no Medusa decoding; serve the base alone:", "", "```bash",
                  f"python -m sglang.launch_server --model-path {base}", "```", "",
                  "## Medusa reference code", "", "```bash", f"python -m medusa.inference.cli --model {draft}", "```",
                  "", "(`base_model_name_or_path` in `draft/config.json` points the reference code at the base.)", ""]
    else:
        lines += ["## vLLM", "", "```bash", f"vllm serve {base}", "```", "",
                  "## SGLang", "", "```bash", f"python -m sglang.launch_server --model-path {base}", "```", ""]
    lines += ["## Load it back into nemo_spec", "", "```python", "from nemo_spec.export import import_draft",
              f"import_draft(spec_model, '{root}')  # spec_model: the transformed base (SpeculativeGPT)", "```", ""]
    return "\n".join(lines)
