"""Side-by-side generation benchmark: our AR and every available speculative method vs transformers generate.

For one base (+ draft) and one prompt set, measures tokens/s, tau and greedy agreement at each batch size
for: our ``ar``, ``prompt_lookup``, ``draft_model`` (with a draft GPT), ``eagle``/``eagle_tree`` (EAGLE
model) or ``medusa`` (Medusa model); and the same weights exported to Hugging Face format run through
transformers ``generate`` — plain, ``prompt_lookup_num_tokens`` and ``assistant_model`` (transformers'
assisted decoding is batch-1 only). Writes JSON, a markdown table and a PNG plot.
"""
from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from nemo_spec.fsutil import write_text_atomic
from nemo_spec.inference.generate import generate
from nemo_spec.inference.proposers import PROPOSERS
from nemo_spec.inference.proposers.common import PromptWindow
from nemo_spec.inference.sampling import SamplingError, SamplingParams
from nemo_spec.models import fastpath, gpt_forward, model_config, unwrap

log = logging.getLogger(__name__)


def available_methods(model: torch.nn.Module, draft_model: Optional[torch.nn.Module] = None) -> List[str]:
    """Methods that can run for this model (+ optional draft GPT)."""
    methods = ["ar", "prompt_lookup", "suffix"]
    if draft_model is not None:
        methods.append("draft_model")
    alg = getattr(getattr(model, "spec_config", None), "algorithm", None)
    if alg in ("eagle1", "eagle3"):
        methods += ["eagle", "eagle_tree"]
    elif alg == "medusa":
        methods.append("medusa")
    elif alg in ("peagle", "dflash"):  # one draft forward per step: the method is named after the draft
        methods += [alg, f"{alg}_tree"]
    return methods


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _chunks(items: Sequence[Any], n: int) -> List[Sequence[Any]]:
    return [items[i: i + n] for i in range(0, len(items), n)]


def run_ours(model: torch.nn.Module, prompts: List[List[int]], method: str, batch_size: int, max_new_tokens: int,
             draft_model: Optional[torch.nn.Module] = None, options: Optional[Dict[str, Any]] = None,
             warmup: bool = True, repeats: int = 1, schedule: str = "fixed") -> Dict[str, Any]:
    """Greedy generation of all prompts with our engine; returns tokens, tokens/s, tau, forwards. ``schedule``:
    ``fixed`` runs the prompts in consecutive batches of ``batch_size`` (each until its slowest row finishes),
    ``continuous`` through one session of ``batch_size`` slots (a row joins as soon as one finishes, as in the
    server)."""
    if schedule not in SCHEDULES:
        raise SamplingError(f"unknown schedule {schedule!r}; choose from {list(SCHEDULES)}")
    opts = {**(options or {}), "ignore_eos": True}
    if schedule == "continuous":
        opts["max_batch"] = batch_size
    params = SamplingParams(max_new_tokens=max_new_tokens)
    dev = next(unwrap(model).parameters()).device
    if warmup:
        generate(model, list(prompts[:batch_size]), SamplingParams(max_new_tokens=min(8, max_new_tokens)),
                 method=method, draft_model=draft_model, options=opts)
    dt = float("inf")
    for _ in range(max(1, repeats)):  # best of N: robust to noise from other processes
        tokens: List[List[int]] = []
        taus: List[float] = []
        tf = df = 0
        chosen: Dict[int, int] = {}  # draft nodes per row -> steps (what adaptive speculation chose)
        steps = 0
        draft_ms = verify_ms = prefill_s = 0.0
        _sync(dev)
        t0 = time.perf_counter()
        for chunk in (_chunks(prompts, batch_size) if schedule == "fixed" else [prompts]):
            outs = generate(model, list(chunk), params, method=method, draft_model=draft_model, options=opts)
            sess = outs[0].stats.get("session", {})
            n_dec = sess.get("decode_steps", 0)
            steps += n_dec
            draft_ms += n_dec * sess.get("draft_ms_per_step", 0.0)
            verify_ms += n_dec * sess.get("verify_ms_per_step", 0.0)
            prefill_s += sess.get("prefill_s", 0.0)
            for lv, k in sess.get("levels", {}).items():
                nodes = sess["draft_nodes_per_level"][lv]
                chosen[nodes] = chosen.get(nodes, 0) + k
            for r in outs:
                tokens.append(r.tokens)
                taus.append(r.stats["tau"])
                tf += r.stats["target_forwards"]
                df += r.stats["draft_forwards"]
        _sync(dev)
        dt = min(dt, time.perf_counter() - t0)
    n = sum(len(t) for t in tokens)
    return {"engine": "nemo_spec", "method": method, "batch_size": batch_size, "new_tokens": n, "time_s": dt,
            "tokens_per_s": n / dt, "tau": sum(taus) / len(taus), "target_forwards": tf, "draft_forwards": df,
            "tokens": tokens, "options": opts, "schedule": schedule, "draft_nodes_chosen": chosen,
            "draft_ms_per_step": draft_ms / steps if steps else None,
            "verify_ms_per_step": verify_ms / steps if steps else None,
            "prefill_s": prefill_s}


#: how our rows batch the prompts (``run_ours``): consecutive fixed batches, or one continuous-batching session
SCHEDULES = ("fixed", "continuous")
#: methods whose draft takes option draft_prompt_tokens (benchmark --draft-prompt-tokens adds their +dpt=N rows)
WINDOWED = tuple(m for m, cls in PROPOSERS.items() if issubclass(cls, PromptWindow))
#: methods whose proposer defers a level-0 step's draft work (option lazy_draft_steps; --eager-catchup rows)
LAZY_METHODS = tuple(m for m, cls in PROPOSERS.items() if cls.defers_level0)
#: methods whose option num_draft_tokens is the length of the chain they draft (benchmark --chain-lengths adds
#: their +ndt=N rows); suffix reads it as a cap on its tree's nodes, the tree methods take other options
CHAIN_METHODS = ("eagle", "draft_model", "prompt_lookup", "peagle", "dflash")


