"""The iteration-level session: rows join at the next step, long prompts never block decoding, cancel, fixed
KV slots, adaptive speculation; vectorised on-device acceptance == the per-row rules; a sync-free hot path (GPU)."""
import pytest
import torch

from nemo_spec.inference import SamplingParams, generate
from nemo_spec.inference.sampling import greedy_tree_accept, tree_accept, tree_accept_rows
from nemo_spec.inference.session import Session, prefill_groups
from nemo_spec.inference.trees import ancestor_mask, children_lists
from nemo_spec.models import build_gpt
from tests.helpers import tiny_llama
from tests.inference_utils import ScriptedLevels

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_gpt(tiny_llama()).eval()


def _random_trees(g, b, n):
    """Random ragged trees [b, 1 + n] (root first); invalid nodes' descendants invalid too."""
    N = n + 1
    par = torch.stack([torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, N)])
                       for _ in range(b)])
    val = torch.rand(b, N, generator=g) < 0.85
    val[:, 0] = True
    for r in range(b):
        for i in range(1, N):
            val[r, i] &= bool(val[r, par[r, i]])
    return par, val


def test_vectorised_acceptance_equals_the_per_row_rules_on_random_trees():
    """tree_accept_rows (all rows at once, a fixed number of tensor ops) gives exactly the path and next token of
    tree_accept / greedy_tree_accept row by row: greedy and sampled rows mixed, i.i.d. drafts and deterministic
    candidates, duplicate sibling tokens, ragged and invalid nodes."""
    from nemo_spec.inference.engine import greedy_accept

    g = torch.Generator().manual_seed(0)
    V = 5
    for trial in range(150):
        b, n = 4, int(torch.randint(1, 14, (1,), generator=g))
        par, val = _random_trees(g, b, n)
        tok = torch.randint(0, V, (b, n + 1), generator=g)  # small vocab: sibling duplicates happen
        kids = [children_lists(par[r].tolist(), val[r].tolist()) for r in range(b)]
        K = max(1, max(len(k) for kl in kids for k in kl))
        anc, depth = ancestor_mask(par, val)
        D = int(depth.max())
        p = torch.softmax(torch.randn(b, n + 1, V, generator=g) * 2, -1)
        q = torch.softmax(torch.randn(b, n + 1, V, generator=g), -1) if trial % 2 else None
        u = torch.rand(b, n + 2, generator=g)
        am = p.argmax(-1)
        sampled = torch.tensor([True, False, True, trial % 3 == 0])
        m, path, nxt = tree_accept_rows(tok, par, val, D, K, argmax=am, p=p, q=q, u=u, sampled=sampled)
        gm, gpath, gnxt = greedy_accept(am, tok, par, val, anc, depth, D)
        for r in range(b):
            if sampled[r]:
                want = tree_accept(p[r], tok[r].tolist(), kids[r], None if q is None else q[r], iter(u[r].tolist()))
            else:
                want = greedy_tree_accept(am[r].tolist(), tok[r].tolist(), kids[r])
                assert (int(gm[r]), gpath[r, 1:1 + len(want[0])].tolist(), int(gnxt[r])) == \
                    (len(want[0]), want[0], want[1])
            assert (int(m[r]), path[r, 1:1 + len(want[0])].tolist(), int(nxt[r])) == (len(want[0]), want[0], want[1])


def test_a_late_short_request_gets_its_first_token_at_the_next_step(model):
    """A row added while a long one runs (free slot) is prefilled and answered at the very next step, and a
    long prompt read in chunks never stops the running row's decoding."""
    sess = Session(model, "ar", max_batch=4, prefill_chunk_tokens=8, options={"ignore_eos": True})
    seen = {}
    long = sess.add([1, 2, 3], SamplingParams(max_new_tokens=60), lambda h, t: seen.setdefault(h, []).extend(t))
    for _ in range(5):
        sess.step()
    step0 = sess.steps
    short = sess.add([7, 8], SamplingParams(max_new_tokens=4))
    sess.step()
    assert sess.rows[short].first_step == step0  # first token in the step after add()
    before = len(seen[long])
    big = sess.add(list(range(1, 41)), SamplingParams(max_new_tokens=2))  # 40 prompt tokens: 5 chunks of 8
    for _ in range(4):
        sess.step()
    assert len(seen[long]) == before + 4  # one token per step while the long prompt is read
    assert sess.rows[big].prefilled < 40 and sess.rows[big].t_first is None
    sess.run()
    res = {h: sess.result(h) for h in (long, short, big)}
    assert res[big].stats["prefill_chunks"] == 5
    ref = generate(model, [[1, 2, 3], [7, 8], list(range(1, 41))],
                   [SamplingParams(max_new_tokens=n) for n in (60, 4, 2)], options={"ignore_eos": True})
    assert [res[h].tokens for h in (long, short, big)] == [r.tokens for r in ref]


def test_prefill_groups_bound_the_padding_of_each_forward():
    """Consecutive slots share a forward while its padded block (slots x longest piece, a slot between that reads
    nothing counting as padding) exceeds the tokens read by at most the budget."""
    assert prefill_groups({0: 1, 1: 2, 2: 7, 3: 10}, 2) == [{0: 1, 1: 2}, {2: 7}, {3: 10}]
    assert prefill_groups({0: 1, 1: 2, 2: 7, 3: 10}, 20) == [{0: 1, 1: 2, 2: 7, 3: 10}]
    assert prefill_groups({4: 5, 6: 5}, 4) == [{4: 5}, {6: 5}]  # slot 5 between them would pad 5 tokens
    assert prefill_groups({4: 5, 6: 5}, 5) == [{4: 5, 6: 5}]
    assert prefill_groups({3: 8, 1: 8, 2: 8}, 0) == [{1: 8, 2: 8, 3: 8}]  # equal pieces never pad
    assert prefill_groups({}, 0) == []


def test_cancel_and_fixed_slots(model):
    """cancel() ends a queued or running row; many requests flow through the same preallocated KV buffers."""
    sess = Session(model, "prompt_lookup", max_batch=2, options={"ignore_eos": True, "num_draft_tokens": 3})
    k = sess.kv.k
    hs = [sess.add([5, 6, 7, 5, 6], SamplingParams(max_new_tokens=6 + i)) for i in range(6)]
    sess.step()
    sess.cancel(hs[0])  # running
    sess.cancel(hs[5])  # queued
    sess.run()
    res = [sess.result(h) for h in hs]
    assert res[0].finish_reason == "cancelled" and res[5].finish_reason == "cancelled" and not res[5].tokens
    ref = generate(model, [[5, 6, 7, 5, 6]], SamplingParams(max_new_tokens=10), options={"ignore_eos": True})[0]
    for i in range(1, 5):
        assert res[i].tokens == ref.tokens[:6 + i] and res[i].finish_reason == "length"
    assert sess.kv.k is k and not sess.busy


@pytest.mark.parametrize("method,algo", [("ar", None), ("prompt_lookup", None), ("suffix", None),
                                         ("draft_model", None), ("eagle", "eagle3"), ("eagle_tree", "eagle3"),
                                         ("medusa", "medusa"), ("peagle", "peagle"), ("dflash", "dflash")])
