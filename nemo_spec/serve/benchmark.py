"""Serving throughput: completion tokens/s at several numbers of concurrent streaming clients vs sequential requests."""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from dataclasses import asdict, dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

log = logging.getLogger(__name__)

DEFAULT_PROMPTS = (
    "def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def __init__(self):", "for i in range(10):",
    "with open(path) as f:", "def main():\n    args =", "if __name__ == '__main__':", "try:\n    import json",
)


@dataclass
class LevelResult:
    """Throughput at one concurrency level."""

    concurrency: int
    requests: int
    completion_tokens: int
    elapsed_s: float
    tokens_per_s: float
    mean_ttft_s: float
    mean_latency_s: float
    speedup_vs_sequential: float = 1.0


async def _one(client: Any, model: str, prompt: str, max_tokens: int, chat: bool) -> tuple[int, float, float]:
    t0 = time.perf_counter()
    ttft: Optional[float] = None
    tokens = 0
    common = dict(model=model, max_tokens=max_tokens, temperature=0.0, stream=True,
                  stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    if chat:
        stream = await client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **common)
    else:
        stream = await client.completions.create(prompt=prompt, **common)
    async for chunk in stream:
        if chunk.choices and ttft is None:
            piece = chunk.choices[0].delta.content if chat else chunk.choices[0].text
            if piece:
                ttft = time.perf_counter() - t0
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return tokens, ttft if ttft is not None else time.perf_counter() - t0, time.perf_counter() - t0


async def _level(base_url: str, api_key: str, model: str, prompts: Sequence[str], concurrency: int, requests: int,
                 max_tokens: int, chat: bool) -> LevelResult:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=600)
    queue: asyncio.Queue = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(prompts[i % len(prompts)])
    out: List[tuple[int, float, float]] = []

    async def worker() -> None:
        while True:
            try:
                p = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            out.append(await _one(client, model, p, max_tokens, chat))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - t0
    await client.close()
    tokens = sum(o[0] for o in out)
    return LevelResult(concurrency, requests, tokens, elapsed, tokens / elapsed if elapsed > 0 else 0.0,
                       sum(o[1] for o in out) / len(out), sum(o[2] for o in out) / len(out))


def _run_level(*args: Any) -> LevelResult:
    return asyncio.run(_level(*args))


def run_benchmark(base_url: str, model: str, levels: Sequence[int] = (1, 4, 8, 16), requests: Optional[int] = None,
                  max_tokens: int = 64, prompts: Sequence[str] = DEFAULT_PROMPTS, api_key: str = "EMPTY",
                  chat: bool = False, warmup: bool = True, client_process: bool = False) -> List[LevelResult]:
    """Measure throughput at each concurrency level (each runs ``requests`` streams, default 2x the level, >= 8);
    level 1 is the sequential baseline the speed-ups are relative to. ``client_process`` runs the clients in a
    separate (spawned) process, so they do not compete for the GIL with a server running in this process."""
    if not levels or any(c < 1 for c in levels):
        raise ValueError(f"levels must be positive integers, got {list(levels)}")
    levels = sorted(set(levels) | {1})
    pool = None
    if client_process:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    run = (lambda *a: pool.submit(_run_level, *a).result()) if pool is not None else _run_level
    try:
        if warmup:
            run(base_url, api_key, model, list(prompts), 1, 1, min(max_tokens, 8), chat)
        results = []
        for c in levels:
            n = requests or max(8, 2 * c)
            results.append(run(base_url, api_key, model, list(prompts), c, n, max_tokens, chat))
    finally:
        if pool is not None:
            pool.shutdown()
    for r in results:
        c = r.concurrency
        log.info("concurrency %d: %d tokens in %.2fs = %.1f tok/s", c, r.completion_tokens, r.elapsed_s,
                 r.tokens_per_s)
    base = results[0].tokens_per_s
    for r in results:
        r.speedup_vs_sequential = r.tokens_per_s / base if base > 0 else 0.0
    return results


def format_table(results: Sequence[LevelResult]) -> str:
    """A plain-text table of the results."""
    rows = ["concurrency  requests  tokens  seconds  tok/s    ttft_s  latency_s  x_sequential"]
    for r in results:
        rows.append(f"{r.concurrency:>11}  {r.requests:>8}  {r.completion_tokens:>6}  {r.elapsed_s:>7.2f}  "
                    f"{r.tokens_per_s:>7.1f}  {r.mean_ttft_s:>6.3f}  {r.mean_latency_s:>9.3f}  "
                    f"{r.speedup_vs_sequential:>12.2f}")
    return "\n".join(rows)


def results_dict(results: Sequence[LevelResult]) -> List[Dict[str, Any]]:
    """JSON-ready results."""
    return [asdict(r) for r in results]


