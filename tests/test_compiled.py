"""The compiled decode step (options={"compile": ...}, nemo_spec/models/compiled.py): same tokens as eager."""
import pytest
import torch

from nemo_spec.inference import SamplingError, SamplingParams, generate
from nemo_spec.models import build_gpt, compiled, gpt_forward, new_kv_cache
from nemo_spec.inference.trees import block_context
from nemo_spec.speculative import SpeculativeTransform
from tests.helpers import tiny_gpt2, tiny_llama

torch.set_num_threads(1)
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [11, 3], [40, 41, 42, 40, 41, 42, 40]]


def _cached_logits(model, ids, steps):
    """Prefill then `steps` single-token cached decode steps (batch of rows): logits of every forward."""
    b = ids.shape[0]
    kv = new_kv_cache(model, b, 64)
    outs = []
    with torch.inference_mode():
        n = ids.shape[1]
        anc = torch.ones(b, n, n, dtype=torch.bool).tril()
        ctx = block_context(kv, anc, torch.arange(n)[None].expand(b, n), 256, max_length=0)
        outs.append(gpt_forward(model, ids, ctx).logits)
        kv.lengths += n
        tok = outs[-1][:, -1].argmax(-1)
        for i in range(steps):
            ctx = block_context(kv, torch.ones(b, 1, 1, dtype=torch.bool), torch.zeros(b, 1, dtype=torch.long), 256,
                                max_length=n + i, single_decode=b == 1)
            outs.append(gpt_forward(model, tok[:, None], ctx).logits)
            kv.lengths += 1
            tok = outs[-1][:, -1].argmax(-1)
    return outs


_UNCOMPILED = {"attn_in": compiled._attn_in, "attn_out_mlp": compiled._attn_out_mlp, "mlp_res": compiled._mlp_res}


@pytest.mark.parametrize("make,inductor", [(tiny_llama, True), (tiny_gpt2, False)])
def test_compiled_layers_compute_the_eager_logits(make, inductor, monkeypatch):
    """Llama layers through inductor; GPT-2 layers (LayerNorm, biases, GELU) through the same generic halves run
    uncompiled (their math; compiling them costs another ~30 s of test time for what inductor already showed)."""
    if not inductor:
        monkeypatch.setattr(compiled, "_compiled", lambda mode: _UNCOMPILED)
    torch.manual_seed(0)
    m = build_gpt(make()).eval()
    ids = torch.tensor([PROMPTS[0], PROMPTS[2] + [1, 2, 3]])
    eager = _cached_logits(m, ids, 3)
    assert compiled.compile_layers(m, True) == len(m.decoder.layers)
    assert all(compiled.mode_of(layer) == "default" for layer in m.decoder.layers)
    got = _cached_logits(m, ids, 3)
    assert all(compiled.mode_of(layer) == "default" for layer in m.decoder.layers)  # no fallback to eager
    for e, g in zip(eager, got):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
    # a changed weight is seen (the compiled halves take the layer's parameters as inputs, not constants)
    with torch.no_grad():
        m.decoder.layers[1].mlp.linear_fc2.weight.mul_(2.0)
    changed = _cached_logits(m, ids, 0)[0]
    compiled.compile_layers(m, "off")
    assert all(compiled.mode_of(layer) is None for layer in m.decoder.layers)
    torch.testing.assert_close(changed, _cached_logits(m, ids, 0)[0], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(changed, eager[0], atol=1e-3)


def test_generate_with_compile_option_gives_the_eager_tokens():
    torch.manual_seed(0)
    m = build_gpt(tiny_llama()).eval()
    sp = SamplingParams(max_new_tokens=8)
    ref = [o.tokens for o in generate(m, PROMPTS, sp)]
    assert [o.tokens for o in generate(m, PROMPTS, sp, options={"compile": True})] == ref
    torch.manual_seed(3)
    spec = SpeculativeTransform(algorithm="eagle3", draft_vocab_size=64)(m).eval()
    spec.set_draft_vocab(torch.arange(96, 0, -1).float())
    opts = {"num_draft_tokens": 3}
    eager = [o.tokens for o in generate(spec, PROMPTS, sp, method="eagle", options=opts)]
    assert eager == ref  # greedy EAGLE == AR
    outs = generate(spec, PROMPTS, sp, method="eagle", options={**opts, "compile": "default"})
    assert [o.tokens for o in outs] == ref
    draft_layers = list(spec.eagle_module.layers)
    assert all(compiled.mode_of(layer) == "default" for layer in draft_layers)  # the draft's layers too, incl.
    assert type(draft_layers[0]).__name__ == "Eagle3FirstLayer"  # the fused first layer (its MLP half compiled)
    # the option governs each session: without it the layers run eager again
    generate(spec, PROMPTS[:1], SamplingParams(max_new_tokens=2), method="eagle", options=opts)
    assert all(compiled.mode_of(layer) is None for layer in spec.modules()
               if isinstance(layer, type(m.decoder.layers[0])))


@pytest.mark.parametrize("bad", ["fast", 3, "on"])
def test_bad_compile_option_is_refused_by_name(bad):
    m = build_gpt(tiny_llama()).eval()
    with pytest.raises(SamplingError, match="option 'compile'"):
        generate(m, PROMPTS[:1], SamplingParams(max_new_tokens=2), options={"compile": bad})