def test_cancel_between_steps_moves_a_running_row_into_the_hole(model, method, algo):
    """cancel() outside a step, of a running row that another running row moves in behind: the proposer's
    per-slot buffers (made in a step's inference mode) are swapped at once. That swap ran outside inference mode
    and raised ("Inplace update to inference tensor outside InferenceMode") for EAGLE (chain and tree), Medusa
    and P-EAGLE; now every method goes on, the moved row with our AR's tokens."""
    from tests.speculative_utils import make_spec

    target = make_spec(tiny_llama(num_layers=4 if algo == "dflash" else 2), algo).eval() if algo else model
    sess = Session(target, method, draft_model=model if method == "draft_model" else None, max_batch=2,
                   options={"ignore_eos": True})
    prompts = {sess.add(p, SamplingParams(max_new_tokens=30)): p for p in ([1, 2, 3], [4, 5])}
    sess.step()  # both rows prefilled and decoding
    assert sess.n_dec == 2
    a, b = sess.slot_rows[0].handle, sess.slot_rows[1].handle
    sess.cancel(a)  # b moves into slot 0
    assert sess.rows[b].slot == 0 and sess.n_dec == 1
    sess.run()
    ref = generate(target, [prompts[b]], SamplingParams(max_new_tokens=30), options={"ignore_eos": True})[0]
    assert sess.result(a).finish_reason == "cancelled" and sess.result(b).tokens == ref.tokens


def _spec_or(model, algo):
    from tests.speculative_utils import make_spec

    return make_spec(tiny_llama(), algo).eval() if algo else model


@pytest.mark.parametrize("method,algo", [("ar", None), ("eagle", "eagle3")])
def test_a_row_cancelled_by_another_rows_callback_gets_nothing_more(model, method, algo):
    """The row in slot 0 cancels the row in slot 1 from its on_tokens, inside a decode step: the cancelled row got
    that step's tokens too (it was emitted after the callback) and, reaching its budget, was reported "length" with
    on_finish called. Now it ends at once: no more tokens streamed or kept, reason "cancelled", no on_finish; the
    other row's tokens are our AR's."""
    target = _spec_or(model, algo)
    sess = Session(target, method, max_batch=2, options={"ignore_eos": True})
    streamed, finished, victim = {}, {}, []

    def on_tokens(h, toks):
        streamed.setdefault(h, []).extend(toks)
        if not victim and sess.n_dec == 2 and sess.slot_rows[0].handle == h:
            v = sess.slot_rows[1].handle
            victim.append((v, len(streamed.get(v, []))))
            sess.cancel(v)

    # whichever row sits in slot 1 is cancelled: with 2 tokens left it would reach its budget that step
    rows = {sess.add(p, SamplingParams(max_new_tokens=n), on_tokens, lambda h, r: finished.setdefault(h, r)): (p, n)
            for p, n in (([1, 2, 3], 3), ([4, 5], 3))}
    sess.run()
    v, had = victim[0]
    res = sess.result(v)
    assert res.finish_reason == "cancelled" and v not in finished
    assert len(streamed[v]) == had < 3 and res.tokens == streamed[v]
    (keep,) = [h for h in rows if h != v]
    p, n = rows[keep]
    ref = generate(target, [p], SamplingParams(max_new_tokens=n), options={"ignore_eos": True})[0]
    assert sess.result(keep).tokens == ref.tokens and finished[keep] == "length"


def test_a_row_cancelled_before_its_first_token_gets_none(model):
    """Two rows finish their prompts in the same step; the first one's on_tokens cancels the other before its
    first token is emitted: it gets none."""
    sess = Session(model, "ar", max_batch=2, options={"ignore_eos": True})
    streamed, hs = {}, []

    def on_tokens(h, toks):
        streamed.setdefault(h, []).extend(toks)
        if len(streamed) == 1:
            sess.cancel(hs[1] if h == hs[0] else hs[0])

    hs += [sess.add(p, SamplingParams(max_new_tokens=6), on_tokens) for p in ([1, 2, 3], [4, 5, 6])]
    sess.run()
    assert len(streamed) == 1 and sorted(sess.result(h).finish_reason for h in hs) == ["cancelled", "length"]


@pytest.mark.parametrize("first", [1, 3])  # reset on the first token (the prefill step's) or in a decode step
def test_reset_from_a_callback_ends_every_row_and_the_session_goes_on(model, first):
    """reset() from an on_tokens callback: in the step that emits the rows' first tokens it left the rest of
    that step working on emptied slots (AttributeError on a None row). Now every row ends at once (nothing more
    streamed), the caches are reset when the step returns, and the session serves the next row as AR does."""
    sess = Session(model, "ar", max_batch=2, options={"ignore_eos": True})
    streamed, resets = {}, []

    def on_tokens(h, toks):
        streamed.setdefault(h, []).extend(toks)
        if len(streamed[h]) >= first and not resets:
            resets.append(h)
            sess.reset()

    for p in ([1, 2, 3], [4, 5, 6, 7]):
        sess.add(p, SamplingParams(max_new_tokens=10), on_tokens)
    sess.run()
    assert not sess.busy and sum(map(len, streamed.values())) <= first + 2
    h = sess.add([1, 2, 3], SamplingParams(max_new_tokens=10))
    sess.run()
    ref = generate(model, [[1, 2, 3]], SamplingParams(max_new_tokens=10), options={"ignore_eos": True})[0]
    assert sess.result(h).tokens == ref.tokens


@pytest.mark.parametrize("method,algo", [("ar", None), ("eagle", "eagle3"), ("draft_model", None)])
def test_sessions_on_one_model_keep_their_own_caches(model, method, algo):
    """Two sessions on one model stepped in turn, and a generate() call in the middle of a session: they shared
    the model's KV caches (the second reset the first's), and the rows' tokens went wrong. A session now owns its
    caches (generate()'s sessions, one after the other, still share the model's): every row == our AR."""
    target = _spec_or(model, algo)
    draft = model if method == "draft_model" else None
    opts = {"ignore_eos": True, "num_draft_tokens": 2}
    a = Session(target, method, draft, opts, max_batch=2, max_seq_len=64)
    b = Session(target, method, draft, opts, max_batch=2, max_seq_len=64)
    assert a.kv is not b.kv
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [1, 2, 3], [9, 3, 9]]
    ha = a.add(prompts[0], SamplingParams(max_new_tokens=30))
    hb = b.add(prompts[1], SamplingParams(max_new_tokens=30))
    for i in range(4):
        a.step()
        b.step()
    mid = generate(target, [prompts[2], prompts[1]], SamplingParams(max_new_tokens=5), method=method,
                   draft_model=draft, options=opts)  # a 2-row session of the shared caches, same shapes
    a.run()
    b.run()
    ref = generate(target, prompts, SamplingParams(max_new_tokens=30), options={"ignore_eos": True})
    assert a.result(ha).tokens == ref[0].tokens and b.result(hb).tokens == ref[1].tokens
    assert mid[0].tokens == ref[2].tokens[:5]


