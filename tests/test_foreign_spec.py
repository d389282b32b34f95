"""A megatron-core GPTModel built from megatron's own local layer spec (not nemo_spec's) as the draft's base.

The base must run through its own modules (megatron's RotaryEmbedding in GPTModel.forward, DotProductAttention,
its masks); nothing may hand it an AttnContext; generation refuses it up front or converts it exactly.
"""
from typing import Optional

import pytest
import torch
import torch.nn.functional as F
from megatron.core.activations import squared_relu
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig

from nemo_spec.models import gpt_forward
from nemo_spec.models.foreign import (ForeignSpecError, causal_megatron_mask, foreign_forward, is_project_spec,
                                      to_project_spec)
from nemo_spec.models.gpt import output_logits
from nemo_spec.speculative import SpeculativeTransform

V, S = 96, 12


def local_spec_gpt(seed: int = 0, tied: bool = False, gpt_kw: Optional[dict] = None, spec_kw: Optional[dict] = None,
                   **config: object) -> GPTModel:
    """Llama-style (RoPE theta 5e5, RMSNorm, SwiGLU, GQA 4/2) GPTModel from megatron's local spec, as NeMo builds
    it without Transformer Engine."""
    from nemo_spec._cpu import apply_cpu_workarounds

    apply_cpu_workarounds()
    torch.manual_seed(seed)
    cfg = TransformerConfig(**{
        "num_layers": 3, "hidden_size": 32, "num_attention_heads": 4, "num_query_groups": 2, "ffn_hidden_size": 64,
        "use_cpu_initialization": True, "normalization": "RMSNorm", "gated_linear_unit": True,
        "activation_func": F.silu, "add_bias_linear": False, "hidden_dropout": 0.0, "attention_dropout": 0.0,
        "bias_activation_fusion": False, "masked_softmax_fusion": False, "persist_layer_norm": False,
        "bias_dropout_fusion": False, "apply_rope_fusion": False, "gradient_accumulation_fusion": False,
        "init_method_std": 0.05, **config})
    kw = {"vocab_size": V, "max_sequence_length": 64, "position_embedding_type": "rope", "rotary_base": 500000,
          "share_embeddings_and_output_weights": tied, **(gpt_kw or {})}
    return GPTModel(cfg, get_gpt_layer_local_spec(normalization="RMSNorm", **(spec_kw or {})), **kw)


def own_forward(gpt: GPTModel, ids: torch.Tensor) -> torch.Tensor:
    b, s = ids.shape
    with torch.no_grad():
        return gpt(ids, torch.arange(s)[None].expand(b, s), causal_megatron_mask(s, ids.device))


def test_base_forward_is_the_models_own_forward_with_rope():
    gpt = local_spec_gpt().eval()
    assert not is_project_spec(gpt)
    ids = torch.randint(0, V, (2, S), generator=torch.Generator().manual_seed(1))
    want = own_forward(gpt, ids)
    with torch.no_grad():
        out = gpt_forward(gpt, ids, aux_layers=[0, 2])  # crashed with an AttnContext in DotProductAttention before
        # the captured final hidden states through the output layer give the model's own logits exactly
        again = output_logits(gpt, out.hidden.transpose(0, 1)).transpose(0, 1)
    assert torch.equal(out.logits, want)
    assert torch.equal(again, want)
    # the captured layer outputs are the decoder's: running the rest of the layers from layer 0's output
    # (megatron's own RoPE, computed the way GPTModel.forward does) reproduces the final hidden state
    with torch.no_grad():
        rope = gpt.rotary_pos_emb(S)
        h = out.aux_hidden[0].transpose(0, 1)
        mask = causal_megatron_mask(S, ids.device)
        for layer in gpt.decoder.layers[1:]:
            h, _ = layer(hidden_states=h, attention_mask=mask, rotary_pos_emb=rope)
            if layer is gpt.decoder.layers[2]:
                assert torch.equal(h.transpose(0, 1), out.aux_hidden[1])
        assert torch.equal(gpt.decoder.final_layernorm(h).transpose(0, 1), out.hidden)
        # and RoPE matters here: without it the same layers give different states (the bug this replaces)
        h0 = out.aux_hidden[0].transpose(0, 1)
        no_rope, _ = gpt.decoder.layers[1](hidden_states=h0, attention_mask=mask, rotary_pos_emb=None)
        with_rope, _ = gpt.decoder.layers[1](hidden_states=h0, attention_mask=mask, rotary_pos_emb=rope)
    assert (no_rope - with_rope).abs().max() > 1e-3


