"""Hugging Face import/export: logit parity with transformers for each family, TP=2, formats, errors."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from nemo_spec.checkpoint import detect_format, hf, save_checkpoint
from nemo_spec.checkpoint.hf import HFCheckpointError, export_hf, hf_to_model_config, load_hf
from nemo_spec.models import build_gpt, gpt_forward
from tests.helpers import ROOT, run_torchrun, script_env, tiny_llama

transformers = pytest.importorskip("transformers")
V = 96


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Give every parameter (norms and biases too) random values so each mapping matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if ("norm" in name or "ln_" in name) and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(0.08 * noise)


def _hf_config(kind: str, **kw):
    T = transformers
    llama = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)
    if kind == "llama":  # GQA, untied
        return T.LlamaConfig(**{**llama, **kw})
    if kind == "llama3":  # llama3 rope scaling, theta 500000
        rp = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
        return T.LlamaConfig(**{**llama, "rope_parameters": rp, **kw})
    if kind == "llama_linear":  # linear rope scaling, MHA, attention + mlp biases
        rp = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
        return T.LlamaConfig(**{**llama, "num_key_value_heads": 4, "rope_parameters": rp, "attention_bias": True,
                                "mlp_bias": True, **kw})
    if kind == "qwen2":  # qkv bias, tied embeddings, theta 1e6
        return T.Qwen2Config(**{**llama, "tie_word_embeddings": True,
                                "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, **kw})
    if kind == "mistral":  # head_dim != hidden/heads, single kv head, no sliding window
        return T.MistralConfig(**{**llama, "num_key_value_heads": 1, "head_dim": 32, "sliding_window": None, **kw})
    if kind == "gpt2":
        return T.GPT2Config(**{"vocab_size": V, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 64,
                               "bos_token_id": 0, "eos_token_id": 0, **kw})
    if kind == "gpt2_untied":  # exact GELU, separate lm_head, n_inner != 4h
        return T.GPT2Config(**{"vocab_size": V, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 64,
                               "n_inner": 96, "activation_function": "gelu", "tie_word_embeddings": False,
                               "bos_token_id": 0, "eos_token_id": 0, **kw})
    raise ValueError(kind)


_ARCH = {"llama": "LlamaForCausalLM", "llama3": "LlamaForCausalLM", "llama_linear": "LlamaForCausalLM",
         "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM", "gpt2": "GPT2LMHeadModel",
         "gpt2_untied": "GPT2LMHeadModel"}


def make_hf_model(kind: str, path: Path, seed: int = 0, **kw) -> torch.nn.Module:
    """A random-weight transformers model of ``kind``, saved to ``path`` (no downloads)."""
    torch.manual_seed(seed)
    cfg = _hf_config(kind, **kw)
    model = getattr(transformers, _ARCH[kind])(cfg).eval()
    _randomize(model, seed)
    model.save_pretrained(str(path))
    return model


def _ids(s: int = 16, b: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (b, s), generator=torch.Generator().manual_seed(seed))


def _hf_logits(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=x).logits.float()


def _our_logits(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return gpt_forward(model.eval(), x).logits.float()


FAMILIES = ["llama", "llama3", "llama_linear", "qwen2", "mistral", "gpt2", "gpt2_untied"]


@pytest.mark.parametrize("kind", FAMILIES)
def test_import_export_parity(kind, tmp_path):
    ref_model = make_hf_model(kind, tmp_path / "hf")
    x = _ids()
    ref = _hf_logits(ref_model, x)

    ours = load_hf(tmp_path / "hf")
    err = (_our_logits(ours, x) - ref).abs().max().item()
    assert err < 1e-4, f"{kind}: import max abs err {err}"

    # a Mistral without sliding window is a Llama; ask for the Mistral architecture explicitly
    arch = "MistralForCausalLM" if kind == "mistral" else None
    out = export_hf(ours, tmp_path / "export", architecture=arch)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == [_ARCH[kind]]
    assert cfg["torch_dtype"] == "float32"
    assert (out / "generation_config.json").is_file() and (out / "model.safetensors").is_file()
    back = transformers.AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).eval()
    err_back = (_hf_logits(back, x) - ref).abs().max().item()
    assert err_back < 1e-4, f"{kind}: export max abs err {err_back}"

    # the exported weights are exactly the original ones (names and values)
    orig = load_file(str(tmp_path / "hf" / "model.safetensors"))
    new = load_file(str(out / "model.safetensors"))
    assert set(orig) == set(new)
    assert all(torch.equal(orig[k], new[k]) for k in orig)


def test_rope_scaling_changes_logits(tmp_path):
    """The llama3 / linear parity tests are meaningful: scaling changes the reference logits."""
    x = _ids(s=24)
    for kind in ("llama3", "llama_linear"):
        scaled = make_hf_model(kind, tmp_path / kind)
        plain_cfg = _hf_config(kind, rope_parameters={"rope_type": "default",
                                                      "rope_theta": scaled.config.rope_parameters["rope_theta"]})
        plain = getattr(transformers, _ARCH[kind])(plain_cfg).eval()
        plain.load_state_dict(scaled.state_dict())
        assert (_hf_logits(scaled, x) - _hf_logits(plain, x)).abs().max() > 1e-3


def test_mistral_sliding_window_exact_beyond_window(tmp_path):
    """Sliding-window attention (no longer a cap of the context): exact against transformers past the window."""
    ref_model = make_hf_model("mistral", tmp_path / "hf", sliding_window=8)
    ours = load_hf(tmp_path / "hf")
    assert ours.nemo_spec_config.sliding_window == 8 and ours.nemo_spec_config.max_position_embeddings == 64
    x = _ids(s=30)
    ref = _hf_logits(ref_model, x)
    assert (_our_logits(ours, x) - ref).abs().max() < 1e-4
    full = make_hf_model("mistral", tmp_path / "full")  # same seed, no window: the window matters at this length
    assert (_hf_logits(full, x) - ref).abs().max() > 1e-3
    out = export_hf(ours, tmp_path / "export")
    assert json.loads((out / "config.json").read_text())["sliding_window"] == 8
    assert json.loads((out / "config.json").read_text())["architectures"] == ["MistralForCausalLM"]


def test_sharded_safetensors_and_pytorch_bin(tmp_path):
    ref_model = make_hf_model("llama", tmp_path / "sharded")
    ref_model.save_pretrained(str(tmp_path / "sharded"), max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    shards = list((tmp_path / "sharded").glob("model-*.safetensors"))
    assert len(shards) > 1
    x = _ids()
    ref = _hf_logits(ref_model, x)
    assert (_our_logits(load_hf(tmp_path / "sharded"), x) - ref).abs().max() < 1e-4

    # GPT-2 as on the hub: pytorch_model.bin, names without "transformer.", causal-mask buffers
    g = make_hf_model("gpt2", tmp_path / "gpt2")
    legacy = tmp_path / "gpt2_bin"
    legacy.mkdir()
    (legacy / "config.json").write_text((tmp_path / "gpt2" / "config.json").read_text())
    sd = {k.removeprefix("transformer."): v for k, v in g.state_dict().items() if k != "lm_head.weight"}
    for i in range(2):
        sd[f"h.{i}.attn.bias"] = torch.tril(torch.ones(64, 64))[None, None]
    torch.save(sd, legacy / "pytorch_model.bin", _use_new_zipfile_serialization=False)  # pre-1.6 format
    assert (_our_logits(load_hf(legacy), x) - _hf_logits(g, x)).abs().max() < 1e-4


def test_load_bf16_params(tmp_path):
    ref_model = make_hf_model("llama", tmp_path / "hf")
    ours = load_hf(tmp_path / "hf", params_dtype=torch.bfloat16)
    assert ours.decoder.layers[0].self_attention.linear_qkv.weight.dtype == torch.bfloat16
    assert ours.embedding.word_embeddings.weight.dtype == torch.bfloat16
    x = _ids()
    err = (_our_logits(ours, x) - _hf_logits(ref_model, x)).abs().max().item()
    assert 0 < err < 0.1  # bf16 rounding only


def test_export_bf16_with_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    ref_model = make_hf_model("qwen2", tmp_path / "hf")
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    vocab = {f"w{i}": i for i in range(V - 1)} | {"<unk>": V - 1}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>"}))
    (tok_dir / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")

    ours = load_hf(tmp_path / "hf")
    out = export_hf(ours, tmp_path / "export", tokenizer_dir=tok_dir, dtype="bf16")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["torch_dtype"] == "bfloat16" and cfg["architectures"] == ["Qwen2ForCausalLM"]
    tensors = load_file(str(out / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert "lm_head.weight" not in tensors  # tied
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / name).is_file(), name
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(out), local_files_only=True)
    assert tok("w3 w5")["input_ids"] == [3, 5]
    back = transformers.AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True,
                                                             dtype=torch.float32).eval()
    x = _ids()
    err = (_hf_logits(back, x) - _hf_logits(ref_model, x)).abs().max().item()
    assert 0 < err < 0.05  # bf16 rounding only


def test_tp2_import_export(tmp_path):
    """Under torchrun: TP=2 import gives transformers' logits; TP=2 export reproduces the weights."""
    args = []
    for kind in ("llama", "qwen2", "gpt2"):
        model = make_hf_model(kind, tmp_path / kind)
        x = _ids(s=12)
        torch.save({"input_ids": x, "logits": _hf_logits(model, x)}, tmp_path / f"{kind}.pt")
        args += [tmp_path / kind, tmp_path / f"{kind}.pt", tmp_path / f"{kind}_tp2_export"]
    bad = tmp_path / "bad"
    make_hf_model("mistral", bad, num_key_value_heads=1)
    out = run_torchrun(ROOT / "tests" / "dist_scripts" / "hf_tp2.py", [bad, *args])
    assert out.count("HF_TP2_OK") == 3, out
    assert "HF_TP2_BAD_TP_REJECTED" in out, out
    for kind in ("llama", "qwen2", "gpt2"):
        orig = load_file(str(tmp_path / kind / "model.safetensors"))
        new = load_file(str(tmp_path / f"{kind}_tp2_export" / "model.safetensors"))
        assert set(orig) == set(new) and all(torch.equal(orig[k], new[k]) for k in orig), kind


