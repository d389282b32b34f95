"""The README.md written into every export: what is there and, per engine, the exact command to serve it."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

_TITLES = {"vllm": "vLLM", "sglang": "SGLang", "trtllm": "TensorRT-LLM (PyTorch LLM API)",
           "reference": "Reference code (SafeAILab/EAGLE, FasterDecoding/Medusa)"}


def render_readme(root: Path, info: Dict[str, Any]) -> str:
    """Markdown for an export at ``root`` described by ``info`` (the export_info.json dict)."""
    from nemo_spec.export.engines import ENGINES

    fmt, dtype = info["format"], info["dtype"]
    spec = info.get("speculative") or {}
    model = info.get("model") or {}
    base = root / "base"
    base_ref = info.get("base_model_name_or_path") or str(base)
    lines: List[str] = [f"# nemo_spec export: {fmt} ({dtype})", ""]
    if info.get("source_checkpoint"):
        lines += [f"Exported from `{info['source_checkpoint']}` at {info.get('exported_at', '')}.", ""]
    lines += ["| path | content |", "|---|---|"]
    if info.get("base"):
        lines.append(f"| `base/` | base model, Hugging Face format ({model.get('family', '')}, "
                     f"{model.get('num_layers', '?')} layers, hidden {model.get('hidden_size', '?')}) |")
    engines = info.get("engines") or {}
    what = {"eagle3": f"EAGLE-3 draft ({spec.get('num_eagle_layers')} layer(s), draft vocab "
                      f"{spec.get('draft_vocab_size') or model.get('vocab_size')})",
            "eagle1": f"EAGLE-1 draft ({spec.get('num_eagle_layers')} layer(s))",
            "dflash": f"DFlash draft ({spec.get('num_eagle_layers')} layer(s), block size {spec.get('block_size')})",
            "peagle": f"P-EAGLE draft, speculators format ({spec.get('num_eagle_layers')} layer(s), "
                      f"{spec.get('parallel_depth')} tokens per parallel-drafting pass)",
            "medusa": f"Medusa heads ({spec.get('num_medusa_heads')} heads x {spec.get('num_medusa_layers')} "
                      f"residual block(s))"}.get(fmt, "")
    for eng, entry in engines.items():
        lines.append(f"| `{entry['dir']}/` | {what}, laid out for {_TITLES[eng]} {ENGINES[eng].VERSION} |")
    for extra in info.get("extra") or []:
        lines.append(f"| `{extra}/` | the Medusa heads in the layout of older vLLM releases (vLLM 0.33 has no "
                     f"Medusa; not verified) |")
    lines += ["| `export_info.json` | what was exported, from where, in which dtype, per-engine directories |", ""]
    lines += [f"The draft configs record their base as `base_model_name_or_path = {base_ref}`.", ""]
    if not info.get("base"):
        base = Path(base_ref) if base_ref else Path("<base model>")
    k = spec.get("ttt_steps") or 3
    if fmt == "dflash":
        k = spec.get("block_size") or 16
    if fmt == "peagle":
        k = spec.get("parallel_depth") or 4
    if fmt == "medusa":
        k = spec.get("num_medusa_heads") or 3
    for eng, entry in engines.items():
        mod = ENGINES[eng]
        launch = entry.get("launch") or {}
        cmd = mod.launch_command(fmt, base, root / entry["dir"], k=k, capture=launch.get("eagle3_layers_to_capture"),
                                 one_model=launch.get("eagle3_one_model", True))
        lang = "python" if eng == "trtllm" or (eng == "reference" and fmt != "medusa") else "bash"
        lines += [f"## {_TITLES[eng]}", "", f"Checked against {mod.VERSION} by `nemo_spec.export.engines.{eng}` "
                  f"(`scripts/verify_export.py`).", "", f"```{lang}", cmd, "```", ""]
    if info.get("llamacpp"):
        from nemo_spec.export.llamacpp import readme_section

        lines += readme_section(root, base, info["llamacpp"])
    for eng, why in (info.get("skipped_engines") or {}).items():
        lines += [f"## {_TITLES[eng]}: not exported", "", why, ""]
    if fmt == "base":
        lines += ["## vLLM", "", "```bash", f"vllm serve {base}", "```", "",
                  "## SGLang", "", "```bash", f"python -m sglang.launch_server --model-path {base}", "```", ""]
    if fmt in ("eagle3", "eagle1", "medusa", "dflash", "peagle"):
        lines += ["## Check it", "", "```bash",
                  f"python scripts/verify_export.py {root} --checkpoint {info.get('source_checkpoint') or '<ckpt>'}",
                  "```", "",
                  "## Load it back into nemo_spec", "", "```python", "from nemo_spec.export import import_draft",
                  f"import_draft(spec_model, '{root}')  # spec_model: the transformed base (SpeculativeGPT)", "```",
                  ""]
    return "\n".join(lines)
