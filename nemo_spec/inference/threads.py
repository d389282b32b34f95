"""CPU threads of the decode step's phases, chosen by timing them (option ``tune_threads``, on by default).

A decode step on a CPU is a few hundred small tensor ops around matrix-vector products whose speed is set by
memory bandwidth. Spreading such ops over more intra-op threads buys no bandwidth on some machines and costs a
thread hand-off per op: on the 2-core host of the README a one-token forward of the quickstart base takes
~8.2 ms on one thread and ~9.0 ms on two, while an 8-row step and any prefill are clearly faster on two. Which
is faster depends on the machine, the model and the number of tokens, so it is measured: for every phase of a
step (draft, verify, the proposer's update) and size bucket of up to 32 tokens, the first ``2 * trials`` calls
alternate between one thread and torch's current count, then one thread is kept for that key only if its median
is faster by ``margin`` (a noisy spell of the machine must not switch a key that gains nothing). Larger forwards (prefill chunks) never change the count. Like the small-GEMM kernel choice
(:mod:`nemo_spec.models.fastpath`), another thread count may sum a product in another order (last bits), so runs
that must be bit-reproducible across processes set ``tune_threads`` false (and ``NEMO_SPEC_SMALL_GEMM=linear``).
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

#: size buckets (tokens in the phase's forwards) that are tuned; larger phases keep torch's thread count
BUCKETS = (1, 2, 4, 8, 16, 32)


class ThreadTuner:
    """Per (phase, bucket, torch's thread count): timings of one thread vs that count, then the faster one."""

    def __init__(self, trials: int = 6, margin: float = 0.93) -> None:
        self.trials = trials
        self.margin = margin
        self.times: Dict[Tuple[Any, ...], Dict[int, List[float]]] = {}
        self.choice: Dict[Tuple[Any, ...], int] = {}

    @staticmethod
    def key(phase: Tuple[Any, ...], tokens: int, threads: int) -> Optional[Tuple[Any, ...]]:
        """The tuning key of a phase of ``tokens`` tokens, or None when it is not tuned (large, or one thread)."""
        if threads <= 1:
            return None
        bucket = next((b for b in BUCKETS if tokens <= b), None)
        return None if bucket is None else (*phase, bucket, threads)

    def pick(self, key: Tuple[Any, ...]) -> int:
        """The thread count to run ``key`` with now: the choice once made, else the less-timed candidate."""
        chosen = self.choice.get(key)
        if chosen is not None:
            return chosen
        t = self.times.setdefault(key, {1: [], key[-1]: []})
        return 1 if len(t[1]) <= len(t[key[-1]]) else key[-1]

    def record(self, key: Tuple[Any, ...], threads: int, seconds: float) -> None:
        """One timing; decides the key once both candidates have ``trials`` timings."""
        if key in self.choice:
            return
        t = self.times[key]
        t[threads].append(seconds)
        if all(len(v) >= self.trials for v in t.values()):
            med = {k: sorted(v)[len(v) // 2] for k, v in t.items()}
            self.choice[key] = 1 if med[1] < self.margin * med[key[-1]] else key[-1]

    @contextlib.contextmanager
    def run(self, phase: Tuple[Any, ...], tokens: int) -> Iterator[None]:
        """Run the body with the thread count chosen for (phase, tokens), timing it while undecided."""
        n = torch.get_num_threads()
        key = self.key(phase, tokens, n)
        if key is None:
            yield
            return
        threads = self.pick(key)
        if threads != n:
            torch.set_num_threads(threads)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            if threads != n:
                torch.set_num_threads(n)
        self.record(key, threads, dt)

    def describe(self) -> Dict[str, int]:
        """Decided keys as 'phase/.../tokens<=B@N threads' -> chosen thread count."""
        return {"/".join(str(k) for k in key[:-2]) + f"/tokens<={key[-2]}@{key[-1]} threads": v
                for key, v in self.choice.items()}
