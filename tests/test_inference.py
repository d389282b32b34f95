"""Generation engine: greedy equality of every method with AR (batch 1 and ragged batch 4), caches, stops, errors."""
import re

import pytest
import torch

from nemo_spec.inference import SamplingError, SamplingParams, generate, get_engine
from nemo_spec.models import build_gpt, model_config
from nemo_spec.speculative import SpeculativeTransform
from tests.helpers import tiny_gpt2, tiny_llama
from tests.inference_utils import accepted_drafts, naive_greedy

torch.set_num_threads(1)  # tiny models: threading only adds overhead on shared CPUs
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [11, 3], [40, 41, 42, 40, 41, 42, 40], [77]]
OPTS = {"depth": 3, "top_k": 3, "total_tokens": 10, "num_draft_tokens": 3}


def _target(make=tiny_llama, seed=0):
    torch.manual_seed(seed)
    return build_gpt(make()).eval()


def _clone(model):
    """A separate GPTModel with the same weights."""
    c = build_gpt(model_config(model)).eval()
    c.load_state_dict(model.state_dict())
    return c


def _noisy_copy(model, scale=0.002, seed=1):
    """A draft that mostly agrees with the target (exercises partial, ragged acceptance)."""
    d = _clone(model)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn_like(p) * scale)
    return d


SPEC_KW = {"eagle3": {"draft_vocab_size": 64}, "medusa": {"num_medusa_heads": 3},
           "peagle": {"draft_vocab_size": 64, "num_eagle_layers": 2, "parallel_depth": 3, "mask_token_id": 95},
           "dflash": {"num_layers": 2, "block_size": 4, "target_layer_ids": [0], "mask_token_id": 95}}


def _spec(model, alg):
    torch.manual_seed(3)
    spec = SpeculativeTransform(algorithm=alg, **SPEC_KW.get(alg, {}))(_clone(model))
    if alg in ("eagle3", "peagle"):
        spec.set_draft_vocab(torch.arange(96, 0, -1).float())
    return spec.eval()


@pytest.fixture(scope="module")
def llama():
    m = _target()
    ref = [naive_greedy(m, p, 10) for p in PROMPTS]
    return m, ref


@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt2])
def test_ar_batched_equals_unbatched_equals_naive(make):
    m = _target(make)
    sp = SamplingParams(max_new_tokens=10)
    ref = [naive_greedy(m, p, 10) for p in PROMPTS]
    assert [o.tokens for o in generate(m, PROMPTS, sp)] == ref
    assert [generate(m, [p], sp)[0].tokens for p in PROMPTS] == ref
    assert _joining(m, "ar", None, ref) is not None


# Rows joining and leaving mid-flight: twice the prompts through 3 slots, budgets 4..10 tokens (rows finish at
# different steps, queued ones take their slots) and prompts read 4 tokens per step (chunked prefill
# interleaved with other rows' decode steps). Each row must still be the AR continuation.
JOIN_OPTS = {"max_batch": 3, "prefill_chunk_tokens": 4}


def _joining(model, method, draft, ref, opts=None):
    prompts = PROMPTS + PROMPTS[::-1]
    refs = ref + ref[::-1]
    budgets = [4 + (3 * i) % 7 for i in range(len(prompts))]
    outs = generate(model, prompts, [SamplingParams(max_new_tokens=n) for n in budgets], method=method,
                    draft_model=draft, options={**(opts or {}), **JOIN_OPTS})
    assert [o.tokens for o in outs] == [r[:n] for r, n in zip(refs, budgets)]
    assert any(o.stats["prefill_chunks"] > 1 for o in outs)  # a prompt was read over several steps
    assert outs[0].stats["session"]["steps"] > max(budgets)  # rows queued behind others: more steps than one row
    return outs


CASES = [("prompt_lookup", None), ("draft_model", "random"), ("draft_model", "noisy"), ("eagle", "eagle1"),
         ("eagle", "eagle3"), ("eagle_tree", "eagle1"), ("eagle_tree", "eagle3"), ("medusa", "medusa"),
         ("peagle", "peagle"), ("dflash", "dflash"), ("peagle_tree", "peagle"), ("dflash_tree", "dflash")]