# ---------------------------------------------------------------------------------------------------------------
# config mapping
# ---------------------------------------------------------------------------------------------------------------

def test_legacy_config_fields_map():
    cfg = hf_to_model_config({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128, "hidden_size": 64,
        "intermediate_size": 160, "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 512,
        "rope_scaling": {"type": "linear", "factor": 2.0}, "tie_word_embeddings": True,
        "bos_token_id": 5, "eos_token_id": [7, 9], "pad_token_id": None}, "x/config.json")
    assert (cfg.vocab_size, cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_layers) == (128, 64, 160, 3)
    assert (cfg.num_attention_heads, cfg.num_query_groups, cfg.head_dim) == (8, 2, 8)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert cfg.tie_word_embeddings and cfg.norm_eps == 1e-5 and cfg.max_position_embeddings == 512
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (5, 7, None)
    g = hf_to_model_config({"model_type": "gpt2", "vocab_size": 100, "n_embd": 32, "n_layer": 1, "n_head": 2,
                            "n_positions": 40, "n_inner": None, "layer_norm_epsilon": 1e-6,
                            "activation_function": "gelu"})
    assert (g.family, g.ffn_hidden_size, g.activation, g.position_embedding) == ("gpt2", 128, "gelu_exact", "learned")
    assert g.tie_word_embeddings and g.add_bias_linear and g.norm_eps == 1e-6