def run_hf(hf_model: Any, prompts: List[List[int]], mode: str, batch_size: int, max_new_tokens: int, pad_id: int,
           assistant: Any = None, prompt_lookup_tokens: int = 10, warmup: bool = True,
           repeats: int = 1) -> Dict[str, Any]:
    """Greedy transformers generate (mode: plain | prompt_lookup | assistant_model) over all prompts."""
    dev = hf_model.device

    def call(chunk: Sequence[List[int]], n_new: int) -> List[List[int]]:
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        att = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, p in enumerate(chunk):
            ids[i, width - len(p):] = torch.tensor(p)
            att[i, width - len(p):] = 1
        kw: Dict[str, Any] = dict(max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False, pad_token_id=pad_id)
        if mode == "prompt_lookup":
            kw["prompt_lookup_num_tokens"] = prompt_lookup_tokens
        elif mode == "assistant_model":
            kw["assistant_model"] = assistant
        with torch.no_grad():
            out = hf_model.generate(input_ids=ids.to(dev), attention_mask=att.to(dev), **kw)
        return [row[width:].tolist() for row in out]

    if warmup:
        call(prompts[:batch_size], min(8, max_new_tokens))
    dt = float("inf")
    for _ in range(max(1, repeats)):
        tokens: List[List[int]] = []
        _sync(dev)
        t0 = time.perf_counter()
        for chunk in _chunks(prompts, batch_size):
            tokens += call(chunk, max_new_tokens)
        _sync(dev)
        dt = min(dt, time.perf_counter() - t0)
    n = sum(len(t) for t in tokens)
    return {"engine": "transformers", "method": mode, "batch_size": batch_size, "new_tokens": n, "time_s": dt,
            "tokens_per_s": n / dt, "tau": None, "target_forwards": None, "draft_forwards": None, "tokens": tokens}


def _load_hf(path: Path, device: torch.device, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    # plain transformers: 5.25 turned Hub kernels on by default (fetched at run time: none offline, and on GPU other
    # kernels than the model code's); use_kernels and dtype= need transformers >= 4.56
    m = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=dtype,
                                             use_kernels=False).to(device).eval()
    m.generation_config.eos_token_id = None  # same token budget as our ignore_eos runs
    return m


