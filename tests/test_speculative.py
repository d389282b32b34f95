"""SpeculativeTransform / SpeculativeGPT at TP=1: structure, frozen base, idempotence, shapes, losses, errors."""

import pytest
import torch
from megatron.core.transformer.identity_op import IdentityOp

import nemo_spec
from nemo_spec.config import ConfigError, SpeculativeConfig
from nemo_spec.models import AttnContext, build_gpt, gpt_forward
from nemo_spec.speculative import SpeculativeGPT, SpeculativeTransform
from tests.helpers import tiny_gpt2, tiny_llama
from tests.speculative_utils import ALG_KWARGS, chain_logits, expected_draft_params, make_spec

ALGS = ["eagle1", "eagle3", "medusa"]


def _cfg(**kw):
    return tiny_llama(num_layers=4, **kw)


@pytest.mark.parametrize("alg", ALGS)
@pytest.mark.parametrize("make", [_cfg, tiny_gpt2])
def test_param_counts_and_frozen_base(alg, make):
    cfg = make()
    base = build_gpt(cfg)
    n_base = sum(p.numel() for p in base.parameters())
    m = SpeculativeTransform(**ALG_KWARGS[alg])(base)
    assert isinstance(m, SpeculativeGPT) and m.gpt is base and m.algorithm == alg
    assert m.num_draft_parameters() == expected_draft_params(cfg, m.spec_config)
    assert sum(p.numel() for p in m.parameters()) == n_base + m.num_draft_parameters()
    assert all(not p.requires_grad for p in m.gpt.parameters())
    assert all(p.requires_grad for p in m.draft_parameters())
    base_ids = {id(p) for p in m.gpt.parameters()}
    assert not base_ids & {id(p) for p in m.draft_parameters()}
    assert nemo_spec.SpeculativeTransform is SpeculativeTransform
    sd = m.state_dict()
    prefix = "medusa_heads." if alg == "medusa" else "eagle_module."
    assert all(k.startswith(("gpt.", prefix)) for k in sd)


def test_draft_inherits_architecture():
    cfg = _cfg(rope_theta=5e5, rope_scaling={"rope_type": "linear", "factor": 2.0}, norm_eps=1e-6)
    m = SpeculativeTransform(num_eagle_layers=2, num_medusa_heads=0)(build_gpt(cfg))
    assert m.algorithm == "eagle3"  # NeMo spelling defaults to EAGLE-3
    for layer in m.eagle_module.layers:
        c = layer.config
        assert (c.hidden_size, c.num_attention_heads, c.num_query_groups, c.kv_channels, c.ffn_hidden_size) == \
            (64, 4, 2, 16, 128)
        assert c.nemo_rope_theta == 5e5 and c.nemo_rope_scaling == {"rope_type": "linear", "factor": 2.0}
        assert c.layernorm_epsilon == 1e-6 and c.gated_linear_unit
        core = layer.self_attention.core_attention
        assert torch.equal(core.inv_freq, m.gpt.decoder.layers[0].self_attention.core_attention.inv_freq)
    assert [layer.layer_number for layer in m.eagle_module.layers] == [1, 2]
    assert m.eagle_module.layers[0].self_attention.linear_qkv.weight.shape[1] == 128  # 2h input
    e1 = SpeculativeTransform(algorithm="eagle1")(build_gpt(cfg))
    assert isinstance(e1.eagle_module.layers[0].input_layernorm, IdentityOp)
    assert e1.eagle_module.fc.bias is not None and m.eagle_module.fc.bias is None