# ---------------------------------------------------------------- Poisson arrivals (issue #15)

@dataclass
class PoissonResult:
    """One scheduler at one arrival rate: throughput, time to first token and inter-token latency percentiles."""

    scheduler: str
    rate: float
    requests: int
    completion_tokens: int
    elapsed_s: float
    tokens_per_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    itl_p50_s: float
    itl_p99_s: float
    clients: int = 0  # 0: open loop (arrivals regardless of responses); N: N closed-loop clients
    rounds: int = 1  # the same arrivals replayed this many times, alternating with the other schedulers


def _pct(xs: Sequence[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))]


async def _timed(client: Any, model: str, prompt: str, max_tokens: int,
                 reached: Optional[Tuple[int, "asyncio.Event"]] = None) -> tuple:
    """One streamed request: (tokens, ttft, gaps between content chunks per token); ``reached`` = (n, event): set
    the event once n content chunks have streamed."""
    t0 = time.perf_counter()
    ttft: Optional[float] = None
    last = t0
    gaps: List[float] = []
    tokens = 0
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            now = time.perf_counter()
            if ttft is None:
                ttft = now - t0
            else:
                gaps.append(now - last)
            last = now
            if reached is not None and len(gaps) + 1 >= reached[0]:
                reached[1].set()
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    if reached is not None:
        reached[1].set()
    return tokens, ttft if ttft is not None else time.perf_counter() - t0, gaps


def _arrivals(rate: float, requests: int, max_tokens: Any, rng: Any) -> Tuple[List[float], List[int]]:
    """``requests`` exponential gaps at ``rate`` per second and their request budgets (see :func:`_poisson`)."""
    gaps, budgets = [], []
    for _ in range(requests):
        gaps.append(rng.expovariate(rate))
        budgets.append(rng.randint(*max_tokens) if isinstance(max_tokens, (tuple, list)) else int(max_tokens))
    return gaps, budgets


async def _poisson(base_url: str, model: str, prompts: Sequence[str], rate: float, requests: int, max_tokens: Any,
                   seed: int, clients: int = 0) -> tuple:
    """``requests`` streamed requests; ``max_tokens`` an int, or (lo, hi): each request's budget drawn uniformly
    from [lo, hi]. Seeded: the same gaps and budgets for every scheduler.

    ``clients`` = 0 (open loop): the requests arrive at Poisson times at ``rate`` per second whatever the server
    does, so in-flight requests pile up without bound once the offered load exceeds what it decodes.
    ``clients`` = N (closed loop): N clients, each sending its next request an exponential think time after its
    previous response has ended (mean N / ``rate``: ``rate`` requests per second in all while responses are quick),
    so at most N requests are in flight and a slower server is offered less; client c sends requests c, c + N, ...
    with their own pre-drawn think times and budgets.

    Returns ([(tokens, ttft, gaps, sent at, ended at) per request, seconds from the start], elapsed seconds)."""
    import random

    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="EMPTY", max_retries=0, timeout=600)
    gaps, budgets = _arrivals(rate / clients if clients > 0 else rate, requests, max_tokens, random.Random(seed))
    out: List[Any] = [None] * requests
    t0 = time.perf_counter()

    async def sent(i: int) -> None:
        t = time.perf_counter() - t0
        out[i] = (*await _timed(client, model, prompts[i % len(prompts)], budgets[i]), t, time.perf_counter() - t0)

    if clients <= 0:
        starts = list(itertools.accumulate(gaps))

        async def one(i: int) -> None:
            await asyncio.sleep(max(0.0, starts[i] - (time.perf_counter() - t0)))
            await sent(i)

        await asyncio.gather(*(one(i) for i in range(requests)))
    else:
        async def loop(c: int) -> None:  # think time, request, think time, ...
            for i in range(c, requests, clients):
                await asyncio.sleep(gaps[i])
                await sent(i)

        await asyncio.gather(*(loop(c) for c in range(min(clients, requests))))
    elapsed = time.perf_counter() - t0
    await client.close()
    return out, elapsed


def _run_poisson(*args: Any) -> tuple:
    return asyncio.run(_poisson(*args))


