"""Target families Qwen3 (dense), Qwen3-MoE, Mixtral and sliding-window attention, end to end against transformers:
logits (several lengths, beyond the window), HF export round trip, EAGLE-3 draft (aux capture, training steps,
export verified through the engine conformance readers), greedy speculative == greedy AR, TP=2, EP=2 (MoE), config
and expert-parallel errors, and the README support table generated from the family declarations."""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nemo_spec.checkpoint import families
from nemo_spec.checkpoint.hf import HFCheckpointError, export_hf, hf_to_model_config, load_hf
from nemo_spec.models import gpt_forward
from tests.helpers import ROOT, run_torchrun

transformers = pytest.importorskip("transformers")
V, WINDOW = 96, 6
BASE = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2)


def _config(kind: str):
    T = transformers
    if kind == "qwen3":  # head_dim 32 != 64/4, tied, window on layers 1 and 3 (layer_types)
        return T.Qwen3Config(**BASE, head_dim=32, tie_word_embeddings=True, use_sliding_window=True,
                             sliding_window=WINDOW, layer_types=["full_attention", "sliding_attention"] * 2)
    if kind == "qwen3_untied":
        return T.Qwen3Config(**BASE, tie_word_embeddings=False)
    if kind == "qwen3_moe":  # 4 experts top-2, renormalised
        return T.Qwen3MoeConfig(**BASE, moe_intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                                norm_topk_prob=True)
    if kind == "qwen3_moe_raw":  # top-k probabilities kept as they are (norm_topk_prob=false), window everywhere
        return T.Qwen3MoeConfig(**BASE, moe_intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                                norm_topk_prob=False, use_sliding_window=True, sliding_window=WINDOW)
    if kind == "mixtral":  # window on every layer
        return T.MixtralConfig(**BASE, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW)
    raise ValueError(kind)


_CLS = {"qwen3": "Qwen3ForCausalLM", "qwen3_untied": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
        "qwen3_moe_raw": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}
KINDS = list(_CLS)
PIPELINE = ["qwen3", "qwen3_moe", "mixtral"]


def _make(kind: str, path: Path, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = getattr(transformers, _CLS[kind])(_config(kind)).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else (0.3 if "gate.weight" in name else 0.08) * noise)
    model.save_pretrained(str(path))
    return model


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {k: (root / k, _make(k, root / k)) for k in KINDS}