def test_eagle3_first_layer_built_from_its_spec():
    """The EAGLE-3 first layer is whatever its ModuleSpec builds (2h-input qkv and hidden_norm at construction,
    nothing replaced afterwards): a layer built from the spec alone takes the draft's layer-0 state dict as is and
    computes what the draft's first layer does (module and fast path), which is the EAGLE-3 midlayer formula."""
    import inspect

    from megatron.core.transformer.spec_utils import build_module

    from nemo_spec.models import fastpath
    from nemo_spec.speculative import eagle
    from tests.export_utils import _attention, _mlp, _rms

    m = make_spec(_cfg(), "eagle3", seed=3)
    draft = m.eagle_module
    spec = eagle.eagle3_first_layer_spec()
    assert spec.module is eagle.Eagle3FirstLayer and spec.submodules.hidden_norm is not IdentityOp
    layer = build_module(spec, config=draft.config, layer_number=1)
    h = draft.hidden_size
    assert layer.self_attention.linear_qkv.weight.shape == (4 * 16 + 2 * 2 * 16, 2 * h)
    assert type(draft.layers[0]) is eagle.Eagle3FirstLayer
    ours = {k[len("layers.0."):]: v for k, v in draft.state_dict().items() if k.startswith("layers.0.")}
    assert list(layer.state_dict()) == list(ours)
    layer.load_state_dict(ours, strict=True)

    g = torch.Generator().manual_seed(0)
    b, s = 2, 6
    emb, feat = torch.randn(s, b, h, generator=g), torch.randn(s, b, h, generator=g)
    pos = torch.arange(s)[None].expand(b, s)
    mask = torch.ones(s, s, dtype=torch.bool).tril()[None].expand(b, s, s)
    with torch.no_grad():
        got = layer(emb, feat, AttnContext(position_ids=pos, mask=mask))
        for fast in (False, True):
            assert torch.equal(draft._eagle3_first_layer(emb, feat, AttnContext(position_ids=pos, mask=mask), fast), got)

    # the EAGLE-3 midlayer formula (vLLM / SGLang llama_eagle3), from the weights alone
    w = {k: v.detach() for k, v in ours.items() if torch.is_tensor(v)}
    qkv = w["self_attention.linear_qkv.weight"].view(2, 4, 16, 2 * h)  # [groups, (q, q, k, v), head_dim, 2h]
    fc1 = w["mlp.linear_fc1.weight"]
    ref_w = {"self_attn.q_proj.weight": qkv[:, :2].reshape(-1, 2 * h), "self_attn.k_proj.weight": qkv[:, 2].reshape(-1, 2 * h),
             "self_attn.v_proj.weight": qkv[:, 3].reshape(-1, 2 * h),
             "self_attn.o_proj.weight": w["self_attention.linear_proj.weight"],
             "mlp.gate_proj.weight": fc1[: fc1.shape[0] // 2], "mlp.up_proj.weight": fc1[fc1.shape[0] // 2:],
             "mlp.down_proj.weight": w["mlp.linear_fc2.weight"]}
    conf = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rope_theta": 10000.0}
    eps = draft.config.layernorm_epsilon
    e, f = emb.transpose(0, 1), feat.transpose(0, 1)
    x = torch.cat([_rms(e, w["input_layernorm.weight"], eps), _rms(f, w["hidden_norm.weight"], eps)], -1)
    r = f + _attention(x, ref_w, "", conf)
    r = r + _mlp(_rms(r, w["pre_mlp_layernorm.weight"], eps), ref_w, "")
    assert torch.allclose(got.transpose(0, 1), r, atol=1e-5, rtol=1e-4)

    # no private megatron methods driving the layer from outside
    for src in (inspect.getsource(eagle), inspect.getsource(fastpath)):
        for banned in ("_forward_mlp", "_forward_attention", "layer.self_attn_bda"):
            assert banned not in src, banned


def test_eagle3_draft_builds_no_module_it_replaces(monkeypatch):
    """Every parallel linear the EAGLE-3 / P-EAGLE draft constructs is one it keeps (no module built, then
    swapped for another after construction)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    built = []
    for cls in (ColumnParallelLinear, RowParallelLinear):
        init = cls.__init__

        def counting(self, *a, _init=init, **kw):
            _init(self, *a, **kw)
            built.append(self)
        monkeypatch.setattr(cls, "__init__", counting)
    for kw in (ALG_KWARGS["eagle3"], dict(algorithm="peagle", num_eagle_layers=2)):
        base = build_gpt(_cfg())
        built.clear()
        draft = SpeculativeTransform(**kw)(base).eagle_module
        kept = {id(mod) for mod in draft.modules()}
        assert built and all(id(mod) in kept for mod in built), [type(mod).__name__ for mod in built]


@pytest.mark.parametrize("alg", ALGS)
def test_idempotent_and_no_stacking(alg):
    m = SpeculativeTransform(**ALG_KWARGS[alg])(build_gpt(_cfg()))
    before = {k: v.clone() for k, v in m.state_dict().items() if isinstance(v, torch.Tensor)}
    again = SpeculativeTransform(**ALG_KWARGS[alg])(m)
    assert again is m
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items() if isinstance(v, torch.Tensor))
    other = "medusa" if alg != "medusa" else "eagle3"
    with pytest.raises(ConfigError, match="refusing to stack"):
        SpeculativeTransform(**ALG_KWARGS[other])(m)
    if alg != "medusa":
        with pytest.raises(ConfigError, match="num_eagle_layers"):
            SpeculativeTransform(algorithm=alg, num_eagle_layers=3)(m)


def test_config_is_deep_copied():
    aux = [0, 1, 2]
    cfg = SpeculativeConfig(algorithm="eagle3", num_eagle_layers=1, aux_layers=aux)
    t = SpeculativeTransform(config=cfg)
    cfg.num_eagle_layers = 5
    aux.append(3)
    m1 = t(build_gpt(_cfg()))
    m2 = t(build_gpt(_cfg()))
    assert m1.spec_config.num_eagle_layers == 1 and m1.spec_config.aux_layers == [0, 1, 2]
    assert m1.spec_config is not m2.spec_config and m1.spec_config.aux_layers is not m2.spec_config.aux_layers
    with pytest.raises(ConfigError, match="either config"):
        SpeculativeTransform(algorithm="eagle3", config=cfg)


@pytest.mark.parametrize("kw,match", [
    (dict(num_eagle_layers=1, num_medusa_heads=2), "both"),
    (dict(), "neither"),
    (dict(num_eagle_layers=0, num_medusa_heads=0), "neither"),
    (dict(algorithm="eagle3", num_eagle_layers=0), "num_eagle_layers must be > 0"),
    (dict(algorithm="medusa", num_medusa_heads=0), "num_medusa_heads must be > 0"),
    (dict(algorithm="medusa", num_eagle_layers=2), "num_eagle_layers=2"),
    (dict(algorithm="eagle1", num_medusa_heads=2), "num_medusa_heads=2"),
    (dict(algorithm="eagle2"), "unknown algorithm 'eagle2'"),
    (dict(algorithm="eagle1", draft_vocab_size=10), "draft_vocab_size is only used by eagle3"),
    (dict(num_eagle_layers=-1), "non-negative"),
])
def test_argument_errors(kw, match):
    with pytest.raises(ConfigError, match=match):
        SpeculativeTransform(**kw)


def test_errors_against_the_model_before_building():
    base = build_gpt(_cfg())
    n_children = len(list(base.children()))
    with pytest.raises(ConfigError, match=r"draft_vocab_size=200 must be in \[1, base vocab_size=96\]"):
        SpeculativeTransform(algorithm="eagle3", draft_vocab_size=200)(base)
    with pytest.raises(ConfigError, match="aux_layers entry 7"):
        SpeculativeTransform(algorithm="eagle3", aux_layers=[0, 1, 7])(base)
    assert len(list(base.children())) == n_children and all(p.requires_grad for p in base.parameters())
    t = SpeculativeTransform(algorithm="eagle3", num_eagle_layers=1)
    with pytest.raises(ConfigError, match="num_query_groups=3"):
        t.validate_for(tiny_llama(num_attention_heads=6, num_query_groups=3, hidden_size=48), 2)
    with pytest.raises(ConfigError, match="draft_vocab_size=47"):
        SpeculativeTransform(algorithm="eagle3", draft_vocab_size=47).validate_for(_cfg(), 2)
    with pytest.raises(TypeError, match="no megatron-core GPTModel"):
        t(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("alg", ["eagle1", "eagle3"])
def test_draft_step_shapes_and_cache(alg):
    m = make_spec(_cfg(), alg).eval()
    x = torch.randint(0, 96, (2, 9))
    with torch.no_grad():
        out = m.base_forward(x)
        f = m.fuse(m.base_features(out))
        assert f.shape == (2, 9, 64)
        hid, logits = m.draft_step(x, f)
    assert hid.shape == (2, 9, 64) and logits.shape == (2, 9, m.draft_vocab_size)
    assert m.draft_vocab_size == (48 if alg == "eagle3" else 96)
    # incremental decoding with the draft's own KV cache equals the full pass
    cache = m.new_draft_cache(2, 12)
    assert cache.k.shape[0] == 2  # one entry per draft layer
    outs = []
    with torch.no_grad():
        for a, b in [(0, 5), (5, 6), (6, 9)]:
            n = b - a
            slots = torch.arange(a, b)[None].expand(2, n)
            mask = (torch.arange(b)[None, None, :] <= torch.arange(a, b)[None, :, None]).expand(2, n, b)
            ctx = AttnContext(position_ids=slots, mask=mask, cache=cache, write_slots=slots, kv_len=b)
            outs.append(m.draft_step(x[:, a:b], f[:, a:b], ctx)[1])
    assert (torch.cat(outs, 1) - logits).abs().max() < 1e-5


def test_eagle3_features_and_draft_vocab():
    m = make_spec(_cfg(), "eagle3")
    assert m.aux_layers == [1, 1, 0]  # {1, L//2-1, L-4} for L=4
    x = torch.randint(0, 96, (1, 6))
    with torch.no_grad():
        out = m.base_forward(x)
    feats = m.base_features(out)
    assert torch.equal(feats[..., :64], out.aux_hidden[1]) and torch.equal(feats[..., 128:], out.aux_hidden[0])
    # identity offsets by default, frequency-chosen vocabulary after set_draft_vocab
    assert torch.equal(m.d2t, torch.zeros(48, dtype=torch.long))
    counts = torch.zeros(96)
    chosen = torch.randperm(96, generator=torch.Generator().manual_seed(3))[:48]
    counts[chosen] = torch.arange(1, 49, dtype=torch.float)
    counts[chosen[0]] = 1000.0
    m.set_draft_vocab(counts)
    assert torch.equal(m.draft_vocab_ids(), chosen.sort().values)
    assert torch.equal(m.draft_to_base_ids(torch.arange(48)), chosen.sort().values)
    assert int(m.draft_vocab_mask().sum()) == 48 and bool(m.t2d[chosen].all())
    w = m.gpt.output_layer.weight
    assert torch.equal(m.eagle_module.output_layer.weight, w[chosen.sort().values])
    # truncated vocabulary: the 48 most frequent
    from nemo_spec.speculative import count_tokens

    counts2 = count_tokens([list(range(i, 96)) for i in range(96)], 96)  # token i appears i+1 times
    assert counts2[5] == 6 and counts2[95] == 96
    m.set_draft_vocab(counts2)
    assert torch.equal(m.draft_vocab_ids(), torch.arange(48, 96))


def test_eagle3_ttt_matches_chain_drafting():
    """Training-time test step i at row t == chain drafting step i from row t with the draft KV cache."""
    m = make_spec(_cfg(), "eagle3").eval()
    m.set_draft_vocab(torch.arange(96, dtype=torch.float).flip(0), reinit_head=False)
    x = torch.randint(0, 96, (2, 11))
    with torch.no_grad():
        res = m.training_losses(x, return_logits=True, ttt_steps=3)
    assert len(res["step_logits"]) == 3 and len(res["step_losses"]) == 3 and len(res["step_acc"]) == 3
    for t in (0, 3, 6):
        chain = chain_logits(m, x, t, 3)
        for i in range(3):
            assert (chain[i] - res["step_logits"][i][:, t]).abs().max() < 1e-4, (t, i)


def test_medusa_logits_and_fresh_heads_equal_base():
    m = make_spec(_cfg(), "medusa", perturb=False)
    x = torch.randint(0, 96, (2, 7))
    with torch.no_grad():
        out = m.base_forward(x)
        ml = m.medusa_logits(out.hidden)
    assert ml.shape == (3, 2, 7, 96)
    for k in range(3):  # zero-initialised blocks + copied output layer = the base head
        assert torch.allclose(ml[k], out.logits, atol=1e-5)
    w = [h.output_layer.weight for h in m.medusa_heads.heads]
    assert w[0].data_ptr() != w[1].data_ptr()  # no sharing between heads


@pytest.mark.parametrize("alg", ALGS)
def test_training_step_updates_only_draft(alg):
    m = make_spec(_cfg(), alg)
    m.train()
    assert not m.gpt.training
    base_before = {k: v.clone() for k, v in m.gpt.state_dict().items() if isinstance(v, torch.Tensor)}
    draft_before = [p.detach().clone() for p in m.draft_parameters()]
    opt = torch.optim.AdamW(m.draft_parameters(), lr=1e-2)
    x = torch.randint(0, 96, (2, 12))
    mask = torch.ones_like(x)
    mask[:, :3] = 0
    losses = []
    for _ in range(3):
        res = m.training_losses(x, mask)
        assert res["loss"].requires_grad and torch.isfinite(res["loss"])
        assert all(0.0 <= float(a) <= 1.0 for a in res["step_acc"])
        opt.zero_grad()
        res["loss"].backward()
        assert all(p.grad is None for p in m.gpt.parameters())
        opt.step()
        losses.append(float(res["loss"]))
    assert losses[-1] < losses[0]
    assert all(torch.equal(base_before[k], v) for k, v in m.gpt.state_dict().items() if isinstance(v, torch.Tensor))
    assert all(not torch.equal(a, p) for a, p in zip(draft_before, m.draft_parameters()))
    n_steps = {"eagle1": 1, "eagle3": 3, "medusa": 3}[alg]
    assert len(res["step_losses"]) == n_steps


def test_loss_mask_is_applied():
    m = make_spec(_cfg(), "medusa")
    x = torch.randint(0, 96, (1, 10))
    full = m.training_losses(x)["step_losses"][0]
    mask = torch.zeros_like(x)
    mask[0, 2] = 1  # head 0 at row 0 predicts token 2 only
    one = m.training_losses(x, mask)["step_losses"][0]
    with torch.no_grad():
        logits = m.medusa_logits(m.base_forward(x).hidden)[0, 0, 0]
    expect = torch.nn.functional.cross_entropy(logits[None], x[0, 2:3])
    assert abs(float(one) - float(expect)) < 1e-5 and abs(float(one) - float(full)) > 1e-6
    zero = m.training_losses(x, torch.zeros_like(x))
    assert float(zero["loss"]) == 0.0


def test_offline_base_outputs_give_same_losses():
    m = make_spec(_cfg(), "eagle3")
    x = torch.randint(0, 96, (2, 8))
    with torch.no_grad():
        out = gpt_forward(m.gpt, x, aux_layers=m.aux_layers)
        a = m.training_losses(x)["loss"]
        b = m.training_losses(x, base_out=out)["loss"]
    assert torch.equal(a, b)


def test_transform_swaps_inside_lightning_module():
    import lightning.pytorch as pl

    class Holder(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = build_gpt(_cfg())

    h = Holder()
    gpt = h.model
    out = SpeculativeTransform(algorithm="medusa", num_medusa_heads=2)(h)
    assert out is h and isinstance(h.model, SpeculativeGPT) and h.model.gpt is gpt
    assert SpeculativeTransform(algorithm="medusa", num_medusa_heads=2)(h) is h and h.model.gpt is gpt
    with pytest.raises(ConfigError, match="refusing to stack"):
        SpeculativeTransform(algorithm="eagle1")(h)


def test_transforming_the_submodule_swaps_it_in_its_holder():
    """NeMo users write transform(lightning_module.module): the holder must end up with the draft, not a frozen base
    and 0 trainable parameters."""
    import lightning.pytorch as pl

    class Holder(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.module = build_gpt(_cfg())

    h = Holder()
    gpt = h.module
    out = SpeculativeTransform(num_eagle_layers=1, num_medusa_heads=0)(h.module)
    assert isinstance(out, SpeculativeGPT) and out.gpt is gpt and h.module is out
    trainable = {id(p) for p in h.parameters() if p.requires_grad}
    assert trainable and trainable == {id(p) for p in out.draft_parameters()}
    lone = build_gpt(_cfg())  # held by nobody: just returned
    assert SpeculativeTransform(algorithm="eagle1")(lone).gpt is lone


@pytest.mark.parametrize("make", [_cfg, tiny_gpt2])
def test_model_config_derived_for_foreign_gpt_model(make):
    """A GPTModel without nemo_spec's config attribute (e.g. NeMo's) gets its ModelConfig from megatron's config."""
    from nemo_spec.speculative import model_config_from_megatron

    cfg = make(rope_theta=5e5) if make is _cfg else make()
    base = build_gpt(cfg)
    del base.nemo_spec_config
    derived = model_config_from_megatron(base)
    for f in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "num_query_groups", "head_dim",
              "ffn_hidden_size", "normalization", "norm_eps", "activation", "position_embedding", "rope_theta",
              "add_bias_linear", "tie_word_embeddings", "max_position_embeddings"):
        assert getattr(derived, f) == getattr(cfg, f), f
    m = SpeculativeTransform(algorithm="eagle1")(base)
    assert m.model_config == derived
    from nemo_spec.models import model_config

    assert model_config(m) == derived