def benchmark(model: torch.nn.Module, prompts: List[List[int]], draft_model: Optional[torch.nn.Module] = None,
              batch_sizes: Sequence[int] = (1, 8), max_new_tokens: int = 64, methods: Optional[Sequence[str]] = None,
              options: Optional[Dict[str, Any]] = None, hf: bool = True, work_dir: Optional[Path] = None,
              warmup: bool = True, repeats: int = 3, tree_options: Optional[Dict[str, Any]] = None,
              suffix_options: Optional[Dict[str, Any]] = None,
              warm_prompts: Optional[List[List[int]]] = None, adaptive: bool = False,
              compile_mode: Optional[str] = None,
              extra_models: Sequence[torch.nn.Module] = (), gemm_modes: Sequence[str] = (),
              schedule: str = "fixed", eager_catchup: bool = False,
              draft_prompt_tokens: Sequence[int] = (), chain_lengths: Sequence[int] = ()) -> Dict[str, Any]:
    """Run every configuration side by side, ``repeats`` rounds (best round each); returns {"rows", "summary", "config"}.

    ``options`` go to every method; ``tree_options`` (depth, top_k, total_tokens, score_temperature) only to
    ``eagle_tree`` — the chain's length is ``num_draft_tokens``, not the tree's depth; ``suffix_options`` only
    to ``suffix``. With ``warm_prompts`` (other prompts than the measured ones) a ``suffix_global`` row runs
    suffix decoding with the model's global store warmed on their outputs and frozen while measuring.
    With ``adaptive`` every speculative method (the extra models' too) also runs as ``<method>+adaptive`` (draft
    size chosen per step); with ``eager_catchup`` too, the methods that defer a level-0 step's draft work (EAGLE,
    P-EAGLE, DFlash; the extra models' too) also run adaptive with their draft caught up after every step
    (``<method>+adaptive+stepwise``: ``lazy_draft_steps=0``, level-0 steps pay their draft work, as before the
    deferred catch-up); each of ``draft_prompt_tokens`` (W) runs the EAGLE and P-EAGLE methods (extra models'
    too) once more with the draft reading only each prompt's last W pairs (``<method>+dpt=W`` rows, and
    ``<method>+adaptive+dpt=W`` with ``adaptive``); each of ``chain_lengths`` (N) runs the chain methods
    (:data:`CHAIN_METHODS`, extra models' too) once more drafting N tokens per step (``<method>+ndt=N`` rows, and
    ``<method>+adaptive+ndt=N`` with ``adaptive``: N is then the largest level);
    with ``compile_mode`` (a torch.compile mode) every method also runs as ``<method>+compiled``; each of
    ``gemm_modes`` (``linear`` | ``transposed`` | ``auto``, see ``fastpath.SMALL_GEMM``) runs every method of the
    main model once more with that small-row CPU kernel rule (``<method>+gemm=<mode>`` rows, their speed-up taken
    against ``ar+gemm=<mode>``) next to the rule in force.
    ``extra_models``: further speculative models on the same base (e.g. P-EAGLE and DFlash drafts next to an
    EAGLE-3 one); their draft methods join the same round robin (a method the main model has, or an earlier extra, gets ``@<i>``).
    ``schedule`` (see :func:`run_ours`): how our rows batch the prompts at each batch size — ``fixed`` batches or
    ``continuous`` batching over that many slots; transformers' rows always run fixed batches (``generate`` has no
    continuous batching).
    """
    if not prompts:
        raise SamplingError("benchmark needs at least one prompt")
    if any(b < 1 for b in batch_sizes):
        raise SamplingError(f"batch sizes must be >= 1, got {list(batch_sizes)}")
    _check_gemm_modes(gemm_modes)
    if any(int(n) < 1 for n in chain_lengths):
        raise SamplingError(f"chain lengths must be >= 1, got {list(chain_lengths)}")
    if schedule not in SCHEDULES:
        raise SamplingError(f"unknown schedule {schedule!r}; choose from {list(SCHEDULES)}")
    ours = functools.partial(run_ours, schedule=schedule)
    avail = available_methods(model, draft_model)
    methods = list(methods) if methods else avail
    missing = [m for m in methods if m not in avail]
    if missing:
        raise SamplingError(f"methods {missing} are not available for this model (available: {avail})")
    if "ar" not in methods:
        methods = ["ar"] + methods
    cfg = model_config(model)
    pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else 0
    jobs: List[Tuple[str, Callable[..., Dict[str, Any]]]] = []

    def variants(label: str, mdl: torch.nn.Module, m: str, b: int, draft: Optional[torch.nn.Module],
                 opts: Optional[Dict[str, Any]]) -> None:
        """Jobs for method ``m`` of ``mdl`` at batch ``b``: as given, and its adaptive / stepwise / prompt-window
        variants (labels ``label+...``)."""
        rows = [("", opts)]
        if adaptive and m != "ar":
            rows.append(("+adaptive", {**(opts or {}), "adaptive": True}))
        if adaptive and eager_catchup and m in LAZY_METHODS:
            rows.append(("+adaptive+stepwise", {**(opts or {}), "adaptive": True, "lazy_draft_steps": 0}))
        for values, takers, tag, option in ((draft_prompt_tokens, WINDOWED, "dpt", "draft_prompt_tokens"),
                                            (chain_lengths, CHAIN_METHODS, "ndt", "num_draft_tokens")):
            for v in (values if m in takers else ()):
                for ad in ((False, True) if adaptive else (False,)):
                    rows.append((f"{'+adaptive' if ad else ''}+{tag}={v}", {
                        **(opts or {}), option: int(v), **({"adaptive": True} if ad else {})}))
        for suffix, o in rows:
            jobs.append((f"nemo_spec {label}{suffix} batch {b}", functools.partial(
                _relabel, f"{label}{suffix}", ours, mdl, prompts, m, b, max_new_tokens, draft, o)))

    for b in batch_sizes:
        for m in methods:
            opts = {**(options or {}), **(tree_options or {})} if m == "eagle_tree" else options
            if m == "suffix":
                opts = {**(options or {}), **(suffix_options or {})}
            variants(m, model, m, b, draft_model, opts)
            if compile_mode:
                jobs.append((f"nemo_spec {m}+compiled batch {b}", functools.partial(
                    _relabel, f"{m}+compiled", ours, model, prompts, m, b, max_new_tokens, draft_model,
                    {**(opts or {}), "compile": compile_mode})))
            for g in gemm_modes:
                jobs.append((f"nemo_spec {m}+gemm={g} batch {b}", functools.partial(
                    _with_gemm, g, f"{m}+gemm={g}", ours, model, prompts, m, b, max_new_tokens, draft_model,
                    opts)))
            if m == "suffix" and warm_prompts:
                gopts = warm_suffix_store(model, warm_prompts, max_new_tokens, {**(options or {}),
                                                                                **(suffix_options or {})})
                jobs.append((f"nemo_spec suffix_global batch {b}", functools.partial(
                    _relabel, "suffix_global", ours, model, prompts, "suffix", b, max_new_tokens, None, gopts)))
    taken = set(avail)
    for i, extra in enumerate(extra_models, 1):
        for m in available_methods(extra):
            if m in ("ar", "prompt_lookup", "suffix"):  # model-free: the main model's rows already measure them
                continue
            label = m if m not in taken else f"{m}@{i}"
            taken.add(label)
            opts = {**(options or {}), **(tree_options or {})} if m == "eagle_tree" else options
            for b in batch_sizes:
                variants(label, extra, m, b, None, opts)
    pretune_s = pretune_models([model, draft_model, *extra_models], gemm_modes)
    with contextlib.ExitStack() as stack:
        if hf:
            jobs += _hf_jobs(stack, model, draft_model, prompts, batch_sizes, max_new_tokens, pad_id, options, work_dir)
        # Round robin: every configuration runs once per round and keeps its best round, so a slow spell of
        # the machine (other processes, memory bandwidth) hits all configurations alike instead of one of them.
        best: List[Optional[Dict[str, Any]]] = [None] * len(jobs)
        rounds = max(1, repeats)
        for rnd in range(rounds):
            for i, (label, fn) in enumerate(jobs):
                log.info("benchmark: %s (round %d/%d)", label, rnd + 1, rounds)
                r = fn(warmup=warmup and rnd == 0, repeats=1)
                if best[i] is None or r["time_s"] < best[i]["time_s"]:
                    best[i] = r
    rows = [r for r in best if r is not None]
    for r in rows:
        if r["engine"] == "nemo_spec" and r["method"] in ("suffix", "suffix_global"):
            add_proposal_cost(model, prompts, r)
    return summarize(rows, {"max_new_tokens": max_new_tokens, "num_prompts": len(prompts),
                            "batch_sizes": list(batch_sizes), "methods": methods, "repeats": repeats,
                            "options": options or {}, "tree_options": tree_options or {},
                            "suffix_options": suffix_options or {}, "warm_prompts": len(warm_prompts or []),
                            "adaptive": adaptive, "eager_catchup": eager_catchup, "compile": compile_mode,
                            "draft_prompt_tokens": [int(w) for w in draft_prompt_tokens],
                            "chain_lengths": [int(n) for n in chain_lengths],
                            "schedule": schedule,
                            "small_gemm": fastpath.SMALL_GEMM, "gemm_modes": list(gemm_modes),
                            "pretune_s": pretune_s,
                            "device": str(next(unwrap(model).parameters()).device),
                            "dtype": str(next(unwrap(model).parameters()).dtype)})