def _ids(s: int, b: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (b, s), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", KINDS)
def test_logits_equal_transformers_and_export_round_trip(hf_dirs, kind, tmp_path):
    path, ref_model = hf_dirs[kind]
    ours = load_hf(path).eval()
    cfg = ours.nemo_spec_config
    assert cfg.qk_layernorm == (kind != "mixtral") and (cfg.num_moe_experts is not None) == (kind not in (
        "qwen3", "qwen3_untied"))
    for s in (3, WINDOW + 1, 25):  # within, at and well beyond the window
        x = _ids(s)
        with torch.no_grad():
            ref = ref_model(input_ids=x).logits
            fast, slow = gpt_forward(ours, x).logits, gpt_forward(ours, x, fast=False).logits
        assert (fast - ref).abs().max() < 1e-4 and (slow - ref).abs().max() < 1e-4, (kind, s)
    out = export_hf(ours, tmp_path / "export")
    conf = json.loads((out / "config.json").read_text())
    assert conf["architectures"] == [_CLS[kind]]
    orig, new = load_file(str(path / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert set(orig) == set(new) and all(torch.equal(orig[k], new[k]) for k in orig)
    back = transformers.AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).eval()
    x = _ids(25)
    with torch.no_grad():
        assert (back(input_ids=x).logits - ref_model(input_ids=x).logits).abs().max() < 1e-5
    assert hf_to_model_config(conf).to_dict() == cfg.to_dict()


def test_window_and_routing_matter(hf_dirs):
    """The parity above is meaningful: the window and the top-k renormalisation change transformers' logits."""
    x = _ids(25)
    for kind, field, value in (("mixtral", "sliding_window", None), ("qwen3_moe", "norm_topk_prob", False)):
        path, ref_model = hf_dirs[kind]
        other = getattr(transformers, _CLS[kind])(_config(kind).__class__(**{
            **_config(kind).to_dict(), field: value})).eval()
        other.load_state_dict(ref_model.state_dict())
        with torch.no_grad():
            assert (other(input_ids=x).logits - ref_model(input_ids=x).logits).abs().max() > 1e-3, kind


def _naive_greedy(model, prompt, n):
    ids = list(prompt)
    for _ in range(n):
        with torch.no_grad():
            ids.append(int(gpt_forward(model, torch.tensor([ids]), fast=False).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("kind", PIPELINE)
def test_eagle3_pipeline(hf_dirs, kind, tmp_path):
    """import -> EAGLE-3 (aux capture == transformers' hidden states) -> train steps -> export, verified through
    every engine reader -> greedy speculative (chain and tree, cached decode past the window) == greedy AR."""
    from nemo_spec.export import ExportError, export_model
    from nemo_spec.export.engines import format_table, verify_export
    from nemo_spec.inference import SamplingParams, generate
    from nemo_spec.speculative import SpeculativeTransform

    path, ref_model = hf_dirs[kind]
    torch.manual_seed(0)
    model = SpeculativeTransform(algorithm="eagle3", aux_layers=[0, 1, 2], draft_vocab_size=48)(load_hf(path))
    layer0 = model.eagle_module.layers[0]
    assert type(layer0.self_attention.q_layernorm).__name__ == "IdentityOp" and hasattr(layer0.mlp, "linear_fc1")
    x = _ids(20)
    with torch.no_grad():
        hs = ref_model(input_ids=x, output_hidden_states=True).hidden_states  # hs[j + 1] = output of layer j
        aux = model.base_forward(x).aux_hidden
    assert len(aux) == 3 and all((a - hs[j + 1]).abs().max() < 1e-4 for j, a in enumerate(aux))

    model.set_draft_vocab(torch.bincount(x.flatten(), minlength=V).double() + torch.linspace(1, 0, V))
    base_before = {k: v.clone() for k, v in model.gpt.state_dict().items() if torch.is_tensor(v)}
    opt = torch.optim.AdamW(list(model.draft_parameters()), lr=3e-3)
    model.train()
    losses = []
    for _ in range(4):
        loss = model.training_losses(x)["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    assert losses[-1] < losses[0], losses
    assert all(torch.equal(v, model.gpt.state_dict()[k]) for k, v in base_before.items())  # base frozen
    model.eval()

    if kind == "mixtral":
        # no engine's Mixtral gives a draft aux hidden states (vllm 0.34.0 models/mixtral.py:375, no SupportsEagle3;
        # sglang 0.5.23 models/mixtral.py: no set_eagle3_layers_to_capture; TensorRT-LLM's never passes
        # spec_metadata to its layers; EaModel's KV Mixtral collects none): nothing is written
        with pytest.raises(ExportError, match="no engine can serve this eagle3 draft"):
            export_model(model, tmp_path / "exp", dtype="fp32", target="all", verify=True)
    else:
        exp = export_model(model, tmp_path / "exp", dtype="fp32", target="all", verify=True)
        rows = {r.engine: r for r in verify_export(exp, model=model)}
        table = format_table(list(rows.values()))
        assert all(rows[e].status == "ok" and rows[e].max_abs_diff < 1e-4
                   for e in ("base", "vllm", "sglang", "trtllm")), table
        assert rows["reference"].status == "unsupported", table  # EaModel hard-codes its aux layers (and base classes)

    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [11, 3, 40]]
    ref = [_naive_greedy(model.gpt, p, 8) for p in prompts]
    sp = SamplingParams(max_new_tokens=8)
    assert [o.tokens for o in generate(model.gpt, prompts, sp)] == ref
    for method in ("eagle", "eagle_tree"):
        outs = generate(model, prompts, sp, method=method, options={"depth": 3, "top_k": 3, "total_tokens": 8,
                                                                   "num_draft_tokens": 3})
        assert [o.tokens for o in outs] == ref, method


MOE = ["qwen3_moe", "mixtral"]


def test_tp2_and_ep2_equal_tp1(hf_dirs, tmp_path):
    """One torchrun launch (gloo, 2 ranks). TP=2: Qwen3, Qwen3-MoE and Mixtral give transformers' logits (experts
    sharded over TP) and export the original weights again. EP=2 (Qwen3-MoE, Mixtral; 2 of the 4 experts per rank):
    logits == EP=1 == transformers', HF export round-trips the weights, greedy AR and EAGLE-3 speculative (chain and
    tree) == EP=1 greedy AR, a draft trains (base frozen), and the torch_dist checkpoint saved at EP=2 reloads at
    EP=2 there and at EP=1 here with the original weights (Qwen3-MoE only: the layout is the same)."""
    from nemo_spec.checkpoint import load_model
    from nemo_spec.checkpoint.hf import hf_state_dict_from_megatron
    from nemo_spec.checkpoint.tp import gather_full_state_dict

    args = []
    for kind in PIPELINE:
        path, ref_model = hf_dirs[kind]
        x = _ids(WINDOW + 6)
        with torch.no_grad():
            torch.save({"input_ids": x, "logits": ref_model(input_ids=x).logits}, tmp_path / f"{kind}.pt")
        args += [path, tmp_path / f"{kind}.pt", tmp_path / f"{kind}_tp2"]
    args.append("--ep")
    for kind in MOE:
        args += [hf_dirs[kind][0], tmp_path / f"{kind}.pt", tmp_path / f"{kind}_ep2"]
    out = run_torchrun(ROOT / "tests" / "dist_scripts" / "families_tp2.py", args, timeout=420)
    assert out.count("FAMILIES_TP2_OK") == len(PIPELINE), out
    assert out.count("FAMILIES_EP2_OK") == len(MOE), out
    for kind in PIPELINE:
        orig = load_file(str(hf_dirs[kind][0] / "model.safetensors"))
        new = load_file(str(tmp_path / f"{kind}_tp2" / "model.safetensors"))
        assert set(orig) == set(new) and all(torch.equal(orig[k], new[k]) for k in orig), kind
    for kind in MOE:
        orig = load_file(str(hf_dirs[kind][0] / "model.safetensors"))
        new = load_file(str(tmp_path / f"{kind}_ep2" / "hf" / "model.safetensors"))
        assert set(orig) == set(new) and all(torch.equal(orig[k], new[k]) for k in orig), kind
    orig = load_file(str(hf_dirs[MOE[0]][0] / "model.safetensors"))
    again = load_model(tmp_path / f"{MOE[0]}_ep2" / "ckpt")  # saved at EP=2, loaded here at EP=1
    back = hf_state_dict_from_megatron(gather_full_state_dict(again, gated=True), again.nemo_spec_config, MOE[0])
    assert set(back) == set(orig) and all(torch.equal(orig[k], back[k]) for k in orig)


def test_unsupported_configs_name_the_field():
    q3m = _config("qwen3_moe").to_dict()
    for d, field in ((dict(q3m, mlp_only_layers=[1]), "mlp_only_layers"),
                     (dict(q3m, decoder_sparse_step=2), "decoder_sparse_step"),
                     (dict(_config("mixtral").to_dict(), router_jitter_noise=0.1), "router_jitter_noise"),
                     (dict(_config("qwen3").to_dict(), attention_bias=True), "attention_bias"),
                     (dict(_config("mixtral").to_dict(), num_experts_per_tok=1), "moe_router_topk=1")):
        with pytest.raises(HFCheckpointError, match=field):
            hf_to_model_config(d)
    cfg = hf_to_model_config(_config("qwen3").to_dict())
    with pytest.raises(HFCheckpointError, match="sliding_window"):  # Llama has no window
        families.family_for_export(dataclasses.replace(cfg, qk_layernorm=False), "LlamaForCausalLM")
    with pytest.raises(HFCheckpointError, match="qk_layernorm=True cannot be exported as MistralForCausalLM"):
        families.family_for_export(cfg, "MistralForCausalLM")
    assert families.family_for_export(cfg).architecture == "Qwen3ForCausalLM"


def test_readme_table_matches_the_declarations():
    text = (ROOT / "README.md").read_text()
    table = families.support_table()
    assert table in text, "README's supported-architecture table is stale: paste families.support_table()"
    for fam in families.FAMILIES:
        assert f"`{fam.architecture}`" in table
    assert len(re.findall(r"^\| `\w+` \|", table, flags=re.M)) == len(families.FAMILIES)
    from nemo_spec.export.engines.reference import base_unsupported

    for fam in families.FAMILIES:  # the declared engines agree with the reference reader's base rule
        if fam.model_type != "gpt2":
            assert ("reference" in fam.limits.engines) == (base_unsupported(fam.architecture) is None), fam
            assert ("EAGLE-1 only" in fam.limits.engines) == (base_unsupported(fam.architecture, "eagle3") is not None
                                                             and base_unsupported(fam.architecture) is None), fam


def test_bad_expert_parallel_configs_name_the_problem(hf_dirs, monkeypatch):
    """EP sizes that cannot run are refused before any weights load, naming the size and what it must divide."""
    from nemo_spec import parallel
    from nemo_spec.checkpoint import CheckpointConfigError, load_model
    from nemo_spec.checkpoint.tp import split_state_dict
    from nemo_spec.config import ConfigError
    from nemo_spec.training.config import TrainConfig, TrainerConfig
    from nemo_spec.training.run import planned_dp_size

    with pytest.raises(parallel.ParallelConfigError, match=r"expert_parallel_size=3 x tensor_parallel_size=1 = 3 "
                                                          r"does not divide the world size 2"):
        parallel.check_sizes(2, 1, 3)
    with pytest.raises(parallel.ParallelConfigError, match="expert_parallel_size must be a positive int, got 0"):
        parallel.check_sizes(2, 1, 0)
    with pytest.raises(parallel.ParallelConfigError, match="= 2 does not divide the world size 1"):
        parallel.initialize(expert_parallel_size=2)  # this single process cannot host two EP ranks
    assert parallel.ep_size() == 1 and parallel.tp_size() == 1  # the session's state is untouched
    moe = hf_to_model_config(_config("qwen3_moe").to_dict())
    dense = hf_to_model_config(_config("qwen3").to_dict())
    with pytest.raises(ConfigError, match="expert parallel size 3 does not divide num_moe_experts=4"):
        moe.check_expert_parallel(3)
    with pytest.raises(ConfigError, match="expert parallel size 2 needs a mixture-of-experts model.*dense"):
        dense.check_expert_parallel(2)
    with pytest.raises(CheckpointConfigError, match="config.json: expert parallel size 3 does not divide "
                                                    "num_moe_experts=4"):
        load_model(hf_dirs["qwen3_moe"][0], ep_size=3)
    with pytest.raises(CheckpointConfigError, match="config.json: expert parallel size 2 needs a mixture-of-experts"):
        load_model(hf_dirs["qwen3"][0], ep_size=2)
    with pytest.raises(CheckpointConfigError, match="cannot load at tp_size=1, ep_size=2.*world size 1"):
        load_model(hf_dirs["mixtral"][0], ep_size=2)
    with pytest.raises(ValueError, match="expert parallel size 2 needs a mixture-of-experts state dict"):
        split_state_dict({"decoder.layers.0.mlp.linear_fc1.weight": torch.zeros(4, 2)}, 0, 1, True, 0, 2)
    with pytest.raises(ConfigError, match="trainer.expert_parallel_size must be a positive int, got 0"):
        TrainerConfig(expert_parallel_size=0).validate()
    with pytest.raises(ConfigError, match="train_base=true with trainer.expert_parallel_size=2 is not supported"):
        TrainConfig(train_base=True, trainer=TrainerConfig(expert_parallel_size=2)).validate()
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"trainer.expert_parallel_size=2 x trainer.tensor_parallel_size=2 = 4 does "
                                          r"not divide the world size 2"):
        planned_dp_size(2, 2)
    assert planned_dp_size(1, 2) == 2
    assert parallel.ep_size() == 1 and parallel.tp_size() == 1


def _edited_copy(src: Path, dst: Path, edit) -> Path:
    import shutil

    shutil.copytree(src, dst)
    conf = json.loads((dst / "config.json").read_text())
    edit(conf)
    (dst / "config.json").write_text(json.dumps(conf))
    return dst


def _auto_logits(path: Path, x: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True).eval()
    with torch.no_grad():
        return model(input_ids=x).logits


def test_config_json_is_read_as_transformers_reads_it(hf_dirs, tmp_path):
    """Absent fields take transformers' class defaults (Mixtral: rms_norm_eps 1e-5, rope_theta 1e6; Mistral: a
    4096-token window; Qwen2: max_window_layers 28), rope_scaling wins over rope_parameters as in transformers 5
    (modeling_rope_utils.py convert_rope_params_to_dict), and both compare with AutoModelForCausalLM's logits. The
    raw file with generic defaults had built other models (a review against transformers' own classes: logit errors
    5.6e-3 for Mixtral's eps, 2.19 for its theta, 0.98 for a rope_scaling added to a v5 config)."""
    x = _ids(25)

    def drop(*keys):
        return lambda c: [c.pop(k, None) for k in keys]

    mixtral = hf_dirs["mixtral"][0]
    for keys in (("rms_norm_eps",), ("rope_parameters", "rope_theta")):
        d = _edited_copy(mixtral, tmp_path / "_".join(keys), drop(*keys))
        got = gpt_forward(load_hf(d).eval(), x).logits
        assert (got - _auto_logits(d, x)).abs().max() < 1e-4, keys
    cfg = load_hf(tmp_path / "rms_norm_eps").nemo_spec_config
    assert cfg.norm_eps == 1e-5 and load_hf(tmp_path / "rope_parameters_rope_theta").nemo_spec_config.rope_theta == 1e6
    both = _edited_copy(hf_dirs["qwen3"][0], tmp_path / "both", lambda c: c.update(
        rope_scaling={"rope_type": "linear", "factor": 4.0}))
    assert json.loads((both / "config.json").read_text())["rope_parameters"]["rope_type"] == "default"
    ours = load_hf(both).eval()
    assert ours.nemo_spec_config.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert (gpt_forward(ours, x).logits - _auto_logits(both, x)).abs().max() < 1e-4
    yarn = _edited_copy(hf_dirs["qwen3"][0], tmp_path / "yarn", lambda c: c.update(
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}))
    with pytest.raises(HFCheckpointError, match="rope_type 'yarn', which is not supported"):  # was dropped silently
        load_hf(yarn)
    base = {k: v for k, v in BASE.items()}
    mistral = hf_to_model_config({**base, "architectures": ["MistralForCausalLM"], "model_type": "mistral"})
    assert mistral.sliding_window == transformers.MistralConfig().sliding_window == 4096
    qwen2 = hf_to_model_config({**base, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                                "use_sliding_window": True, "sliding_window": 8})  # max_window_layers 28 >= 4 layers
    assert qwen2.sliding_window is None and qwen2.window_layers() == []


def test_configs_transformers_reads_otherwise_are_refused(hf_dirs, tmp_path):
    """architectures and model_type disagreeing (transformers builds the model_type's class: a Mistral config named
    Llama lost its window, logit error 3.37), a Mistral config with layer_types (transformers reads it as Ministral's
    alternating windows: 3.10), and a tied config whose stored lm_head differs from the embedding (transformers 5
    runs the stored head: 4.03) all loaded silently."""
    base = dict(BASE)
    with pytest.raises(HFCheckpointError, match="architectures says LlamaForCausalLM .* but model_type is 'mistral'"):
        hf_to_model_config({**base, "architectures": ["LlamaForCausalLM"], "model_type": "mistral"})
    with pytest.raises(HFCheckpointError, match="Mistral config with 'layer_types' is read by transformers as "
                                                "Ministral"):
        hf_to_model_config({**base, "architectures": ["MistralForCausalLM"], "model_type": "mistral",
                            "layer_types": ["sliding_attention", "full_attention"] * 2})
    path = hf_dirs["qwen3_untied"][0]
    tied = _edited_copy(path, tmp_path / "tied", lambda c: c.update(tie_word_embeddings=True))
    with pytest.raises(HFCheckpointError, match="tie_word_embeddings is true but the stored lm_head.weight differs"):
        load_hf(tied)


def test_no_family_error_names_the_models_own_family_reason():
    """The refusal kept only the last three families' reasons: for a GPT-2-style model with grouped KV heads it
    listed why Qwen2, Mistral and Llama (other layer families) cannot hold it and hid GPT-2's (NeMo review)."""
    import dataclasses

    from nemo_spec.checkpoint.families import FamilyError, family_for_export
    from tests.helpers import tiny_gpt2, tiny_llama

    with pytest.raises(FamilyError, match=r"hold this model: ModelConfig.num_query_groups=1 cannot be exported as "
                                          r"GPT2LMHeadModel \(needs 4\)$"):
        family_for_export(dataclasses.replace(tiny_gpt2(), num_query_groups=1))
    with pytest.raises(FamilyError, match=r"normalization='LayerNorm' cannot be exported as (\w+, ){5}"
                                          r"LlamaForCausalLM \(needs 'RMSNorm'\)$"):  # one line for the six
        family_for_export(dataclasses.replace(tiny_llama(), add_bias_linear=True, normalization="LayerNorm"))