@contextlib.contextmanager
def _client_pool() -> Iterator[Any]:
    """One spawned process for the benchmark's clients (no GIL contention with the in-process server)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    try:
        yield pool
    finally:
        pool.shutdown()


@contextlib.contextmanager
def _served(pool: Any, checkpoint: str, scheduler: str, method: str, options: Optional[Dict[str, Any]],
            max_batch: int, warm_prompts: Sequence[str], max_queue: int = 64,
            loaded: Optional[Dict[str, Any]] = None) -> Iterator[str]:
    """``checkpoint`` served in-process with ``scheduler``, warmed up by two short requests; yields the /v1 URL.
    ``loaded`` (a dict): reuse the model, tokenizer and draft it holds, or fill it with those loaded now. The
    few-row CPU kernels are timed for every count up to 32 whatever the scheduler (the batch scheduler's default),
    so both schedulers run the same kernels; counts already timed are not timed again."""
    from nemo_spec.models import fastpath
    from nemo_spec.serve import ModelSpec, ServeConfig
    from nemo_spec.serve.models import ModelManager
    from nemo_spec.serve.server import ServerThread

    spec = ModelSpec(name="bench", path=checkpoint, method=method, options=dict(options or {}),
                     max_batch=max_batch, scheduler=scheduler, pretune_rows=fastpath.MAX_TUNED_ROWS)
    cfg = ServeConfig(models=[spec], max_queue=max_queue)
    manager = ModelManager(cfg.max_queue, cfg.batch_wait_ms / 1000.0)
    served = manager.add(spec, **(loaded or {}))  # loads on a thread that ends (one CPU thread team per process)
    if loaded is not None and not loaded:
        loaded.update(model=served.model, tokenizer=served.tokenizer, draft_model=served.draft_model)
    server = ServerThread(cfg, manager).start()
    try:
        url = server.url + "/v1"
        pool.submit(_run_poisson, url, "bench", list(warm_prompts), 50.0, 2, 8, 0).result()
        yield url
    finally:
        server.stop()


def compare_schedulers(checkpoint: str, rates: Sequence[float] = (2.0, 4.0, 8.0), requests: int = 32,
                       max_tokens: Any = 64, method: str = "ar", options: Optional[Dict[str, Any]] = None,
                       max_batch: int = 16, schedulers: Sequence[str] = ("batch", "continuous"),
                       prompts: Sequence[str] = DEFAULT_PROMPTS, seed: int = 0,
                       clients: int = 0, rounds: int = 1) -> List[PoissonResult]:
    """Replay the same Poisson arrivals at each rate (requests per second) against ``checkpoint`` served in-process
    by each scheduler; clients run in a spawned process (no GIL contention with the server).
    ``max_tokens``: every request's budget, or (lo, hi) to draw each one uniformly (mixed lengths).
    ``clients``: 0 for open-loop arrivals, N for N closed-loop clients (see :func:`_poisson`).

    Side by side: the model is loaded once and its few-row CPU kernels are timed once for every count a step of
    either scheduler can use, then each (round, rate) serves it with every scheduler in turn, the order reversed
    every other round, so a slow spell of the machine hits both alike. ``rounds`` repeat the same arrivals; a
    scheduler's throughput is its tokens over its seconds summed over the rounds, its latency percentiles are over
    all its requests."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    loaded: Dict[str, Any] = {}
    runs: Dict[Tuple[str, float], List[Tuple[Any, float]]] = {}
    with _client_pool() as pool:
        for rnd in range(rounds):
            for rate in rates:
                for sched in (schedulers if rnd % 2 == 0 else list(schedulers)[::-1]):
                    with _served(pool, checkpoint, sched, method, options, max_batch, prompts,
                                 max(64, 2 * requests), loaded) as url:
                        out, elapsed = pool.submit(_run_poisson, url, "bench", list(prompts), float(rate), requests,
                                                   max_tokens, seed, clients).result()
                    runs.setdefault((sched, float(rate)), []).append((out, elapsed))
                    log.info("%s at %.1f req/s (round %d/%d): %.1f tok/s", sched, rate, rnd + 1, rounds,
                             sum(o[0] for o in out) / elapsed)
    results: List[PoissonResult] = []
    for sched in schedulers:
        for rate in rates:
            rs = runs[(sched, float(rate))]
            outs = [o for out, _ in rs for o in out]
            toks, elapsed = sum(o[0] for o in outs), sum(e for _, e in rs)
            ttft = [o[1] for o in outs]
            gaps = [g for o in outs for g in o[2]]
            results.append(PoissonResult(sched, float(rate), requests * rounds, toks, elapsed, toks / elapsed,
                                         _pct(ttft, 0.5), _pct(ttft, 0.99), _pct(gaps, 0.5), _pct(gaps, 0.99),
                                         clients, rounds))
    return results


def format_poisson(results: Sequence[PoissonResult]) -> str:
    """Side-by-side table: every scheduler per rate, with continuous/batch ratios."""
    loops = sorted({r.clients for r in results})
    rounds = max((r.rounds for r in results), default=1)
    rows = [f"arrivals: {', '.join(f'{c} closed-loop clients' if c else 'open loop' for c in loops)}"
            + (f"; {rounds} rounds, schedulers alternating" if rounds > 1 else ""),
            "scheduler   rate  tok/s   ttft_p50  ttft_p99  itl_p50  itl_p99"]
    for r in results:
        rows.append(f"{r.scheduler:<10} {r.rate:>5.1f} {r.tokens_per_s:>7.1f} {r.ttft_p50_s:>9.3f} {r.ttft_p99_s:>9.3f} "
                    f"{r.itl_p50_s:>8.4f} {r.itl_p99_s:>8.4f}")
    by = {(r.scheduler, r.rate): r for r in results}
    for rate in sorted({r.rate for r in results}):
        a, b = by.get(("continuous", rate)), by.get(("batch", rate))
        if a and b:
            rows.append(f"rate {rate:g}: continuous/batch throughput {a.tokens_per_s / b.tokens_per_s:.2f}x, "
                        f"ttft p99 {b.ttft_p99_s / a.ttft_p99_s:.1f}x lower, ttft p50 "
                        f"{b.ttft_p50_s / a.ttft_p50_s:.1f}x lower")
    return "\n".join(rows)


@dataclass
class LateResult:
    """A short request sent while a long one streams: its time to first token, in seconds and in engine steps."""

    scheduler: str
    long_tokens: int
    short_tokens: int
    delay_s: float
    idle_ttft_s: float  # the short request alone on the idle server
    late_ttft_s: float  # the short request sent ``delay_s`` into the long one
    step_s: float  # median gap between the long request's streamed chunks (one engine step each)
    late_ttft_steps: float
    extra_wait_steps: float  # (late_ttft_s - idle_ttft_s) / step_s: how long it waited behind the long request
    short_done_before_long_s: float  # how long before the long request's end the short one had finished


async def _late(base_url: str, model: str, prompt: str, long_tokens: int, short_tokens: int, delay: float,
                after_tokens: Optional[int] = None) -> tuple:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="EMPTY", max_retries=0, timeout=600)
    _, idle_ttft, _ = await _timed(client, model, prompt, short_tokens)
    t0 = time.perf_counter()
    started = asyncio.Event()

    async def long_one() -> tuple:
        out = await _timed(client, model, prompt, long_tokens, None if after_tokens is None else (after_tokens, started))
        return out, time.perf_counter() - t0

    async def short_one() -> tuple:
        if after_tokens is None:
            await asyncio.sleep(delay)
        else:
            await started.wait()
        out = await _timed(client, model, prompt, short_tokens)
        return out, time.perf_counter() - t0

    (lng, t_long), (sht, t_short) = await asyncio.gather(long_one(), short_one())
    await client.close()
    return idle_ttft, sht[1], _pct(lng[2], 0.5), t_long - t_short