@pytest.mark.parametrize("method,kind", CASES)
def test_speculative_greedy_equals_ar(llama, method, kind):
    m, ref = llama
    sp = SamplingParams(max_new_tokens=10)
    model, draft = m, None
    if method == "draft_model":
        draft = build_gpt(tiny_llama(num_layers=1)).eval() if kind == "random" else _noisy_copy(m)
    elif kind is not None:
        model = _spec(m, kind)
    outs = generate(model, PROMPTS, sp, method=method, draft_model=draft, options=OPTS)
    assert [o.tokens for o in outs] == ref
    assert outs[0].stats["session"]["prefill_forwards"] == 1  # 20 padding tokens in 40: within the default
    # the prefill split by length: rows sorted into slots [1, 2 | 7 | 10 tokens], one forward per group
    split = generate(model, PROMPTS, sp, method=method, draft_model=draft, options={**OPTS, "prefill_pad_tokens": 2})
    assert [o.tokens for o in split] == ref and split[0].stats["session"]["prefill_forwards"] == 3
    assert [generate(model, [p], sp, method=method, draft_model=draft, options=OPTS)[0].tokens
            for p in PROMPTS[:2]] == ref[:2]
    _joining(model, method, draft, ref, OPTS)
    for o in outs:
        s = o.stats
        assert s["method"] == method and s["new_tokens"] == 10
        assert s["target_forwards"] == sum(s["accept_hist"]) + 1  # prefill + one verification per step
        steps = sum(s["accept_hist"])  # tau: tokens per decoding step (accepted + 1), the prefill excluded
        assert s["decode_steps"] == steps
        assert abs(s["tau"] - (sum(m * c for m, c in enumerate(s["accept_hist"])) + steps) / steps) < 1e-9
        assert (s["draft_forwards"] > 0) == (method != "prompt_lookup") and s["tokens_per_s"] > 0 and s["peak_memory_bytes"] > 0
    if kind == "noisy":
        assert max(max(len(o.stats["accept_hist"]) for o in outs), 0) > 2  # multi-token acceptance happened
        assert len({o.stats["target_forwards"] for o in outs}) > 1 or outs[0].stats["tau"] > 1.5  # ragged rows


def test_perfect_draft_accepts_everything(llama):
    m, ref = llama
    outs = generate(m, PROMPTS, SamplingParams(max_new_tokens=10), method="draft_model", draft_model=m,
                    options={"num_draft_tokens": 4})
    assert [o.tokens for o in outs] == ref
    assert all(o.stats["target_forwards"] == 3 for o in outs)  # 1 + 5 + 5 tokens (4 drafts + bonus)
    # tau counts decoding steps only (the reference code's 5.00 here; prefill-inclusive counting gave 10/3)
    assert all(o.stats["tau"] == 5.0 and o.stats["decode_steps"] == 2 for o in outs)


def test_per_row_max_tokens_stops_and_streaming(llama):
    m, ref = llama
    params = [SamplingParams(max_new_tokens=3), SamplingParams(max_new_tokens=10, stop_token_ids=(ref[1][4],)),
              SamplingParams(max_new_tokens=10), SamplingParams(max_new_tokens=6)]
    seen = {r: [] for r in range(4)}

    def on_tokens(row, toks):
        seen[row].extend(toks)
        return not (row == 2 and len(seen[row]) >= 2)  # cancel row 2 after its second token

    outs = generate(m, PROMPTS, params, method="prompt_lookup", on_tokens=on_tokens, options=OPTS)
    stop_at = ref[1].index(ref[1][4])
    assert outs[0].tokens == ref[0][:3] and outs[0].finish_reason == "length"
    assert outs[1].tokens == ref[1][:stop_at] and outs[1].finish_reason == "stop"
    assert outs[2].finish_reason == "cancelled" and outs[2].tokens == ref[2][: len(outs[2].tokens)]
    assert outs[3].tokens == ref[3][:6]
    assert all(seen[r] == outs[r].tokens for r in range(4))


def test_eos_from_model_config_unless_ignored(llama):
    m, ref = llama
    eos = ref[0][3]
    model_config(m).eos_token_id = eos
    try:
        out = generate(m, [PROMPTS[0]], SamplingParams(max_new_tokens=10), method="prompt_lookup", options=OPTS)[0]
        assert out.tokens == ref[0][: ref[0].index(eos)] and out.finish_reason == "stop"
        out = generate(m, [PROMPTS[0]], SamplingParams(max_new_tokens=10), options={"ignore_eos": True})[0]
        assert out.tokens == ref[0] and out.finish_reason == "length"
    finally:
        model_config(m).eos_token_id = None


def test_stop_strings_with_tokenizer(llama):
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import WordLevel

    m, ref = llama
    tok = Tokenizer(WordLevel({f"w{i}": i for i in range(96)}, unk_token="w0"))
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    stop = f"w{ref[0][2]}"
    sp = SamplingParams(max_new_tokens=10, stop_strings=(stop,))
    out = generate(m, [PROMPTS[0]], sp, tokenizer=tok)[0]
    assert out.finish_reason == "stop" and stop not in out.text
    assert out.tokens == ref[0][: ref[0].index(ref[0][2]) + 1]  # up to the token completing the stop string
    draft = _noisy_copy(m)
    for method in ("prompt_lookup", "draft_model"):  # multi-token steps stop at the same token
        spec_out = generate(m, [PROMPTS[0]], sp, method=method, draft_model=draft, tokenizer=tok, options=OPTS)[0]
        assert (spec_out.tokens, spec_out.text, spec_out.finish_reason) == (out.tokens, out.text, "stop")
    with pytest.raises(SamplingError, match="tokenizer"):
        generate(m, [PROMPTS[0]], SamplingParams(stop_strings=("x",)))


