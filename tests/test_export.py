"""Draft export to serving formats (EAGLE-3, EAGLE-1, Medusa) + the HF base: layout, semantics, round trip, errors."""
import json
import subprocess
import sys

import pytest
import torch

from nemo_spec.export import ExportError, detect_draft_format, export_checkpoint, export_model, import_draft
from nemo_spec.export.formats import merge_qkv, split_qkv
from tests.export_utils import (
    ALGS, feature_width, load_dir_tensors, make_model, make_tokenizer_dir, our_draft_logits, reference_eagle1,
    reference_eagle3, reference_medusa,
)
from tests.helpers import ROOT

B, S = 2, 9
TARGET = {"eagle3": "vllm", "eagle1": "reference", "medusa": "reference"}  # the single-layout tests below


def _save(model, path, tokenizer_dir=None):
    from nemo_spec.checkpoint import save_checkpoint

    return save_checkpoint(model, path, tokenizer_dir=tokenizer_dir)


def _inputs(model, seed=3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.model_config.vocab_size, (B, S), generator=g)
    feats = torch.randn(B, S, feature_width(model), generator=g)
    return ids, feats


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """TP=1 checkpoints of each algorithm, saved and exported (fp32) once for the module."""
    root = tmp_path_factory.mktemp("export")
    tok = make_tokenizer_dir(root / "tok")
    out = {}
    for alg in ALGS:
        model = make_model(alg, seed=0).eval()
        ckpt = _save(model, root / f"ckpt_{alg}", tokenizer_dir=tok if alg == "eagle3" else None)
        exp = export_checkpoint(ckpt, root / f"exp_{alg}", dtype="fp32", target=TARGET[alg])
        out[alg] = (model, ckpt, exp)
    return out


def test_qkv_split_merge_is_per_group_gqa():
    heads, groups, d = 6, 2, 3
    # label every fused row with (kind, head, dim): megatron order per group = [q heads of g, k_g, v_g]
    rows, per = [], heads // groups
    for g in range(groups):
        rows += [("q", g * per + i, j) for i in range(per) for j in range(d)]
        rows += [("k", g, j) for j in range(d)] + [("v", g, j) for j in range(d)]
    code = {r: n for n, r in enumerate(rows)}
    fused = torch.tensor([[float(code[r])] for r in rows])
    q, k, v = split_qkv(fused, heads, groups, d)
    assert q[:, 0].tolist() == [code[("q", h, j)] for h in range(heads) for j in range(d)]
    assert k[:, 0].tolist() == [code[("k", g, j)] for g in range(groups) for j in range(d)]
    assert v[:, 0].tolist() == [code[("v", g, j)] for g in range(groups) for j in range(d)]
    assert torch.equal(merge_qkv(q, k, v, heads, groups, d), fused)
    with pytest.raises(ExportError, match="rows"):
        split_qkv(fused[:-1], heads, groups, d)


