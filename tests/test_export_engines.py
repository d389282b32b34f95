"""Engine conformance: every export format x every engine that claims it reads back as our draft; regression
tests for the ways exports used to load silently wrong in vLLM 0.33.0 / SGLang 0.5.23 (issue 14, bugs 1-7)."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from nemo_spec.export import ExportError, detect_draft_format, export_checkpoint, export_model, import_draft
from nemo_spec.export.engines import EngineMismatch, format_table, verify_export
from nemo_spec.export.engines import sglang, trtllm, vllm
from nemo_spec.export.engines._llama import base_forward
from tests.export_utils import make_model

IDS = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(5))

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}  # wavelengths over 16 and 64 positions: all three regimes
CASES = {  # name -> (alg, transform kwargs, base config kwargs)
    "eagle3_reduced": ("eagle3", {}, {}),
    "eagle3_full_2layers": ("eagle3", dict(draft_vocab_size=None, num_eagle_layers=2), {}),
    "eagle3_repeated_aux": ("eagle3", dict(aux_layers=[1, 1, 0]), {}),
    "eagle3_reference_aux": ("eagle3", dict(aux_layers=[1, 3, 4]), dict(num_layers=8)),
    "eagle1": ("eagle1", {}, {}),
    "medusa": ("medusa", {}, {}),
    # a Qwen2-style base (q/k/v biases): vLLM's o_proj then has a bias too, left torch.empty unless written
    "eagle3_qkv_bias": ("eagle3", {}, dict(add_qkv_bias=True)),
    "eagle1_qkv_bias": ("eagle1", {}, dict(add_qkv_bias=True)),
    # RoPE scaling (Llama 3.x): every reader rotates like the engine; EaModel's draft takes linear only
    "eagle3_llama3_rope": ("eagle3", dict(aux_layers=[1, 3, 4]), dict(num_layers=8, rope_scaling=LLAMA3_ROPE)),
    "eagle3_linear_rope": ("eagle3", dict(aux_layers=[1, 3, 4]),
                           dict(num_layers=8, rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "eagle1_linear_rope_theta": ("eagle1", {}, dict(rope_scaling={"rope_type": "linear", "factor": 2.0},
                                                    rope_theta=5e5)),
    # one captured layer: SGLang skips fc (features no wider than the embedding)
    "eagle3_single_aux": ("eagle3", dict(aux_layers=[2, 2, 2]), {}),
    # vLLM's speculators options (the speculators trainer's defaults), unsorted aux: input_norm's blocks follow fc's
    "eagle3_speculators_options": ("eagle3", dict(aux_layers=[4, 1, 3], num_eagle_layers=2, norm_before_fc=True,
                                                  norm_before_residual=True, norm_output=True), dict(num_layers=8)),
}
EXPECT = {  # engines that must verify ok; the others must say 'unsupported' with a reason
    "eagle3_reduced": {"vllm", "sglang", "trtllm"},
    "eagle3_full_2layers": {"vllm", "sglang", "trtllm"},
    "eagle3_repeated_aux": {"vllm", "sglang", "trtllm"},
    "eagle3_reference_aux": {"vllm", "sglang", "trtllm", "reference"},
    "eagle1": {"vllm", "sglang", "reference"},
    "medusa": {"reference"},
    "eagle3_qkv_bias": {"vllm"},
    "eagle1_qkv_bias": {"vllm", "sglang", "reference"},
    "eagle3_llama3_rope": {"vllm", "sglang", "trtllm"},
    "eagle3_linear_rope": {"vllm", "sglang", "trtllm", "reference"},
    "eagle1_linear_rope_theta": {"vllm", "sglang"},
    "eagle3_single_aux": {"vllm"},
    "eagle3_speculators_options": {"vllm"},
}


def _model(name):
    alg, kw, base_kw = CASES[name]
    if base_kw:
        import tests.export_utils as eu

        orig = eu.base_config
        eu.base_config = lambda **k: orig(**base_kw, **k)
        try:
            return make_model(alg, **kw).eval()
        finally:
            eu.base_config = orig
    return make_model(alg, **kw).eval()


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("engines")
    out = {}
    for name in CASES:
        m = _model(name)
        out[name] = (m, export_model(m, root / name, dtype="fp32", target="all"))
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_every_format_reads_back_in_every_claimed_engine(exports, name):
    model, exp = exports[name]
    rows = verify_export(exp, model=model)
    table = format_table(rows)
    status = {r.engine: r.status for r in rows}
    assert status.pop("base") == "ok", table
    assert {e for e, s in status.items() if s == "ok"} == EXPECT[name], table
    assert all(s == "unsupported" for e, s in status.items() if e not in EXPECT[name]), table
    assert all(r.max_abs_diff < 1e-4 for r in rows if r.status == "ok"), table
    info = json.loads((exp / "export_info.json").read_text())
    readme = (exp / "README.md").read_text()
    for eng in EXPECT[name]:
        assert info["engines"][eng]["dir"] == f"draft/{eng}" and f"Checked against" in readme
    fresh = _model(name)
    fresh.gpt.load_state_dict(model.gpt.state_dict())
    import_draft(fresh, exp)  # the per-engine layouts import back exactly
    with torch.no_grad():
        if model.algorithm == "medusa":
            a, b = (m.medusa_logits(m.base_forward(IDS).hidden) for m in (fresh, model))
        else:
            a, b = (m.draft_step(IDS[:, 1:], m.fuse(m.base_features(m.base_forward(IDS)))[:, :-1])[1]
                    for m in (fresh, model))
    assert (a - b).abs().max() < 1e-5


def _copy(src, dst, conf_edit=None, tensor_edit=None, weights="model.safetensors"):
    shutil.copytree(src, dst)
    conf = json.loads((dst / "config.json").read_text())
    if conf_edit:
        conf_edit(conf)
    (dst / "config.json").write_text(json.dumps(conf))
    if tensor_edit:
        w = load_file(str(dst / weights))
        tensor_edit(w)
        save_file(w, str(dst / weights))
    return dst


def _draft(model, ids=IDS):
    with torch.no_grad():
        out = model.base_forward(ids)
        return model.draft_step(ids[:, 1:], model.fuse(model.base_features(out))[:, :-1])[1]


def test_bug1_eagle1_bias_field_and_fc_bias_in_vllm(exports, tmp_path):
    """Old EAGLE-1 output: 'bias': true + fc.bias. vLLM reads 'bias' as attention bias (llama.py:267-271): the
    q/k/v/o biases it builds are not in the file; without the field it drops fc.bias (a different function)."""
    model, exp = exports["eagle1"]
    run = base_forward(exp / "base", IDS)
    old = exp / "draft" / "reference"  # what the single draft/ used to be
    with pytest.raises(EngineMismatch, match="torch.empty.*o_proj.bias"):
        vllm.draft_logits("eagle1", old, run, IDS)
    no_field = _copy(old, tmp_path / "nofield", conf_edit=lambda c: c.pop("bias"))
    theirs = vllm.draft_logits("eagle1", no_field, run, IDS)
    assert (theirs - _draft(model)).abs().max() > 1e-3  # fc.bias silently ignored
    ours = vllm.draft_logits("eagle1", exp / "draft" / "vllm", run, IDS)  # the fold keeps the function exact
    assert (ours - _draft(model)).abs().max() < 1e-4
    assert json.loads((exp / "draft" / "vllm" / "config.json").read_text()).get("bias") is None


def test_bug2_sglang_eagle1_needs_its_architecture(exports):
    _, exp = exports["eagle1"]
    run = base_forward(exp / "base", IDS)
    with pytest.raises(EngineMismatch, match="LlamaForCausalLMEagle"):
        sglang.draft_logits("eagle1", exp / "draft" / "reference", run, IDS)  # LlamaForCausalLM, as before
    conf = json.loads((exp / "draft" / "sglang" / "config.json").read_text())
    assert conf["architectures"] == ["LlamaForCausalLMEagle"] and "bias" not in conf


def test_bug3_sglang_aux_ids_are_zero_based(exports, tmp_path):
    """Old output wrote vLLM's ids (layer+1) under eagle_config; SGLang adds another +1 (llama.py:941)."""
    model, exp = exports["eagle3_reduced"]
    run = base_forward(exp / "base", IDS)
    old = _copy(exp / "draft" / "sglang", tmp_path / "old", conf_edit=lambda c: c["eagle_config"].update(
        eagle_aux_hidden_state_layer_ids=[i + 1 for i in c["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]))
    ours = sglang.draft_logits("eagle3", exp / "draft" / "sglang", run, IDS)
    with pytest.raises(EngineMismatch, match="distinct hidden states"):  # [1,2,3]+1 -> layer 4 is never captured
        sglang.draft_logits("eagle3", old, run, IDS)
    full = torch.full_like(ours, float("-inf"))
    assert torch.isfinite(ours).sum() == 2 * 8 * 48 and not torch.equal(ours, full)
    assert json.loads((exp / "draft" / "sglang" / "config.json").read_text())["eagle_config"][
        "eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    assert json.loads((exp / "draft" / "vllm" / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [
        1, 2, 3]


def test_vllm_eagle3_reads_only_the_top_level_aux_ids(exports, tmp_path):
    """vLLM runs EAGLE-3 on its V2 model runner by default (config/vllm.py:731-760, 3066-3075 @ 0.33.0), whose
    eagle3_utils.py:113-124 reads the top-level eagle_aux_hidden_state_layer_ids only: a draft with its ids only in
    eagle_config is captured at the model's default layers (the reader used to follow the V1 runner's fallback to
    eagle_config, gone in vLLM 0.34.0)."""
    model, exp = exports["eagle3_full_2layers"]
    run = base_forward(exp / "base", IDS)
    d = exp / "draft" / "vllm"
    assert (vllm.draft_logits("eagle3", d, run, IDS) - _draft(model)).abs().max() < 1e-4
    conf = json.loads((d / "config.json").read_text())
    assert conf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == conf["eagle_aux_hidden_state_layer_ids"]
    only_nested = _copy(d, tmp_path / "nested", conf_edit=lambda c: c.pop("eagle_aux_hidden_state_layer_ids"))
    L = run.num_layers
    assert vllm.aux_layer_ids(json.loads((only_nested / "config.json").read_text())) is None
    assert sorted(set(conf["eagle_aux_hidden_state_layer_ids"])) != sorted({2, L // 2, L - 3})
    with pytest.raises(EngineMismatch, match=r"aux ids \[2, 2, 1\] capture 2 distinct hidden states"):  # default
        vllm.draft_logits("eagle3", only_nested, run, IDS)


def test_bug4_vllm_full_vocab_has_no_d2t(exports, tmp_path):
    _, exp = exports["eagle3_full_2layers"]
    run = base_forward(exp / "base", IDS)
    assert "d2t" not in load_file(str(exp / "draft" / "vllm" / "model.safetensors"))
    old = _copy(exp / "draft" / "vllm", tmp_path / "old",
                tensor_edit=lambda w: w.update(d2t=torch.zeros(96, dtype=torch.long)))
    with pytest.raises(EngineMismatch, match="d2t stored for a full-vocabulary draft"):
        vllm.draft_logits("eagle3", old, run, IDS)


def test_bug5_repeated_aux_layers_are_merged_for_the_engines(exports, tmp_path):
    """aux [1, 1, 0]: engines capture the distinct layers sorted ([0, 1]); the old fc [h, 3h] was a shape error."""
    model, exp = exports["eagle3_repeated_aux"]
    run = base_forward(exp / "base", IDS)
    w = load_file(str(exp / "draft" / "vllm" / "model.safetensors"))
    assert tuple(w["fc.weight"].shape) == (64, 128)
    old_fc = model.eagle_module.fc.weight.detach().clone()
    old = _copy(exp / "draft" / "vllm", tmp_path / "old",
                conf_edit=lambda c: c.update(eagle_aux_hidden_state_layer_ids=[2, 2, 1], eagle_config={
                    "eagle_aux_hidden_state_layer_ids": [2, 2, 1], "use_aux_hidden_state": True}),
                tensor_edit=lambda w: w.update({"fc.weight": old_fc}))
    with pytest.raises(EngineMismatch, match="shape error at run time"):
        vllm.draft_logits("eagle3", old, run, IDS)


def test_bug6_sglang_multi_layer_eagle3_uses_hidden_norm(exports, tmp_path):
    model, exp = exports["eagle3_full_2layers"]
    run = base_forward(exp / "base", IDS)
    # layers >= 1 as input_layernorm (the old single layout), aux ids already in SGLang's numbering
    old = _copy(exp / "draft" / "vllm", tmp_path / "old", conf_edit=lambda c: c["eagle_config"].update(
        eagle_aux_hidden_state_layer_ids=[0, 1, 2]))
    with pytest.raises(EngineMismatch, match="layers.1.hidden_norm"):
        sglang.draft_logits("eagle3", old, run, IDS)
    assert "layers.1.hidden_norm.weight" in load_file(str(exp / "draft" / "sglang" / "model.safetensors"))


def test_bug7_no_medusa_for_vllm_033_and_stale_claims_gone(exports, tmp_path):
    model, exp = exports["medusa"]
    with pytest.raises(ExportError, match="vllm 0.33.0 cannot serve a medusa draft"):
        export_model(model, tmp_path / "x", target="vllm")
    assert not (tmp_path / "x").exists()
    readme = (exp / "README.md").read_text()
    assert "vllm serve" not in readme and "draft_vllm_legacy" in readme
    for _, e in exports.values():
        text = (e / "README.md").read_text()
        assert "loads strictly" not in text and "single `midlayer`" not in text


def test_single_target_writes_draft_dir_and_verifies_at_export(tmp_path):
    model = make_model("eagle3", seed=2).eval()
    exp = export_model(model, tmp_path / "v", dtype="fp32", target="sglang", verify=True)
    assert (exp / "draft" / "config.json").is_file() and not (exp / "draft" / "vllm").exists()
    with pytest.raises(ExportError, match="EaModel captures the inputs of layers 2, L//2, L-3"):
        export_model(model, tmp_path / "r", target="reference")


def test_an_export_that_fails_verification_is_never_published(tmp_path):
    """verify=True ran after the export was renamed into place: a failed verification raised but left a complete
    looking export behind (and a retry then met "exists and is not empty"); found by review. Now verification
    reads the temp directory first: nothing appears, and the retry with a fixed model succeeds."""
    model = make_model("eagle3", seed=2).eval()
    with torch.no_grad():  # beyond fp16's range: inf in the fp16 export, so the readers disagree with the model
        model.eagle_module.fc.weight[0, 0] = 1e6
    out = tmp_path / "ex"
    with pytest.raises(ExportError, match="does not load as our draft.*nothing was written"):
        export_model(model, out, dtype="fp16", verify=True)
    assert not out.exists() and list(tmp_path.iterdir()) == []
    with torch.no_grad():
        model.eagle_module.fc.weight[0, 0] = 0.0
    assert (export_model(model, out, dtype="fp16", verify=True) / "export_info.json").is_file()


def test_trtllm_multi_layer_loads_in_both_snapshots(exports, tmp_path):
    """TensorRT-LLM @ b35ac1b64368: load_weights only prefixes 'model.' (modeling_speculative.py:301-305) onto
    midlayer.N (171-177), and every layer is an Eagle3DecoderLayer with input_layernorm + hidden_norm and a 2h qkv
    (55-56, 97-107, 119-122). The old layers.N.* output with a Llama layer 1 loaded nothing for midlayer.1.
    TensorRT-LLM @ 00679c66c3e3 (Eagle3DecoderLayer.__init__) builds layers >= 1 as *regular* layers (h-wide qkv,
    no input_layernorm) unless eagle_config.next_layer_regular is false: the 2h layout without that key (what the
    exporter wrote before) fails its qkv load, so the export writes the key (the older snapshot reads none)."""
    model, exp = exports["eagle3_full_2layers"]
    run = base_forward(exp / "base", IDS)
    d = exp / "draft" / "trtllm"
    w = load_file(str(d / "model.safetensors"))
    conf = json.loads((d / "config.json").read_text())
    assert conf["eagle_config"] == {"next_layer_regular": False}
    assert not any(k.startswith("layers.") for k in w) and "d2t" not in w and "t2d" not in w
    for i in (0, 1):
        for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
            assert f"midlayer.{i}.{n}.weight" in w
        assert tuple(w[f"midlayer.{i}.self_attn.q_proj.weight"].shape) == (64, 128)
    assert w["midlayer.1.self_attn.q_proj.weight"][:, :64].abs().max() == 0  # layer 1 ignores the embedding
    launch = {"eagle3_layers_to_capture": conf["nemo_spec_aux"]["captured"]}
    want = _draft(model)
    for snap in trtllm.SNAPSHOTS:
        assert (trtllm.eagle3_logits(d, run, IDS, launch, snap) - want).abs().max() < 1e-4
    assert (trtllm.draft_logits("eagle3", d, run, IDS, launch) - want).abs().max() < 1e-4

    no_key = _copy(d, tmp_path / "no_key", conf_edit=lambda c: c.pop("eagle_config"))
    assert (trtllm.eagle3_logits(no_key, run, IDS, launch, trtllm.SNAPSHOTS[0]) - want).abs().max() < 1e-4
    with pytest.raises(EngineMismatch, match=r"00679c66c3e3: midlayer.1.self_attn.q_proj.weight \(64, 128\) has 128 "
                                             r"inputs.*takes 64 there \(a regular layer"):
        trtllm.draft_logits("eagle3", no_key, run, IDS, launch)

    def regular(t):  # the layout 00679c66c3e3 builds by default: layers.N.* names, layer 1 a regular layer
        for k in list(t):
            v = t.pop(k)
            if k == "midlayer.1.input_layernorm.weight":
                continue
            if k.startswith("midlayer.1.self_attn.") and k.split(".")[-2] in ("q_proj", "k_proj", "v_proj"):
                v = v[:, 64:].contiguous()
            t[k.replace("midlayer.", "layers.", 1) if k.startswith("midlayer.") else k] = v

    reg = _copy(no_key, tmp_path / "regular", tensor_edit=regular)
    assert (trtllm.eagle3_logits(reg, run, IDS, launch, trtllm.SNAPSHOTS[1]) - want).abs().max() < 1e-4
    with pytest.raises(EngineMismatch, match="b35ac1b64368: .*name no module"):
        trtllm.draft_logits("eagle3", reg, run, IDS, launch)
    snippet = trtllm.launch_command("eagle3", exp / "base", d, capture=launch["eagle3_layers_to_capture"])
    assert "eagle3_one_model" not in snippet and "speculative_model_dir=" in snippet  # an alias at 00679c66c3e3


def test_trtllm_single_captured_layer_has_no_fc(exports, tmp_path):
    """modeling_speculative.py:164-168 builds fc only for num_capture_layers > 1 (337-338 skip it otherwise)."""
    model = make_model("eagle3", aux_layers=[2, 2, 2], seed=3).eval()
    with pytest.raises(ExportError, match="fc only for more than one captured layer"):
        export_model(model, tmp_path / "t", target="trtllm")
    _, exp = exports["eagle3_reduced"]
    run = base_forward(exp / "base", IDS)
    with pytest.raises(EngineMismatch, match="no parameter for \\['fc.weight'"):  # one capture layer: no fc module
        trtllm.draft_logits("eagle3", exp / "draft" / "trtllm", run, IDS, {"eagle3_layers_to_capture": [2]})


def test_verify_script_exit_codes(tmp_path, capsys):
    from nemo_spec.checkpoint import save_checkpoint
    from nemo_spec.export.cli import verify_main

    model = make_model("eagle1", seed=4).eval()
    ckpt = save_checkpoint(model, tmp_path / "ckpt")
    exp = export_checkpoint(ckpt, tmp_path / "exp", dtype="fp32", verify=True)
    assert verify_main([str(exp), "--checkpoint", str(ckpt)]) == 0
    assert "sglang" in capsys.readouterr().out
    w = load_file(str(exp / "draft" / "sglang" / "model.safetensors"))
    w["fc.bias"] = w["fc.bias"] + 0.5
    save_file(w, str(exp / "draft" / "sglang" / "model.safetensors"))
    assert verify_main([str(exp), "--checkpoint", str(ckpt)]) == 1
    out = capsys.readouterr().out
    assert "sglang     mismatch" in out and "vllm       ok" in out


def test_draft_vocab_counts_loss_masked_targets_only():
    from nemo_spec.training.run import token_counts

    class S:
        def __init__(self, ids, mask):
            self.input_ids, self.loss_mask = torch.tensor(ids), torch.tensor(mask)

    class D:
        samples = [S([5, 5, 5, 7, 8], [0, 0, 0, 1, 1]), S([5, 9], [0, 1])]

    c = token_counts(D(), 16)
    assert c[5] == 0 and c[7] == 1 and c[8] == 1 and c[9] == 1 and int(c.sum()) == 3  # prompt tokens excluded
    D.samples.append(S([3, 16], [1, 1]))
    with pytest.raises(ValueError, match="token id 16 outside the base vocabulary"):
        token_counts(D(), 16)  # used to be clamped into id 15


@pytest.mark.parametrize("alg", ["peagle", "dflash"])
def test_parallel_drafts_on_a_biased_rope_scaled_base_verify_in_their_engines(alg, tmp_path):
    """P-EAGLE (vLLM, through the EAGLE-3 writer: o_proj biases) and DFlash (every engine: rotated like the
    engine's llama3 RoPE) export on a Qwen2-style base with Llama-3 RoPE scaling and verify exactly (an export
    whose verification fails is refused, so export_model returning is the check; the rows say which engines)."""
    from tests.helpers import tiny_llama
    from tests.speculative_utils import make_spec

    m = make_spec(tiny_llama(num_layers=8, add_qkv_bias=True, rope_scaling=LLAMA3_ROPE), alg).eval()
    exp = export_model(m, tmp_path / alg, dtype="fp32", target="all", verify=True)
    rows = {r.engine: r for r in verify_export(exp, model=m, seq_len=11)}
    ok = {e for e, r in rows.items() if r.status == "ok"}
    # SGLang 0.5.23's Qwen2 captures no DFlash features (models/qwen2.py: no set_dflash_layers_to_capture), nor does
    # TensorRT-LLM's (no capture call in its QwenDecoderLayer at the pinned commit; DFlash is one-model only there)
    want = {"base", "vllm"} if alg == "peagle" else {"base", "vllm", "reference"}
    assert ok == want, format_table(list(rows.values()))
    assert all(r.max_abs_diff < 1e-4 for r in rows.values() if r.status == "ok")
    if alg == "peagle":
        w = load_file(str(exp / "draft" / "vllm" / "model.safetensors"))
        assert all(torch.equal(w[f"layers.{i}.self_attn.o_proj.bias"], torch.zeros(64)) for i in range(2))


def test_foreign_eagle3_files_are_matched_to_the_models_aux_layers(exports, tmp_path):
    """EAGLE-3 files other tools wrote carry no nemo_spec_aux: their fc reads the captured layers in layer order, named
    by ids whose numbering depends on the writer. A model with the same layers in another order imports them with
    fc's blocks reordered (they were loaded as they stood: a silently wrong draft); a model fed other layers is
    refused naming both (it imported silently)."""
    import tests.export_utils as eu

    model, exp = exports["eagle3_reference_aux"]  # aux [1, 3, 4] of an 8-layer base

    def built(aux):
        orig = eu.base_config
        eu.base_config = lambda **k: orig(num_layers=8, **k)
        try:
            m = make_model("eagle3", aux_layers=aux).eval()
        finally:
            eu.base_config = orig
        m.gpt.load_state_dict(model.gpt.state_dict())
        return m

    def strip(conf):
        conf.pop("nemo_spec_aux")

    def ids_in_eagle_config_only(conf):  # vLLM's numbering (inputs), only where SGLang reads 0-based outputs
        strip(conf)
        conf.pop("eagle_aux_hidden_state_layer_ids")

    def modelopt(conf):  # hf_spec_configs.py:18-56 @ nvidia-modelopt 0.47.0: 0-based outputs + its own keys
        strip(conf)
        conf.pop("eagle_aux_hidden_state_layer_ids")
        conf["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [1, 3, 4], "use_aux_hidden_state": True,
                                "use_input_layernorm_in_first_layer": True, "use_last_layernorm": True,
                                "next_layer_regular": True, "parallel_draft_step": 1}

    def no_ids(conf):  # engines then capture their default: inputs of layers 2, L//2, L-3 = outputs 1, 3, 4
        ids_in_eagle_config_only(conf)
        conf.pop("eagle_config")

    dirs = {"vllm": _copy(exp / "draft" / "vllm", tmp_path / "vllm", strip),
            "sglang": _copy(exp / "draft" / "sglang", tmp_path / "sglang", strip),
            "vllm_ids_in_eagle_config": _copy(exp / "draft" / "vllm", tmp_path / "vec", ids_in_eagle_config_only),
            "modelopt": _copy(exp / "draft" / "vllm", tmp_path / "mo", modelopt),
            "no_ids": _copy(exp / "draft" / "vllm", tmp_path / "none", no_ids)}
    want = _draft(model)
    for name, d in dirs.items():
        for aux in ([1, 3, 4], [4, 1, 3]):
            m = built(aux)
            import_draft(m, d)
            assert (_draft(m) - want).abs().max() < 1e-5, (name, aux)
        fix = r"" if name == "vllm_ids_in_eagle_config" else r".*aux_layers=\[1, 3, 4\]"  # read both ways there
        with pytest.raises(ExportError, match=r"reads base layers .*\[1, 3, 4\].* fed layers \[1, 3, 5\]" + fix):
            import_draft(built([1, 3, 5]), d)


def test_tp2_import_of_a_foreign_eagle3_file_without_lm_head(tmp_path):
    """At TP=2 every rank reads a vLLM-layout EAGLE-3 file another tool wrote (no nemo_spec_aux) without lm_head (a
    full-vocabulary ModelOpt Megatron export: the base's output layer stands in, gathered over TP) into a model
    whose aux layers are unsorted (fc's sorted blocks reordered): the draft equals the one exported, exactly."""
    from nemo_spec.checkpoint import save_checkpoint
    from nemo_spec.export import draft_state_dict
    from tests.helpers import ROOT, run_torchrun

    m = make_model("eagle3", draft_vocab_size=None, aux_layers=[2, 0, 1]).eval()
    with torch.no_grad():  # a draft that predicts with the base's head, as such files mean
        m.eagle_module.output_layer.weight.copy_(m.gpt.output_layer.weight)
    ckpt = save_checkpoint(m, tmp_path / "ckpt")
    exp = export_model(m, tmp_path / "exp", dtype="fp32", target="vllm")

    def foreign(conf):
        conf.pop("nemo_spec_aux")

    d = _copy(exp / "draft", tmp_path / "foreign", foreign, lambda w: w.pop("lm_head.weight"))
    torch.save({"ckpt": str(ckpt), "export": str(d), "draft": draft_state_dict(m), "algorithm": "eagle3",
                "target": "vllm"}, tmp_path / "blob.pt")
    assert "DRAFT_EXPORT_TP2_OK eagle3" in run_torchrun(ROOT / "tests" / "dist_scripts" / "draft_export_tp2.py",
                                                        [tmp_path], timeout=300)


def test_nonzero_attention_biases_the_draft_lacks_are_refused(exports, tmp_path):
    """A vLLM EAGLE-3 file on a q/k/v-biased base carries o_proj biases (vLLM builds them from attention_bias): zeros
    import (the same function), a trained nonzero one was dropped silently (found by review)."""
    model, exp = exports["eagle3_qkv_bias"]

    def o_bias(w):
        w["midlayer.self_attn.o_proj.bias"] = torch.randn(w["midlayer.self_attn.o_proj.bias"].shape)

    d = _copy(exp / "draft" / "vllm", tmp_path / "obias", tensor_edit=o_bias)
    with pytest.raises(ExportError, match=r"nonzero attention biases .*midlayer\.self_attn\.o_proj\.bias"):
        import_draft(_model("eagle3_qkv_bias"), d)
    import_draft(_model("eagle3_qkv_bias"), exp / "draft" / "vllm")  # its zeros


def _as_speculators(conf):
    """Our vLLM EAGLE-3 config rewritten as vllm-project/speculators 0.9.0 saves one (models/eagle3/config.py:27-82):
    architectures Eagle3DraftModel, the draft's Llama config nested under transformer_layer_config, vLLM-numbered ids
    at the top level, its draft options off."""
    conf.pop("nemo_spec_aux")
    conf.pop("eagle_config", None)
    keep = ("draft_vocab_size", "eagle_aux_hidden_state_layer_ids", "tie_word_embeddings", "architectures")
    layer = {k: conf.pop(k) for k in list(conf) if k not in keep}
    conf.update(architectures=["Eagle3DraftModel"], speculators_model_type="eagle3", transformer_layer_config=layer,
                norm_before_fc=False, norm_before_residual=False, norm_output=False, fc_norm=False,
                target_hidden_size=None, speculators_config={"algorithm": "eagle3"})


def _layers_0(w):
    for k in [k for k in w if k.startswith("midlayer.")]:  # speculators names layer 0 layers.0.* (core.py:71-78)
        w[k.replace("midlayer.", "layers.0.")] = w.pop(k)


def test_speculators_eagle3_drafts_import_and_their_options_must_match(exports, tmp_path):
    """speculators' EAGLE-3 files (the Hub's *-speculator.eagle3 drafts) were refused outright. They import now
    (checked against files speculators 0.9.0's own save code wrote, tests/speculators). Its draft options
    (norm_before_fc with its input_norm tensor, norm_before_residual, norm_output: the speculators trainer's
    defaults) must be the model's — a file trained with them imported into a draft without them was another function
    (max logit error 1.79) — and a speculators config without norm_before_residual means true, as vLLM reads it."""
    model, exp = exports["eagle3_reference_aux"]
    d = _copy(exp / "draft" / "vllm", tmp_path / "spec", _as_speculators, _layers_0)
    fresh = _model("eagle3_reference_aux")
    fresh.gpt.load_state_dict(model.gpt.state_dict())
    assert detect_draft_format(d) == "eagle3" and import_draft(fresh, d) == "eagle3"
    assert (_draft(fresh) - _draft(model)).abs().max() < 1e-5
    for flag in ("norm_before_residual", "norm_output"):
        e = _copy(d, tmp_path / flag, lambda c: c.update({flag: True}))
        with pytest.raises(ExportError, match=rf"trained with {flag}=True, this model's draft with {flag}=False.*"
                                              rf"SpeculativeTransform\(\.\.\., {flag}=True\)"):
            import_draft(_model("eagle3_reference_aux"), e)
    e = _copy(d, tmp_path / "fc_norm", lambda c: c.update({"fc_norm": True}))
    with pytest.raises(ExportError, match="trained with fc_norm.*not supported"):
        import_draft(_model("eagle3_reference_aux"), e)
    e = _copy(d, tmp_path / "absent", lambda c: c.pop("norm_before_residual"))  # vLLM's default then: true
    with pytest.raises(ExportError, match=r"norm_before_residual=True.*absent one as true"):
        import_draft(_model("eagle3_reference_aux"), e)
    e = _copy(d, tmp_path / "input_norm", tensor_edit=lambda w: w.update({"input_norm.weight": torch.ones(3 * 64)}))
    with pytest.raises(ExportError, match=r"tensors this EAGLE-3 draft does not have: \['input_norm.weight'\].*"
                                          r"without norm_before_fc"):
        import_draft(_model("eagle3_reference_aux"), e)
    e = _copy(exp / "draft" / "vllm", tmp_path / "qnorm",
              tensor_edit=lambda w: w.update({"midlayer.self_attn.q_norm.weight": torch.ones(16)}))
    with pytest.raises(ExportError, match=r"does not have: \['midlayer.self_attn.q_norm.weight'\]"):
        import_draft(_model("eagle3_reference_aux"), e)


def test_draft_option_edge_cases(exports, tmp_path):
    """From a review: SpecForge's norm_output=false (logits without the final norm, llama3_eagle.py:1690) is refused
    again; norm_before_fc is read from eagle_config first, as vLLM reads it (llama_eagle3.py:184-187); and
    norm_before_fc over repeated aux layers is refused at the transform (no engine captures a layer twice, so it
    could never be exported)."""
    from nemo_spec.config import ConfigError

    _, exp = exports["eagle3_speculators_options"]

    def specforge(conf):
        conf["norm_output"] = False

    with pytest.raises(ExportError, match="trained with norm_output=false"):
        import_draft(_model("eagle3_reduced"), _copy(exports["eagle3_reduced"][1] / "draft" / "vllm",
                                                     tmp_path / "sf", specforge))

    def in_eagle_config(conf):
        conf["eagle_config"]["norm_before_fc"] = conf.pop("norm_before_fc")

    assert import_draft(_model("eagle3_speculators_options"),
                        _copy(exp / "draft" / "vllm", tmp_path / "ec", in_eagle_config)) == "eagle3"
    with pytest.raises(ConfigError, match=r"norm_before_fc needs 3 distinct aux layers.*\[1, 1, 2\]"):
        make_model("eagle3", aux_layers=[1, 1, 2], norm_before_fc=True)


@pytest.mark.parametrize("algorithm", ["eagle3", "dflash"])
def test_drafts_reading_aux_features_are_not_exported_for_engines_whose_base_class_cannot_give_them(tmp_path,
                                                                                                     algorithm):
    """EAGLE-3 / DFlash drafts read the base's intermediate hidden states; vLLM's MixtralForCausalLM does not
    implement SupportsEagle3 (vllm 0.34.0 model_executor/models/mixtral.py:375; the runner raises at
    eagle3_utils.py:18-19) and SGLang's has no set_eagle3_layers_to_capture (0.5.23 model_runner_components/
    attention_backend_setup.py:54-71), yet such drafts were exported, and verified, for both."""
    from nemo_spec.checkpoint.hf import hf_to_model_config
    from nemo_spec.models import build_gpt
    from nemo_spec.speculative import SpeculativeTransform

    cfg = hf_to_model_config({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 96,
                              "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
                              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
                              "num_local_experts": 4, "num_experts_per_tok": 2, "eos_token_id": 2}, "mixtral")
    kw = (dict(algorithm="eagle3", num_eagle_layers=1, draft_vocab_size=48, aux_layers=[0, 1, 2])
          if algorithm == "eagle3" else
          dict(algorithm="dflash", num_layers=1, block_size=4, target_layer_ids=[0, 2], mask_token_id=5))
    torch.manual_seed(0)
    model = SpeculativeTransform(**kw)(build_gpt(cfg))
    # TensorRT-LLM's MixtralForCausalLM never passes spec_metadata to its layers (modeling_mixtral.py @ b35ac1b64368
    # MixtralModel.forward): such drafts were exported for it too
    for engine in ("vllm", "sglang", "trtllm"):
        with pytest.raises(ExportError, match=f"{engine} .*MixtralForCausalLM does not hand a draft the base's "
                                              f"intermediate hidden states"):
            export_model(model, tmp_path / engine, dtype="fp32", target=engine)
    if algorithm == "eagle3":  # the reference code's KV Mixtral collects no aux states either: nothing can run it
        with pytest.raises(ExportError, match="no engine can serve this eagle3 draft"):
            export_model(model, tmp_path / "all", dtype="fp32", target="all")
        return
    out = export_model(model, tmp_path / "all", dtype="fp32", target="all")
    info = json.loads((out / "export_info.json").read_text())
    assert set(info["engines"]) == {"reference"}
    assert all("intermediate hidden states" in info["skipped_engines"][e] for e in ("vllm", "sglang", "trtllm"))


def _hf_base(arch: str, model_type: str, **extra):
    from nemo_spec.checkpoint.hf import hf_to_model_config
    from nemo_spec.models import build_gpt

    cfg = hf_to_model_config({"architectures": [arch], "model_type": model_type, "vocab_size": 96, "hidden_size": 64,
                              "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
                              "num_key_value_heads": 2, "max_position_embeddings": 256, "eos_token_id": 2, **extra},
                             model_type)
    torch.manual_seed(0)
    return build_gpt(cfg)


def test_trtllm_serves_mistral_eagle3_two_model_and_no_dflash_off_its_one_model_bases(tmp_path):
    """TensorRT-LLM's MistralForCausalLM is a DecoderModelForCausalLM: its layers capture hidden states but the class
    holds no draft, so EAGLE-3 runs only in the two-model mode (eagle3_one_model=False; NVIDIA/TensorRT-LLM#6158) —
    the snippet used the one-model default — and DFlash (one-model only) not at all. Qwen2's layers capture nothing
    at the pinned commit and the PyTorch backend has no GPT-2; DFlash drafts were exported for all three."""
    from nemo_spec.speculative import SpeculativeTransform

    dflash = dict(algorithm="dflash", num_layers=1, block_size=4, target_layer_ids=[0, 2], mask_token_id=5)
    mistral = _hf_base("MistralForCausalLM", "mistral", sliding_window=4096)
    model = SpeculativeTransform(algorithm="eagle3", num_eagle_layers=1, aux_layers=[0, 1, 2])(mistral)
    out = export_model(model, tmp_path / "m3", dtype="fp32", target="trtllm")
    info = json.loads((out / "export_info.json").read_text())
    assert info["engines"]["trtllm"]["launch"]["eagle3_one_model"] is False
    readme = (out / "README.md").read_text()
    snippet = readme[readme.index("```python\n") + 10:readme.index("```", readme.index("```python\n") + 10)]
    assert "eagle3_one_model=False" in snippet
    compile(snippet, "launch", "exec")  # the README's snippet is valid Python
    assert [r.status for r in verify_export(out, model=model)] == ["ok", "ok"]
    llama = export_model(SpeculativeTransform(algorithm="eagle3", num_eagle_layers=1, aux_layers=[0, 1, 2])(
        _hf_base("LlamaForCausalLM", "llama")), tmp_path / "l3", dtype="fp32", target="trtllm")
    assert "eagle3_one_model" not in (llama / "README.md").read_text()  # the default one-model path
    assert "eagle3_one_model" not in json.loads((llama / "export_info.json").read_text())["engines"]["trtllm"]["launch"]

    from tests.helpers import tiny_gpt2
    from nemo_spec.models import build_gpt

    torch.manual_seed(0)
    bases = {"MistralForCausalLM": _hf_base("MistralForCausalLM", "mistral", sliding_window=4096),
             "Qwen2ForCausalLM": _hf_base("Qwen2ForCausalLM", "qwen2"),
             "GPT2LMHeadModel": build_gpt(tiny_gpt2(num_layers=4))}
    for arch, base in bases.items():
        with pytest.raises(ExportError, match=f"trtllm .*{arch} does not hand a draft"):
            export_model(SpeculativeTransform(**dflash)(base), tmp_path / arch, dtype="fp32", target="trtllm")
    qwen3 = export_model(SpeculativeTransform(**dflash)(_hf_base("Qwen3ForCausalLM", "qwen3", head_dim=16)),
                         tmp_path / "q3", dtype="fp32", target="trtllm")
    assert "1.3.0rc14" in (qwen3 / "README.md").read_text()  # the release DFlash needs there, not 1.2.x



def test_the_trtllm_two_model_check_leaves_bases_no_family_writes_to_the_other_checks(monkeypatch, tmp_path):
    """The TensorRT-LLM branch asked for the base's HF architecture unguarded: a FamilyError (not an ExportError,
    which a --target all export skips per engine) would end the whole export (diff review; the bases that reach it
    today all have a family, so the failure is forced here)."""
    import nemo_spec.checkpoint.families as fams
    from nemo_spec.checkpoint.families import FamilyError

    model = _model("eagle3_reduced")

    def no_family(*a, **k):
        raise FamilyError("no Hugging Face architecture can hold this model: (forced)")

    monkeypatch.setattr(fams, "family_for_export", no_family)
    out = export_model(model, tmp_path / "d", dtype="fp32", target="trtllm", include_base=False)
    launch = json.loads((out / "export_info.json").read_text())["engines"]["trtllm"]["launch"]
    assert "eagle3_one_model" not in launch


def test_bf16_verification_scales_with_the_logits_and_still_catches_a_wrong_layout(tmp_path):
    """A bf16 export's rounding grows with its logits: SmolLM2-135M's bf16 base was off by 0.22 (0.66% of its
    largest logit, 33.5) and a fixed 0.15 refused the headline model's default export. Here a base whose logits are
    ~300x larger stands in; a swapped layout is still a mismatch."""
    model = make_model("eagle3", seed=8).eval()
    with torch.no_grad():  # logits (and their bf16 rounding) ~300x larger, layout untouched
        model.gpt.output_layer.weight.mul_(300.0)
        model.eagle_module.output_layer.weight.mul_(300.0)
    exp = export_model(model, tmp_path / "exp", dtype="bf16", target="vllm")
    rows = {r.engine: r for r in verify_export(exp, model=model)}
    assert rows["base"].max_abs_diff > 0.15 and rows["base"].status == "ok"
    assert rows["vllm"].status == "ok"
    w = load_file(str(exp / "draft" / "model.safetensors"))
    q = w["midlayer.self_attn.q_proj.weight"]
    w["midlayer.self_attn.q_proj.weight"] = torch.cat([q[q.shape[0] // 2:], q[:q.shape[0] // 2]])  # heads swapped
    save_file(w, str(exp / "draft" / "model.safetensors"))
    assert {r.engine: r for r in verify_export(exp, model=model)}["vllm"].status == "mismatch"