@pytest.mark.parametrize("alg", ["eagle3", "eagle1", "medusa"])
def test_draft_trains_on_a_local_spec_base(alg):
    gpt = local_spec_gpt(seed=2)
    kwargs = {"eagle3": dict(num_eagle_layers=1, num_medusa_heads=0),
              "eagle1": dict(algorithm="eagle1", num_eagle_layers=1),
              "medusa": dict(algorithm="medusa", num_medusa_heads=2)}[alg]
    model = SpeculativeTransform(**kwargs)(gpt)
    base0 = {k: v.clone() for k, v in model.gpt.state_dict().items() if torch.is_tensor(v)}
    draft0 = {k: v.detach().clone() for k, v in model.draft.named_parameters()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in model.draft_parameters()}
    ids = torch.randint(0, V, (2, S), generator=torch.Generator().manual_seed(3))
    losses = []
    for _ in range(8):
        opt.zero_grad()
        loss = model.training_losses(ids)["loss"]
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    for k, v in model.gpt.state_dict().items():
        if torch.is_tensor(v):
            assert torch.equal(v, base0[k]), k
    unchanged = [k for k, v in model.draft.named_parameters() if torch.equal(v, draft0[k])]
    assert not unchanged


def test_nemo_style_forward_returns_the_per_token_draft_loss():
    """NeMo's llm.GPTModel calls module(input_ids, position_ids, attention_mask, decoder_input=, labels=,
    inference_context=) and reduces the [b, s] result with its loss mask (nemo/collections/llm/gpt/model/base.py
    GPTModel.forward, MaskedTokenLossReduction)."""
    model = SpeculativeTransform(num_eagle_layers=1, num_medusa_heads=0, ttt_steps=2)(local_spec_gpt(seed=4))
    ids = torch.randint(0, V, (2, S), generator=torch.Generator().manual_seed(5))
    pos = torch.arange(S)[None].expand(2, S)
    mask = causal_megatron_mask(S, ids.device)
    labels = torch.roll(ids, -1, 1)
    tok = model(ids, pos, mask, decoder_input=None, labels=labels, inference_context=None)
    assert tok.shape == (2, S) and tok.dtype == torch.float32
    res = model.training_losses(ids)
    # every unrolled step i scores rows t < S - 2 - i, placed at label position t + 1 + i
    n = [2 * (S - 2 - i) for i in range(2)]
    want = sum((0.8 ** i) * res["step_losses"][i] * n[i] for i in range(2))
    assert torch.allclose(tok.sum(), want, rtol=1e-5)
    assert (tok[:, 0] == 0).all() and (tok[:, -1] == 0).all()  # label 0 / the last label: nothing predicts them
    (tok * torch.ones_like(tok)).sum().div(tok.numel()).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.draft_parameters()
               if p.requires_grad and p.dim() > 1)
    assert all(p.grad is None for p in model.gpt.parameters())
    assert model.model_type == model.gpt.model_type
    seen = []
    model.gpt.set_input_tensor = lambda t: seen.append(t)
    model.set_input_tensor("x")
    assert seen == ["x"]
    with pytest.raises(ValueError, match="packed"):
        model(ids, pos, mask, labels=labels, packed_seq_params=object())


