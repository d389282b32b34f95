"""Model builder: forward shapes, KV-cache incremental decoding, explicit masks, TP=2 == TP=1."""
import copy
import pickle
import time

import pytest
import torch

from nemo_spec.checkpoint.tp import is_tensor_entry
from nemo_spec.config import ConfigError, ModelConfig
from nemo_spec.models import AttnContext, build_gpt, gpt_forward, new_kv_cache
from tests.helpers import ROOT, run_torchrun, tiny_gpt2, tiny_llama


@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt2])
def test_forward_and_backward(make):
    torch.manual_seed(0)
    m = build_gpt(make())
    x = torch.randint(0, 96, (2, 12))
    out = gpt_forward(m, x, aux_layers=[0, 1])
    assert out.logits.shape == (2, 12, 96) and out.hidden.shape == (2, 12, 64) and len(out.aux_hidden) == 2
    out.logits.float().logsumexp(-1).mean().backward()
    assert all(p.grad is not None for p in m.parameters())


@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt2])
def test_kv_cache_incremental_matches_full(make):
    torch.manual_seed(0)
    m = build_gpt(make()).eval()
    x = torch.randint(0, 96, (3, 10))
    with torch.no_grad():
        full = gpt_forward(m, x).logits
        cache = new_kv_cache(m, batch_size=3, max_len=16)
        # prefill 6 tokens, then one token at a time
        steps = [(0, 6)] + [(i, i + 1) for i in range(6, 10)]
        outs = []
        for a, b in steps:
            n = b - a
            slots = torch.arange(a, b)[None].expand(3, n)
            kv = b
            mask = torch.arange(kv)[None, None, :] <= torch.arange(a, b)[None, :, None]
            ctx = AttnContext(position_ids=slots, mask=mask.expand(3, n, kv), cache=cache, write_slots=slots, kv_len=kv)
            outs.append(gpt_forward(m, x[:, a:b], ctx).logits)
            cache.lengths += n
    inc = torch.cat(outs, 1)
    assert (inc - full).abs().max() < 1e-5


def test_explicit_mask_equals_causal():
    torch.manual_seed(0)
    m = build_gpt(tiny_llama()).eval()
    x = torch.randint(0, 96, (2, 8))
    pos = torch.arange(8)[None].expand(2, 8)
    mask = torch.tril(torch.ones(8, 8, dtype=torch.bool))[None].expand(2, 8, 8)
    with torch.no_grad():
        a = gpt_forward(m, x).logits
        b = gpt_forward(m, x, AttnContext(position_ids=pos, mask=mask)).logits
    assert (a - b).abs().max() < 1e-5


def test_tp_size_must_divide_heads():
    cfg = tiny_llama(num_attention_heads=6, num_query_groups=3, hidden_size=48)
    with pytest.raises(ConfigError, match="num_query_groups=3"):
        cfg.check_tensor_parallel(2)


def test_invalid_config_names_field():
    with pytest.raises(ConfigError, match="activation"):
        tiny_llama(activation="relu6")


@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt2])
def test_tp2_logits_equal_tp1(make, tmp_path):
    torch.manual_seed(0)
    cfg = make()
    m = build_gpt(cfg).eval()
    x = torch.randint(0, 96, (2, 9))
    with torch.no_grad():
        logits = gpt_forward(m, x).logits
    sd = {k: v for k, v in m.state_dict().items() if is_tensor_entry(k, v)}
    path = tmp_path / "blob.pt"
    torch.save({"config": cfg.to_dict(), "state_dict": sd, "input_ids": x, "logits": logits}, path)
    out = run_torchrun(ROOT / "tests" / "dist_scripts" / "tp_logits.py", [path])
    assert "TP2_MAX_ERR" in out