def test_session_api_misuse_gets_errors_that_name_the_problem(model):
    """Unknown handles, a max_seq_len below 1 and a row longer than max_seq_len get errors naming the problem (a
    bare KeyError(99); a session with slots of -2 positions; "needs 32 slots ... KV slot length=21" for a
    29-token prompt at max_seq_len=20); free_slots() never goes below 0 (a `while free_slots():` loop ran on)."""
    from nemo_spec.inference.sampling import SamplingError

    for bad in (0, -3):
        with pytest.raises(SamplingError, match="max_seq_len"):
            Session(model, "ar", max_seq_len=bad)
    sess = Session(model, "ar", max_batch=1, max_seq_len=20, options={"ignore_eos": True})
    with pytest.raises(SamplingError, match=r"29 prompt tokens \+ max_new_tokens=2 = 31 tokens .*max_seq_len=20"):
        sess.add(list(range(1, 30)), SamplingParams(max_new_tokens=2))
    hs = [sess.add([1, 2], SamplingParams(max_new_tokens=2)) for _ in range(3)]
    assert sess.free_slots() == 0
    with pytest.raises(KeyError, match="unknown row handle 99"):
        sess.done(99)
    with pytest.raises(KeyError, match="unknown row handle 99"):
        sess.result(99)
    sess.run()
    sess.result(hs[0])
    with pytest.raises(KeyError, match="already taken"):
        sess.result(hs[0])


@pytest.mark.parametrize("method", ["prompt_lookup", "draft_model"])
def test_adaptive_speculation_is_lossless_and_reports_its_choices(model, method):
    prompts = [[5, 6, 7, 5, 6, 7, 5], [9, 3, 9, 3], [1, 2], [4, 4, 4]] * 2
    sp = SamplingParams(max_new_tokens=12)
    opts = {"ignore_eos": True, "num_draft_tokens": 4}
    draft = model if method == "draft_model" else None
    ar = generate(model, prompts, sp, options={"ignore_eos": True})
    outs = generate(model, prompts, sp, method=method, draft_model=draft, options={**opts, "adaptive": True})
    assert [o.tokens for o in outs] == [o.tokens for o in ar]
    info = outs[0].stats["session"]
    assert sum(info["levels"].values()) == info["steps"]  # every step decoded (rows join in the step prefilling them)
    chosen = info["adaptive"]["chosen"]  # draft nodes -> steps, over this model's adaptive sessions
    assert 0 in chosen and 1 in chosen  # measured plain decoding and the smallest draft
    if method == "prompt_lookup":  # a free draft: the full one is tried (a draft as big as the target, drafting 4
        assert max(chosen) == 4  # tokens a step, cannot beat plain decoding even if all were accepted: not tried)
    assert sum(outs[0].stats["speculation_levels"].values()) == outs[0].stats["target_forwards"] - 1


def test_adaptive_speculation_does_not_learn_step_costs_from_steps_that_timed_kernels(monkeypatch):
    """A row count's first use times the CPU kernels inside that step (0.1-2 s): the controller must not take that
    for the cost of drafting or verifying (it then chose plain decoding for ~100 steps of a draft accepting all 7
    tokens). Steps in which kernel timing ran still teach acceptance, not costs; other steps teach both."""
    import nemo_spec.models.fastpath as fp
    from nemo_spec.inference.session import Session
    from tests.speculative_utils import make_spec

    def run(tuning_every_step):
        spec = make_spec(tiny_llama(), "eagle3").eval()  # its own controller (one is kept per model and method)
        if tuning_every_step:  # as if every step met a new row count
            spent = iter(range(10 ** 6))
            monkeypatch.setattr(fp, "tuning_seconds", lambda: float(next(spent)))
        sess = Session(spec, "eagle", options={"num_draft_tokens": 3, "ignore_eos": True}, max_batch=2,
                       adaptive=True)
        hs = [sess.add(p, SamplingParams(max_new_tokens=12)) for p in ([5, 6, 7, 8], [9, 3, 1])]
        sess.run()
        monkeypatch.undo()
        ctl = sess.adaptive
        return ctl.verify.s1, ctl.draft.s1, sum(map(sum, ctl.trials)), [sess.result(h).tokens for h in hs], ctl.chosen

    clean, tuned = run(False), run(True)
    assert clean[0] > 0 and clean[1] > 0  # costs learnt
    assert tuned[0] == 0 and tuned[1] == 0 and tuned[2] > 0  # no costs from timed-kernel steps; acceptance still
    assert tuned[3] == clean[3]
    # a trial of the largest level that measured nothing is tried again (before: plain decoding until the next
    # trial, 32 steps on, as the costs of larger levels were extrapolated from 1-token steps)
    # levels 0-3 (up to 3 draft tokens): the smallest and plain decoding once each, then the largest at every step
    assert tuned[4][1] == 1 and tuned[4][0] == 1 and set(tuned[4]) == {0, 1, 3}


def test_adaptive_acceptance_is_per_tree_level_and_shared_along_a_chain():
    """Trees: measuring a small tree's low acceptance leaves a larger tree's own (higher) measured acceptance
    alone, so the controller keeps choosing the large tree where it pays (shared per-depth counts made the large
    tree look as poor as the small ones, and it got stuck on them). Chains: a long chain's step also measures
    every shorter chain (its prefix), so they agree at each depth."""
    from types import SimpleNamespace as NS

    from nemo_spec.inference.adaptive import AdaptiveSpeculation

    def step(ctl, level, accepted, b, chain):
        n = ctl.levels[level]
        tree = NS(tokens=torch.zeros(b, n), sizes=None, max_children=1 if chain else 2)
        res = NS(paths=[[0] * (a + 1) for a in accepted])
        ctl.observe(b, level, tree, res, draft_s=1e-3 * (1 + level), verify_s=1e-3 * (4 + 0.3 * b * (1 + n)))

    tree_p = NS(levels=[0, 2, 3, 5, 7, 8, 10], level_depth=lambda i: i, draft_forwards=lambda i: 1 + max(0, i - 1))
    ctl = AdaptiveSpeculation(tree_p)
    for _ in range(3):
        step(ctl, 6, [5] * 4, 4, chain=False)  # the 10-node, depth-6 tree accepts 5 of 6 depths
    for _ in range(40):
        step(ctl, 2, [0] * 4, 4, chain=False)  # the 3-node, depth-2 tree accepts nothing
    assert ctl.expected_tokens(2) < 1.1 and ctl.expected_tokens(6) > 4.5
    assert ctl.predicted_rate(4, 6) > ctl.predicted_rate(4, 2)
    info = ctl.describe()
    assert info["expected_tokens"][10] == pytest.approx(ctl.expected_tokens(6), abs=1e-3)

    chain_p = NS(levels=[0, 1, 2, 3, 4], level_depth=lambda i: i, draft_forwards=lambda i: 1 + max(0, i - 1))
    ctl = AdaptiveSpeculation(chain_p)
    for _ in range(20):
        step(ctl, 4, [4, 1, 0, 3], 4, chain=True)
    for d in range(1, 3):  # chains of 2 and 4 tokens: the same acceptance at depths 1-2
        assert ctl.succ[2][d] / ctl.trials[2][d] == pytest.approx(ctl.succ[4][d] / ctl.trials[4][d])
    assert ctl.expected_tokens(2) < ctl.expected_tokens(4)