def _run_late(*args: Any) -> tuple:
    return asyncio.run(_late(*args))


def late_request(checkpoint: str, long_tokens: int = 250, short_tokens: int = 4, delay_s: float = 0.4,
                 method: str = "ar", options: Optional[Dict[str, Any]] = None, max_batch: int = 16,
                 schedulers: Sequence[str] = ("batch", "continuous"),
                 prompt: str = DEFAULT_PROMPTS[0], after_tokens: Optional[int] = None) -> List[LateResult]:
    """Per scheduler: a ``long_tokens`` request, and ``delay_s`` later (``after_tokens``: once the long one has
    streamed that many tokens, whatever the machine's speed) a ``short_tokens`` one with free batch slots;
    the short one's time to first token against the idle server's and against the engine step time (the long
    request's median streaming gap). Served in-process; clients run in a spawned process."""
    results: List[LateResult] = []
    with _client_pool() as pool:
        for sched in schedulers:
            with _served(pool, checkpoint, sched, method, options, max_batch, [prompt]) as url:
                idle, late, step, before = pool.submit(_run_late, url, "bench", prompt, long_tokens, short_tokens,
                                                       delay_s, after_tokens).result()
                per = (lambda t: t / step) if step > 0 else (lambda t: float("nan"))
                results.append(LateResult(sched, long_tokens, short_tokens, delay_s, idle, late, step, per(late),
                                          per(late - idle), before))
                log.info("%s: late short request ttft %.3fs = %.1f steps (idle %.3fs)", sched, late,
                         results[-1].late_ttft_steps, idle)
    return results


def format_late(results: Sequence[LateResult]) -> str:
    """Table of the late-request measurement, one row per scheduler."""
    rows = ["scheduler   idle_ttft_s  late_ttft_s  step_s   late_ttft_steps  extra_wait_steps  "
            "short_done_before_long_s"]
    for r in results:
        rows.append(f"{r.scheduler:<10} {r.idle_ttft_s:>12.3f} {r.late_ttft_s:>12.3f} {r.step_s:>7.4f} "
                    f"{r.late_ttft_steps:>16.1f} {r.extra_wait_steps:>17.1f} {r.short_done_before_long_s:>25.2f}")
    return "\n".join(rows)