def test_stop_strings_where_a_longer_output_decodes_without_them(llama):
    # an HF tokenizer with clean_up_tokenization_spaces (BERT / GPT-2-era configs): decode(out[:k]) ends "wA '", the
    # stop string, and decode(out[:k + 1]) reads "wA'x" without it; AR stops at token k, and so must a step that
    # accepts tokens k and k + 1 together (the session decoded only the whole chunk)
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    m, ref = llama
    out = ref[0]
    k = next(i for i in range(2, len(out)) if len({out[i - 2], out[i - 1], out[i]}) == 3
             and out[i - 1] not in out[:i - 1] and out[i] not in out[:i])
    names = {out[k - 1]: "'", out[k]: "x"}
    rust = Tokenizer(WordLevel({names.get(i, f"w{i}"): i for i in range(96)}, unk_token="w0"))
    rust.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok = PreTrainedTokenizerFast(tokenizer_object=rust, clean_up_tokenization_spaces=True)
    stop = f"w{out[k - 2]} '"
    assert stop in tok.decode(out[:k]) and stop not in tok.decode(out[:k + 1])
    sp = SamplingParams(max_new_tokens=10, stop_strings=(stop,))
    ar = generate(m, [PROMPTS[0]], sp, tokenizer=tok)[0]
    assert (ar.tokens, ar.finish_reason) == (out[:k], "stop")
    spec_out = generate(m, [PROMPTS[0]], sp, method="draft_model", draft_model=_clone(m), tokenizer=tok,
                        options={"num_draft_tokens": 4})[0]  # a perfect draft: whole chunks accepted
    assert (spec_out.tokens, spec_out.text, spec_out.finish_reason) == (ar.tokens, ar.text, "stop")


def test_stop_strings_deep_into_a_long_output(llama):
    # past the first tokens a step decodes its prefixes' last tokens first (the whole output only on a hit there):
    # a stop string 50 tokens in still ends AR and every multi-token method at the same token
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import WordLevel

    m, _ = llama
    tok = Tokenizer(WordLevel({f"w{i}": i for i in range(96)}, unk_token="w0"))
    tok.decoder = decoders.WordPiece(prefix="##")
    out = generate(m, [PROMPTS[0]], SamplingParams(max_new_tokens=64), options={"ignore_eos": True})[0].tokens
    k = next(i for i in range(50, 64) if f"w{out[i - 1]} w{out[i]}" not in tok.decode(out[:i]))
    stop = f"w{out[k - 1]} w{out[k]}"  # first completed by token k
    sp = SamplingParams(max_new_tokens=64, stop_strings=(stop,))
    ar = generate(m, [PROMPTS[0]], sp, tokenizer=tok, options={"ignore_eos": True})[0]
    assert (ar.tokens, ar.finish_reason) == (out[:k + 1], "stop") and stop not in ar.text
    for method, draft in (("prompt_lookup", None), ("draft_model", _clone(m))):
        spec_out = generate(m, [PROMPTS[0]], sp, method=method, draft_model=draft, tokenizer=tok,
                            options={"num_draft_tokens": 4, "ignore_eos": True})[0]
        assert (spec_out.tokens, spec_out.text, spec_out.finish_reason) == (ar.tokens, ar.text, "stop")


def test_cache_reused_and_recreated(llama):
    m, ref = llama
    sp = SamplingParams(max_new_tokens=10)
    generate(m, PROMPTS, sp)
    eng = get_engine(m)
    c1 = eng.caches["target"]
    assert [o.tokens for o in generate(m, PROMPTS, sp)] == ref
    assert eng.caches["target"] is c1  # same shape: reset and reused
    generate(m, PROMPTS[:2], sp)
    assert eng.caches["target"] is not c1 and eng.caches["target"].batch_size == 2
    c2 = eng.caches["target"]
    generate(m, PROMPTS[:2], SamplingParams(max_new_tokens=100))
    assert eng.caches["target"] is not c2  # longer budget: re-created


def test_pad_id_is_a_parameter(llama):
    m, ref = llama
    for pad in (0, 95):
        assert [o.tokens for o in generate(m, PROMPTS, SamplingParams(max_new_tokens=10), options={"pad_id": pad})] == ref
    with pytest.raises(SamplingError, match="pad_id"):
        generate(m, PROMPTS, SamplingParams(max_new_tokens=2), options={"pad_id": 96})