def test_adaptive_charges_deferred_draft_work_to_plain_steps():
    """Draft work a level-0 step put off (EAGLE's deferred catch-up) counts against level 0 in the cost model:
    its predicted time is the verify fit plus the mean deferred seconds per level-0 step."""
    from types import SimpleNamespace as NS

    from nemo_spec.inference.adaptive import AdaptiveSpeculation

    prop = NS(levels=[0, 1, 2, 3], level_depth=lambda i: i, draft_forwards=lambda i: i)  # lazy: none at level 0
    ctl = AdaptiveSpeculation(prop)
    for level, n in ((3, 3), (0, 0)) * 4:
        tree = NS(tokens=torch.zeros(4, n), sizes=None, max_children=1)
        ctl.observe(4, level, tree, NS(paths=[[0]] * 4), draft_s=1e-3 * level, verify_s=1e-3 * (2 + 0.5 * 4 * (1 + n)))
    plain = ctl.predicted_rate(4, 0)
    assert plain == pytest.approx(4 / ctl.verify.predict(4))
    ctl.observe_deferred(6e-3, 3)
    ctl.observe_deferred(0.0, 0)  # steps that ran no deferred work change nothing
    assert ctl.deferred_per_step() == pytest.approx(2e-3)
    assert ctl.predicted_rate(4, 0) == pytest.approx(4 / (ctl.verify.predict(4) + 2e-3))
    assert ctl.predicted_rate(4, 0) < plain
    assert ctl.describe()["deferred_draft_s_per_plain_step"] == pytest.approx(2e-3)


def test_adaptive_trials_of_a_draft_that_does_not_pay_grow_rarer():
    """A draft that is never accepted: after each trial of the largest level the controller goes back to plain
    decoding and waits twice as long for the next trial (32, 64, ... up to 256 steps); once the draft pays again,
    a trial or two raise its measured acceptance until the largest level wins, and the interval is back to 32."""
    from types import SimpleNamespace as NS

    from nemo_spec.inference.adaptive import AdaptiveSpeculation

    prop = NS(levels=[0, 1, 2, 3], level_depth=lambda i: i, draft_forwards=lambda i: i)
    ctl = AdaptiveSpeculation(prop)
    b = 4

    def run(steps, accepted):
        trials = []
        for k in range(steps):
            level = ctl.choose(b)
            n = ctl.levels[level]
            tree = NS(tokens=torch.zeros(b, n), sizes=None, max_children=1)
            ctl.observe(b, level, tree, NS(paths=[[0] * (min(accepted, n) + 1)] * b),
                        draft_s=1e-3 * level, verify_s=1e-3 * (2 + 0.5 * b * (1 + n)))
            if level == 3:
                trials.append(k)
        return trials

    trials = run(2000, accepted=0)
    gaps = [y - x for x, y in zip(trials, trials[1:])]
    assert gaps[:4] == [33, 65, 129, 257] and set(gaps[4:]) == {257}
    assert ctl.explore_every == ctl.describe()["trial_every"] == 256
    after = run(1000, accepted=3)  # the draft now accepts everything
    assert ctl.explore_every == 32 and len(after) > 500 and after[-1] == 999


def test_adaptive_chain_probes_one_level_deeper_after_a_whole_chain_was_accepted():
    """A chain step measures the depths it drafted only. Seen on the quickstart's EAGLE-3 draft at batch 8: the
    first trial of the largest chain (rows' first tokens after their prompts) accepted little; 32 plain steps later
    the next trial accepted every token, but the old counts still made a 1-token chain the best bet, and at that
    level the deeper depths were never measured again: 100 steps before the largest chain won (0.96x our AR where
    the fixed 8-token chain gave 1.24x). Now a level whose whole chain every row accepted is followed by a probe
    one level deeper, so the controller climbs within a few steps of that trial; a probe that loses (here: the
    draft is right for exactly 2 tokens) is not repeated for explore_every steps and starts no probe of the level
    above it."""
    from types import SimpleNamespace as NS

    from nemo_spec.inference.adaptive import AdaptiveSpeculation

    prop = NS(levels=[0, 1, 2, 3, 4], level_depth=lambda i: i, draft_forwards=lambda i: i)
    b = 8

    def run(ctl, steps, accepted):
        seq = []
        for k in range(steps):
            level = ctl.choose(b)
            n = ctl.levels[level]
            acc = accepted(k)
            ctl.observe(b, level, NS(tokens=torch.zeros(b, n), sizes=None, max_children=1),
                        NS(paths=[[0] * (min(a, n) + 1) for a in acc]), draft_s=1.7e-3 * n,
                        verify_s=1e-3 * (5.6 + 0.42 * b * (1 + n)))  # the quickstart base's fit at batch 8
            seq.append(level)
        return seq

    ctl = AdaptiveSpeculation(prop)
    seq = run(ctl, 3, lambda k: [0, 1] * 4) + run(ctl, 150, lambda k: [4] * b)
    # the smallest chain and plain decoding (the fit's two token counts), the poor first trial, plain decoding,
    # the next trial
    assert seq[:36] == [1, 0, 4] + [0] * 32 + [4]
    assert seq[36:38] == [1, 2] and seq.index(4, 36) < 44 and seq[-100:] == [4] * 100  # was: 1 until step 98

    ctl = AdaptiveSpeculation(prop)
    seq = run(ctl, 300, lambda k: [2] * b)  # every row accepts exactly 2 draft tokens
    probes = [k for k in range(1, 300) if seq[k] == 3 and seq[k - 1] == 2]
    assert seq[-50:].count(2) >= 45 and len(probes) >= 2
    assert all(y - x >= ctl.explore_base for x, y in zip(probes, probes[1:]))

    # every token accepted, but verifying more than 4 tokens a row costs a jump: 3 draft tokens are best; a probe of
    # 4 wins nothing, and a lost probe does not go on to probe 5, 6, ... (it did: 3 3 4 5 6 7 8 3 3 ...)
    deep = NS(levels=list(range(9)), level_depth=lambda i: i, draft_forwards=lambda i: i)
    ctl = AdaptiveSpeculation(deep)
    seq = []
    for k in range(400):
        level = ctl.choose(4)
        n = ctl.levels[level]
        ctl.observe(4, level, NS(tokens=torch.zeros(4, n), sizes=None, max_children=1), NS(paths=[[0] * (n + 1)] * 4),
                    draft_s=1e-3 * n, verify_s=1e-3 * (4 + 0.3 * 4 * (1 + n) + (20 if n > 3 else 0)))
        seq.append(level)
    tail = seq[100:]
    assert tail.count(3) >= 0.9 * len(tail) and not any(x == 4 and y == 5 for x, y in zip(tail, tail[1:]))

    # what starts a probe: every row accepted its whole chain, some row's chain as deep as the level; chains only
    ctl = AdaptiveSpeculation(prop)
    ctl.steps = 5

    def probe_after(accepted, sizes=None, max_children=1, level=2):
        ctl.observe(len(accepted), level, NS(tokens=torch.zeros(len(accepted), 2), sizes=sizes,
                                             max_children=max_children),
                    NS(paths=[[0] * (a + 1) for a in accepted]), draft_s=2e-3, verify_s=1e-2)
        return ctl._probe

    assert probe_after([2, 2, 2]) == 3
    assert probe_after([2, 1, 2]) is None  # one row rejected a draft token
    assert probe_after([2, 2, 2], max_children=2) is None  # a tree's levels are not nested chains
    assert probe_after([1, 1, 0], sizes=[1, 1, 0]) is None  # chains the matches cut short: no deeper depth drafted
    assert probe_after([2, 1, 0], sizes=[2, 1, 0]) == 3


