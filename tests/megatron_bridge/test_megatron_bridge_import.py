"""Megatron Bridge checkpoints (NeMo 3's LLM training) load with ``load_model``: checkpoints Megatron Bridge 0.3.1's
own providers and save code wrote (tests/megatron_bridge/make_exports.py, in its side environment) give Bridge's own
forward's logits at TP=1 and TP=2 — Llama untied and tied, Llama 3.1's RoPE scaling (``rope_scaling`` +
``rope_scaling_factor``, which the NeMo 2 field mapping alone does not know: logits off by 2e-2), Qwen3's QK layer
norm — and feed the speculative tools like any other base.

Runs with ``make test-megatron-bridge`` (which builds the checkpoints and points NEMO_SPEC_BRIDGE_EXPORTS at them);
skipped otherwise.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nemo_spec.checkpoint import (CheckpointError, detect_format, find_tokenizer_dir, load_model,
                                  read_checkpoint_config)
from nemo_spec.models import gpt_forward
from tests.helpers import ROOT, run_torchrun, script_env

EXPORTS = os.environ.get("NEMO_SPEC_BRIDGE_EXPORTS")
pytestmark = pytest.mark.skipif(not EXPORTS, reason="Megatron Bridge checkpoints not built: run make "
                                                    "test-megatron-bridge")
NAMES = ("llama", "llama_tied", "llama31_rope", "qwen3")


@pytest.fixture(scope="module")
def ref():
    torch.set_num_threads(1)
    return torch.load(Path(EXPORTS) / "reference.pt", weights_only=False)


@pytest.mark.parametrize("name", NAMES)
def test_bridge_checkpoints_give_bridges_own_logits(ref, name):
    root = Path(EXPORTS) / name
    assert detect_format(root) == detect_format(root / "iter_0000000") == "megatron_bridge"
    info = read_checkpoint_config(root)
    assert info["target"] == ref[name]["provider"] and info["params_dtype"] == "float32"
    model = info["model"]
    assert (model["num_layers"], model["hidden_size"], model["vocab_size"]) == (2, 64, 128)
    assert model["tie_word_embeddings"] == (name == "llama_tied")
    assert model["qk_layernorm"] == (name == "qwen3")
    if name == "llama31_rope":
        assert model["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    m = load_model(root).eval()
    with torch.no_grad():
        logits = gpt_forward(m, ref["tokens"]).logits.float()
    err = (logits - ref[name]["logits"]).abs().max().item()
    assert err < 1e-4, err


def test_tp2_load(ref):
    out = run_torchrun(Path(__file__).parent / "tp2_logits.py",
                       [Path(EXPORTS) / "llama31_rope", Path(EXPORTS) / "reference.pt", "llama31_rope"])
    assert "TP2_MAX_ERR" in out


def test_tokenizer_saved_by_bridge_is_found():
    root = Path(EXPORTS) / "llama"
    tok_dir = find_tokenizer_dir(root)
    assert tok_dir == root / "iter_0000000" / "tokenizer"
    assert json.loads((tok_dir / "tokenizer_config.json").read_text())["eos_token"] == "</s>"
    assert find_tokenizer_dir(Path(EXPORTS) / "llama_tied") is None  # saved without one


def test_gpt_speculate_attaches_a_draft_to_a_bridge_checkpoint(tmp_path):
    out = tmp_path / "eagle3"
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpt_speculate.py"), "--model_path",
                        str(Path(EXPORTS) / "llama"), "--export_dir", str(out), "--algorithm", "eagle3",
                        "--num_eagle_layers", "1"], cwd=ROOT, env=script_env(), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    info = read_checkpoint_config(out)
    assert info["format"] == "nemo_spec" and info["speculative"]["algorithm"] == "eagle3"
    assert find_tokenizer_dir(out) is not None  # Bridge's tokenizer travels with the new checkpoint


def test_a_setting_the_layer_spec_lacks_is_refused_by_name(tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(Path(EXPORTS) / "llama", root)
    f = root / "iter_0000000" / "run_config.yaml"
    f.write_text(f.read_text().replace("  num_moe_experts: null\n", "  num_moe_experts: 4\n"))
    with pytest.raises(CheckpointError, match=r"mixture of experts \(config.num_moe_experts=4\)"):
        read_checkpoint_config(root)


def test_a_lora_checkpoint_is_refused_naming_its_base():
    # Bridge saves only the adapters when cfg.peft is set; the error said "no embedding.word_embeddings.weight
    # tensor (is .../run_config.yaml a GPT checkpoint?)"
    root = Path(EXPORTS) / "llama_lora"
    assert detect_format(root) == "megatron_bridge"
    with pytest.raises(CheckpointError, match=r"a PEFT checkpoint \(megatron\.bridge\.peft\.lora\.LoRA\).*adapter "
                                              r"weights.*/ckpt/llama_base"):
        load_model(root)


def test_a_tokenizer_bridge_saved_for_another_library_is_not_offered(caplog):
    # a TikTokenizer's vocabulary lands in tokenizer/tokenizer.json, which a Hugging Face loader failed on
    # ("'str' object cannot be interpreted as an integer"); it is not returned as the checkpoint's tokenizer
    root = Path(EXPORTS) / "llama_tiktoken"
    assert (root / "iter_0000000" / "tokenizer" / "tokenizer.json").is_file()
    assert find_tokenizer_dir(root) is None
    assert find_tokenizer_dir(root / "iter_0000000") is None  # the iteration directory itself too
    assert "TikTokenizer" in caplog.text