def test_bad_inputs_give_clear_errors(llama):
    m, _ = llama
    with pytest.raises(SamplingError, match="prompt 1 has 256 tokens"):
        generate(m, [[1], [1] * 256], SamplingParams())
    with pytest.raises(SamplingError, match="max_new_tokens=250 exceeds"):
        generate(m, [[1] * 10], SamplingParams(max_new_tokens=250))
    with pytest.raises(SamplingError, match="KV cache"):
        generate(m, [[1] * 10], SamplingParams(max_new_tokens=50), options={"max_cache_len": 32})
    with pytest.raises(SamplingError, match="outside"):
        generate(m, [[1, 200]], SamplingParams())
    with pytest.raises(SamplingError, match="empty"):
        generate(m, [[]], SamplingParams())
    with pytest.raises(SamplingError, match="unknown generation method"):
        generate(m, [[1]], SamplingParams(), method="beam")
    with pytest.raises(SamplingError, match="draft_model="):
        generate(m, [[1]], SamplingParams(), method="draft_model")
    with pytest.raises(SamplingError, match="SpeculativeGPT"):
        generate(m, [[1]], SamplingParams(), method="eagle")
    with pytest.raises(SamplingError, match="top_p"):
        generate(m, [[1]], SamplingParams(top_p=2.0))
    with pytest.raises(SamplingError, match="num_draft_tokens"):
        generate(m, [[1]], SamplingParams(), method="prompt_lookup", options={"num_draft_tokens": 0})
    with pytest.raises(SamplingError, match="medusa"):
        generate(_spec(m, "eagle1"), [[1]], SamplingParams(), method="medusa")
    with pytest.raises(SamplingError, match="prefix"):
        generate(_spec(m, "medusa"), [[1]], SamplingParams(), method="medusa", options={"medusa_choices": [(0, 1)]})
    with pytest.raises(SamplingError, match=r"unknown generation option\(s\) \['dpeth'\]"):
        generate(m, [[1]], SamplingParams(), options={"dpeth": 3})
    for bad in (0, -1.0, float("nan"), "0.5", True):
        with pytest.raises(SamplingError, match="score_temperature"):
            generate(_spec(m, "eagle1"), [[1]], SamplingParams(), method="eagle_tree",
                     options={"score_temperature": bad})


@pytest.mark.slow
def test_tp2_generation_equals_tp1(llama, trained, tmp_path):
    """Every method at TP=2 gives the TP=1 tokens; the trained P-EAGLE / DFlash drafts accept as many drafted tokens
    at TP=2 as at TP=1."""
    from nemo_spec.checkpoint.tp import is_tensor_entry
    from tests.helpers import ROOT, run_torchrun

    m, ref = llama
    sd = lambda mod: {k: v for k, v in mod.state_dict().items() if is_tensor_entry(k, v)}  # noqa: E731
    draft = _noisy_copy(m)
    spec_kw = {"eagle1": {}, **SPEC_KW}
    specs = {alg: trained[alg] if alg in ("peagle", "dflash") else _spec(m, alg) for alg in spec_kw}
    sp = SamplingParams(max_new_tokens=8)
    refs, accepted = {}, {}
    for method, kind in [("ar", None), ("prompt_lookup", None), ("draft_model", None), ("eagle", "eagle3"),
                         ("eagle_tree", "eagle1"), ("eagle_tree", "eagle3"), ("medusa", "medusa"),
                         ("peagle", "peagle"), ("peagle_tree", "peagle"), ("dflash", "dflash"),
                         ("dflash_tree", "dflash")]:
        model = specs.get(kind, m)
        outs = generate(model, PROMPTS, sp, method=method, draft_model=draft, options=OPTS)
        refs[(method, kind)] = [o.tokens for o in outs]
        assert refs[(method, kind)] == [r[:8] for r in ref]
        accepted[method] = sum(accepted_drafts(o) for o in outs)
    blob = {"config": model_config(m).to_dict(), "target": sd(m), "draft_config": model_config(draft).to_dict(),
            "draft": sd(draft), "spec_kw": spec_kw, "specs": {a: sd(s) for a, s in specs.items()},
            "prompts": PROMPTS, "options": OPTS, "max_new": 8, "ref": refs}
    path = tmp_path / "gen.pt"
    torch.save(blob, path)
    out = run_torchrun(ROOT / "tests" / "dist_scripts" / "gen_tp.py", [path], timeout=300)
    assert f"TP2_GEN_OK {len(refs)}" in out
    for method in ("peagle", "peagle_tree", "dflash", "dflash_tree"):  # the TP=2 drafts accept what TP=1's do
        tp2 = re.search(rf"TP2_ACCEPTED {method} (\d+)", out)
        assert accepted[method] >= 4 and tp2 and int(tp2.group(1)) == accepted[method], (method, accepted, out[-2000:])