def test_adaptive_never_tries_a_level_that_could_not_pay_even_if_every_draft_token_were_accepted():
    """Measured on SmolLM2-135M at batch 8 (2026-12-06): a decode step 61 ms, a 48-node EAGLE-2 tree's
    verification of 8 x 49 tokens 0.66-0.85 s. The controller used to open every session with a trial of its largest
    level: one such step cost 11-14 decode steps (0.77-0.95x our AR over 64 tokens). Now the first two steps measure the
    smallest level and plain decoding, and the largest is tried (first, and every explore_every steps) only if,
    with every draft token accepted, it would beat the level the model chose. Here 7 tokens a row in 0.9 s lose to
    1 in 61 ms, so it never runs; where the largest level is cheap, it is tried at the third step and again when
    the trial interval comes round."""
    from types import SimpleNamespace as NS

    from nemo_spec.inference.adaptive import AdaptiveSpeculation

    def run(b, levels, verify, draft_s, accepted, steps):
        prop = NS(levels=levels, level_depth=lambda i: i, draft_forwards=lambda i: i)
        ctl = AdaptiveSpeculation(prop)
        seq = []
        for k in range(steps):
            level = ctl.choose(b)
            n = ctl.levels[level]
            ctl.observe(b, level, NS(tokens=torch.zeros(b, n), sizes=None, max_children=2),
                        NS(paths=[[0] * (min(accepted, level) + 1)] * b), draft_s=draft_s * level,
                        verify_s=verify(b * (1 + n)))
            seq.append(level)
        return ctl, seq

    tree = [0, 8, 16, 24, 32, 40, 48]  # depth d: a tree of 8 d nodes
    ctl, seq = run(8, tree, lambda x: 0.0446 + 0.00205 * x, 8e-3, accepted=3, steps=200)
    assert seq[:2] == [1, 0] and 6 not in seq and ctl.chosen.get(6, 0) == 0
    assert ctl.best_case_rate(8, 6, ctl.verify_costs(8)[6]) < ctl.predicted_rate(8, 0)
    # the same tree over 1 row at 0.05 ms a verified token: the largest level can pay, and does
    ctl, seq = run(1, tree, lambda x: 4e-3 + 5e-5 * x, 1e-3, accepted=6, steps=60)
    assert seq[:3] == [1, 0, 6] and seq.count(6) >= 2  # the first trial, and the interval's


def test_adaptive_verify_cost_of_a_level_follows_its_own_steps():
    """Verify time grows more slowly with width on wide steps (here 0.6 ms per token up to 8, 0.2 beyond). After
    a long spell of narrow level-0 steps the shared line extrapolates a 40-token step at twice its cost; the
    largest chain's own measured step keeps its prediction right, so at 8 rows it still wins (as its measured
    tokens per second say it should) instead of locking the controller on plain decoding."""
    from types import SimpleNamespace as NS

    from nemo_spec.inference.adaptive import AdaptiveSpeculation

    def verify_s(x):
        return 1e-3 * (2 + 0.6 * min(x, 8) + 0.2 * max(0, x - 8))

    prop = NS(levels=[0, 1, 2, 3, 4], level_depth=lambda i: i, draft_forwards=lambda i: i)
    ctl = AdaptiveSpeculation(prop)
    for level, b, acc in [(4, 8, 3)] + [(0, 1 + k % 8, 0) for k in range(200)]:
        n = ctl.levels[level]
        ctl.observe(b, level, NS(tokens=torch.zeros(b, n), sizes=None, max_children=1),
                    NS(paths=[[0] * (acc + 1)] * b), draft_s=1e-3 * level, verify_s=verify_s(b * (1 + n)))
    assert ctl.verify.predict(40) > 1.8 * verify_s(40)  # the shared line, fitted on narrow steps
    assert ctl.verify_seconds(8, 4) == pytest.approx(verify_s(40), rel=0.02)
    assert ctl.verify_seconds(8, 0) == pytest.approx(verify_s(8), rel=0.02)
    measured = {4: 8 * ctl.expected_tokens(4) / (verify_s(40) + 4e-3), 0: 8 / verify_s(8)}
    assert measured[4] > measured[0]
    ctl.steps = 2
    assert ctl.choose(8) == 4

def test_adaptive_never_predicts_a_larger_level_cheaper_than_a_measured_smaller_one():
    """A draft whose tokens past depth 3 are never accepted (a DFlash block on a loop): chains of 3, 4 and 5 all
    give 4 tokens a step, and their own verify timings differ by noise, here the 5-token steps timed fastest. The
    controller must not pay for 2 extra verified tokens on that noise: a level's verify cost is never below a
    measured smaller level's, and on equal tokens the smaller level wins."""
    from types import SimpleNamespace as NS

    from nemo_spec.inference.adaptive import AdaptiveSpeculation

    prop = NS(levels=[0, 1, 2, 3, 4, 5], level_depth=lambda i: i, draft_forwards=lambda i: 1 if i else 0)
    ctl = AdaptiveSpeculation(prop)
    noise = {0: 1.0, 3: 1.1, 4: 1.05, 5: 0.9}  # level 5's steps happened to run on a quiet machine
    for k in range(300):
        level = (0, 3, 4, 5)[k % 4]
        n, b = ctl.levels[level], 1
        ctl.observe(b, level, NS(tokens=torch.zeros(b, n), sizes=None, max_children=1),
                    NS(paths=[[0] * (min(n, 3) + 1)]), draft_s=2e-3,
                    verify_s=1e-3 * (3.5 + 0.4 * (1 + n)) * noise[level])
    assert ctl.expected_tokens(5) == pytest.approx(ctl.expected_tokens(3), rel=0.05)
    assert ctl.verify_seconds(1, 5) < ctl.verify_seconds(1, 3)  # what the timings say
    costs = ctl.verify_costs(1)
    assert costs[5] >= costs[4] >= ctl.verify_seconds(1, 3)
    ctl.steps, ctl.since_top = 2, 0
    assert ctl.choose(1) == 3


@pytest.mark.gpu
@pytest.mark.parametrize("method,temperature", [("ar", 0.0), ("draft_model", 0.8), ("eagle_tree", 0.0),
                                                ("eagle", 0.8), ("medusa", 0.8), ("prompt_lookup", 0.8),
                                                ("peagle", 0.8), ("dflash", 0.0), ("dflash_tree", 0.8)])