def time_forwards(model: torch.nn.Module, rows: Sequence[int], modes: Sequence[str] = ("linear", "auto"),
                  context: int = 256, calls: int = 5, rounds: int = 5, seed: int = 0) -> List[Dict[str, Any]]:
    """One cached target forward of ``n`` new tokens (a chain after ``context`` cached tokens: a decode step at
    n = 1, a verification block above) per row count and small-row kernel rule, rounds alternating between the
    rules; returns [{rows, mode, ms}] with the median of ``rounds`` means over ``calls`` forwards each."""
    import statistics

    from nemo_spec.inference.proposers.common import chain_block
    from nemo_spec.models import new_kv_cache

    if not modes:
        raise SamplingError(f"time_forwards needs at least one small-row kernel mode of {list(GEMM_MODES)}")
    _check_gemm_modes(modes)
    if not rows or min(rows) < 1 or context < 1:
        raise SamplingError(f"--forward-rows must be >= 1 and the context >= 1, got {list(rows)} and {context}")
    target = unwrap(model)
    cfg = model_config(model)
    if context + max(rows) > cfg.max_position_embeddings:
        raise SamplingError(f"context {context} + {max(rows)} rows exceeds the model context "
                            f"{cfg.max_position_embeddings}")
    fastpath.register(model)
    dev = next(target.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    cache = new_kv_cache(target, batch_size=1, max_len=context + max(rows))

    def forward(n: int, cached: int) -> None:
        ids = torch.randint(0, cfg.vocab_size, (1, n), generator=gen).to(dev)
        ctx = chain_block(cache, ids, torch.ones(1, n, dtype=torch.bool, device=dev), cfg.max_position_embeddings,
                          max_length=cached)
        gpt_forward(target, ids, ctx)

    times: Dict[Tuple[int, str], List[float]] = {}
    with torch.no_grad():
        forward(context, 0)
        cache.lengths += context
        for n in rows:  # first use of each row count (kernel timing) outside the measurement
            for mode in modes:
                with fastpath.small_gemm_rule(mode):
                    forward(n, context)
        for _ in range(max(1, rounds)):
            for n in rows:
                for mode in modes:
                    with fastpath.small_gemm_rule(mode):
                        _sync(dev)
                        t0 = time.perf_counter()
                        for _ in range(max(1, calls)):
                            forward(n, context)
                        _sync(dev)
                    times.setdefault((n, mode), []).append((time.perf_counter() - t0) / max(1, calls))
    return [{"rows": n, "mode": mode, "ms": 1e3 * statistics.median(times[(n, mode)])} for n in rows for mode in modes]


def forwards_markdown(res: List[Dict[str, Any]]) -> str:
    """Table of :func:`time_forwards`: ms per forward for each rule and each rule's speed-up over the first."""
    modes = list(dict.fromkeys(r["mode"] for r in res))
    by = {(r["rows"], r["mode"]): r["ms"] for r in res}
    cols = [f"{m} ms" for m in modes] + [f"{m} vs {modes[0]}" for m in modes[1:]]
    lines = ["| rows | " + " | ".join(cols) + " |", "|---:|" + "---:|" * len(cols)]
    for n in dict.fromkeys(r["rows"] for r in res):
        ms = [by[(n, m)] for m in modes]
        cells = [f"{t:.2f}" for t in ms] + [f"{ms[0] / t:.2f}x" for t in ms[1:]]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _relabel(method: str, fn: Callable[..., Dict[str, Any]], *args: Any, **kw: Any) -> Dict[str, Any]:
    return {**fn(*args, **kw), "method": method}


#: small-row CPU kernel rules a benchmark can put side by side (``--gemm``; see ``fastpath.SMALL_GEMM``)
GEMM_MODES = ("linear", "transposed", "skinny", "auto")


def _check_gemm_modes(modes: Sequence[str]) -> None:
    """SamplingError naming any mode that is not one of :data:`GEMM_MODES`."""
    bad = [g for g in modes if g not in GEMM_MODES]
    if bad:
        raise SamplingError(f"unknown small-row kernel modes {bad}; choose from {list(GEMM_MODES)}")


def _with_gemm(mode: str, method: str, fn: Callable[..., Dict[str, Any]], *args: Any, **kw: Any) -> Dict[str, Any]:
    """``fn`` run with the fast path's small-row kernel rule set to ``mode`` (restored after), relabelled."""
    with fastpath.small_gemm_rule(mode):
        return _relabel(method, fn, *args, **kw)


#: Outputs the global suffix store holds in the benchmark's suffix_global row (unless suffix options say).
BENCH_GLOBAL_CACHE = 256


def pretune_models(models: Sequence[Optional[torch.nn.Module]], gemm_modes: Sequence[str] = ()) -> float:
    """Time the few-row CPU kernels of every model for every row count a step can use (``fastpath.pretune``)
    before any timed round, as the server does at load: otherwise a configuration's first round — and an
    adaptive controller's first observations — would include the pauses of timing each new row count. Covers
    the rule in force and ``auto`` in ``gemm_modes``; a no-op under the fixed rules. Returns the seconds spent."""
    t0 = time.perf_counter()
    n = 0
    if fastpath.SMALL_GEMM == "auto" or "auto" in gemm_modes:  # the fixed rules time nothing
        with fastpath.small_gemm_rule("auto"):
            n = sum(fastpath.pretune(m) for m in models if m is not None)
    dt = time.perf_counter() - t0
    if n:
        log.info("benchmark: few-row CPU kernels timed for 1-%d rows in %.1fs", fastpath.MAX_TUNED_ROWS, dt)
    return dt


def warm_suffix_store(model: torch.nn.Module, warm_prompts: List[List[int]], max_new_tokens: int,
                      options: Dict[str, Any]) -> Dict[str, Any]:
    """Fill the model's global suffix store with greedy outputs for ``warm_prompts``; returns the frozen options."""
    from nemo_spec.inference.proposers.suffix import DEFAULT_MAX_DEPTH, global_store

    opts = {"global_cache": BENCH_GLOBAL_CACHE, **options, "ignore_eos": True, "global_update": True}
    store = global_store(model, opts["global_cache"], opts.get("max_depth", DEFAULT_MAX_DEPTH))
    store.clear()
    t0 = time.perf_counter()
    for p in warm_prompts:  # one request at a time, as a server would have served them
        generate(model, [p], SamplingParams(max_new_tokens=max_new_tokens), method="suffix", options=opts)
    log.info("benchmark: global suffix store warmed on %d other prompts in %.1f s (%d outputs, %d nodes)",
             len(warm_prompts), time.perf_counter() - t0, len(store), store.trie.num_nodes())
    return {**opts, "global_update": False}


def add_proposal_cost(model: torch.nn.Module, prompts: List[List[int]], row: Dict[str, Any]) -> None:
    """Replay a suffix row's outputs through the proposer: its time per step next to the row's verify step."""
    from nemo_spec.inference.proposers.suffix import replay_cost

    opts = row.get("options") or {}
    cost = replay_cost(model, prompts, row["tokens"], opts)
    row["propose_ms_per_step"] = cost["propose_ms_per_step"]
    row["prompt_index_ms"] = 1e3 * cost["prefill_s"] / max(len(prompts), 1)
    row["step_ms"] = 1e3 * row["time_s"] / max(row["target_forwards"], 1)


def _hf_jobs(stack: contextlib.ExitStack, model: torch.nn.Module, draft_model: Optional[torch.nn.Module],
             prompts: List[List[int]], batch_sizes: Sequence[int], max_new_tokens: int, pad_id: int,
             options: Optional[Dict[str, Any]], work_dir: Optional[Path]) -> List[Tuple[str, Callable[..., Dict]]]:
    """Export the same weights to Hugging Face format (in a temp dir kept open by ``stack``); transformers jobs."""
    dev = next(unwrap(model).parameters()).device
    dtype = next(unwrap(model).parameters()).dtype
    from nemo_spec.checkpoint.hf import export_hf

    if work_dir is not None:
        Path(work_dir).mkdir(parents=True, exist_ok=True)
    tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(dir=work_dir)))
    hf_model = _load_hf(export_hf(unwrap(model), tmp / "base", dtype=dtype), dev, dtype)
    jobs = [(f"transformers plain batch {b}",
             functools.partial(run_hf, hf_model, prompts, "plain", b, max_new_tokens, pad_id)) for b in batch_sizes]
    k = int((options or {}).get("num_draft_tokens", 10))
    jobs.append(("transformers prompt_lookup batch 1", functools.partial(
        run_hf, hf_model, prompts, "prompt_lookup", 1, max_new_tokens, pad_id, prompt_lookup_tokens=k)))
    if draft_model is not None:
        assistant = _load_hf(export_hf(unwrap(draft_model), tmp / "draft", dtype=dtype), dev, dtype)
        jobs.append(("transformers assistant_model batch 1", functools.partial(
            run_hf, hf_model, prompts, "assistant_model", 1, max_new_tokens, pad_id, assistant)))
    return jobs