@pytest.fixture(scope="module")
def trained(llama):
    """EAGLE-1/EAGLE-3/Medusa drafts trained for a few steps on the target's own greedy continuations."""
    m, _ = llama
    torch.manual_seed(5)
    prompts = [torch.randint(0, 96, (4,)).tolist() for _ in range(12)] + PROMPTS
    seqs = [p + o.tokens for p, o in zip(prompts, generate(m, prompts, SamplingParams(max_new_tokens=28)))]
    data = torch.tensor([s[:29] for s in seqs])
    specs = {}
    for alg, steps in [("eagle1", 60), ("eagle3", 40), ("medusa", 60), ("peagle", 40), ("dflash", 40)]:
        spec = _spec(m, alg)
        opt = torch.optim.Adam(list(spec.draft_parameters()), lr=3e-3)
        spec.train()
        for _ in range(steps):
            loss = spec.training_losses(data, ttt_steps=1)["loss"] if alg == "eagle3" else spec.training_losses(data)["loss"]
            opt.zero_grad()
            loss.backward()
            opt.step()
        specs[alg] = spec.eval()
    return specs


@pytest.mark.parametrize("method,kind", [("eagle", "eagle1"), ("eagle_tree", "eagle1"), ("eagle", "eagle3"),
                                         ("eagle_tree", "eagle3"), ("medusa", "medusa"), ("peagle", "peagle"),
                                         ("dflash", "dflash"), ("peagle_tree", "peagle"),
                                         ("dflash_tree", "dflash")])
def test_trained_drafts_greedy_equals_ar_with_ragged_acceptance(llama, trained, method, kind):
    m, ref = llama
    outs = generate(trained[kind], PROMPTS, SamplingParams(max_new_tokens=10), method=method, options=OPTS)
    assert [o.tokens for o in outs] == ref
    accepted = [accepted_drafts(o) for o in outs]
    assert sum(accepted) >= 4, accepted  # drafts accepted: multi-token steps, cache compaction exercised
    assert len({tuple(o.stats["accept_hist"]) for o in outs}) > 1  # rows advanced by different amounts
    joined = _joining(trained[kind], method, None, ref, OPTS)  # with slots moving under accepted drafts
    assert sum(accepted_drafts(o) for o in joined) >= 4


def test_medusa_custom_choices_and_tree_options(llama, trained):
    m, ref = llama
    outs = generate(trained["medusa"], PROMPTS, SamplingParams(max_new_tokens=10), method="medusa",
                    options={"medusa_choices": [[0], [1], [0, 0], [0, 0, 0], [0, 1]]})
    assert [o.tokens for o in outs] == ref
    outs = generate(trained["eagle1"], PROMPTS, SamplingParams(max_new_tokens=10), method="eagle_tree",
                    options={"depth": 4, "top_k": 2, "total_tokens": 6})
    assert [o.tokens for o in outs] == ref
    assert all(o.stats["draft_forwards"] >= 4 * (o.stats["target_forwards"] - 1) for o in outs)


def test_tree_score_temperature_shapes_the_tree(llama, trained):
    """Greedy rows rank tree nodes at score_temperature: near 0 a D-node tree of depth D is exactly the draft's
    top-1 chain (same acceptance as chain drafting); very hot, depth stops mattering and the tree goes shallow."""
    m, ref = llama
    sp = SamplingParams(max_new_tokens=10)
    spec = trained["eagle3"]
    chain = generate(spec, PROMPTS, sp, method="eagle", options={"num_draft_tokens": 3})
    tree = {t: generate(spec, PROMPTS, sp, method="eagle_tree",
                        options={"depth": 3, "top_k": 2, "total_tokens": 3, "score_temperature": t})
            for t in (1e-4, 1e4)}
    for outs in tree.values():
        assert [o.tokens for o in outs] == ref
    assert [o.stats["accept_hist"] for o in tree[1e-4]] == [o.stats["accept_hist"] for o in chain]
    # hot: path probability no longer favours depth, the 3 nodes spread over siblings and acceptance changes
    assert [o.stats["accept_hist"] for o in tree[1e4]] != [o.stats["accept_hist"] for o in chain]


def test_prompt_lookup_prefers_a_full_continuation():
    from nemo_spec.inference.proposers import PromptLookupProposer

    pl = PromptLookupProposer({"num_draft_tokens": 4, "max_ngram": 2})
    # latest match of [1, 2] (at 3) has only 3 tokens after it; the earlier one (at 0) has all 4
    assert pl.lookup([1, 2, 3, 1, 2, 3, 1, 2]) == [3, 1, 2, 3]
    assert pl.lookup([5, 1, 2, 9, 9, 1, 2]) == [9, 9, 1, 2]  # a single match: its continuation
    assert pl.lookup([7, 1, 2, 8, 1, 2]) == [8, 1, 2]          # no full one: the longest
    assert pl.lookup([4, 5, 6, 4, 7, 6]) == [4, 7, 6]         # no bigram match: the unigram's
    assert pl.lookup([1, 2, 3]) == []