def test_eagle3_layout_and_reference_semantics(exported):
    from transformers import AutoModelForCausalLM

    model, _, exp = exported["eagle3"]
    cfg, draft = model.model_config, exp / "draft"
    conf = json.loads((draft / "config.json").read_text())
    assert conf["architectures"] == ["LlamaForCausalLMEagle3"] and conf["draft_vocab_size"] == 48
    assert conf["vocab_size"] == cfg.vocab_size and "target_hidden_size" not in conf  # equal widths: engines default
    assert conf["num_key_value_heads"] == 2 and conf["num_hidden_layers"] == 1
    assert conf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert conf["base_model_name_or_path"] == str(exp / "base")
    h, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_query_groups * cfg.head_dim
    w = load_dir_tensors(draft, ["model.safetensors"])
    expected = {
        "fc.weight": (h, 3 * h), "midlayer.hidden_norm.weight": (h,), "midlayer.input_layernorm.weight": (h,),
        "midlayer.self_attn.q_proj.weight": (q, 2 * h), "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * h), "midlayer.self_attn.o_proj.weight": (h, q),
        "midlayer.post_attention_layernorm.weight": (h,), "midlayer.mlp.gate_proj.weight": (cfg.ffn_hidden_size, h),
        "midlayer.mlp.up_proj.weight": (cfg.ffn_hidden_size, h),
        "midlayer.mlp.down_proj.weight": (h, cfg.ffn_hidden_size),
        "norm.weight": (h,), "lm_head.weight": (48, h), "d2t": (48,), "t2d": (cfg.vocab_size,),
    }
    assert {k: tuple(v.shape) for k, v in w.items()} == expected
    assert w["d2t"].dtype == torch.int64 and w["t2d"].dtype == torch.bool and int(w["t2d"].sum()) == 48

    # the base's index lets the EAGLE reference code find the embedding table the draft does not store
    index = json.loads((exp / "base" / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["model.embed_tokens.weight"] == "model.safetensors"
    assert set(index["weight_map"]) == set(load_dir_tensors(exp / "base", ["model.safetensors"]))
    # the base as transformers loads it supplies the aux features by vLLM's layer ids (hidden_states[j])
    hf = AutoModelForCausalLM.from_pretrained(exp / "base", dtype=torch.float32).eval()
    ids, _ = _inputs(model)
    with torch.no_grad():
        hf_out = hf(ids, output_hidden_states=True)
        ours = model.base_forward(ids)
    assert (hf_out.logits - ours.logits).abs().max() < 1e-4  # base export: logit parity in transformers
    feats = torch.cat([hf_out.hidden_states[j] for j in conf["eagle_aux_hidden_state_layer_ids"]], -1)
    ref_logits, base_ids, _ = reference_eagle3(draft, hf.get_input_embeddings().weight.detach(), ids[:, 1:],
                                               feats[:, :-1])
    with torch.no_grad():
        our_logits = model.draft_step(ids[:, 1:], model.fuse(model.base_features(ours))[:, :-1])[1]
    assert (ref_logits - our_logits).abs().max() < 1e-4
    assert torch.equal(base_ids, model.draft_to_base_ids(torch.arange(48)))
    # the checkpoint's tokenizer (with its chat template) travels into base/
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(exp / "base")
    assert tok.apply_chat_template([{"role": "user", "content": "w1 w2"}], tokenize=False) == "user w1 w2 </s> "
    assert tok("w1 w2")["input_ids"] == [4, 5]


def test_eagle1_layout_and_reference_semantics(exported):
    from transformers import AutoModelForCausalLM

    model, _, exp = exported["eagle1"]
    cfg, draft = model.model_config, exp / "draft"
    conf = json.loads((draft / "config.json").read_text())
    assert conf["architectures"] == ["LlamaForCausalLM"] and conf["num_hidden_layers"] == 2 and conf["bias"] is True
    w = load_dir_tensors(draft, ["pytorch_model.bin"])
    w2 = load_dir_tensors(draft, ["model.safetensors"])
    assert w.keys() == w2.keys() and all(torch.equal(w[k], w2[k]) for k in w)
    assert "layers.0.input_layernorm.weight" not in w and "layers.1.input_layernorm.weight" in w
    assert tuple(w["fc.weight"].shape) == (cfg.hidden_size, 2 * cfg.hidden_size) and "fc.bias" in w
    assert tuple(w["embed_tokens.weight"].shape) == (cfg.vocab_size, cfg.hidden_size)
    assert not any(k.startswith(("norm", "lm_head")) for k in w)

    hf = AutoModelForCausalLM.from_pretrained(exp / "base", dtype=torch.float32).eval()
    ids, _ = _inputs(model)
    with torch.no_grad():
        last = hf.model(ids).last_hidden_state
        ours = model.base_forward(ids)
        our_logits = model.draft_step(ids[:, 1:], model.base_features(ours)[:, :-1])[1]
    ref_logits, _ = reference_eagle1(draft, hf.lm_head.weight.detach(), ids[:, 1:], last[:, :-1])
    assert (ref_logits - our_logits).abs().max() < 1e-4


def test_medusa_layout_and_reference_semantics(exported):
    model, _, exp = exported["medusa"]
    cfg, draft = model.model_config, exp / "draft"
    conf = json.loads((draft / "config.json").read_text())
    assert (conf["medusa_num_heads"], conf["medusa_num_layers"]) == (3, 1)
    assert conf["base_model_name_or_path"] == str(exp / "base")
    w = load_dir_tensors(draft, ["medusa_lm_head.safetensors"])
    wpt = load_dir_tensors(draft, ["medusa_lm_head.pt"])
    assert w.keys() == wpt.keys()
    blocks = {f"{k}.0.linear.{p}" for k in range(3) for p in ("weight", "bias")}
    assert set(w) == blocks | {f"{k}.1.weight" for k in range(3)}
    assert tuple(w["2.1.weight"].shape) == (cfg.vocab_size, cfg.hidden_size)
    _, hidden = _inputs(model)
    ref, _ = reference_medusa(draft, hidden)
    assert (ref - our_draft_logits(model, None, hidden)).abs().max() < 1e-4
    assert detect_draft_format(exp / "draft_vllm_legacy") == "medusa_vllm"
    vw = load_dir_tensors(exp / "draft_vllm_legacy", ["model.safetensors"])
    assert torch.equal(vw["blocks.1.layers.0.weight"], w["1.0.linear.weight"])
    assert torch.equal(vw["lm_heads.2.weight"], w["2.1.weight"])


@pytest.mark.parametrize("alg", list(ALGS))
def test_import_back_gives_identical_draft_logits(exported, alg):
    model, _, exp = exported[alg]
    fresh = make_model(alg, seed=11).eval()
    fresh.gpt.load_state_dict(model.gpt.state_dict())
    ids, feats = _inputs(model)
    assert (our_draft_logits(fresh, ids, feats) - our_draft_logits(model, ids, feats)).abs().max() > 1e-3
    assert import_draft(fresh, exp) == alg
    assert torch.equal(our_draft_logits(fresh, ids, feats), our_draft_logits(model, ids, feats))
    if alg == "eagle3":
        assert torch.equal(fresh.d2t, model.d2t) and torch.equal(fresh.t2d, model.t2d)


def test_medusa_two_layers_round_trip_through_vllm_layout(tmp_path):
    model = make_model("medusa", seed=2, num_medusa_layers=2).eval()
    holder = torch.nn.Module()  # e.g. a LightningModule holding the transformed model as .model
    holder.model = model
    exp = export_model(holder, tmp_path / "exp", dtype="fp32", include_base=False, base_name="my/base",
                       target="reference")
    assert json.loads((exp / "draft" / "config.json").read_text())["base_model_name_or_path"] == "my/base"
    fresh = make_model("medusa", seed=9, num_medusa_layers=2).eval()
    fresh.gpt.load_state_dict(model.gpt.state_dict())
    assert import_draft(fresh, exp / "draft_vllm_legacy") == "medusa_vllm"
    _, hidden = _inputs(model)
    assert torch.equal(our_draft_logits(fresh, None, hidden), our_draft_logits(model, None, hidden))
    assert not (exp / "base").exists()


def test_bf16_export_dtypes_and_readme(tmp_path):
    model = make_model("eagle3", seed=1)
    exp = export_model(model, tmp_path / "exp", dtype="bf16", target="vllm")
    from safetensors.torch import load_file

    raw = load_file(str(exp / "draft" / "model.safetensors"))
    assert raw["fc.weight"].dtype == torch.bfloat16 and raw["lm_head.weight"].dtype == torch.bfloat16
    assert raw["d2t"].dtype == torch.int64 and raw["t2d"].dtype == torch.bool
    assert json.loads((exp / "draft" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert all(v.dtype == torch.bfloat16 for v in load_file(str(exp / "base" / "model.safetensors")).values())
    info = json.loads((exp / "export_info.json").read_text())
    assert info["format"] == "eagle3" and info["dtype"] == "bfloat16" and info["speculative"]["draft_vocab_size"] == 48
    readme = (exp / "README.md").read_text()
    assert f"vllm serve {exp / 'base'}" in readme and '"method": "eagle3"' in readme
    assert "Checked against 0.33.0" in readme and "sglang" not in readme.lower()  # one engine: one section
    # bf16 import back: the draft equals the bf16-rounded original
    fresh = make_model("eagle3", seed=4)
    import_draft(fresh, exp)
    for (k, a), (_, b) in zip(sorted(model.draft.state_dict().items()), sorted(fresh.draft.state_dict().items())):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            assert torch.equal(a.to(torch.bfloat16).float(), b), k


def test_errors_before_work(tmp_path):
    from nemo_spec.models import build_gpt
    from tests.export_utils import base_config

    plain = build_gpt(base_config())
    with pytest.raises(ExportError, match="not transformed"):
        export_model(plain, tmp_path / "a", fmt="eagle3")
    assert not (tmp_path / "a").exists()
    with pytest.raises(ExportError, match="unknown export format 'eagle2'"):
        export_model(make_model("medusa"), tmp_path / "b", fmt="eagle2")
    with pytest.raises(ExportError, match="medusa draft; it cannot be exported as eagle1"):
        export_model(make_model("medusa"), tmp_path / "b", fmt="eagle1")
    with pytest.raises(ExportError, match="unknown export dtype 'fp8'"):
        export_model(make_model("medusa"), tmp_path / "b", dtype="fp8")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    with pytest.raises(ExportError, match="not empty.*overwrite"):
        export_model(make_model("medusa"), tmp_path / "full")
    assert (tmp_path / "full" / "keep.txt").read_text() == "x"
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ExportError, match="not a directory"):
        export_model(make_model("medusa"), tmp_path / "afile")
    # an untransformed model exports its base only with format auto
    exp = export_model(plain, tmp_path / "base_only")
    assert (exp / "base" / "config.json").is_file() and not (exp / "draft").exists()
    with pytest.raises(ExportError, match="holds no draft"):
        import_draft(make_model("eagle1"), exp)


def test_eagle_formats_refuse_non_llama_base(tmp_path):
    from nemo_spec.models import build_gpt
    from nemo_spec.speculative import SpeculativeTransform
    from tests.helpers import tiny_gpt2

    m = SpeculativeTransform(algorithm="eagle1")(build_gpt(tiny_gpt2()))
    with pytest.raises(ExportError, match="Llama-style.*normalization='LayerNorm'"):
        export_model(m, tmp_path / "x")


def test_import_rejects_wrong_algorithm_and_shapes(exported, tmp_path):
    _, _, exp = exported["eagle1"]
    with pytest.raises(ExportError, match="holds a eagle1 draft but the model's draft is eagle3"):
        import_draft(make_model("eagle3"), exp)
    other = make_model("eagle3", draft_vocab_size=32)
    with pytest.raises(ExportError, match="output_layer.weight"):
        import_draft(other, exported["eagle3"][2])


def test_failed_export_leaves_nothing_and_keeps_previous(tmp_path, monkeypatch):
    import nemo_spec.export as ex

    model = make_model("eagle1", seed=3)

    def boom(*a, **k):
        raise RuntimeError("disk full (injected)")

    monkeypatch.setattr(ex, "_write_draft_dir", boom)
    with pytest.raises(RuntimeError, match="injected"):
        export_model(model, tmp_path / "exp")
    assert list(tmp_path.iterdir()) == []  # no export dir, no temp dir left behind
    monkeypatch.undo()
    first = export_model(model, tmp_path / "exp", dtype="fp32")
    before = sorted(p.relative_to(first) for p in first.rglob("*"))
    monkeypatch.setattr(ex, "_write_draft_dir", boom)
    with pytest.raises(RuntimeError, match="injected"):
        export_model(model, tmp_path / "exp", overwrite=True, dtype="bf16")
    assert sorted(p.relative_to(first) for p in first.rglob("*")) == before
    assert json.loads((first / "export_info.json").read_text())["dtype"] == "float32"
    assert [p.name for p in tmp_path.iterdir()] == ["exp"]


def test_overwrite_replaces_an_earlier_export_only(tmp_path):
    """export --overwrite into the source checkpoint, or into any directory that is not an export, deleted it
    (found by review: a checkpoint exported onto itself was gone); now refused, and the directory untouched. An
    earlier export is still replaced."""
    from nemo_spec.checkpoint import save_checkpoint
    from nemo_spec.models import build_gpt
    from tests.helpers import tiny_llama

    ck = save_checkpoint(build_gpt(tiny_llama()), tmp_path / "ck")
    home = tmp_path / "home"
    home.mkdir()
    (home / "thesis.tex").write_text("years of work")
    for target in (ck, home):
        before = sorted(p.name for p in target.iterdir())
        with pytest.raises(ExportError, match="not an export .*refusing to replace it"):
            export_checkpoint(ck, target, fmt="base", dtype="fp32", overwrite=True)
        assert sorted(p.name for p in target.iterdir()) == before
    first = export_checkpoint(ck, tmp_path / "exp", fmt="base", dtype="fp32")
    (first / "stale.txt").write_text("old")
    again = export_checkpoint(ck, first, fmt="base", dtype="fp32", overwrite=True)
    assert again == first and not (first / "stale.txt").exists() and (first / "export_info.json").is_file()


def test_untransformed_checkpoint_as_draft_fails_before_loading(tmp_path):
    from nemo_spec.models import build_gpt
    from tests.export_utils import base_config

    ckpt = _save(build_gpt(base_config()), tmp_path / "plain")
    with pytest.raises(ExportError, match=r"checkpoint .*plain has no draft.*not transformed"):
        export_checkpoint(ckpt, tmp_path / "out", fmt="medusa")
    assert not (tmp_path / "out").exists()


def test_cli(exported, tmp_path, capsys):
    from nemo_spec.export.cli import main

    _, ckpt, _ = exported["eagle3"]
    args = ["--checkpoint", str(ckpt), "--export_dir", str(tmp_path / "cli"), "--dtype", "fp16"]
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "export.py"), *args], capture_output=True, text=True,
                       cwd=ROOT, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert detect_draft_format(tmp_path / "cli") == "eagle3"
    assert json.loads((tmp_path / "cli" / "draft" / "vllm" / "config.json").read_text())["torch_dtype"] == "float16"
    assert "vllm       ok" in p.stderr and "sglang     ok" in p.stderr  # verified at the end by default
    # user errors: exit code 2 and a one-line message (run in-process; same entry point)
    assert main(args) == 2 and "not empty" in capsys.readouterr().err
    assert main(args[:-2] + ["--format", "medusa", "--overwrite"]) == 2
    assert "cannot be exported as medusa" in capsys.readouterr().err
    assert main(["--checkpoint", str(tmp_path / "missing"), "--export_dir", str(tmp_path / "x")]) == 2
    assert str(tmp_path / "missing") in capsys.readouterr().err


def test_tp2_export_and_import(exported, tmp_path):
    """TP=2 checkpoints export to the same files as their TP=1 load; exports import exactly at TP=1 and TP=2."""
    from nemo_spec.checkpoint import load_model
    from tests.helpers import run_torchrun

    blob = {}
    for alg, (model, ckpt, exp) in exported.items():
        ids, feats = _inputs(model)
        blob[alg] = {"ckpt": str(ckpt), "export": str(exp), "ids": ids, "feats": feats,
                     "logits": our_draft_logits(model, ids, feats)}
    torch.save(blob, tmp_path / "blob.pt")
    stdout = run_torchrun(ROOT / "tests" / "dist_scripts" / "export_tp2.py", [tmp_path], timeout=600)
    assert "EXPORT_TP2_OK" in stdout
    tp2 = torch.load(tmp_path / "tp2_out.pt")
    for alg in ALGS:
        exp2 = tmp_path / f"exp_tp2_{alg}"
        # the TP=2 checkpoint loaded at TP=1 exports byte-identical tensors (TP gather == exact reshard)
        m1 = load_model(tmp_path / f"ckpt_tp2_{alg}").eval()
        exp1 = export_model(m1, tmp_path / f"exp_tp1_{alg}", dtype="fp32", include_base=alg == "eagle3",
                            target=TARGET[alg])
        for sub in ("draft", "base") if alg == "eagle3" else ("draft",):
            names = ["medusa_lm_head.safetensors"] if (alg, sub) == ("medusa", "draft") else ["model.safetensors"]
            a, b = load_dir_tensors(exp1 / sub, names), load_dir_tensors(exp2 / sub, names)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (alg, sub)
        # the TP=2 export imported at TP=1 reproduces the TP=2 draft logits
        fresh = make_model(alg, seed=13).eval()
        fresh.gpt.load_state_dict(m1.gpt.state_dict())
        import_draft(fresh, exp2)
        ids, feats = blob[alg]["ids"], blob[alg]["feats"]
        assert (our_draft_logits(fresh, ids, feats) - tp2[alg]["logits"]).abs().max() < 1e-5


def test_eagle3_import_accepts_layers0_naming_and_requires_d2t(exported, tmp_path):
    """vLLM also loads EAGLE-3 drafts whose first layer is named layers.0.*; a reduced vocab without d2t is refused."""
    from safetensors.torch import load_file, save_file

    model, _, exp = exported["eagle3"]
    d = tmp_path / "renamed"
    d.mkdir()
    (d / "config.json").write_text((exp / "draft" / "config.json").read_text())
    orig = load_file(str(exp / "draft" / "model.safetensors"))
    sd = {k.replace("midlayer.", "layers.0."): v for k, v in orig.items()}
    save_file(sd, str(d / "model.safetensors"))
    fresh = make_model("eagle3", seed=8).eval()
    fresh.gpt.load_state_dict(model.gpt.state_dict())
    import_draft(fresh, d)
    ids, feats = _inputs(model)
    assert torch.equal(our_draft_logits(fresh, ids, feats), our_draft_logits(model, ids, feats))
    save_file({k: v for k, v in sd.items() if k not in ("d2t", "t2d")}, str(d / "model.safetensors"))
    with pytest.raises(ExportError, match="reduced vocabulary .*no 'd2t'"):
        import_draft(fresh, d)


def test_eagle3_full_vocab_two_layers_vllm_layout(tmp_path):
    """Draft vocab = base vocab (d2t all zero) and a second draft layer written as vLLM's layers.1.*."""
    model = make_model("eagle3", seed=6, draft_vocab_size=None, num_eagle_layers=2).eval()
    exp = export_model(model, tmp_path / "exp", dtype="fp32", include_base=False, target="vllm")
    conf = json.loads((exp / "draft" / "config.json").read_text())
    assert conf["num_hidden_layers"] == 2 and conf["draft_vocab_size"] == model.model_config.vocab_size
    ids, feats = _inputs(model)
    emb = model.gpt.embedding.word_embeddings.weight.detach()
    ref, base_ids, w = reference_eagle3(exp / "draft", emb, ids, feats)
    assert "layers.1.input_layernorm.weight" in w and "d2t" not in w and "t2d" not in w  # vLLM: no d2t param
    assert torch.equal(base_ids, torch.arange(model.model_config.vocab_size))
    assert (ref - our_draft_logits(model, ids, feats)).abs().max() < 1e-4


@pytest.mark.parametrize("target", ["vllm", "sglang", "trtllm"])
def test_eagle3_unsorted_aux_layers_import_back_in_aux_order(tmp_path, target):
    """The files hold fc over the sorted captured layers; import puts the blocks back in the draft's aux order
    (was: a distinct but unsorted aux list imported with permuted fc blocks)."""
    model = make_model("eagle3", seed=21, aux_layers=[2, 0, 1]).eval()
    exp = export_model(model, tmp_path / "e", dtype="fp32", include_base=False, target=target)
    fresh = make_model("eagle3", seed=21, aux_layers=[2, 0, 1]).eval()
    with torch.no_grad():
        fresh.eagle_module.fc.weight.zero_()
    import_draft(fresh, exp)
    assert torch.equal(fresh.eagle_module.fc.weight, model.eagle_module.fc.weight)


def test_exports_are_readable_by_other_users(exported):
    """An export (base HF dir + draft) gets the modes a plain mkdir / open gives (0o777 / 0o666 less the umask):
    tempfile.mkdtemp makes 0o700 folders and safetensors 0.8 writes 0o600 files, which an engine running under
    another account (a vLLM container, a shared filesystem) could not read."""
    import os

    from nemo_spec.fsutil import current_umask

    mask = current_umask()
    for _, _, exp in exported.values():
        paths = [exp, *exp.rglob("*")]
        assert any(p.suffix == ".safetensors" for p in paths) and any(p.name == "base" for p in paths)
        for p in paths:
            want = (0o777 if p.is_dir() else 0o666) & ~mask
            assert os.stat(p).st_mode & 0o777 == want, (p, oct(os.stat(p).st_mode & 0o777))


def test_damaged_export_files_are_export_errors_naming_the_file(exported, tmp_path):
    """From a review: import_draft / verify_export on a truncated safetensors or .pt file, a config.json that is a
    list, or an export_info.json without its format raised the library's own errors (SafetensorError,
    UnpicklingError, AttributeError, KeyError), which the CLIs print as tracebacks. Now an ExportError naming
    the file; the CLI exits 2 with one line."""
    import shutil

    from nemo_spec.export.cli import verify_main
    from nemo_spec.export.engines import verify_export

    model, ckpt, exp = exported["eagle3"]
    draft = exp / "draft"

    def damaged(name, edit):
        root = tmp_path / name
        shutil.copytree(exp, root)
        edit(root)
        return root

    cut = damaged("cut", lambda r: (r / "draft" / "model.safetensors").write_bytes(
        (draft / "model.safetensors").read_bytes()[:200]))
    with pytest.raises(ExportError, match="model.safetensors is damaged"):
        import_draft(make_model("eagle3"), cut)
    listed = damaged("listed", lambda r: (r / "draft" / "config.json").write_text("[1, 2]"))
    with pytest.raises(ExportError, match="config.json.*JSON object"):
        import_draft(make_model("eagle3"), listed)
    pt = tmp_path / "pt"
    shutil.copytree(exported["medusa"][2], pt)
    (pt / "draft" / "medusa_lm_head.safetensors").unlink()
    (pt / "draft" / "medusa_lm_head.pt").write_bytes(b"\x80\x04not a pickle")
    with pytest.raises(ExportError, match="medusa_lm_head.pt is damaged"):
        import_draft(make_model("medusa"), pt)
    empty = damaged("empty", lambda r: (r / "export_info.json").write_text("{}"))
    with pytest.raises(ExportError, match="export_info.json.*format"):
        verify_export(empty, model=model)
    engines = damaged("engines", lambda r: (r / "export_info.json").write_text(json.dumps(
        {**json.loads((exp / "export_info.json").read_text()), "engines": ["vllm"]})))
    with pytest.raises(ExportError, match="export_info.json.*engines"):
        verify_export(engines, model=model)
    assert verify_main([str(cut), "--checkpoint", str(ckpt)]) == 2


@pytest.mark.parametrize("kw,why", [
    ({}, None),
    ({"num_eagle_layers": 2}, "2 draft layers: its converter detects an EAGLE-3 draft only with one"),
    ({"aux_layers": [0, 0, 1]}, "2 distinct aux layers [1, 2]: it needs exactly 3"),
    ({"aux_layers": [0, 1, 3]}, "aux id 4 (the base's last layer's output)"),
])
def test_export_says_whether_and_how_llama_cpp_serves_an_eagle3_draft(tmp_path, kw, why):
    """llama.cpp reads draft/vllm (tests/llamacpp/test_llamacpp_spec.py runs it); export_info.json and the README
    say so with the converter and server commands, or name each of its limits the draft hits."""
    model = make_model("eagle3", seed=5, **kw).eval()
    exp = export_model(model, tmp_path / "e", dtype="fp32", include_base=True, target="all")
    entry = json.loads((exp / "export_info.json").read_text())["llamacpp"]
    readme = (exp / "README.md").read_text()
    assert entry["dir"] == "draft/vllm" and entry["spec_type"] == "draft-eagle3"
    if why is None:
        assert entry["unsupported"] is None
        assert (f"python convert_hf_to_gguf.py {exp / 'draft' / 'vllm'} --target-model-dir {exp / 'base'} "
                f"--outtype f16 --outfile draft.gguf") in readme
        assert "llama-server -m base.gguf -md draft.gguf --spec-type draft-eagle3 --spec-draft-n-max 4" in readme
    else:
        assert why in entry["unsupported"] and f"Not served by llama.cpp 0c1e570" in readme
        assert "convert_hf_to_gguf.py" not in readme


def test_export_tells_llama_cpp_users_the_dflash_block_and_sglang_only_eagle3_needs_the_vllm_layout(tmp_path):
    from nemo_spec.config import ModelConfig
    from nemo_spec.export.llamacpp import llamacpp_entry

    cfg = ModelConfig(vocab_size=96, hidden_size=64, num_layers=4, num_attention_heads=4, num_query_groups=2,
                      ffn_hidden_size=128, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                         "original_max_position_embeddings": 64})
    files = {"draft": ({}, {"block_size": 8})}
    e = llamacpp_entry("dflash", files, {"sglang": {"dir": "draft"}}, cfg, "LlamaForCausalLM")
    assert e["unsupported"] is None and e["n_max"] == 7 and e["spec_type"] == "draft-dflash"
    assert any("block_size - 1" in n for n in e["notes"]) and any("rope_freqs" in n for n in e["notes"])
    assert "Qwen2ForCausalLM graph hands a draft no layer inputs" in llamacpp_entry(
        "dflash", files, {"sglang": {"dir": "draft"}}, cfg, "Qwen2ForCausalLM")["unsupported"]
    assert "export with --target vllm or all" in llamacpp_entry("eagle3", {}, {"sglang": {"dir": "draft"}}, cfg,
                                                                "LlamaForCausalLM")["unsupported"]
    assert llamacpp_entry("medusa", {}, {}, cfg, "LlamaForCausalLM") is None