def _our_row(rows: List[Dict[str, Any]], method: str, batch_size: int) -> Optional[Dict[str, Any]]:
    """Our row of ``method`` at ``batch_size``, if this run measured it."""
    return next((x for x in rows if x["engine"] == "nemo_spec" and x["method"] == method
                 and x["batch_size"] == batch_size), None)


def summarize(rows: List[Dict[str, Any]], config: Dict[str, Any]) -> Dict[str, Any]:
    """Add speedups vs our AR at the same batch size and agreement with our batch-1 AR tokens."""
    ar = {r["batch_size"]: r for r in rows if r["engine"] == "nemo_spec" and r["method"] == "ar"}
    ref = ar[min(ar)]["tokens"] if ar else None
    for r in rows:
        base = ar.get(r["batch_size"]) or (ar[min(ar)] if ar else None)
        if "+gemm=" in r["method"]:  # against our AR under the same kernel rule, where it ran
            base = _our_row(rows, "ar+" + r["method"].partition("+")[2], r["batch_size"]) or base
        r["speedup_vs_ar"] = r["tokens_per_s"] / base["tokens_per_s"] if base else None
        if ref is not None:
            r["matches_ar"] = sum(a == b for a, b in zip(r["tokens"], ref)) / len(ref)
    summary: Dict[str, Any] = {}
    for b, r in ar.items():
        hf_plain = next((x for x in rows if x["engine"] == "transformers" and x["method"] == "plain"
                         and x["batch_size"] == b), None)
        if hf_plain:
            summary[f"ar_vs_transformers_b{b}"] = r["tokens_per_s"] / hf_plain["tokens_per_s"]
        spec = [x for x in rows if x["engine"] == "nemo_spec" and x["method"].split("+")[0] != "ar"
                and "+gemm=" not in x["method"] and x["batch_size"] == b]
        if spec:
            best = max(spec, key=lambda x: x["tokens_per_s"])
            summary[f"best_speculative_b{b}"] = {"method": best["method"], "speedup_vs_ar": best["speedup_vs_ar"]}
            hf_b = [x for x in rows if x["engine"] == "transformers" and x["batch_size"] == b]
            if hf_b:  # our best method against transformers' best (plain, prompt lookup, assisted) at this batch
                summary[f"best_vs_transformers_best_b{b}"] = (
                    best["tokens_per_s"] / max(x["tokens_per_s"] for x in hf_b))
        hf_b = [x for x in rows if x["engine"] == "transformers" and x["batch_size"] == b]
        if hf_b:  # the best of all our methods, plain decoding included, against transformers' best
            ours = max([r] + spec, key=lambda x: x["tokens_per_s"])
            theirs = max(hf_b, key=lambda x: x["tokens_per_s"])
            summary[f"best_method_vs_transformers_best_b{b}"] = {
                "ours": ours["method"], "theirs": theirs["method"],
                "ratio": ours["tokens_per_s"] / theirs["tokens_per_s"]}
    for r in rows:  # the compiled decode step / another kernel rule next to the default (same method, batch, run)
        if r["engine"] != "nemo_spec" or not (r["method"].endswith("+compiled") or "+gemm=" in r["method"]):
            continue
        m, _, variant = r["method"].partition("+")
        eager = _our_row(rows, m, r["batch_size"])
        if eager is None:
            continue
        if variant == "compiled":
            summary[f"{m}_compiled_vs_eager_b{r['batch_size']}"] = r["tokens_per_s"] / eager["tokens_per_s"]
        else:  # how much faster the rule in force is than this one
            summary[f"{m}_vs_{variant}_b{r['batch_size']}"] = eager["tokens_per_s"] / r["tokens_per_s"]
    return {"config": config, "rows": rows, "summary": summary, "targets": check_targets(rows, summary)}