def test_seeded_prompt_lookup_row_does_not_depend_on_its_batch():
    """Prompt lookup drafts a different number of tokens per row; a seeded row must sample the same alone or batched."""
    import torch as _t

    from nemo_spec.inference import SamplingParams as _SP, generate as _gen
    from nemo_spec.models import build_gpt as _build
    from tests.helpers import tiny_llama as _tiny

    _t.manual_seed(0)
    m = _build(_tiny()).eval()
    a = [1, 2, 3, 1, 2, 3, 1, 2]
    b = [4, 5] * 8 + [4]
    sp = _SP(temperature=1.0, seed=123, max_new_tokens=20)
    alone = _gen(m, [a], sp, method="prompt_lookup", options={"ignore_eos": True})[0].tokens
    batched = _gen(m, [a, b], sp, method="prompt_lookup", options={"ignore_eos": True})[0].tokens
    assert alone == batched


def test_draft_model_context_is_checked_per_row():
    """A long prompt with few new tokens and a short prompt with many fit a draft context that their maxima exceed."""
    import torch as _t

    from nemo_spec.inference import SamplingParams as _SP, generate as _gen
    from nemo_spec.models import build_gpt as _build
    from tests.helpers import tiny_llama as _tiny

    _t.manual_seed(0)
    target = _build(_tiny()).eval()
    draft = _build(_tiny(num_layers=1, max_position_embeddings=64)).eval()
    prompts = [list(range(1, 51)), [1, 2, 3, 4, 5]]
    params = [_SP(max_new_tokens=5), _SP(max_new_tokens=50)]
    spec = _gen(target, prompts, params, method="draft_model", draft_model=draft, options={"ignore_eos": True})
    ar = _gen(target, prompts, params, method="ar", options={"ignore_eos": True})
    assert [r.tokens for r in spec] == [r.tokens for r in ar]


def test_cache_recreated_when_model_dtype_changes():
    """A cached KV cache is not reused after the model's dtype changes (it would silently keep the old dtype)."""
    import torch as _t

    from nemo_spec.inference import SamplingParams as _SP, generate as _gen
    from nemo_spec.inference.generate import _ENGINES
    from nemo_spec.models import build_gpt as _build
    from tests.helpers import tiny_llama as _tiny

    _t.manual_seed(0)
    m = _build(_tiny()).eval()
    _gen(m, [[1, 2, 3]], _SP(max_new_tokens=4))
    assert _ENGINES[m].caches["target"].k.dtype == _t.float32
    m.to(_t.bfloat16)
    _gen(m, [[1, 2, 3]], _SP(max_new_tokens=4))
    assert _ENGINES[m].caches["target"].k.dtype == _t.bfloat16


def test_eagle2_selection_keeps_every_parent_under_score_ties():
    """EAGLE-2 re-ranking with many exactly-tied scores near -20 (children with log p = 0): every kept node's
    parent is kept. (A float32 depth tie-break of 1e-6 is below resolution there and fails this check.)"""
    from nemo_spec.inference.trees import select_tree

    g = torch.Generator().manual_seed(0)
    depth = torch.cat([torch.full((1, 4), 1), torch.full((1, 16), 2), torch.full((1, 16), 3)], 1)
    old_broken = 0
    for _ in range(50):
        s1 = -20.0 - torch.randint(0, 3, (1, 4), generator=g).float() * 0.5
        s2 = s1.repeat_interleave(4, 1) + torch.where(torch.rand(1, 16, generator=g) < 0.5, 0.0, -0.5)
        best = s2.topk(4).indices
        s3 = s2[0, best].repeat_interleave(4, 1) + torch.where(torch.rand(1, 16, generator=g) < 0.5, 0.0, -0.5)
        score = torch.cat([s1, s2, s3], 1)
        par = torch.cat([torch.full((1, 4), -1), torch.arange(4).repeat_interleave(4)[None],
                         (4 + best).repeat_interleave(4, 1)], 1)
        for n in range(1, 36):
            toks, parents = select_tree(torch.arange(36)[None], score, par, depth, n)
            kept = toks[0].tolist()  # tokens are the candidate indices here
            assert all(par[0, i] < 0 or int(par[0, i]) in kept for i in kept)
            # block parents point at earlier kept nodes (or the root) and match the candidate parents
            for j, i in enumerate(kept):
                pj = int(parents[0, j])
                assert pj < j + 1 and (pj == 0 if par[0, i] < 0 else kept[pj - 1] == int(par[0, i]))
            old = (score - 1e-6 * depth).topk(n, -1).indices[0].tolist()
            old_broken += any(par[0, i] >= 0 and int(par[0, i]) not in old for i in old)
    assert old_broken > 0  # the data does exercise the tie case