@pytest.mark.parametrize("gemm", ["linear", "auto"])
@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt2, lambda: tiny_llama(num_query_groups=4, add_qkv_bias=True)])
def test_fast_inference_path_matches_module_forward(make, gemm, monkeypatch):
    """The lean inference path (models/fastpath.py) computes what the megatron modules compute: full causal
    forward, and cached decoding with a tree-style explicit mask, with the same aux features — with F.linear and
    with the timed small-row kernels (gemm="auto": 1-, 6- and 12-row products over the model's registered weights)."""
    from nemo_spec.models import fastpath

    monkeypatch.setattr(fastpath, "SMALL_GEMM", gemm)
    torch.manual_seed(0)
    m = build_gpt(make()).eval()
    fastpath.register(m)
    for p in m.parameters():  # non-zero biases so that every bias term is exercised
        if p.dim() == 1:
            torch.nn.init.normal_(p, std=0.1)
    x = torch.randint(0, 96, (2, 9))
    with torch.no_grad():
        ref = gpt_forward(m, x, aux_layers=[0], fast=False)
        got = gpt_forward(m, x, aux_layers=[0], fast=True)
        assert fastpath.active() and all(fastpath.supported(layer) for layer in m.decoder.layers)
        torch.testing.assert_close(got.logits, ref.logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.aux_hidden[0], ref.aux_hidden[0], rtol=1e-5, atol=1e-5)
        outs = {}
        for fast in (False, True):
            cache = new_kv_cache(m, batch_size=2, max_len=16)
            pre = AttnContext(position_ids=torch.arange(6)[None].expand(2, 6), cache=cache,
                              write_slots=torch.arange(6)[None].expand(2, 6), kv_len=6,
                              mask=torch.ones(6, 6, dtype=torch.bool).tril()[None].expand(2, 6, 6))
            gpt_forward(m, x[:, :6], pre, fast=fast)
            cache.lengths += 6
            # a 3-node tree after the prefix: node 0 root, nodes 1 and 2 both children of node 0
            anc = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
            mask = torch.cat([torch.ones(3, 6, dtype=torch.bool), anc], 1)[None].expand(2, 3, 9)
            ctx = AttnContext(position_ids=torch.tensor([[6, 7, 7]]).expand(2, 3), mask=mask, cache=cache,
                              write_slots=torch.arange(6, 9)[None].expand(2, 3), kv_len=9)
            outs[fast] = gpt_forward(m, x[:, 6:9], ctx, fast=fast).logits
        torch.testing.assert_close(outs[True], outs[False], rtol=1e-5, atol=1e-5)
        one = gpt_forward(m, x[:1, :1], fast=True).logits  # a 1-row product
        torch.testing.assert_close(one, gpt_forward(m, x[:1, :1], fast=False).logits, rtol=1e-5, atol=1e-5)
    if gemm == "auto":  # the whole model was timed as one group, per row count used
        group = fastpath._GROUP_OF[id(m.decoder.layers[0].mlp.linear_fc1.weight)]
        assert {k[2] for k in group.choice} >= {1, 6}
    # with gradients on, the module forward is used (training never takes the fast path)
    assert not fastpath.active()


def test_last_logits_only_matches_full_forward():
    torch.manual_seed(0)
    m = build_gpt(tiny_llama()).eval()
    x = torch.randint(0, 96, (2, 7))
    with torch.no_grad():
        full = gpt_forward(m, x)
        last = gpt_forward(m, x, last_logits_only=True)
    assert last.logits.shape == (2, 1, 96)
    torch.testing.assert_close(last.logits[:, 0], full.logits[:, -1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(last.hidden, full.hidden)


@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt2])
def test_bf16_model_runs_both_paths(make):
    """A model built with params_dtype=bf16 has bf16 parameters throughout (megatron leaves torch norms and learned
    positions in fp32) and runs through the module forward and the fast path with matching logits."""
    torch.manual_seed(0)
    m = build_gpt(make(), params_dtype=torch.bfloat16).eval()
    assert {p.dtype for p in m.parameters()} == {torch.bfloat16}
    x = torch.randint(0, 96, (2, 9))
    with torch.no_grad():
        a = gpt_forward(m, x, fast=False).logits.float()
        b = gpt_forward(m, x, fast=True).logits.float()
    assert torch.isfinite(a).all()
    torch.testing.assert_close(a, b, rtol=0.05, atol=0.05)


def test_kv_expansion_for_the_cpu_backward_is_exact():
    """expand_kv_for_backward (CPU training: k/v repeated to the query heads, enable_gqa off) gives enable_gqa's
    outputs and gradients; without autograd it leaves k/v alone."""
    import torch.nn.functional as F

    from nemo_spec.models.attention import expand_kv_for_backward

    torch.manual_seed(0)
    q = torch.randn(2, 6, 11, 8, requires_grad=True)
    k = torch.randn(2, 2, 11, 8, requires_grad=True)
    v = torch.randn(2, 2, 11, 8, requires_grad=True)
    w = torch.randn(2, 6, 11, 8)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    g_ref = torch.autograd.grad((ref * w).sum(), [q, k, v])
    ke, ve, gqa = expand_kv_for_backward(q, k, v)
    assert not gqa and ke.shape == (2, 6, 11, 8)
    out = F.scaled_dot_product_attention(q, ke, ve, is_causal=True, enable_gqa=gqa)
    g = torch.autograd.grad((out * w).sum(), [q, k, v])
    assert torch.allclose(out, ref, atol=1e-6)
    for a, b in zip(g, g_ref):
        assert torch.allclose(a, b, atol=1e-5)
    with torch.no_grad():
        assert expand_kv_for_backward(q, k, v)[2] is True