# What the out-of-the-box report is held against (batch 1): EAGLE-2 tree acceptance, EAGLE wall-clock speedup,
# and our plain decoding against transformers on the same weights.
TARGET_TREE_TAU = 3.5
TARGET_EAGLE_SPEEDUP = 2.0
TARGET_AR_VS_TRANSFORMERS = 1.0
# Issue #19: the best of our methods (plain decoding included) against transformers' best (plain / prompt lookup).
TARGET_BEST_VS_TRANSFORMERS_BEST = 1.5
# Suffix decoding (issue #18): tokens/s against our and transformers' prompt lookup, proposal cost per step.
TARGET_SUFFIX_VS_PROMPT_LOOKUP = 1.25
TARGET_SUFFIX_VS_HF_PROMPT_LOOKUP = 1.6
TARGET_SUFFIX_PROPOSE_FRACTION = 0.10


def check_targets(rows: List[Dict[str, Any]], summary: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Batch-1 numbers against the targets, for the configurations this run measured: [{name, value, target, met}]."""
    b1 = [r for r in rows if r["engine"] == "nemo_spec" and r["batch_size"] == 1]
    out: List[Dict[str, Any]] = []

    def add(name: str, value: float, target: float, op: str = ">=") -> None:
        met = value >= target if op == ">=" else value <= target
        out.append({"name": name, "value": float(value), "target": target, "met": bool(met), "op": op})

    tree = next((r for r in b1 if r["method"] == "eagle_tree"), None)
    if tree is not None:
        add("EAGLE tree tau", tree["tau"], TARGET_TREE_TAU)
    eagle = [r for r in b1 if r["method"] in ("eagle", "eagle_tree") and r.get("speedup_vs_ar") is not None]
    if eagle:
        best = max(eagle, key=lambda r: r["speedup_vs_ar"])
        add(f"EAGLE ({best['method']}) tokens/s vs our AR", best["speedup_vs_ar"], TARGET_EAGLE_SPEEDUP)
    if "ar_vs_transformers_b1" in summary:
        add("our AR tokens/s vs transformers generate", summary["ar_vs_transformers_b1"], TARGET_AR_VS_TRANSFORMERS)
    best = summary.get("best_method_vs_transformers_best_b1")
    if best is not None:
        add(f"our best method ({best['ours']}) tokens/s vs transformers' best ({best['theirs']})", best["ratio"],
            TARGET_BEST_VS_TRANSFORMERS_BEST)
    pl = next((r for r in b1 if r["method"] == "prompt_lookup"), None)
    hf_pl = next((r for r in rows if r["engine"] == "transformers" and r["method"] == "prompt_lookup"), None)
    ar = next((r for r in b1 if r["method"] == "ar"), None)
    for r in b1:
        if r["method"] not in ("suffix", "suffix_global"):
            continue
        if pl is not None:
            add(f"{r['method']} tokens/s vs our prompt_lookup", r["tokens_per_s"] / pl["tokens_per_s"],
                TARGET_SUFFIX_VS_PROMPT_LOOKUP)
        if hf_pl is not None:
            add(f"{r['method']} tokens/s vs transformers prompt_lookup", r["tokens_per_s"] / hf_pl["tokens_per_s"],
                TARGET_SUFFIX_VS_HF_PROMPT_LOOKUP)
        if ar is not None and r.get("propose_ms_per_step") is not None:
            add(f"{r['method']} proposal time per step / our AR decode step",
                r["propose_ms_per_step"] / (1e3 / ar["tokens_per_s"]), TARGET_SUFFIX_PROPOSE_FRACTION, "<=")
    return out


def to_markdown(result: Dict[str, Any]) -> str:
    """Markdown table of the benchmark rows plus the summary ratios."""
    lines = ["| engine | method | batch | tokens/s | tau | draft ms/step | verify ms/step | prefill s "
             "| speedup vs our AR | matches our AR |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        tau = f"{r['tau']:.2f}" if r.get("tau") is not None else "-"
        sp = f"{r['speedup_vs_ar']:.2f}x" if r.get("speedup_vs_ar") is not None else "-"
        ma = f"{100 * r['matches_ar']:.0f}%" if r.get("matches_ar") is not None else "-"
        dm, vm = (f"{r[k]:.2f}" if r.get(k) is not None else "-" for k in ("draft_ms_per_step", "verify_ms_per_step"))
        pf = f"{r['prefill_s']:.3f}" if r.get("prefill_s") is not None else "-"
        lines.append(f"| {r['engine']} | {r['method']} | {r['batch_size']} | {r['tokens_per_s']:.1f} | {tau} | {dm} "
                     f"| {vm} | {pf} | {sp} | {ma} |")
    lines.append("")
    for k, v in result["summary"].items():
        if isinstance(v, dict) and "ratio" in v:
            lines.append(f"- {k}: our {v['ours']} at {v['ratio']:.2f}x transformers' {v['theirs']}")
        elif isinstance(v, dict):
            lines.append(f"- {k}: {v['method']} at {v['speedup_vs_ar']:.2f}x our AR")
        else:
            lines.append(f"- {k}: {v:.2f}x")
    for t in result.get("targets", []):
        lines.append(f"- target at batch 1: {t['name']} {t.get('op', '>=')} {t['target']:g}: {t['value']:.2f} "
                     f"({'met' if t['met'] else 'NOT met'})")
    for r in result["rows"]:
        if r.get("propose_ms_per_step") is not None:
            lines.append(f"- {r['method']} batch {r['batch_size']}: proposal {r['propose_ms_per_step']:.3f} ms per step, "
                         f"prompt indexing {r['prompt_index_ms']:.2f} ms per prompt, "
                         f"{r['step_ms']:.2f} ms per target forward")
    for r in result["rows"]:
        if "+adaptive" in r["method"] and r.get("draft_nodes_chosen"):
            ch = ", ".join(f"{k} nodes: {v}" for k, v in sorted(r["draft_nodes_chosen"].items()))
            lines.append(f"- {r['method']} batch {r['batch_size']} chose (steps per draft size): {ch}")
    c = result["config"]
    sched = "; our rows: continuous batching over <batch> slots" if c.get("schedule") == "continuous" else ""
    lines.append(f"- {c['num_prompts']} prompts, {c['max_new_tokens']} new tokens each, greedy, {c['device']} "
                 f"{c['dtype']}{sched}")
    return "\n".join(lines) + "\n"


def plot(result: Dict[str, Any], path: Path) -> Path:
    """Bar chart of tokens/s per configuration, grouped by batch size (PNG, written atomically)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    labels = [f"{'ours' if r['engine'] == 'nemo_spec' else 'HF'}:{r['method']}\nb={r['batch_size']}" for r in rows]
    colors = ["tab:blue" if r["engine"] == "nemo_spec" else "tab:orange" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(rows)), 4.5))
    ax.bar(range(len(rows)), [r["tokens_per_s"] for r in rows], color=colors)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("tokens / s")
    ax.set_title("generation throughput (blue: nemo_spec, orange: transformers)")
    fig.tight_layout()
    path = Path(path)
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
    return path


