"""Speculation that adapts to the batch: per step, the draft level with the most expected tokens per second.

The proposer offers levels (draft nodes per row, from 0 = plain decoding up to its configured size). For a step of
``b`` rows at level ``i`` the controller predicts

    tokens(i)  = b * E[accepted + 1 | level i]           from the running per-depth acceptance at that level
    seconds(i) = T_verify(b * (1 + nodes(i))) * k(i) + draft_forwards(i) * T_draft(b)   (+ T_deferred at level 0)

with ``T_verify`` / ``T_draft`` straight-line fits (fixed cost + cost per token / row) of the session's own timings
of its verify forwards and drafting, exponentially forgetting old samples, and picks the level with the highest
tokens / seconds. ``k(i)`` scales the shared line by how level i's own verify steps compared with it (a line fitted
mostly on narrow level-0 steps can misjudge a step five times as wide), and never below that of a smaller level
measured by its own steps (so noise alone does not buy verified nodes). ``T_deferred`` is the running mean, per
level-0 step, of the draft work such a step put off to a later one (EAGLE reads a run of level-0 steps' tokens into
its draft in one forward when it next drafts: a level-0 step then costs what an AR step costs, plus that share). At
large batches the target forward stops being nearly free per token and the chosen draft shrinks, down to none. The
first two steps measure the smallest level and plain decoding (the fit needs two token counts). A trial of the
largest level — the third step, then once every ``explore_every`` steps at a lower level, so acceptance keeps being
measured — runs only if that level, with every draft token accepted, would beat the level the model would choose (a
trial that cannot pay measures nothing worth its cost: on SmolLM2-135M at batch 8 a 48-node tree's verification of
392 tokens took as long as 11-14 decode steps, and sessions that opened with that trial ran at 0.77-0.95x our AR).
The interval doubles (up to ``max_explore_every``) each time the step after such a trial still prefers a lower
level, and is reset when the largest wins, so a draft that does not pay (say, one not trained for these prompts)
costs few trial steps; acceptance counts are forgotten by steps elapsed. A chain step measures the depths it drafted
only, so after a chain step in which every row accepted its whole chain (and some row's chain was as deep as the
level) the next step takes the next level (a probe: the next chain length, one token more for EAGLE), unless a probe
of that level lost within the last ``explore_every`` steps as first set (``explore_base``); a probe that lost starts
no probe of the level above it. Without probes a first trial that happened to accept little (the rows' first
drafting steps after their prompts) left the deeper depths' estimates low, and a controller settled on a short chain
never measured them again until the next trial of the largest level. Acceptance is kept per level: a chain's
conditional acceptance at depth d is the same for every chain at least d long (a shorter chain is a prefix of a
longer one), so a chain step updates every level; a tree of another node budget holds other candidates at each depth
(a 3-node tree accepts less at depth 1 than a 10-node one), so a tree step updates its own level only — measuring
small trees must not make a larger one look as poor as they are. Under tensor parallelism the first rank's choice is
broadcast (timings differ per rank; every rank must run the same step).
"""
from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional

from nemo_spec import parallel

log = logging.getLogger(__name__)


class LinearFit:
    """Weighted least squares y = a + c x with exponential forgetting; a, c >= 0."""

    def __init__(self, decay: float = 0.97) -> None:
        self.decay = decay
        self.s1 = self.sx = self.sy = self.sxx = self.sxy = 0.0

    def add(self, x: float, y: float) -> None:
        """Record one sample."""
        d = self.decay
        self.s1 = self.s1 * d + 1.0
        self.sx = self.sx * d + x
        self.sy = self.sy * d + y
        self.sxx = self.sxx * d + x * x
        self.sxy = self.sxy * d + x * y

    @property
    def ready(self) -> bool:
        """Samples at two or more distinct x."""
        return self.s1 > 0 and self.s1 * self.sxx - self.sx ** 2 > 1e-9 * max(self.s1 * self.sxx, 1e-30)

    def coefficients(self) -> "tuple[float, float]":
        """(a, c); with one distinct x only, the line through the origin and the mean."""
        if self.s1 == 0:
            return 0.0, 0.0
        if not self.ready:
            mx = self.sx / self.s1
            return 0.0, (self.sy / self.s1) / mx if mx > 0 else 0.0
        det = self.s1 * self.sxx - self.sx ** 2
        c = (self.s1 * self.sxy - self.sx * self.sy) / det
        a = (self.sy - c * self.sx) / self.s1
        if c < 0:  # noise: flat
            return self.sy / self.s1, 0.0
        if a < 0:
            return 0.0, self.sxy / self.sxx
        return a, c

    def predict(self, x: float) -> float:
        """Predicted y at x."""
        a, c = self.coefficients()
        return a + c * x


