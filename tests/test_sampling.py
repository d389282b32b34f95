"""Sampling params validation, logit warping, and the lossless accept/reject rules (statistical, tiny vocab)."""
import pytest
import torch

from nemo_spec.inference import sampling
from nemo_spec.inference.sampling import (SamplingError, SamplingParams, chain_accept, sample_from, tree_accept,
                                          warp_logits)
from tests.inference_utils import chi2_critical, chi2_stat

torch.set_num_threads(1)  # tiny tensors: threading only adds overhead on shared CPUs
V = 5
P = torch.tensor([0.05, 0.40, 0.25, 0.20, 0.10])
Q = torch.tensor([0.30, 0.10, 0.35, 0.05, 0.20])
N = 4000


@pytest.mark.parametrize("field,value", [("temperature", -0.1), ("temperature", float("nan")), ("top_k", -1),
                                         ("top_p", 0.0), ("top_p", 1.5), ("max_new_tokens", 0),
                                         ("stop_token_ids", (-3,)), ("seed", 1.5)])
def test_invalid_sampling_params_name_field(field, value):
    with pytest.raises(SamplingError, match=field):
        SamplingParams(**{field: value})


def test_warp_greedy_top_k_top_p():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    g = warp_logits(logits, SamplingParams(temperature=0.0))
    assert torch.equal(g, torch.tensor([[0.0, 1.0, 0.0, 0.0]]))  # no division by zero at T=0
    k2 = warp_logits(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (k2[0, [0, 3]] == 0).all() and abs(float(k2.sum()) - 1) < 1e-6
    full = torch.softmax(logits, -1)[0]
    p = warp_logits(logits, SamplingParams(temperature=1.0, top_p=float(full[1] + 1e-3)))
    assert (p[0, 1] > 0) and (p[0, 2] > 0) and p[0, 0] == 0 and p[0, 3] == 0  # smallest set covering top_p
    hot = warp_logits(logits, SamplingParams(temperature=0.5))
    assert torch.allclose(hot[0], torch.softmax(logits[0] / 0.5, -1))


def test_sample_from_never_picks_zero_probability():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5]]).expand(1000, 4)
    u = torch.linspace(0, 0.999999, 1000)
    u[0] = 0.0
    toks = sample_from(probs, u)
    assert set(toks.tolist()) == {1, 3}


def _run_chain(p, q, n=N, seed=0, deterministic_x=None):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        u = torch.rand(3, generator=g).tolist()
        if deterministic_x is None:
            x = int(sample_from(q, torch.tensor(u[2])))
            m, tok = chain_accept(torch.stack([p, p]), [x], q[None], u[:2])
        else:
            m, tok = chain_accept(torch.stack([p, p]), [deterministic_x], None, u[:2])
            x = deterministic_x
        out.append(x if m == 1 else tok)
    return out


def _check(samples, p):
    stat, df = chi2_stat(samples, {i: float(p[i]) for i in range(len(p))})
    return stat, chi2_critical(df)


def test_chain_accept_is_lossless_stochastic_and_deterministic():
    stat, crit = _check(_run_chain(P, Q), P)
    assert stat < crit, (stat, crit)
    stat, crit = _check(_run_chain(P, Q, deterministic_x=2), P)  # one-hot draft (prompt lookup style)
    assert stat < crit, (stat, crit)


def test_wrong_rules_are_caught(monkeypatch):
    """A residual of p (instead of max(0, p-q)) or always accepting must fail the same statistical check."""
    monkeypatch.setattr(sampling, "residual", lambda p, q: p)
    stat, crit = _check(_run_chain(P, Q), P)
    assert stat > crit, (stat, crit)
    monkeypatch.undo()
    monkeypatch.setattr(sampling, "accept_test", lambda p_x, q_x, u: True)
    stat, crit = _check(_run_chain(P, Q), P)
    assert stat > crit, (stat, crit)


def test_greedy_target_reduces_to_exact_matching():
    p = torch.nn.functional.one_hot(torch.tensor(3), V).float()
    for x in range(V):
        m, tok = chain_accept(torch.stack([p, p]), [x], Q[None], [0.999, 0.5])
        assert (m, tok) == ((1, 3) if x == 3 else (0, 3))


@pytest.mark.parametrize("mode", ["topk", "iid"])
def test_tree_sibling_rejection_is_lossless(mode):
    """Root with 3 candidate children (deterministic top-3 of q, or 3 i.i.d. samples of q), each with a child."""
    g = torch.Generator().manual_seed(1)
    p_child = torch.tensor([0.6, 0.1, 0.1, 0.1, 0.1])
    out = []
    for _ in range(N):
        if mode == "topk":
            cands = torch.topk(Q, 3).indices.tolist()
            qs = None
        else:
            cands = [int(sample_from(Q, torch.rand(1, generator=g)[0])) for _ in range(3)]
            qs = [Q] + [None] * 6  # root's children are i.i.d. draws from Q; grandchildren deterministic
        # block: 0 root, 1..3 children, 4..6 grandchildren (token 0 under each child)
        tokens = [0] + cands + [0, 0, 0]
        children = [[1, 2, 3], [4], [5], [6], [], [], []]
        p = torch.stack([P, p_child, p_child, p_child, P, P, P])
        u = iter(torch.rand(10, generator=g).tolist())
        path, tok = tree_accept(p, tokens, children, qs, u)
        out.append(tokens[path[0]] if path else tok)
        assert len(path) <= 2 and all(c in children[a] for a, c in zip([0] + path, path))
    stat, crit = _check(out, P)
    assert stat < crit, (mode, stat, crit)


def test_tree_wrong_residual_caught(monkeypatch):
    monkeypatch.setattr(sampling, "residual", lambda p, q: p)
    g = torch.Generator().manual_seed(2)
    cands = torch.topk(Q, 3).indices.tolist()
    out = []
    for _ in range(N):
        u = iter(torch.rand(5, generator=g).tolist())
        path, tok = tree_accept(torch.stack([P, P, P, P]), [0] + cands, [[1, 2, 3], [], [], []], None, u)
        out.append(([0] + cands)[path[0]] if path else tok)
    stat, crit = _check(out, P)
    assert stat > crit, (stat, crit)