def test_decode_and_verify_steps_never_sync_the_device(method, temperature):
    """Under torch.cuda.set_sync_debug_mode("error") whole session steps (prefill, draft, target verify, device
    acceptance, cache keep, slot moves) run; the one allowed device -> host read is the accepted ids."""
    from nemo_spec.speculative import SpeculativeTransform

    torch.manual_seed(0)
    dev = torch.device("cuda")
    target = build_gpt(tiny_llama(), device=dev).eval()
    model, draft = target, None
    if method == "draft_model":
        draft = build_gpt(tiny_llama(num_layers=1), device=dev).eval()
    elif method.startswith("eagle") or method == "medusa":
        alg = "medusa" if method == "medusa" else "eagle3"
        kw = {"num_medusa_heads": 2} if alg == "medusa" else {}
        model = SpeculativeTransform(algorithm=alg, **kw)(target).to(dev).eval()
    elif method.startswith(("peagle", "dflash")):  # one-forward drafts, run adaptive (deferred draft work too)
        from tests.speculative_utils import ALG_KWARGS

        alg = method.split("_")[0]
        if alg == "dflash":  # its target layers [0, 2] need four base layers
            target = build_gpt(tiny_llama(num_layers=4), device=dev).eval()
        model = SpeculativeTransform(**ALG_KWARGS[alg])(target).to(dev).eval()
    opts = {"ignore_eos": True, "depth": 3, "top_k": 2, "total_tokens": 5, "num_draft_tokens": 3,
            "adaptive": method.startswith(("peagle", "dflash"))}
    sess = Session(model, method, draft, opts, max_batch=3, prefill_chunk_tokens=6)
    sp = [SamplingParams(temperature=temperature, seed=i, max_new_tokens=6 + 3 * i) for i in range(4)]
    for i, p in enumerate(sp):
        sess.add([1, 2, 3, 1, 2, 3, 4][: 3 + i], p)
    sess.step()  # first use: kernels load, host buffers are pinned
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        while sess.step():
            pass
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert all(sess.result(h).finish_reason == "length" for h in range(4))


def test_decode_context_equals_the_one_node_block_context():
    """decode_context (the plain step's context) == block_context of a one-node block: positions, write slots,
    attended cache slots (ragged lengths, left padding, one row without padding: no mask at all)."""
    from nemo_spec.inference.trees import block_context, decode_context
    from nemo_spec.models.attention import KVCache

    for lengths, starts in (([7, 3, 11], [2, 0, 5]), ([9], [0])):
        b = len(lengths)
        kv = KVCache(2, b, 32, 1, 4, torch.float32, torch.device("cpu"))
        kv.lengths.copy_(torch.tensor(lengths))
        kv.starts.copy_(torch.tensor(starts))
        one = torch.ones(b, 1, 1, dtype=torch.bool)
        ref = block_context(kv, one, torch.zeros(b, 1, dtype=torch.long), 10, max_length=max(lengths))
        got = decode_context(kv, max(lengths), 10, unpadded=not any(starts))
        assert torch.equal(got.position_ids, ref.position_ids) and torch.equal(got.write_slots, ref.write_slots)
        assert got.kv_len == ref.kv_len and got.write_start() == ref.write_start()
        assert (got.sdpa_mask() is None) == (b == 1)
        want = ref.mask[:, None] if ref.sdpa_mask() is None else ref.sdpa_mask()
        assert torch.equal(want, got.sdpa_mask() if b > 1 else torch.ones_like(want))


@pytest.mark.parametrize("method", ["ar", "prompt_lookup"])
def test_the_plain_decode_step_equals_the_empty_tree_verification(model, method, monkeypatch):
    """Engine.decode_one (empty trees without the tree machinery) gives the tokens, accepted counts and stats of
    the tree path: greedy and seeded sampled rows mixed, ragged rows joining and leaving mid-flight; prompt
    lookup mixes plain steps (no row found a match) and speculative ones."""
    from nemo_spec.inference.engine import Engine

    prompts = [[5, 6, 7, 5, 6, 7, 5], [9, 3, 9, 3], [1, 2], [4, 4, 4], [8, 1, 8, 1, 8]]
    opts = {"ignore_eos": True, "num_draft_tokens": 3}
    plain_steps = []
    decode_one = Engine.decode_one

    def counted(self, *a):
        plain_steps.append(1)
        return decode_one(self, *a)

    monkeypatch.setattr(Engine, "decode_one", counted)

    def run(plain):
        monkeypatch.setattr(Engine, "plain_decode", plain)
        sess = Session(model, method, options=opts, max_batch=3, prefill_chunk_tokens=6)
        hs = [sess.add(p, SamplingParams(temperature=0.0 if i % 2 else 0.9, top_p=0.9, seed=i,
                                         max_new_tokens=5 + 3 * i)) for i, p in enumerate(prompts)]
        sess.run()
        res = [sess.result(h) for h in hs]
        return [(r.tokens, r.stats["accept_hist"], r.stats["target_forwards"]) for r in res]

    plain = run(True)
    n_plain = len(plain_steps)
    assert run(False) == plain
    assert n_plain > 0 and len(plain_steps) == n_plain  # plain steps were taken, by the first run only
    if method == "prompt_lookup":
        assert any(sum(h[1:]) for _, h, _ in plain)  # and speculative steps accepted drafts


DEFER_ROWS = {  # prompts, budgets, level schedule (runs of 0s longer than the lazy_draft_steps cap too)
    "mixed": ([[5, 6, 7, 5, 6, 7, 5], [9, 3, 9, 3, 1], [1, 2], [4, 4, 4, 8], [7, 1, 7, 1, 7, 1]],
              [20, 23, 26, 29, 32], [3, 0, 0, 0, 0, 0, 2, 0, 1, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0, 1]),
    # short rows under long level-0 runs: slots holding deferred work are swapped
    "swaps": ([[5, 6, 7, 5, 6, 7, 5], [9, 3, 9, 3, 1], [1, 2], [4, 4, 4, 8], [7, 1, 7, 1, 7, 1],
               [3, 3, 2, 9, 8, 1, 4]], [9, 4, 13, 6, 11, 7], [0] * 7 + [3] + [0] * 9 + [1]),
    # rows joining during a level-0 run finish at other times: slots with different pending work are swapped
    "joins": ([[5, 6, 7, 5, 6, 7, 5], [9, 3, 9, 3, 1], [1, 2], [4, 4, 4, 8], [7, 1, 7, 1, 7, 1],
               [3, 3, 2, 9, 8, 1, 4]], [3, 5, 30, 4, 6, 9], [0] * 20 + [3]),
}


def _deferred_vs_stepwise(spec, method, rows, options=None, chunk=None, hook=None):
    """Run DEFER_ROWS[rows] (odd rows sampled, seeded) under a scripted level schedule with lazy_draft_steps 0
    (draft work after every step) and 3; check every proposal and every row's tokens are the same and greedy rows
    are AR's. ``hook(sess)`` may wrap the session's proposer. Returns ((results, session) stepwise, deferred)."""
    prompts, budgets, schedule = DEFER_ROWS[rows]
    sp = [SamplingParams(max_new_tokens=n, temperature=0.8 if i % 2 else 0.0, seed=i) for i, n in enumerate(budgets)]

    def run(lazy):
        sess = Session(spec, method, options={"ignore_eos": True, **(options or {}), "lazy_draft_steps": lazy},
                       max_batch=3, adaptive=True, prefill_chunk_tokens=chunk)
        sess.adaptive = ScriptedLevels(schedule)
        trees, propose = [], sess.proposer.propose

        def record(s, st, level=None):
            t = propose(s, st, level)
            trees.append((level, t.tokens.clone(), None if t.parents is None else t.parents.clone(),
                          None if t.q is None else t.q.clone()))
            return t

        sess.proposer.propose = record
        if hook is not None:
            hook(sess)
        hs = [sess.add(p, s) for p, s in zip(prompts, sp)]
        sess.run()
        return [sess.result(h) for h in hs], trees, sess

    (eager, eager_trees, eager_s), (lazy, lazy_trees, lazy_s) = run(0), run(3)
    ar = generate(spec, [p for p, s in zip(prompts, sp) if s.greedy], SamplingParams(max_new_tokens=40),
                  options={"ignore_eos": True})
    assert [r.tokens for r in lazy] == [r.tokens for r in eager]
    assert [r.tokens for r, s in zip(lazy, sp) if s.greedy] == [a.tokens[:len(r.tokens)] for r, a in
                                                              zip([r for r, s in zip(lazy, sp) if s.greedy], ar)]
    assert len(lazy_trees) == len(eager_trees) >= len(schedule)
    for (la, lt, lp, lq), (ea, et, ep, eq) in zip(lazy_trees, eager_trees):
        assert la == ea and torch.equal(lt, et) and (lp is None) == (ep is None) and (lq is None) == (eq is None)
        assert lp is None or torch.equal(lp, ep)
        assert lq is None or torch.allclose(lq, eq, atol=1e-5)
    return (eager, eager_s), (lazy, lazy_s)