class AdaptiveSpeculation:
    """Chooses each step's speculation level from a cost model and the proposer's running acceptance."""

    def __init__(self, proposer: Any, prior: float = 0.6, prior_weight: float = 4.0, decay: float = 0.995,
                 explore_every: int = 32, max_explore_every: int = 256) -> None:
        self.proposer = proposer
        self.levels: List[int] = list(proposer.levels)
        self.depths = [proposer.level_depth(i) for i in range(len(self.levels))]
        self.forwards = [proposer.draft_forwards(i) for i in range(len(self.levels))]
        D = max(self.depths) if self.depths else 0
        # per level, per depth (index 1..D): decayed trials and successes of the conditional acceptance
        self.trials = [[prior_weight] * (D + 2) for _ in self.levels]
        self.succ = [[prior * prior_weight] * (D + 2) for _ in self.levels]
        self.decay = decay
        self.verify = LinearFit()
        # per level, decayed sums over its own verify steps: weight, tokens, seconds (see verify_seconds)
        self.own = [[0.0, 0.0, 0.0] for _ in self.levels]
        self.draft = LinearFit()
        self.deferred_s = self.deferred_steps = 0.0  # decayed sums: deferred draft seconds, level-0 steps covered
        self.explore_every = self.explore_base = explore_every
        self.max_explore_every = max_explore_every
        self._trial = False  # the last step was a forced trial of the largest level
        self._probe: Optional[int] = None  # a chain level to try next step (the chain below it was accepted whole)
        self._probed: Optional[int] = None  # the level the last step probed
        self._probe_after: Dict[int, int] = {}  # level -> the step from which it may be probed again
        self._measured_at = 0  # the step count at the last acceptance measurement
        self.steps = 0
        self.since_top = 0
        self.chosen: Dict[int, int] = {}

    def expected_tokens(self, i: int) -> float:
        """Expected tokens per row per step at level i (accepted drafts + the target's own token)."""
        e = p = 1.0
        for d in range(1, self.depths[i] + 1):
            p *= self.succ[i][d] / self.trials[i][d]
            e += p
        return e

    def predicted_rate(self, b: int, i: int, verify_s: Optional[float] = None) -> float:
        """Predicted tokens per second of a b-row step at level i (``verify_s``: its :meth:`verify_costs` entry,
        when the caller has them)."""
        t = (self.verify_costs(b)[i] if verify_s is None else verify_s) + self.forwards[i] * self.draft.predict(b)
        if self.levels[i] == 0:
            t += self.deferred_per_step()
        return b * self.expected_tokens(i) / t if t > 0 else float("inf")

    def verify_seconds(self, b: int, i: int) -> float:
        """Predicted verify time of a b-row step at level i: the shared line, scaled by how the level's own steps
        compared with it. A line through mostly small steps (a long spell at level 0) can badly misjudge a step
        five times as wide; without the level's own measurements it would then lock the controller out of it."""
        x = b * (1 + self.levels[i])
        w, wx, wy = self.own[i]
        shared = self.verify.predict(x)
        if w <= 0:
            return shared
        at = self.verify.predict(wx / w)
        return shared * min(4.0, max(0.25, (wy / w) / at)) if at > 0 else shared

    def verify_costs(self, b: int) -> List[float]:
        """Predicted verify time of a b-row step at every level: :meth:`verify_seconds`, but never below that of a
        smaller level measured by its own steps (one pass over the levels). Verifying more nodes is not cheaper,
        and where the levels' timings differ by noise alone (a draft whose deeper tokens are never accepted) the
        smaller level then wins the tie instead of the noisier one."""
        out, floor = [], 0.0
        for i in range(len(self.levels)):
            t = self.verify_seconds(b, i)
            out.append(max(t, floor))
            if self.own[i][0] > 0:
                floor = max(floor, t)
        return out

    def deferred_per_step(self) -> float:
        """Mean seconds of deferred draft work per level-0 step (0 until some was run)."""
        return self.deferred_s / self.deferred_steps if self.deferred_steps > 0 else 0.0

    def observe_deferred(self, seconds: float, steps: int) -> None:
        """Draft work that ``steps`` level-0 steps put off ran in ``seconds``."""
        if steps > 0:
            self.deferred_s = self.deferred_s * 0.9 + seconds
            self.deferred_steps = self.deferred_steps * 0.9 + steps

    def best_case_rate(self, b: int, i: int, verify_s: float) -> float:
        """Tokens per second of a b-row step at level i if every row accepted all its draft tokens."""
        t = verify_s + self.forwards[i] * self.draft.predict(b)
        return b * (1 + self.depths[i]) / t if t > 0 else float("inf")

    def choose(self, b: int) -> int:
        """The level for the next step of ``b`` rows."""
        top = len(self.levels) - 1
        if top == 0:
            return 0
        fitted = self.steps > 1 and self.verify.ready
        costs = self.verify_costs(b) if fitted else None
        best = max(range(top + 1), key=lambda j: self.predicted_rate(b, j, costs[j])) if costs else 0
        initial = self.own[top][0] == 0  # no timed step of the largest level yet: a trial is due
        trial = self.steps > 1 and (initial or self.since_top >= self.explore_every)
        if trial and costs is not None and best != top:
            # a trial that could not win even if every draft token were accepted measures nothing worth its cost
            # (a 48-node tree over 8 rows of a 135M model: one 392-token verification, 11-14 decode steps)
            trial = self.best_case_rate(b, top, costs[top]) > self.predicted_rate(b, best, costs[best])
        predicted = not trial and fitted
        if self.steps < 2:  # the fit needs two token counts: the smallest draft, then plain decoding
            i = 1 if self.steps == 0 else 0
        elif trial:
            i = top
        elif not predicted:
            i = 0
        else:
            i = best
        probe = self._probe
        if predicted and self._probed is not None and i < self._probed:  # the probe lost: not again for a while,
            self._probe_after[self._probed] = self.steps + self.explore_base  # nor the levels above it now
            probe = None
        self._probe = self._probed = None
        if predicted and probe is not None and i < probe:
            i = self._probed = probe
        i = parallel.same_on_generation_ranks([i])[0]
        if predicted and self._trial:  # the first choice after a trial: did the largest level win its place back?
            self.explore_every = self.explore_base if i == top else min(2 * self.explore_every, self.max_explore_every)
        # interval trials only: a first trial's outcome (rows' first drafting steps) does not stretch the interval
        self._trial = trial and i == top and not initial
        self.steps += 1
        self.since_top = 0 if i == top else self.since_top + 1
        self.chosen[i] = self.chosen.get(i, 0) + 1
        return i

    def observe(self, b: int, level: int, tree: Any, res: Any, draft_s: float, verify_s: float,
                timed: bool = True) -> None:
        """Learn from one step: its timings (unless ``timed`` is False: something else ran inside them) and every
        row's accepted length."""
        n = tree.tokens.shape[1]
        self._probe = None
        if timed:
            self.verify.add(b * (1 + n), verify_s)
            own, d = self.own[level], self.verify.decay
            own[:] = [own[0] * d + 1.0, own[1] * d + b * (1 + n), own[2] * d + verify_s]
            if self.forwards[level] > 0 and draft_s > 0:
                self.draft.add(b, draft_s / self.forwards[level])
        elif level == len(self.levels) - 1:
            self.since_top = self.explore_every  # the trial measured nothing: try the largest level again next step
        if self.levels[level] == 0:
            return
        chain = tree.max_children is not None and tree.max_children <= 1
        # forget by steps elapsed, not by measurements: after a long spell of plain decoding a trial's fresh counts
        # outweigh the old ones (a draft that starts to pay is noticed within a trial or two)
        f = self.decay ** max(1, self.steps - self._measured_at)
        self._measured_at = self.steps
        self.trials = [[t * f for t in ts] for ts in self.trials]
        self.succ = [[s * f for s in ss] for ss in self.succ]
        # a chain's acceptance at depth d holds for every chain level reaching d; a tree's for its own level only
        updated = [j for j in range(1, len(self.levels)) if chain or j == level]
        sizes = [tree.sizes[r] if tree.sizes is not None else n for r in range(len(res.paths))]
        up = level + 1
        if (chain and up < len(self.levels) and self.depths[up] > self.depths[level]
                and self.steps >= self._probe_after.get(up, 0) and max(sizes) >= self.depths[level]
                and all(len(p) - 1 >= size for p, size in zip(res.paths, sizes))):
            self._probe = up  # every row accepted its whole chain, one as deep as the level: measure deeper next step
        for path, size in zip(res.paths, sizes):
            if size == 0:
                continue
            depth = min(size, self.depths[level]) if chain else self.depths[level]
            m = len(path) - 1
            for j in updated:
                for d in range(1, min(m + 1, depth, self.depths[j]) + 1):
                    self.trials[j][d] += 1
                    self.succ[j][d] += 1 if d <= m else 0

    def describe(self) -> Dict[str, Any]:
        """What it chose and believes: steps per level, acceptance per depth, the fitted costs."""
        a, c = self.verify.coefficients()
        ad, cd = self.draft.coefficients()
        top = len(self.levels) - 1
        return {"chosen": {self.levels[i]: k for i, k in sorted(self.chosen.items())},
                "acceptance_by_depth": [round(s / t, 3) for s, t in zip(self.succ[top][1:], self.trials[top][1:])],
                "expected_tokens": {self.levels[i]: round(self.expected_tokens(i), 3) for i in range(top + 1)},
                "verify_s": {"fixed": a, "per_token": c}, "draft_forward_s": {"fixed": ad, "per_row": cd},
                "deferred_draft_s_per_plain_step": self.deferred_per_step(), "trial_every": self.explore_every}