def write_outputs(result: Dict[str, Any], out_dir: Path) -> Dict[str, Path]:
    """Write benchmark.json, benchmark.md and benchmark.png into out_dir (atomically)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, text in [("benchmark.json", json.dumps(result, indent=2)), ("benchmark.md", to_markdown(result))]:
        paths[name] = write_text_atomic(out_dir / name, text)
    paths["benchmark.png"] = plot(result, out_dir / "benchmark.png")
    return paths


def default_prompts(n: int, max_prompt_chars: int = 1200) -> List[str]:
    """Held-out code-completion prompts from the local stdlib corpus (the built-in base model's domain)."""
    from nemo_spec.base.corpus import heldout_samples, load_corpus

    return [s.prompt for s in heldout_samples(load_corpus(), n=n, max_prompt_chars=max_prompt_chars)]


def build_parser():
    """Argument parser of scripts/benchmark.py."""
    import argparse

    p = argparse.ArgumentParser(description="Benchmark AR and speculative decoding (ours) against transformers "
                                            "generate on the same weights.")
    p.add_argument("--model", required=True, help="checkpoint dir (base GPT, or an EAGLE/Medusa speculative model)")
    p.add_argument("--draft-model", default=None, help="smaller GPT checkpoint (draft_model + HF assistant_model)")
    p.add_argument("--extra-models", nargs="+", default=[],
                   help="further speculative checkpoints on the same base (e.g. P-EAGLE / DFlash next to EAGLE-3): "
                        "their draft methods run in the same round robin")
    p.add_argument("--tokenizer", default=None, help="tokenizer dir (default: the checkpoint's)")
    p.add_argument("--prompt-file", default=None, help="one prompt per line / JSONL with 'prompt' "
                                                         "(default: held-out stdlib code prompts)")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--methods", nargs="+", default=None, help="subset of our methods (default: all available)")
    p.add_argument("--num-draft-tokens", type=int, default=None,
                   help="chain length of eagle / draft_model / prompt_lookup (and HF prompt lookup)")
    p.add_argument("--depth", type=int, default=None, help="eagle_tree: tree depth")
    p.add_argument("--tree-top-k", type=int, default=None, help="eagle_tree: children per expanded node")
    p.add_argument("--total-tokens", type=int, default=None, help="eagle_tree: nodes verified per step")
    p.add_argument("--score-temperature", type=float, default=None, help="eagle_tree: greedy ranking temperature")
    p.add_argument("--suffix-tokens", type=int, default=None, help="suffix: draft nodes per step at most")
    p.add_argument("--suffix-depth", type=int, default=None, help="suffix: suffix trie depth (max_depth)")
    p.add_argument("--suffix-factor", type=float, default=None, help="suffix: nodes per matched token (spec_factor)")
    p.add_argument("--suffix-min-prob", type=float, default=None, help="suffix: min_token_prob")
    p.add_argument("--warm-prompts", type=int, default=0,
                   help="suffix_global row: warm the global suffix store on this many further prompts (0: no row)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per configuration (best is reported)")
    p.add_argument("--adaptive", action="store_true",
                   help="also run every speculative method with adaptive speculation (<method>+adaptive rows)")
    p.add_argument("--eager-catchup", action="store_true",
                   help="with --adaptive: EAGLE, P-EAGLE and DFlash methods also run with the draft caught up "
                        "after every step (<method>+adaptive+stepwise rows, lazy_draft_steps=0) next to the "
                        "deferred catch-up")
    p.add_argument("--draft-prompt-tokens", type=int, nargs="+", default=[],
                   help="also run the EAGLE and P-EAGLE methods with the draft reading only each prompt's last N tokens "
                        "(<method>+dpt=N rows; option draft_prompt_tokens) next to the whole prompt")
    p.add_argument("--chain-lengths", type=int, nargs="+", default=[],
                   help="also run the chain methods (eagle, draft_model, prompt_lookup, peagle, dflash) drafting N "
                        "tokens per step (<method>+ndt=N rows; option num_draft_tokens) next to --num-draft-tokens "
                        "(or each method's default)")
    p.add_argument("--compile", nargs="?", const="default", default=None,
                   choices=["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"],
                   help="also run every method with its decode step compiled (<method>+compiled rows; "
                        "mode default: 'default', 'reduce-overhead' = CUDA graphs on a GPU)")
    p.add_argument("--gemm", nargs="+", default=[], choices=list(GEMM_MODES),
                   help="also run every method with this small-row CPU kernel rule (<method>+gemm=<mode> rows, next "
                        "to the rule in force: NEMO_SPEC_SMALL_GEMM, default auto)")
    p.add_argument("--forward-rows", type=int, nargs="+", default=None,
                   help="instead of generating: time one cached target forward of each of these many new tokens "
                        "under the small-row kernel rules linear and auto (or --gemm's), side by side")
    p.add_argument("--forward-context", type=int, default=256, help="--forward-rows: cached tokens before the block")
    p.add_argument("--schedule", default="fixed", choices=list(SCHEDULES),
                   help="how our rows batch the prompts at each batch size: consecutive fixed batches (each runs "
                        "until its slowest row finishes) or continuous batching over that many slots (a prompt "
                        "joins when a row finishes, as in the server); transformers always runs fixed batches")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers comparison")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--out-dir", default="benchmark_out")
    return p