def test_fastpath_small_gemm_kernel_choice(monkeypatch):
    """CPU products of up to MAX_TUNED_ROWS rows: every candidate kernel (F.linear and the transposed product, over x
    as it is and zero-padded) computes F.linear's product; "auto" times them once per row count over the weights
    a model registered together and caches the choice in their group; a lone weight gets a group of its own;
    forced modes override; an unknown mode is an error naming the variable."""
    from nemo_spec.models import fastpath, skinny_gemm

    torch.manual_seed(0)
    w, b = torch.randn(48, 16), torch.randn(48)
    for rows in (1, 3, 5, 11, 25, 33):
        x = torch.randn(2, rows, 16)[:1]  # [1, rows, 16]
        want = torch.nn.functional.linear(x, w, b)
        for k in fastpath.candidates(rows):
            got = fastpath._run(k, x.reshape(rows, 16), w).view(1, rows, 48) + b
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        for mode in ("linear", "transposed", "skinny", "auto"):
            monkeypatch.setattr(fastpath, "SMALL_GEMM", mode)
            torch.testing.assert_close(fastpath.linear(x, w, b), want, atol=1e-5, rtol=1e-5)
    torch_kernels = [("linear", 1), ("transposed", 1), ("linear", 2), ("transposed", 2), ("linear", 4),
                     ("transposed", 4)]
    assert fastpath.candidates(1) == torch_kernels + [("skinny", 1)] * skinny_gemm.available()
    assert fastpath.candidates(1, w.double()) == torch_kernels  # the compiled kernel is fp32 only
    assert {p for _, p in fastpath.candidates(11)} == {11, 12, 16}
    assert sorted(k[2] for k in fastpath._GROUP_OF[id(w)].choice) == [1, 3, 5, 11, 25]  # 33 rows always take F.linear

    # every padded kernel through linear() itself: [s, b, in] input, a non-contiguous one, bias added once
    monkeypatch.setattr(fastpath, "SMALL_GEMM", "auto")
    with monkeypatch.context() as mp:
        for k_index in (-1, -2):
            mp.setattr(fastpath, "kernel", lambda weight, rows, i=k_index: fastpath.candidates(rows)[i])
            for rows in (1, 3, 5):
                x = torch.randn(rows, 1, 16)
                xt = torch.randn(1, rows, 16).transpose(0, 1)
                for xx in (x, xt):
                    torch.testing.assert_close(fastpath.linear(xx, w, b), torch.nn.functional.linear(xx, w, b),
                                               atol=1e-5, rtol=1e-5)

    emb = torch.nn.Embedding(10, 16)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 16), emb)
    fastpath.register(model)
    group = fastpath._GROUP_OF[id(model[0].weight)]
    assert group is fastpath._GROUP_OF[id(model[1].weight)] and len(group.refs) == 2
    assert id(emb.weight) not in fastpath._GROUP_OF  # embedding tables are not swept
    fastpath.register(model)
    assert fastpath._GROUP_OF[id(model[0].weight)] is group  # re-registering keeps the group (and its timings)
    copy.deepcopy(model)  # the groups live beside the weights, not on them: a module stays copyable / picklable
    pickle.dumps(model)

    lone = torch.randn(8, 16)
    with fastpath.small_gemm_rule("auto"):
        fastpath.kernel(lone, 2)
    key = id(lone)
    assert key in fastpath._GROUP_OF
    del lone
    assert key not in fastpath._GROUP_OF  # dropped with its weight: a new tensor at that id starts afresh

    # the choice follows the timings: make every kernel but the transposed one over 4 rows slow
    real = fastpath._run

    def timed(kernel, x2, weight):
        if kernel != ("transposed", 4):
            time.sleep(2e-3)
        return real(kernel, x2, weight)

    monkeypatch.setattr(fastpath, "_run", timed)
    monkeypatch.setattr(fastpath, "SMALL_GEMM", "auto")
    assert fastpath.kernel(model[0].weight, 3) == ("transposed", 4) == fastpath.kernel(model[1].weight, 3)
    assert {k[2] for k in group.choice} == {3}  # both shapes timed in the one sweep
    monkeypatch.setattr(fastpath, "SMALL_GEMM", "transposed")
    assert fastpath.kernel(model[0].weight, 3) == ("transposed", 3)  # a forced mode overrides the cached measurement
    monkeypatch.setattr(fastpath, "SMALL_GEMM", "linear")
    assert fastpath.kernel(model[0].weight, 3) == ("linear", 3)
    monkeypatch.setattr(fastpath, "SMALL_GEMM", "skinny")
    assert fastpath.kernel(model[0].weight, 3) == ("skinny" if skinny_gemm.available() else "linear", 3)
    assert fastpath.kernel(model[0].weight.double(), 3) == ("linear", 3)  # fp64: not the kernel's
    monkeypatch.setattr(fastpath, "SMALL_GEMM", "fastest")
    with pytest.raises(ValueError, match="NEMO_SPEC_SMALL_GEMM"):
        fastpath.kernel(torch.randn(5, 7), 2)


def test_rope_qk_equals_apply_rope_exactly():
    """Generation rotates q and k in one pass (roll + signed sin); bitwise what apply_rope gives each of them."""
    from nemo_spec.models.attention import AttnContext, apply_rope, rope_cos_sin, rope_inv_freq, rope_qk

    torch.manual_seed(0)
    inv = rope_inv_freq(32, 10000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    pos = torch.randint(0, 500, (2, 5))
    q, k = torch.randn(2, 4, 5, 32), torch.randn(2, 2, 5, 32)
    rq, rk = rope_qk(q, k, AttnContext(position_ids=pos).rope_signed(inv))
    cs = rope_cos_sin(pos, inv)
    assert torch.equal(rq, apply_rope(q, pos, inv, cs)) and torch.equal(rk, apply_rope(k, pos, inv, cs))