@pytest.mark.parametrize("method,chunk", [("eagle", None), ("eagle_tree", None), ("eagle", 2)])
def test_level0_steps_defer_the_eagle_catch_up_without_changing_any_draft(method, chunk):
    """A level-0 step drafts nothing, so EAGLE keeps its (feature, token) pairs and reads them in one draft forward
    when a later step drafts, or once lazy_draft_steps of them piled up; a prompt's draft prefill waits for the
    row's first drafting step the same way (``chunk``: prompts read, and the catch-up read, a few tokens per
    forward). Against catching up after every step (lazy_draft_steps=0), under the same level schedule with rows
    joining and leaving: every proposed tree is the same, greedy rows == AR and sampled rows the same tokens; fewer
    draft forwards; level 0 costs no draft forward in the cost model."""
    from tests.speculative_utils import make_spec

    spec = make_spec(tiny_llama(), "eagle3").eval()
    opts = {"num_draft_tokens": 3, "depth": 3, "top_k": 2, "total_tokens": 5}
    (eager, eager_s), (lazy, lazy_s) = _deferred_vs_stepwise(spec, method, "mixed", opts, chunk)
    eager_def, lazy_def = eager_s.adaptive.deferred, lazy_s.adaptive.deferred
    assert not eager_def and lazy_def and max(lazy_def) <= 3  # caught up after at most 3 level-0 steps
    assert sum(r.stats["draft_forwards"] for r in lazy) < sum(r.stats["draft_forwards"] for r in eager)
    lazy_p, eager_p = lazy_s.proposer, eager_s.proposer
    assert lazy_p.draft_forwards(0) == 0 and eager_p.draft_forwards(0) == 1 and lazy_p.draft_forwards(3) == 3
    lazy_st, eager_st = lazy_s.stats(), eager_s.stats()
    assert lazy_st["draft_prefill_s"] > 0 and eager_st["draft_prefill_s"] == 0  # the prompts' pairs waited
    # prefill_s: the prompts' reading in all, the draft's deferred part included
    assert lazy_st["prefill_s"] > lazy_st["draft_prefill_s"] and eager_st["prefill_s"] > 0
    # ... and not also in the draft time per step (it ran inside decode steps): the columns add up
    for sess, st in ((lazy_s, lazy_st), (eager_s, eager_st)):
        assert st["draft_ms_per_step"] * st["decode_steps"] / 1e3 == pytest.approx(
            sess.decode_s["draft"] - st["draft_prefill_s"])


@pytest.mark.parametrize("method,chunk,rows", [("dflash", None, "mixed"), ("dflash_tree", None, "mixed"),
                                               ("dflash", 2, "mixed"), ("dflash", None, "swaps"),
                                               ("dflash", 2, "swaps")])
def test_level0_steps_defer_the_dflash_context_injection_without_changing_any_draft(method, chunk, rows):
    """A level-0 step drafts nothing, so DFlash keeps that position's base features and injects a run of them in
    one write when a later step drafts, or once lazy_draft_steps of them piled up; a prompt's injection waits for
    the row's first drafting step the same way (``chunk``: prompts prefilled a few tokens at a time). Against
    injecting after every step (lazy_draft_steps=0), under the same level schedule with rows joining, leaving and
    swapping slots: every proposed block is the same, greedy rows == AR, sampled rows the same tokens; fewer
    injections; the controller is told the deferred steps, the stats the deferred prefill."""
    import nemo_spec.speculative.dflash as D
    from tests.speculative_utils import make_spec

    spec = make_spec(tiny_llama(num_layers=4), "dflash").eval()
    writes, swapped, write = [], [], D.DFlashDraft.write_context

    def counted(self, cache, fused, counts):
        writes.append(fused.shape[1])
        return write(self, cache, fused, counts)

    def spy_swaps(sess):
        p, swap = sess.proposer, sess.proposer.swap

        def swap_spy(i, j, used):  # slots exchanged while holding deferred work
            swapped.append(i != j and bool(p.prompt_f[i] or p.prompt_f[j] or p.deferred_n[i] or p.deferred_n[j]))
            swap(i, j, used)

        sess.proposer.swap = swap_spy
        sess.from_here = (len(writes), len(swapped))  # this run's writes and swaps follow

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(D.DFlashDraft, "write_context", counted)
        (eager, eager_s), (lazy, lazy_s) = _deferred_vs_stepwise(spec, method, rows, chunk=chunk, hook=spy_swaps)
    (w0, s0), (w1, s1) = eager_s.from_here, lazy_s.from_here
    assert len(writes) - w1 < w1 - w0  # fewer injections
    assert not any(swapped[s0:s1]) and (any(swapped[s1:]) or rows != "swaps")
    eager_def, lazy_def = eager_s.adaptive.deferred, lazy_s.adaptive.deferred
    assert not eager_def and lazy_def and max(lazy_def) <= 3  # injected after at most 3 level-0 steps
    assert lazy_s.stats()["draft_prefill_s"] > 0 and eager_s.stats()["draft_prefill_s"] == 0  # the prompts waited


@pytest.mark.parametrize("method,rows,chunk,window", [("peagle", "mixed", None, None),
                                                      ("peagle_tree", "mixed", None, None),
                                                      ("peagle", "swaps", None, None), ("peagle", "joins", None, None),
                                                      ("peagle", "mixed", 2, None), ("peagle", "swaps", 2, None),
                                                      ("peagle", "mixed", 2, 3)])