@pytest.mark.parametrize("alg", ALGS)
def test_gpt2_family_base(alg):
    """Learned positions, LayerNorm, GELU, biases and tied embeddings: drafts build, run, and get gradients."""
    torch.manual_seed(0)
    m = SpeculativeTransform(**ALG_KWARGS[alg])(build_gpt(tiny_gpt2()))
    x = torch.randint(0, 96, (2, 8))
    res = m.training_losses(x)
    res["loss"].backward()
    assert torch.isfinite(res["loss"]) and all(p.grad is not None for p in m.draft_parameters())
    tied = m.gpt.shared_embedding_or_output_weight()
    assert tied.grad is None
    if alg == "eagle3":  # head rows seeded from the tied embedding
        assert torch.equal(m.eagle_module.output_layer.weight, tied[:48])
    if alg == "eagle1":
        assert isinstance(m.eagle_module.layers[0].input_layernorm, IdentityOp)
        assert isinstance(m.eagle_module.layers[1].input_layernorm, torch.nn.LayerNorm)


def test_reapply_ignores_fields_of_other_algorithms():
    """A checkpoint's EAGLE-3 draft re-transformed with a config whose Medusa fields differ is a no-op."""
    from nemo_spec.config import SpeculativeConfig
    from nemo_spec.models import build_gpt
    from nemo_spec.speculative import SpeculativeTransform
    from tests.helpers import tiny_llama

    spec = SpeculativeTransform(config=SpeculativeConfig(algorithm="eagle3", num_eagle_layers=1, num_medusa_heads=0))(
        build_gpt(tiny_llama()))
    again = SpeculativeTransform(config=SpeculativeConfig(algorithm="eagle3", num_eagle_layers=1, num_medusa_heads=4))(spec)
    assert again is spec
    with pytest.raises(Exception, match="num_eagle_layers"):
        SpeculativeTransform(config=SpeculativeConfig(algorithm="eagle3", num_eagle_layers=2))(spec)