def test_sliding_window_config_mapping():
    base = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096}
    qwen = dict(base, architectures=["Qwen2ForCausalLM"], sliding_window=1024, max_window_layers=2)

    def window(d):
        c = hf_to_model_config(d)
        assert c.max_position_embeddings == 4096  # the window no longer caps the context
        return c.sliding_window, c.sliding_window_layers

    assert window(dict(qwen, use_sliding_window=False)) == (None, None)
    assert window(dict(qwen, use_sliding_window=True)) == (1024, [2, 3])  # layers >= max_window_layers
    assert window(dict(qwen, use_sliding_window=True, max_window_layers=0)) == (1024, None)  # every layer
    assert window(dict(qwen, use_sliding_window=True, layer_types=["full_attention"] * 4)) == (None, None)
    assert window(dict(qwen, use_sliding_window=True, layer_types=["full_attention", "sliding_attention"] * 2)
                  ) == (1024, [1, 3])
    # transformers nulls sliding_window without use_sliding_window, whatever layer_types says
    assert window(dict(qwen, layer_types=["full_attention", "sliding_attention"] * 2)) == (None, None)
    mistral = dict(base, architectures=["MistralForCausalLM"])
    assert window(dict(mistral, sliding_window=None)) == (None, None)
    assert window(dict(mistral, sliding_window=512)) == (512, None)
    q = hf_to_model_config(qwen)
    assert q.add_qkv_bias and not q.add_bias_linear  # Qwen2 always has q/k/v biases
    with pytest.raises(HFCheckpointError, match="layer_types"):
        hf_to_model_config(dict(qwen, use_sliding_window=True, layer_types=["sliding_attention"]))