def test_level0_steps_defer_the_peagle_catch_up_without_changing_any_draft(method, rows, chunk, window):
    """P-EAGLE at level 0: the step's pair joins the row's pending pairs (no draft forward) and the next drafting
    step's one forward reads them all, or one forward once lazy_draft_steps of them piled up; a prompt's pairs
    wait for the row's first forward the same way (``chunk``: prompts prefilled, and read, a few pairs at a time;
    ``window``: the draft reads only a prompt's last pairs, ``draft_prompt_tokens``).
    Against a forward at every level-0 step and the prompt read at prefill (lazy_draft_steps=0), under the same
    level schedule with rows joining, leaving and swapping slots: every proposal the same, greedy rows == AR,
    sampled rows the same tokens; fewer forwards; the waiting prompts' time is reported as draft prefill."""
    from tests.speculative_utils import make_spec

    spec = make_spec(tiny_llama(), "peagle").eval()
    uneven, waiting = [], []  # per swap: different numbers of pending pairs; a slot holding unread prompt pairs

    def spy_swaps(sess):
        p, swap = sess.proposer, sess.proposer.swap

        def swap_spy(i, j, used):
            uneven.append(i != j and p.pend_n[i] != p.pend_n[j])
            waiting.append(i != j and bool(p.prompt_pairs[i] or p.prompt_pairs[j]))
            swap(i, j, used)

        sess.proposer.swap = swap_spy

    opts = {"draft_prompt_tokens": window} if window else None
    (eager, eager_s), (lazy, lazy_s) = _deferred_vs_stepwise(spec, method, rows, opts, chunk=chunk, hook=spy_swaps)
    assert rows != "joins" or sum(uneven) >= 2
    assert rows != "swaps" or any(waiting)
    assert lazy_s.stats()["draft_prefill_s"] > 0 and eager_s.stats()["draft_prefill_s"] == 0  # the prompts waited
    # fewer forwards; with a 2-token budget, pairs held with a waiting prompt are read 1 per row per forward
    assert chunk or sum(r.stats["draft_forwards"] for r in lazy) < sum(r.stats["draft_forwards"] for r in eager)
    lazy_p, eager_p = lazy_s.proposer, eager_s.proposer
    assert lazy_p.draft_forwards(0) == 0 and eager_p.draft_forwards(0) == 1 and lazy_p.draft_forwards(2) == 1


@pytest.mark.parametrize("method,chunk,window", [("eagle", None, None), ("eagle_tree", None, None), ("eagle", 2, None),
                                                 ("eagle", None, 1), ("peagle", None, None), ("peagle", 2, None),
                                                 ("peagle", None, 1), ("dflash", None, None), ("dflash", 2, None)])
def test_rows_never_drafted_for_cost_the_draft_nothing(method, chunk, window):
    """A row the controller never drafts for costs an AR row: once lazy_draft_steps level-0 steps have piled up, a
    row whose prompt still waits adds them to it instead of making the draft read the prompt and the steps (which
    cost 0.16-0.20 s at batch 8 on SmolLM2). 20 level-0 steps (lazy_draft_steps 3, rows joining and leaving): the
    draft runs nothing until the first drafting step, which reads the held pairs; every proposal and token the same
    as catching up after every step, greedy rows AR's (checked by _deferred_vs_stepwise). ``window`` 1
    (``draft_prompt_tokens``): a P-EAGLE row then has no waiting prompt pairs (its one pair is pending) and was
    caught up by the first full buffer until the rows the draft has read nothing of were tracked as such."""
    import nemo_spec.speculative.dflash as D
    from tests.speculative_utils import make_spec

    algo = {"eagle": "eagle3", "eagle_tree": "eagle3"}.get(method, method)
    spec = make_spec(tiny_llama(num_layers=4 if method == "dflash" else 2), algo).eval()
    runs = []  # per run: the decode step (proposals so far) of each draft call

    def spy(sess):
        steps, calls, propose = [0], [], sess.proposer.propose
        runs.append(calls)

        def counted(s, st, level=None):
            steps[0] += 1
            return propose(s, st, level)

        sess.proposer.propose = counted
        if method == "dflash":
            for name in ("write_context", "forward"):
                f = getattr(D.DFlashDraft, name)
                mp.setattr(D.DFlashDraft, name,
                           lambda self, *a, _f=f, **k: (calls.append(steps[0]), _f(self, *a, **k))[1])
        else:
            step = spec.draft_step
            mp.setattr(spec, "draft_step", lambda *a, **k: (calls.append(steps[0]), step(*a, **k))[1])

    with pytest.MonkeyPatch.context() as mp:
        opts = {"num_draft_tokens": 3, "depth": 3, "top_k": 2, "total_tokens": 5} if method.startswith("eagle") \
            else {}
        if window:
            opts["draft_prompt_tokens"] = window
        (eager, _), (lazy, _) = _deferred_vs_stepwise(spec, method, "joins", opts, chunk=chunk, hook=spy)
    eager_calls, lazy_calls = runs
    assert min(eager_calls) <= 20  # catching up every step: the draft ran during the level-0 run
    assert lazy_calls and min(lazy_calls) == 21  # deferred: nothing before the first drafting step (the 21st)
    assert [r.stats["draft_forwards"] for r, n in zip(lazy, DEFER_ROWS["joins"][1]) if n < 10] == [0] * 5


def test_peagle_pending_pairs_next_to_a_row_at_its_slot_end_fit_the_draft_cache():
    """A row that joins with a long prompt sits near the end of its slot while another row has many deferred
    pending pairs: the ragged block's padding must not overflow the draft cache (it did: "need 50 slots, cache has
    49"); the tokens are AR's and those of a forward at every level-0 step."""
    from tests.speculative_utils import make_spec

    spec = make_spec(tiny_llama(), "peagle").eval()
    late = list(range(3, 3 + 34))

    def run(lazy):
        sess = Session(spec, "peagle", options={"ignore_eos": True, "lazy_draft_steps": lazy}, max_batch=2,
                       adaptive=True, max_seq_len=40)
        sess.adaptive = ScriptedLevels([0] * 14 + [3])
        a = sess.add([1, 2], SamplingParams(max_new_tokens=30))
        for _ in range(10):
            sess.step()
        b = sess.add(late, SamplingParams(max_new_tokens=6))
        sess.run()
        return [sess.result(a).tokens, sess.result(b).tokens]

    got = run(12)
    ar = generate(spec, [[1, 2], late], [SamplingParams(max_new_tokens=30), SamplingParams(max_new_tokens=6)],
                  options={"ignore_eos": True})
    assert got == run(0) == [r.tokens for r in ar]


def test_deferred_draft_prefill_reads_only_the_joining_rows():
    """Under adaptive speculation a row's draft prefill waits for its first drafting step; when a row joins a
    running batch, that catch-up reads the prompt over the joining row's slot only (not padded over every decode
    row), and the tokens stay our AR's."""
    from tests.speculative_utils import make_spec

    spec = make_spec(tiny_llama(), "eagle3").eval()
    sess = Session(spec, "eagle", options={"num_draft_tokens": 2, "ignore_eos": True}, max_batch=3)
    sess.adaptive = ScriptedLevels([2])
    calls, step = [], spec.draft_step

    def spy(tok, feats, ctx, head=True):
        calls.append(tuple(tok.shape))
        return step(tok, feats, ctx, head=head)

    spec.draft_step = spy
    long_prompts = [[5, 6, 7, 5, 6], [9, 3, 9, 3, 1, 2]]
    hs = [sess.add(p, SamplingParams(max_new_tokens=12)) for p in long_prompts]
    for _ in range(4):
        sess.step()
    late = [4, 4, 8, 1, 2, 3, 4, 5, 6]
    calls.clear()
    hs.append(sess.add(late, SamplingParams(max_new_tokens=6)))
    sess.step()  # the late row's target prefill (its draft prefill waits)
    sess.step()  # its first drafting step: the prompt's 9 pairs over its slot alone
    assert (1, len(late)) in calls and not any(r == 3 and n >= len(late) for r, n in calls), calls
    sess.run()
    ar = generate(spec, long_prompts + [late], SamplingParams(max_new_tokens=12), options={"ignore_eos": True})
    for h, a in zip(hs, ar):
        got = sess.result(h).tokens
        assert got == a.tokens[:len(got)]