def test_speculators_draft_options_train_save_and_decode(tmp_path):
    """vLLM's speculators EAGLE-3 options (norm_before_fc: an input_norm over the 3h features before fc;
    norm_before_residual: layer 0's residual is hidden_norm(feature); norm_output: the normalised output is the
    next step's feature): they train (input_norm gets gradients), the generation path computes what the training
    path does, they are checkpointed, greedy speculative decoding equals AR, and they are part of the draft's shape."""
    from nemo_spec.checkpoint import load_model, save_checkpoint
    from nemo_spec.inference import SamplingParams, generate
    from tests.speculative_utils import perturb_draft, train_draft

    opts = dict(norm_before_fc=True, norm_before_residual=True, norm_output=True)
    torch.manual_seed(0)
    cfg = tiny_llama(num_layers=4)
    m = SpeculativeTransform(algorithm="eagle3", num_eagle_layers=2, aux_layers=[2, 0, 1], **opts)(build_gpt(cfg))
    plain = SpeculativeTransform(algorithm="eagle3", num_eagle_layers=2, aux_layers=[2, 0, 1])(build_gpt(cfg))
    assert m.num_draft_parameters() == plain.num_draft_parameters() + 3 * cfg.hidden_size  # input_norm [3h]
    perturb_draft(m, 1, 0.2)
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    before = m.eagle_module.input_norm.weight.detach().clone()
    losses = [float(r["loss"]) for r in train_draft(m, ids, steps=4)]
    assert losses[-1] < losses[0] and not torch.equal(before, m.eagle_module.input_norm.weight)
    m.eval()
    feats = m.fuse(m.base_features(m.base_forward(ids)))
    with torch.no_grad():  # generation: the fast path
        h_fast, l_fast = m.draft_step(ids, feats.detach())
    h_mod, l_mod = m.draft_step(ids, feats.detach())  # training: the modules
    assert (l_fast - l_mod).abs().max() < 1e-4 and (h_fast - h_mod).abs().max() < 1e-4
    # norm_output: the output rows are normalised (the next step's feature), the logits come from them directly
    assert torch.allclose(l_mod, m.eagle_module.output_layer(h_mod)[0], atol=1e-5)
    loaded = load_model(save_checkpoint(m, tmp_path / "ckpt")).eval()
    assert loaded.spec_config.norm_before_fc and loaded.spec_config.norm_output
    with torch.no_grad():
        assert torch.equal(loaded.draft_step(ids, loaded.fuse(loaded.base_features(loaded.base_forward(ids))))[1],
                           l_fast)
    prompts, params = [[5, 6, 7, 8, 5, 6, 7, 8], [3, 4, 9]], SamplingParams(max_new_tokens=10)
    ar = [o.tokens for o in generate(m.gpt, prompts, params)]
    for method in ("eagle", "eagle_tree"):
        assert [o.tokens for o in generate(m, prompts, params, method=method)] == ar, method
    with pytest.raises(ConfigError, match="different shape.*norm_before_fc: True -> False"):
        SpeculativeTransform(algorithm="eagle3", num_eagle_layers=2, aux_layers=[2, 0, 1],
                             norm_before_residual=True, norm_output=True)(m)
    with pytest.raises(ConfigError, match="norm_output is an EAGLE-3 draft option, not medusa"):
        SpeculativeConfig(algorithm="medusa", norm_output=True).validate()
    from nemo_spec.speculative.cli import main as speculate_main  # scripts/gpt_speculate.py --norm_before_fc ...

    base = save_checkpoint(m.gpt, tmp_path / "base")
    assert speculate_main(["--model_path", str(base), "--export_dir", str(tmp_path / "cli"), "--num_eagle_layers", "1",
                           "--aux_layers", "0,1,2",
                           "--norm_before_fc", "--norm_output"]) == 0
    c = load_model(tmp_path / "cli").spec_config
    assert c.norm_before_fc and c.norm_output and not c.norm_before_residual