def _check_args(args: Any) -> None:
    """The CLI's numbers and paths, checked before any checkpoint is loaded."""
    for name in ("num_prompts", "max_new_tokens", "repeats"):
        if getattr(args, name) < 1:
            raise SamplingError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warm_prompts < 0:
        raise SamplingError(f"--warm-prompts must be >= 0, got {args.warm_prompts}")
    for name in ("batch_sizes", "chain_lengths", "draft_prompt_tokens", "forward_rows"):
        bad = [v for v in getattr(args, name) or () if v < 1]
        if bad:
            raise SamplingError(f"--{name.replace('_', '-')} must all be >= 1, got {getattr(args, name)}")
    for flag, path in [("--model", args.model), ("--draft-model", args.draft_model),
                       *[("--extra-models", p) for p in args.extra_models]]:
        if path is not None and not os.path.exists(path):
            raise SamplingError(f"{flag} {path}: no such checkpoint directory")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the benchmark CLI; writes JSON/markdown/PNG and prints the table."""
    import sys

    from nemo_spec import parallel
    from nemo_spec.checkpoint import find_tokenizer_dir, load_model
    from nemo_spec.data.chat import load_tokenizer
    from nemo_spec.inference.cli import read_prompt_file

    args = build_parser().parse_args(argv)
    _check_args(args)
    tok_path = args.tokenizer or find_tokenizer_dir(args.model)
    if tok_path is None:
        raise SamplingError(f"no tokenizer found with checkpoint {args.model}; pass --tokenizer")
    tokenizer = load_tokenizer(tok_path)
    if args.prompt_file:
        texts = read_prompt_file(args.prompt_file)[: args.num_prompts + args.warm_prompts]
    else:
        texts = default_prompts(args.num_prompts + args.warm_prompts)
    prompts = [tokenizer.encode(t, add_special_tokens=False) or [0] for t in texts]
    options = {"num_draft_tokens": args.num_draft_tokens} if args.num_draft_tokens is not None else {}
    tree_options = {k: v for k, v in [("depth", args.depth), ("top_k", args.tree_top_k),
                                      ("total_tokens", args.total_tokens),
                                      ("score_temperature", args.score_temperature)] if v is not None}
    parallel.initialize(1)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    model = load_model(args.model, dtype=dtype)
    if args.forward_rows:
        res = time_forwards(model, args.forward_rows, ["linear", "auto"] if not args.gemm else args.gemm,
                            context=args.forward_context, rounds=max(1, args.repeats))
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        table = forwards_markdown(res)
        write_text_atomic(out / "forwards.json", json.dumps(res, indent=2))
        write_text_atomic(out / "forwards.md", table)
        sys.stdout.write(table + f"wrote {out / 'forwards.md'}, {out / 'forwards.json'}\n")
        return 0
    draft = load_model(args.draft_model, dtype=dtype) if args.draft_model else None
    extras = [load_model(p, dtype=dtype) for p in args.extra_models]
    ctx = model_config(model).max_position_embeddings - args.max_new_tokens
    prompts = [p[-ctx:] for p in prompts]
    prompts, warm = prompts[: args.num_prompts], prompts[args.num_prompts:]
    if args.warm_prompts and len(warm) < args.warm_prompts:
        raise SamplingError(f"--warm-prompts {args.warm_prompts}: only {len(warm)} prompts left after the "
                            f"{args.num_prompts} measured ones")
    suffix_options = {k: v for k, v in [("num_draft_tokens", args.suffix_tokens), ("max_depth", args.suffix_depth),
                                        ("spec_factor", args.suffix_factor),
                                        ("min_token_prob", args.suffix_min_prob)] if v is not None}
    result = benchmark(model, prompts, draft, args.batch_sizes, args.max_new_tokens, args.methods, options,
                       hf=not args.no_hf, work_dir=Path(args.out_dir), repeats=args.repeats, tree_options=tree_options,
                       suffix_options=suffix_options, warm_prompts=warm or None, adaptive=args.adaptive,
                       compile_mode=args.compile, extra_models=extras, gemm_modes=args.gemm,
                       schedule=args.schedule, eager_catchup=args.eager_catchup,
                       draft_prompt_tokens=args.draft_prompt_tokens, chain_lengths=args.chain_lengths)
    paths = write_outputs(result, Path(args.out_dir))
    sys.stdout.write(to_markdown(result))
    sys.stdout.write(f"wrote {', '.join(str(p) for p in paths.values())}\n")
    return 0