def test_generation_refuses_then_converts_exactly():
    from nemo_spec.inference import SamplingParams, generate

    gpt = local_spec_gpt(seed=6).eval()
    spec = SpeculativeTransform(num_eagle_layers=1, num_medusa_heads=0)(gpt)
    prompt = [[3, 14, 15, 9, 2, 6]]
    params = SamplingParams(temperature=0.0, max_new_tokens=10)
    with pytest.raises(ForeignSpecError, match="to_project_spec"):
        generate(gpt, prompt, params)
    with pytest.raises(ForeignSpecError, match="layer spec"):
        generate(spec, prompt, params, method="eagle")
    conv = to_project_spec(spec)
    assert is_project_spec(conv.gpt) and conv.eagle_module is spec.eagle_module and spec.gpt is gpt
    ids = torch.randint(0, V, (1, S), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        got = gpt_forward(conv.gpt, ids).logits
    want = own_forward(gpt, ids)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    ar = generate(conv, prompt, params, method="ar")[0].tokens
    eagle = generate(conv, prompt, params, method="eagle")[0].tokens
    assert ar == eagle and len(ar) == 10
    # the converted base's greedy tokens are the original model's own greedy continuation
    seq = list(prompt[0])
    for _ in range(10):
        seq.append(int(own_forward(gpt, torch.tensor([seq]))[0, -1].argmax()))
    assert ar == seq[len(prompt[0]):]


def test_conversion_refuses_what_it_cannot_represent():
    gpt = local_spec_gpt(seed=8)
    gpt.config.rotary_interleaved = True
    with pytest.raises(ForeignSpecError, match="rotary_interleaved"):
        to_project_spec(gpt)



@pytest.mark.parametrize("config,gpt_kw,words", [
    ({"window_size": (6, 0)}, {}, r"window_size=\(6, 0\) \(sliding-window"),
    ({}, {"rotary_percent": 0.5}, r"rotary_percent=0.5 \(RoPE on 4 of 8 head dims\)"),
    ({}, {"position_embedding_type": "none"}, "position_embedding_type='none'"),
    ({"softmax_scale": 0.5}, {}, "softmax_scale=0.5"), ({"no_rope_freq": [0, 0, 1]}, {}, r"no_rope_freq=\[0, 0, 1\]"),
    ({"gated_linear_unit": False}, {}, "activation_func=silu without gated_linear_unit"),
    ({"activation_func": F.gelu}, {}, "gated_linear_unit with activation_func=gelu"),
    # Nemotron's squared ReLU was refused only by the logit check's numbers (NeMo families review)
    ({"gated_linear_unit": False, "activation_func": squared_relu}, {},
     "activation_func=squared_relu without gated_linear_unit")])
def test_conversion_names_each_option_it_cannot_represent(config, gpt_kw, words):
    """From a review: a sliding window was dropped silently (a different model; the 16-token logit check cannot see
    a window of 16 or more), rotary_percent was refused as 'scaled RoPE?', the others as 'does not reproduce its
    logits' (or, for 'none', converted to learned positions). Each is now refused by name, before any weights move."""
    with pytest.raises(ForeignSpecError, match=words):
        to_project_spec(local_spec_gpt(seed=8, gpt_kw=gpt_kw, **config))


@pytest.mark.parametrize("fused", [True, False])
def test_gelu_through_megatrons_fused_bias_gelu_is_the_tanh_approximation(fused):
    """NeMo's Starcoder / Starcoder2 and GPTConfig126M-175B keep ``activation_func=F.gelu`` with
    ``bias_activation_fusion=True``: megatron's MLP then runs its fused bias-GELU kernel, the tanh approximation
    (megatron/core/fusions/fused_bias_gelu.py:17-19), and nemo_spec read it as the exact (erf) GELU — a different
    model (NeMo families review: 1 of 40 greedy tokens differed; at this weight scale the conversion was refused
    by the logit check). Without the fusion it is the exact GELU."""
    gpt = local_spec_gpt(seed=9, gpt_kw={"position_embedding_type": "learned_absolute"}, spec_kw={"qk_layernorm": False},
                         gated_linear_unit=False, activation_func=F.gelu, add_bias_linear=True,
                         bias_activation_fusion=fused, num_query_groups=4,
                         init_method_std=0.3).eval()
    conv = to_project_spec(gpt)
    assert conv.nemo_spec_config.activation == ("gelu" if fused else "gelu_exact")
    ids = torch.randint(0, V, (2, S), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want, got = own_forward(gpt, ids), gpt_forward(conv, ids).logits
    assert (got - want).abs().max() < 1e-5 * want.abs().max()


def test_seq_len_interpolation_converts_as_linear_rope_scaling():
    """megatron's seq_len_interpolation_factor (positions / f) was refused by to_project_spec although load_model reads
    the same setting from NeMo / Megatron-LM checkpoints as linear RoPE scaling (found by the NeMo review): a model
    trained in memory with it could not be converted, generated with or exported."""
    gpt = local_spec_gpt(seed=8, gpt_kw={"seq_len_interpolation_factor": 2.0}).eval()
    conv = to_project_spec(gpt)
    assert conv.nemo_spec_config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    ids = torch.randint(0, V, (1, S), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.allclose(gpt_forward(conv, ids).logits, own_forward(gpt, ids), atol=1e-5, rtol=1e-5)


def test_qk_layernorm_converts_and_a_rounded_rope_base_is_read_exactly():
    """qk_layernorm was refused although nemo_spec's spec has it; the RoPE base read back from float32 inv_freq was
    999997.4 for 1e6 at head dim 128 (it went into the converted model and the exports)."""
    from nemo_spec.speculative.transform import model_config_from_megatron

    gpt = local_spec_gpt(seed=9, qk_layernorm=True, spec_kw={"qk_layernorm": True}).eval()
    conv = to_project_spec(gpt)
    ids = torch.randint(0, V, (1, S), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.allclose(gpt_forward(conv, ids).logits, own_forward(gpt, ids), atol=1e-5, rtol=1e-5)
    wide = local_spec_gpt(seed=9, kv_channels=128, gpt_kw={"rotary_base": 1000000})
    assert model_config_from_megatron(wide).rope_theta == 1e6


@pytest.mark.parametrize("flag", ["pre_process", "post_process"])
def test_a_pipeline_stage_is_refused_by_name(flag):
    """post_process=False failed with AttributeError 'output_layer' deep in the draft, pre_process=False with
    'NoneType has no attribute size' (found by review)."""
    from nemo_spec.config import ConfigError

    with pytest.raises(ConfigError, match=f"{flag}=False \\(a pipeline stage"):
        SpeculativeTransform(num_eagle_layers=1)(local_spec_gpt(seed=1, gpt_kw={flag: False}))


def test_save_and_export_convert_another_spec_first(tmp_path):
    """save_checkpoint of a local-spec model wrote megatron's TE-style norm names, which load_model could not read;
    export_model wrote a foreign base without any conversion check (rotary_interleaved exported silently wrong).
    Both now go through to_project_spec: the checkpoint loads with the model's own logits, a base nemo_spec cannot
    represent is refused by name."""
    from nemo_spec import parallel
    from nemo_spec.checkpoint import load_model, save_checkpoint
    from nemo_spec.export import export_model

    parallel.initialize(tensor_parallel_size=1)
    gpt = local_spec_gpt(seed=4).eval()
    spec = SpeculativeTransform(num_eagle_layers=1)(gpt)
    ck = save_checkpoint(spec, tmp_path / "ck")
    ids = torch.randint(0, V, (1, S), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = gpt_forward(load_model(ck).gpt, ids).logits
    assert torch.allclose(got, own_forward(gpt, ids), atol=1e-5, rtol=1e-5)
    bad = local_spec_gpt(seed=4)
    bad.config.rotary_interleaved = True
    with pytest.raises(ForeignSpecError, match="rotary_interleaved"):
        export_model(SpeculativeTransform(num_eagle_layers=1)(bad), tmp_path / "exp", dtype="fp32")
    assert not (tmp_path / "exp").exists()


def test_a_sequence_parallel_base_at_tp2_gives_the_drafts_every_position():
    """Found by review: at TP=2 with sequence_parallel=True (NeMo's default at TP > 1) the captured hidden states
    were each rank's half of the sequence and the draft losses failed on shapes. Under torchrun: base outputs,
    EAGLE-3 / EAGLE-1 / DFlash / Medusa / P-EAGLE losses and draft gradients equal those without sequence
    parallelism."""
    from tests.helpers import ROOT, run_torchrun

    out = run_torchrun(ROOT / "tests" / "dist_scripts" / "foreign_sequence_parallel.py", [str(ROOT)], timeout=300)
    for alg in ("eagle3", "eagle1", "dflash", "medusa", "peagle"):
        assert out.count(f"SEQUENCE_PARALLEL_OK {alg}") == 2, out[-2000:]
