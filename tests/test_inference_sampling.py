"""Sampling through every speculative method matches AR sampling exactly in distribution (tiny vocabulary).

The reference is the exact distribution of 3-token continuations under AR sampling (enumerated from the
target). Each method generates N seeded rows in one batch; a Pearson chi-square test at the 0.9995 level
must pass — and must fail when the residual or the acceptance test is deliberately broken.
"""
import pytest
import torch

from nemo_spec.inference import SamplingParams, generate, sampling
from nemo_spec.models import build_gpt, model_config
from nemo_spec.speculative import SpeculativeTransform
from tests.helpers import tiny_llama
from tests.inference_utils import chi2_critical, chi2_stat, exact_continuations

torch.set_num_threads(1)  # tiny models: threading only adds overhead on shared CPUs
V, NEW, N = 6, 3, 1500
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]
PARAMS = dict(temperature=0.9, top_p=0.97, max_new_tokens=NEW)
OPTS = {"num_draft_tokens": 2, "depth": 2, "top_k": 2, "total_tokens": 5}


def _cfg(**kw):
    return tiny_llama(vocab_size=V, init_method_std=0.1, **kw)


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    target = build_gpt(_cfg()).eval()
    exact = exact_continuations(target, PROMPT, SamplingParams(**PARAMS), NEW, V)
    torch.manual_seed(7)
    draft = build_gpt(_cfg(num_layers=1)).eval()
    specs = {}
    for alg, kw in [("eagle1", {}), ("eagle3", {"draft_vocab_size": 4}), ("medusa", {"num_medusa_heads": 2}),
                    ("peagle", {"draft_vocab_size": 4, "parallel_depth": 2, "mask_token_id": 5}),
                    ("dflash", {"num_layers": 2, "block_size": 3, "target_layer_ids": [0], "mask_token_id": 5})]:
        clone = build_gpt(model_config(target)).eval()
        clone.load_state_dict(target.state_dict())
        torch.manual_seed(11)
        spec = SpeculativeTransform(algorithm=alg, **kw)(clone)
        if alg in ("eagle3", "peagle"):
            spec.set_draft_vocab(torch.tensor([1.0, 5, 4, 3, 2, 0.5]))
        if alg in ("medusa", "dflash"):  # make the heads disagree with the base head (DFlash: varied drafts)
            with torch.no_grad():
                for p in spec.draft_parameters():
                    p.add_(torch.randn_like(p) * 0.1)
        specs[alg] = spec.eval()
    return target, draft, specs, exact


# rows joining and leaving mid-flight: N rows through 256 slots, prompts read 480 tokens per step (60 rows)
JOINING = {"max_batch": 256, "prefill_chunk_tokens": 480}


def _stat(setup, method, kind=None, joining=False):
    target, draft, specs, exact = setup
    model = specs[kind] if kind else target
    params = [SamplingParams(seed=1000 + i, **PARAMS) for i in range(N)]
    outs = generate(model, [PROMPT] * N, params, method=method, draft_model=draft,
                    options={**OPTS, **(JOINING if joining else {})})
    samples = [tuple(o.tokens) for o in outs]
    assert all(len(s) == NEW for s in samples)
    stat, df = chi2_stat(samples, exact)
    tau = sum(o.stats["tau"] for o in outs) / N
    return stat, chi2_critical(df), tau


@pytest.mark.parametrize("joining", [False, True], ids=["fixed", "joining"])
@pytest.mark.parametrize("method,kind", [("ar", None), ("prompt_lookup", None), ("draft_model", None),
                                         ("eagle", "eagle1"), ("eagle_tree", "eagle3"), ("medusa", "medusa"),
                                         ("peagle", "peagle"), ("dflash", "dflash"), ("peagle_tree", "peagle"),
                                         ("dflash_tree", "dflash")])
def test_speculative_sampling_matches_ar(setup, method, kind, joining):
    stat, crit, tau = _stat(setup, method, kind, joining)
    assert stat < crit, (method, stat, crit)
    if method != "ar":
        assert tau > 1.0  # drafts were accepted at least sometimes: the rule was really exercised


@pytest.mark.parametrize("method,kind", [("draft_model", None), ("eagle", "eagle1"), ("eagle_tree", "eagle3"),
                                         ("medusa", "medusa"), ("prompt_lookup", None), ("peagle", "peagle"),
                                         ("dflash", "dflash"), ("peagle_tree", "peagle"), ("dflash_tree", "dflash")])
def test_wrong_residual_is_caught(setup, method, kind, monkeypatch):
    # the engine accepts every row at once on the device (sampling.tree_accept_rows): break its residual there
    monkeypatch.setattr(sampling, "residual_rows", lambda p, q: p)  # resample from p instead of norm(max(0, p - q))
    stat, crit, _ = _stat(setup, method, kind)
    assert stat > crit, (method, stat, crit)


def test_accept_always_is_caught(setup, monkeypatch):
    monkeypatch.setattr(sampling, "accept_rows", lambda p_x, q_x, u: torch.ones_like(p_x, dtype=torch.bool))
    stat, crit, _ = _stat(setup, "draft_model")
    assert stat > crit, (stat, crit)


def test_same_seed_same_tokens_regardless_of_batch(setup):
    target, draft, _, _ = setup
    sp = SamplingParams(seed=5, temperature=1.0, max_new_tokens=6)
    alone = generate(target, [PROMPT], sp, method="draft_model", draft_model=draft)[0].tokens
    batched = generate(target, [PROMPT[:3], PROMPT, [4]], [SamplingParams(seed=9, max_new_tokens=6), sp,
                                                             SamplingParams(seed=1, temperature=1.0, max_new_tokens=6)],
                       method="draft_model", draft_model=draft)[1].tokens
    assert alone == batched


@pytest.mark.parametrize("method,kind", [("draft_model", None), ("eagle_tree", "eagle3"), ("medusa", "medusa"),
                                         ("peagle", "peagle"), ("dflash", "dflash"), ("dflash_tree", "dflash")])
def test_seeded_row_joining_a_running_batch_samples_as_alone(setup, method, kind):
    """A seeded row added while other rows are mid-generation (and others joining after it) gets the tokens it
    gets alone: per-row generators, per-row draft sizes, slots moved under it as rows leave."""
    from nemo_spec.inference.session import Session

    target, draft, specs, _ = setup
    model = specs[kind] if kind else target
    sp = SamplingParams(seed=5, temperature=1.0, max_new_tokens=8)
    alone = generate(model, [PROMPT], sp, method=method, draft_model=draft, options=OPTS)[0].tokens
    sess = Session(model, method, draft, OPTS, max_batch=3, prefill_chunk_tokens=3)
    others = [SamplingParams(seed=9, temperature=0.7, max_new_tokens=3), SamplingParams(max_new_tokens=12)]
    for p, o in zip([PROMPT[:4], [4, 1]], others):
        sess.add(p, o)
    for _ in range(3):
        sess.step()
    h = sess.add(PROMPT, sp)
    sess.step()
    sess.add([2, 3, 4], SamplingParams(seed=1, temperature=1.0, max_new_tokens=5))
    sess.run()
    assert sess.result(h).tokens == alone