def test_ancestor_and_chain_masks_match_a_naive_walk():
    """Vectorised tree masks (repeated squaring) == walking each node's parent links, incl. invalid nodes."""
    from nemo_spec.inference.trees import ancestor_mask, chain_mask, chain_parents

    def walk(parents, valid):
        b, n = parents.shape
        anc = torch.zeros(b, n, n, dtype=torch.bool)
        depth = torch.zeros(b, n, dtype=torch.long)
        for r in range(b):
            for i in range(n):
                p = int(parents[r, i])
                if p >= 0 and valid[r, i]:
                    anc[r, i], depth[r, i] = anc[r, p], depth[r, p] + 1
                anc[r, i, i] = True
        return anc, depth

    g = torch.Generator().manual_seed(0)
    for _ in range(60):
        n = int(torch.randint(1, 40, (1,), generator=g))
        parents = torch.stack([torch.tensor([-1] + [int(torch.randint(-1, i, (1,), generator=g)) for i in range(1, n)])
                               for _ in range(3)])
        valid = torch.rand(3, n, generator=g) < 0.8
        for got, want in zip(ancestor_mask(parents, valid), walk(parents, valid)):
            assert torch.equal(got, want)
        v = torch.arange(n)[None] < torch.randint(0, n + 1, (3, 1), generator=g)
        for got, want in zip(chain_mask(v), walk(chain_parents(3, n, torch.device("cpu")), v)):
            assert torch.equal(got, want)


def test_benchmark_runs_drafts_of_other_models_side_by_side(llama):
    """benchmark(extra_models=...): P-EAGLE and DFlash drafts on the same base, in the EAGLE-3 model's run, each
    giving our AR tokens (greedy), with the draft and verify time of a decode step reported."""
    from nemo_spec.inference import benchmark as bench

    m, _ = llama
    res = bench.benchmark(_spec(m, "eagle3"), PROMPTS, methods=["eagle"], batch_sizes=(1, 2), max_new_tokens=6,
                          hf=False, repeats=1, options=OPTS,
                          extra_models=[_spec(m, "peagle"), _spec(m, "dflash"), _spec(m, "eagle3")])
    got = {(r["method"], r["batch_size"]): r for r in res["rows"]}
    assert set(got) == {(k, b) for k in ("ar", "eagle", "peagle", "peagle_tree", "dflash", "dflash_tree", "eagle@3",
                                         "eagle_tree@3") for b in (1, 2)}
    assert all(r["matches_ar"] == 1.0 for r in res["rows"]), [(r["method"], r["matches_ar"]) for r in res["rows"]]
    assert all(r["draft_forwards"] > 0 and r["draft_ms_per_step"] > 0 for k, r in got.items() if k[0] != "ar")
    assert "| nemo_spec | dflash | 1 |" in bench.to_markdown(res)


def test_benchmark_adaptive_rows_with_the_stepwise_draft_catch_up_side_by_side(llama):
    """benchmark(adaptive=True, eager_catchup=True): each EAGLE method (and an extra model's DFlash methods) runs
    plain, adaptive (deferred catch-up) and adaptive with the draft caught up after every step
    (lazy_draft_steps=0); all give our AR tokens and report the draft sizes they chose; without eager_catchup there
    are no stepwise rows."""
    from nemo_spec.inference import benchmark as bench

    m, _ = llama
    spec = _spec(m, "eagle3")
    kw = dict(methods=["eagle"], batch_sizes=(2,), max_new_tokens=6, hf=False, repeats=1, options=OPTS, adaptive=True)
    res = bench.benchmark(spec, PROMPTS, eager_catchup=True, extra_models=[_spec(m, "dflash")], **kw)
    got = {r["method"]: r for r in res["rows"]}
    assert set(got) == {"ar", "eagle", "eagle+adaptive", "eagle+adaptive+stepwise"} | {
        f"{d}{v}" for d in ("dflash", "dflash_tree") for v in ("", "+adaptive", "+adaptive+stepwise")}
    assert got["eagle+adaptive+stepwise"]["options"]["lazy_draft_steps"] == 0
    assert got["dflash+adaptive+stepwise"]["options"]["lazy_draft_steps"] == 0
    assert "lazy_draft_steps" not in got["eagle+adaptive"]["options"] and res["config"]["eager_catchup"]
    assert all(r["matches_ar"] == 1.0 for r in res["rows"])
    assert "- eagle+adaptive+stepwise batch 2 chose (steps per draft size): " in bench.to_markdown(res)
    plain = bench.benchmark(spec, PROMPTS, **kw)
    assert {r["method"] for r in plain["rows"]} == {"ar", "eagle", "eagle+adaptive"}
    assert bench.build_parser().parse_args(["--model", "x", "--adaptive", "--eager-catchup"]).eager_catchup