def test_exported_config_reads_back_identically():
    for cfg in (tiny_llama(), tiny_llama(tie_word_embeddings=True, add_qkv_bias=True, rope_theta=1e6),
                tiny_llama(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64})):
        d = hf.model_config_to_hf(cfg)
        back = hf_to_model_config(d)
        assert back.to_dict() == cfg.to_dict()


# ---------------------------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------------------------

def test_missing_directory_config_and_weights(tmp_path):
    import nemo_spec.checkpoint as ck

    assert issubclass(HFCheckpointError, ValueError)
    if hasattr(ck, "CheckpointError"):
        assert issubclass(HFCheckpointError, ck.CheckpointError)
    with pytest.raises(HFCheckpointError, match="not a directory"):
        load_hf(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(HFCheckpointError, match=r"config\.json: missing"):
        load_hf(tmp_path / "empty")
    make_hf_model("llama", tmp_path / "hf")
    (tmp_path / "hf" / "model.safetensors").unlink()
    with pytest.raises(HFCheckpointError, match="no weights found"):
        load_hf(tmp_path / "hf")
    (tmp_path / "hf" / "config.json").write_text("{not json")
    with pytest.raises(HFCheckpointError, match="invalid JSON"):
        load_hf(tmp_path / "hf")


def test_missing_shard_named(tmp_path):
    m = make_hf_model("llama", tmp_path / "hf")
    m.save_pretrained(str(tmp_path / "hf"), max_shard_size="40KB")
    victim = sorted((tmp_path / "hf").glob("model-*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(HFCheckpointError, match=victim.name):
        load_hf(tmp_path / "hf")


def test_unsupported_architecture_named(tmp_path):
    make_hf_model("llama", tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg["architectures"] = ["FalconForCausalLM"]
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HFCheckpointError, match=r"FalconForCausalLM.*supported architectures.*GPT2LMHeadModel"):
        load_hf(tmp_path / "hf")
    with pytest.raises(HFCheckpointError, match="hidden_act"):
        hf_to_model_config(dict(cfg, architectures=["LlamaForCausalLM"], hidden_act="gelu"))
    with pytest.raises(HFCheckpointError, match="yarn"):
        hf_to_model_config(dict(cfg, architectures=["LlamaForCausalLM"],
                                rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}))


def test_shape_mismatch_names_tensor_and_shapes(tmp_path, monkeypatch):
    make_hf_model("llama", tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    built = []
    monkeypatch.setattr("nemo_spec.models.build_gpt", lambda *a, **k: built.append(1))
    with pytest.raises(HFCheckpointError, match=r"model\.layers\.0\.mlp\.down_proj\.weight.*\(64, 128\).*\(64, 96\)"):
        load_hf(tmp_path / "hf")
    assert not built, "the model must not be built before the shapes are checked"


def test_untied_without_lm_head_and_unexpected_tensor(tmp_path):
    make_hf_model("qwen2", tmp_path / "hf")  # tied: no lm_head.weight stored
    path = tmp_path / "hf" / "config.json"
    cfg = json.loads(path.read_text())
    path.write_text(json.dumps(dict(cfg, tie_word_embeddings=False)))
    with pytest.raises(HFCheckpointError, match="lm_head.weight"):
        load_hf(tmp_path / "hf")
    path.write_text(json.dumps(cfg))
    sd = load_file(str(tmp_path / "hf" / "model.safetensors"))
    sd["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    save_file(sd, str(tmp_path / "hf" / "model.safetensors"))
    with pytest.raises(HFCheckpointError, match="unexpected tensor.*q_norm"):
        load_hf(tmp_path / "hf")


def test_export_refuses_nonempty_dir_and_leaves_nothing_on_failure(tmp_path, monkeypatch):
    model = build_gpt(tiny_llama())
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(HFCheckpointError, match="not empty"):
        export_hf(model, out)
    assert (out / "keep.txt").read_text() == "x"
    with pytest.raises(HFCheckpointError, match="dtype"):
        export_hf(model, tmp_path / "o2", dtype="int8")

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr("safetensors.torch.save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        export_hf(model, tmp_path / "o3")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no partial or temp directory left
    monkeypatch.undo()
    with pytest.raises(HFCheckpointError, match="not a Hugging Face model directory"):
        export_hf(model, out, overwrite=True)  # overwrite never replaces an unrelated directory ...
    assert (out / "keep.txt").read_text() == "x"
    first = export_hf(model, tmp_path / "o4")
    (first / "stale.txt").write_text("old")
    export_hf(model, first, overwrite=True)  # ... only an earlier HF export
    assert not (first / "stale.txt").exists() and (first / "model.safetensors").is_file()
    ck = save_checkpoint(model, tmp_path / "ck")
    with pytest.raises(HFCheckpointError, match="not a Hugging Face model directory"):
        hf.convert_checkpoint_to_hf(ck, ck, overwrite=True)  # it deleted its own source checkpoint
    assert detect_format(ck) == "nemo_spec"


def test_export_rejects_unrepresentable_config():
    with pytest.raises(HFCheckpointError, match="normalization"):
        hf.model_config_to_hf(tiny_llama(normalization="LayerNorm"))
    with pytest.raises(HFCheckpointError, match="GPT2LMHeadModel"):
        hf.model_config_to_hf(tiny_llama(), architecture="GPT2LMHeadModel")
    with pytest.raises(HFCheckpointError, match="FooForCausalLM"):
        hf.model_config_to_hf(tiny_llama(), architecture="FooForCausalLM")
    # q/k/v biases alone (Qwen2) as Llama: its attention_bias=false dropped them (logits off by 1.4 on reload)
    with pytest.raises(HFCheckpointError, match="add_qkv_bias=True without add_bias_linear .* LlamaForCausalLM"):
        hf.model_config_to_hf(tiny_llama(add_qkv_bias=True), architecture="LlamaForCausalLM")
    assert hf.model_config_to_hf(tiny_llama(add_qkv_bias=True))["architectures"] == ["Qwen2ForCausalLM"]


# ---------------------------------------------------------------------------------------------------------------
# conversions and the CLI
# ---------------------------------------------------------------------------------------------------------------

def test_cli_export_hf_to_hf(tmp_path):
    """One real CLI run (subprocess): HF -> HF re-export in fp16."""
    ref_model = make_hf_model("gpt2", tmp_path / "hf")
    env = script_env()
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "convert_hf.py"), "export", str(tmp_path / "hf"),
                        str(tmp_path / "out"), "--dtype", "fp16"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == "float16"
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), local_files_only=True,
                                                             dtype=torch.float32).eval()
    x = _ids()
    assert 0 < (_hf_logits(back, x) - _hf_logits(ref_model, x)).abs().max() < 0.05  # fp16 rounding only


def test_convert_errors_before_work(tmp_path):
    make_hf_model("gpt2", tmp_path / "hf")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("x")
    with pytest.raises(HFCheckpointError, match="not empty"):
        hf.convert_checkpoint_to_hf(tmp_path / "hf", tmp_path / "out")
    with pytest.raises(HFCheckpointError, match="dtype"):
        hf.convert_checkpoint_to_hf(tmp_path / "hf", tmp_path / "out2", dtype="fp8")
    with pytest.raises(HFCheckpointError, match="not a directory"):
        hf.convert_hf_to_checkpoint(tmp_path / "missing", tmp_path / "ck")
    assert not (tmp_path / "ck").exists() and not (tmp_path / "out2").exists()


def test_convert_hf_to_torch_dist_and_back(tmp_path):
    import nemo_spec.checkpoint as ck

    if not hasattr(ck, "save_checkpoint") or not hasattr(ck, "load_model"):
        pytest.skip("nemo_spec.checkpoint.save_checkpoint/load_model not available yet")
    ref_model = make_hf_model("llama", tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    hf.convert_hf_to_checkpoint(tmp_path / "hf", tmp_path / "ck")
    assert ck.read_checkpoint_config(tmp_path / "ck")["converted_from_hf"] == str((tmp_path / "hf").resolve())
    x = _ids()
    ref = _hf_logits(ref_model, x)
    assert (_our_logits(ck.load_model(tmp_path / "ck"), x) - ref).abs().max() < 1e-4
    assert (_our_logits(ck.load_model(tmp_path / "hf"), x) - ref).abs().max() < 1e-4  # HF dir autodetected
    tok_dir = ck.find_tokenizer_dir(tmp_path / "ck")
    assert tok_dir is not None and not (tok_dir / "model.safetensors").exists()  # tokenizer files only
    out = hf.convert_checkpoint_to_hf(tmp_path / "ck", tmp_path / "back")
    assert (out / "tokenizer_config.json").is_file()  # tokenizer travelled HF -> torch_dist -> HF
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2 and gen["bos_token_id"] == 1
    back = transformers.AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).eval()
    assert (_hf_logits(back, x) - ref).abs().max() < 1e-4


def test_fp16_export_refuses_weights_beyond_its_range(tmp_path):
    """A weight beyond fp16's range was written as inf without a word (found by review): now an error naming the
    tensor and its largest value, nothing written; bf16 holds it."""
    torch.manual_seed(0)
    m = build_gpt(tiny_llama())
    with torch.no_grad():
        m.decoder.layers[0].mlp.linear_fc2.weight[0, 0] = 1e5  # fp16's largest finite value is 65504
    with pytest.raises(HFCheckpointError, match=r"model\.layers\.0\.mlp\.down_proj\.weight: values up to 1e\+05 do "
                                                r"not fit float16"):
        export_hf(m, tmp_path / "hf", dtype="fp16")
    assert not (tmp_path / "hf").exists()
    sd = load_file(str(export_hf(m, tmp_path / "bf", dtype="bf16") / "model.safetensors"))
    assert all(bool(torch.isfinite(v.float()).all()) for v in sd.values())


def test_import_overwrite_replaces_a_checkpoint_and_is_checked_before_loading(tmp_path, monkeypatch):
    """convert_hf.py import --overwrite was not passed on (a second import into the same directory failed, telling
    the user to pass the option they had passed) and the check ran after the whole model was loaded (found by
    review). Now the destination is checked first and --overwrite replaces the earlier checkpoint."""
    torch.manual_seed(0)
    src = export_hf(build_gpt(tiny_llama()), tmp_path / "hf")
    ck = hf.convert_hf_to_checkpoint(src, tmp_path / "ck")
    real = hf.load_hf
    monkeypatch.setattr(hf, "load_hf", lambda *a, **k: pytest.fail("loaded before checking the destination"))
    with pytest.raises(HFCheckpointError, match="exists and is not empty"):
        hf.convert_hf_to_checkpoint(src, ck)
    monkeypatch.setattr(hf, "load_hf", real)
    assert hf.convert_hf_to_checkpoint(src, ck, overwrite=True) == ck and detect_format(ck) == "nemo_spec"


@pytest.mark.parametrize("bad", [{"rope_scaling": {"type": "linear"}}, {"rope_scaling": {"rope_type": "linear",
                                                                                          "factor": "four"}},
                                 {"rope_theta": "1e4x"}, {"num_attention_heads": 0, "head_dim": None},
                                 {"num_attention_heads": "four"}, {"architectures": 5}])
def test_a_config_field_of_the_wrong_kind_is_an_error_naming_config_json(tmp_path, bad):
    """config.json values of the wrong type, or a rope_scaling without its factor, escaped as a bare KeyError /
    ValueError / ZeroDivisionError / TypeError from inside the family code (found by review)."""
    import shutil

    from nemo_spec.checkpoint import CheckpointError, load_model

    torch.manual_seed(0)
    d = export_hf(build_gpt(tiny_llama()), tmp_path / "hf")
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg.update(bad)
    (d / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    with pytest.raises(CheckpointError, match="config.json"):
        load_model(d)
    shutil.rmtree(d)


@pytest.mark.parametrize("where", ["config", "generation_config"])
def test_every_listed_eos_id_stops_generation_as_transformers(tmp_path, where):
    """Llama 3 lists several end-of-sequence ids (end of text, of message, of turn); only the first stopped our
    generation, so a reply ran past the end of its turn. transformers' generate() stops at any of them, and vLLM
    0.34.0 adds generation_config.json's list to every request's stop ids (v1/engine/input_processor.py:63, 484;
    sampling_params.py:793-807)."""
    from nemo_spec.checkpoint import load_model
    from nemo_spec.inference import SamplingParams, generate
    from nemo_spec.models.gpt import model_config
    from nemo_spec.inference.generate import end_of_sequence_ids

    ref_model = make_hf_model("llama", tmp_path / "hf", seed=3)
    prompt = [5, 17, 33, 8]
    x = torch.tensor([prompt])
    with torch.no_grad():  # greedy continuation with no eos, to pick listed ids from
        free = ref_model.generate(x, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)[0, 4:]
    free = free.tolist()
    stop_at = next(i for i in range(2, len(free)) if free[i] not in free[:i] and free[i] != 2)
    third = next(t for t in range(V - 1, 0, -1) if t not in free)
    eos = [2, free[stop_at], third]  # the first id is config.json's own eos (2); the model emits the second
    cfg_path = tmp_path / "hf" / "config.json"
    if where == "config":  # no generation_config.json: transformers falls back to config.json's list
        (tmp_path / "hf" / "generation_config.json").unlink()
        cfg = json.loads(cfg_path.read_text())
        cfg_path.write_text(json.dumps({**cfg, "eos_token_id": eos}))
    else:  # config.json keeps one id; generation_config.json lists them all
        gen_path = tmp_path / "hf" / "generation_config.json"
        gen_path.write_text(json.dumps({**json.loads(gen_path.read_text()), "eos_token_id": eos}))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    with torch.no_grad():
        want = hf_model.generate(x, max_new_tokens=12, do_sample=False, pad_token_id=0)[0, 4:].tolist()
    assert want == free[:stop_at + 1]  # transformers stops at the listed id
    model = load_model(tmp_path / "hf")
    assert model_config(model).stop_token_ids() == eos
    for method in ("ar", "prompt_lookup"):
        res = generate(model, [prompt], SamplingParams(temperature=0.0, max_new_tokens=12), method=method)[0]
        assert res.tokens + [eos[1]] == want and res.finish_reason == "stop", method
    assert end_of_sequence_ids(model, None) == eos  # the server's stop ids
    out = tmp_path / "exported"  # the list survives our export (config.json + generation_config.json)
    export_hf(model, out)
    assert transformers.GenerationConfig.from_pretrained(str(out)).eos_token_id == eos
    assert model_config(load_model(out)).stop_token_ids() == eos


def test_legacy_rope_scaling_added_to_a_v5_config_uses_the_theta_transformers_uses(tmp_path, caplog):
    """transformers 5 saves rope_theta only inside rope_parameters; a user who then adds a legacy rope_scaling (as
    model cards say) gets rope_scaling in place of rope_parameters, theta and all, so transformers runs the class
    default theta (modeling_rope_utils.py convert_rope_params_to_dict) — we took rope_parameters' 1e6 (logits off by
    0.4), silently. Now the same theta as transformers, with a warning naming the discarded one."""
    make_hf_model("qwen2", tmp_path / "hf", seed=4)
    cfg_path = tmp_path / "hf" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    assert cfg["rope_parameters"]["rope_theta"] == 1e6 and "rope_theta" not in cfg
    cfg_path.write_text(json.dumps({**cfg, "rope_scaling": {"type": "linear", "factor": 2.0}}))
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert ref_model.config.rope_parameters["rope_theta"] == 10000.0  # what transformers runs
    x = _ids(s=24)
    with caplog.at_level("WARNING"):
        model = load_hf(tmp_path / "hf")
    assert "not rope_parameters' 1000000.0" in caplog.text
    torch.testing.assert_close(_our_logits(model, x), _hf_logits(ref_model, x), atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch,drop", [("MistralForCausalLM", "num_key_value_heads"),
                                       ("Qwen3ForCausalLM", "head_dim"), ("LlamaForCausalLM", "num_key_value_heads")])
def test_sizes_left_out_of_config_json_take_the_class_defaults(tmp_path, arch, drop):
    """A config.json without num_key_value_heads (Mistral's class default is 8 KV heads; Llama's one per head, which
    its class default in to_dict(), 32, is not) or a Qwen3 one without head_dim (class default 128, not hidden /
    heads) is what transformers loads; we refused it with a shape error."""
    T = transformers
    cls = getattr(T, arch)
    cfg_cls = cls.config_class
    base = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=16,
                max_position_embeddings=64)
    if arch == "Qwen3ForCausalLM":
        base["num_attention_heads"], base["num_key_value_heads"] = 4, 2
    torch.manual_seed(0)
    ref_model = cls(cfg_cls(**base)).eval()
    _randomize(ref_model, 5)
    ref_model.save_pretrained(str(tmp_path / "hf"))
    cfg_path = tmp_path / "hf" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop(drop)
    cfg_path.write_text(json.dumps(cfg))
    ref_model = T.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    x = _ids(s=12)
    torch.testing.assert_close(_our_logits(load_hf(tmp_path / "hf"), x), _hf_logits(ref_model, x), atol=1e-4, rtol=0)


def test_config_json_with_model_type_only_loads_as_transformers_loads_it(tmp_path):
    """transformers' AutoModelForCausalLM loads a config.json that names only its model_type; load_model refused
    it ("no 'architectures' field")."""
    from nemo_spec.checkpoint import load_model

    make_hf_model("qwen2", tmp_path / "hf", seed=6)
    cfg_path = tmp_path / "hf" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("architectures")
    cfg_path.write_text(json.dumps(cfg))
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert detect_format(tmp_path / "hf") == "hf" and hf.is_hf_dir(tmp_path / "hf")
    x = _ids()
    torch.testing.assert_close(_our_logits(load_model(tmp_path / "hf"), x), _hf_logits(ref_model, x), atol=1e-4,
                               rtol=0)


@pytest.mark.parametrize("field", ["attention_bias", "mlp_bias"])
def test_qwen2_ignores_llama_bias_fields_as_transformers_does(tmp_path, field):
    """Qwen2 has q/k/v biases and no others whatever attention_bias / mlp_bias say (transformers' Qwen2Attention
    and Qwen2MLP never read them); a config.json carrying them was refused with "missing tensor(s) o_proj.bias"."""
    make_hf_model("qwen2", tmp_path / "hf", seed=7)
    cfg_path = tmp_path / "hf" / "config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), field: True}))
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    x = _ids()
    torch.testing.assert_close(_our_logits(load_hf(tmp_path / "hf"), x), _hf_logits(ref_model, x), atol=1e-4, rtol=0)


def test_generation_config_ids_replace_config_json_ids(tmp_path):
    """generation_config.json's end-of-sequence ids are the ones generation stops at, a single one too (transformers'
    GenerationConfig; vLLM's sampling_params.py:793-807): a config.json list stood beside a single id before."""
    from nemo_spec.checkpoint.hf import with_generation_eos

    for gen, want in ((2, [2]), (5, [5]), ([5, 2], [5, 2]), (None, [2, 3])):
        d = tmp_path / f"d{gen}"
        d.mkdir()
        if gen is not None:
            (d / "generation_config.json").write_text(json.dumps({"eos_token_id": gen}))
        cfg = tiny_llama(eos_token_id=2, eos_token_ids=[2, 3])
        assert with_generation_eos(cfg, d).stop_token_ids() == want, gen
        if gen is not None:
            assert transformers.GenerationConfig.from_pretrained(str(d)).eos_token_id == gen
