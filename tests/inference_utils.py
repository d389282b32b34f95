"""Helpers for the inference tests: chi-square bounds, exact AR continuation distributions, reference greedy."""
from __future__ import annotations

import math
from collections import Counter
from typing import Dict, List, Sequence, Tuple

import torch

from nemo_spec.inference.sampling import SamplingParams, warp_logits
from nemo_spec.models import gpt_forward


def accepted_drafts(out) -> int:
    """Drafted tokens a generation output accepted in all (its ``accept_hist``: steps per accepted count)."""
    return sum(n * c for n, c in enumerate(out.stats["accept_hist"]))


def chi2_critical(df: int, z: float = 3.29) -> float:
    """Upper chi-square quantile (Wilson-Hilferty); z=3.29 is the one-sided 0.9995 normal quantile."""
    a = 2.0 / (9.0 * df)
    return df * (1 - a + z * math.sqrt(a)) ** 3


def chi2_stat(samples: Sequence, expected: Dict, min_count: float = 5.0) -> Tuple[float, int]:
    """Pearson chi-square of samples against expected probabilities; cells under min_count pooled. Returns (stat, df)."""
    n = len(samples)
    obs = Counter(samples)
    stat, cells = 0.0, 0
    pool_e = pool_o = 0.0
    for k, p in expected.items():
        e = n * p
        if e < min_count:
            pool_e += e
            pool_o += obs.get(k, 0)
            continue
        stat += (obs.get(k, 0) - e) ** 2 / e
        cells += 1
    missing = sum(c for k, c in obs.items() if k not in expected)
    pool_o += missing
    if pool_e > 0:
        stat += (pool_o - pool_e) ** 2 / max(pool_e, 1e-9)
        cells += 1
    elif pool_o:
        stat = float("inf")
    return stat, max(cells - 1, 1)


def exact_continuations(model, prompt: List[int], params: SamplingParams, n: int, vocab: int) -> Dict[tuple, float]:
    """Exact probability of every length-n continuation under AR sampling with ``params`` (small vocab only)."""
    probs: Dict[tuple, float] = {(): 1.0}
    for step in range(n):
        prefixes = [k for k in probs if len(k) == step]
        x = torch.tensor([prompt + list(k) for k in prefixes])
        with torch.no_grad():
            p = warp_logits(gpt_forward(model, x).logits[:, -1], params)
        for i, k in enumerate(prefixes):
            for t in range(vocab):
                if p[i, t] > 0:
                    probs[k + (t,)] = probs[k] * float(p[i, t])
    return {k: v for k, v in probs.items() if len(k) == n}


def naive_greedy(model, prompt: List[int], n: int) -> List[int]:
    """Greedy continuation by full recomputation (no cache, no batching)."""
    x = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            x.append(int(gpt_forward(model, torch.tensor([x])).logits[0, -1].argmax()))
    return x[len(prompt):]


#: rows for the proposal tests: ragged prompts and budgets; with max_batch=2 the third joins the second's slot
SLOT_REUSE_ROWS = (([5, 9, 11, 3, 5, 9], 8), ([40, 2], 3), ([7, 1, 30], 6))


class ScriptedLevels:
    """Stands in for the adaptive controller: the levels of a fixed schedule, step by step."""

    def __init__(self, seq):
        self.seq, self.i, self.deferred = seq, 0, []

    def choose(self, b):
        self.i += 1
        return self.seq[(self.i - 1) % len(self.seq)]

    def observe(self, *args, **kwargs):
        pass

    def observe_deferred(self, seconds, steps):
        if steps:
            self.deferred.append(steps)

    def describe(self):
        return {}


def recorded_proposals(model, method: str, rows, options: Dict, max_batch: int = 2, after=None, levels=None):
    """Run a Session over ``rows`` [(prompt, SamplingParams or max_new_tokens)] recording every step's proposal:
    ([(rows' sequences so far), DraftTree, its tokens cloned)], and the rows' results. ``after(proposer, st)`` is
    called after every proposal (a check of the proposer's state); ``levels``: an adaptive session whose
    speculation levels follow this schedule (:class:`ScriptedLevels`)."""
    from nemo_spec.inference.session import Session

    sess = Session(model, method, options=options, max_batch=max_batch)
    if levels is not None:
        sess.adaptive = ScriptedLevels(levels)
    seen = []
    propose = sess.proposer.propose

    def spy(s, st, level=None):
        tree = propose(s, st, level)
        seen.append(([list(x) for x in st.seqs], tree, tree.tokens.clone()))
        if after is not None:
            after(sess.proposer, st)
        return tree

    sess.proposer.propose = spy
    handles = [sess.add(p, sp if isinstance(sp, SamplingParams) else SamplingParams(max_new_tokens=sp))
               for p, sp in rows]
    sess.run()
    return seen, [sess.result(h) for h in handles]


def train_on_own_continuations(model, prompts: Sequence[List[int]], steps: int, length: int = 11):
    """Train ``model``'s draft for ``steps`` steps on the first ``length`` tokens of each prompt followed by the
    target's own greedy continuation (so verification accepts its drafts); returns the model in eval mode."""
    from nemo_spec.inference import generate
    from tests.speculative_utils import train_draft

    outs = generate(model, [list(p) for p in prompts], SamplingParams(max_new_tokens=length))
    train_draft(model, torch.tensor([(list(p) + o.tokens)[:length] for p, o in zip(prompts, outs)]), steps)
    return model.eval()