def test_benchmark_draft_prompt_window_rows_side_by_side(llama):
    """benchmark(draft_prompt_tokens=[W]): the EAGLE and P-EAGLE methods (an extra model's too) run once more with
    the draft reading each prompt's last W tokens (<method>+dpt=W, and +adaptive+dpt=W with adaptive), DFlash not;
    with adaptive, the extra models' methods also run adaptive (<method>+adaptive);
    every row our AR tokens, the option recorded; the CLI flag reaches it."""
    from nemo_spec.inference import benchmark as bench

    m, _ = llama
    spec = _spec(m, "eagle3")
    res = bench.benchmark(spec, PROMPTS, methods=["eagle", "eagle_tree"], batch_sizes=(2,), max_new_tokens=6, hf=False,
                          repeats=1, options=OPTS, adaptive=True, draft_prompt_tokens=[3],
                          extra_models=[_spec(m, "peagle"), _spec(m, "dflash")])
    got = {r["method"]: r for r in res["rows"]}
    assert set(got) == {"ar", "eagle", "eagle+adaptive", "eagle+dpt=3", "eagle+adaptive+dpt=3", "eagle_tree",
                        "eagle_tree+adaptive", "eagle_tree+dpt=3", "eagle_tree+adaptive+dpt=3", "peagle",
                        "peagle+adaptive", "peagle+dpt=3", "peagle+adaptive+dpt=3", "peagle_tree",
                        "peagle_tree+adaptive", "peagle_tree+dpt=3", "peagle_tree+adaptive+dpt=3", "dflash",
                        "dflash+adaptive", "dflash_tree", "dflash_tree+adaptive"}
    assert got["dflash+adaptive"]["options"]["adaptive"] is True and "adaptive" not in got["dflash"]["options"]
    assert "- dflash+adaptive batch 2 chose (steps per draft size): " in bench.to_markdown(res)
    assert got["eagle+dpt=3"]["options"]["draft_prompt_tokens"] == 3 and res["config"]["draft_prompt_tokens"] == [3]
    assert got["peagle_tree+dpt=3"]["options"]["draft_prompt_tokens"] == 3
    assert got["eagle_tree+adaptive+dpt=3"]["options"]["adaptive"] is True
    assert "draft_prompt_tokens" not in got["eagle"]["options"]
    assert all(r["matches_ar"] == 1.0 and r["prefill_s"] > 0 for r in res["rows"])
    assert "| prefill s |" in bench.to_markdown(res)
    assert bench.build_parser().parse_args(["--model", "x", "--draft-prompt-tokens", "64", "128"]).draft_prompt_tokens \
        == [64, 128]


def test_benchmark_chain_length_rows_side_by_side(llama):
    """benchmark(chain_lengths=[N, ...]): the chain methods (an extra model's too) run once more drafting N tokens
    per step (<method>+ndt=N, and +adaptive+ndt=N with adaptive, whose levels stop at N); tree methods not; every
    row our AR tokens; the CLI flag reaches it."""
    from nemo_spec.inference import benchmark as bench

    m, _ = llama
    spec = _spec(m, "eagle3")
    res = bench.benchmark(spec, PROMPTS, methods=["prompt_lookup", "eagle", "eagle_tree"], batch_sizes=(2,),
                          max_new_tokens=6, hf=False, repeats=1, options=OPTS, adaptive=True, chain_lengths=[1, 5],
                          extra_models=[_spec(m, "dflash")])
    got = {r["method"]: r for r in res["rows"]}
    chains = {f"{c}{a}{n}" for c in ("prompt_lookup", "eagle", "dflash") for a in ("", "+adaptive")
              for n in ("", "+ndt=1", "+ndt=5")}
    assert set(got) == {"ar", "eagle_tree", "eagle_tree+adaptive", "dflash_tree", "dflash_tree+adaptive"} | chains
    assert res["config"]["chain_lengths"] == [1, 5] and got["eagle+ndt=5"]["options"]["num_draft_tokens"] == 5
    assert got["eagle"]["options"]["num_draft_tokens"] == OPTS["num_draft_tokens"]
    assert got["eagle+adaptive+ndt=1"]["options"]["adaptive"] is True
    assert max(got["eagle+adaptive+ndt=1"]["draft_nodes_chosen"]) <= 1
    # an EAGLE chain of N costs N draft forwards a step (the tiny random draft is rarely right: about a step a token)
    assert got["eagle+ndt=5"]["draft_forwards"] > 2 * got["eagle+ndt=1"]["draft_forwards"]
    assert all(r["matches_ar"] == 1.0 for r in res["rows"])
    assert bench.build_parser().parse_args(["--model", "x", "--chain-lengths", "6", "8"]).chain_lengths == [6, 8]
    with pytest.raises(SamplingError, match="chain lengths"):
        bench.benchmark(spec, PROMPTS, methods=["eagle"], hf=False, chain_lengths=[0])
