"""Suffix decoding: the suffix trie and global store (incremental = rebuild, eviction bound, matching, trees),
losslessness (greedy equality at batch 1 and ragged batch 4, chi-square at T > 0), options and the server."""
from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from nemo_spec.inference import SamplingError, SamplingParams, generate
from nemo_spec.inference.proposers.suffix import (SuffixStore, SuffixTrie, TrieCursor, expand, global_store, node_budget)
from nemo_spec.models import build_gpt
from tests.helpers import tiny_llama
from tests.inference_utils import chi2_critical, chi2_stat, naive_greedy
from tests.test_inference import PROMPTS, _target
from tests.test_inference_sampling import N, PARAMS, PROMPT, setup  # noqa: F401  (setup is a fixture)

torch.set_num_threads(1)


def _substring_counts(seqs, depth):
    """Reference: occurrences of every substring of length <= depth over the sequences."""
    c = Counter()
    for s in seqs:
        for i in range(len(s)):
            for n in range(1, depth + 1):
                if i + n <= len(s):
                    c[tuple(s[i:i + n])] += 1
    return dict(c)


def _node(trie, path):
    node = trie.node(path)
    assert node is not None, path
    return node


def _check_links(trie):
    """Suffix links point at the string minus its first token; sibling lists are consistent both ways."""
    for path in [()] + list(trie.as_dict()):
        node = _node(trie, path)
        if path:
            assert trie.link[node] == _node(trie, path[1:]), path
        kids = trie.children(node)
        assert [trie.prev[c] for c in kids] == ([-1] + kids[:-1] if kids else [])
        assert sorted(trie.token[c] for c in kids) == sorted(t for t in range(10) if trie.child(node, t) is not None)


# ------------------------------------------------------------------------------------------------ structures

def test_incremental_updates_equal_a_rebuild():
    rng = random.Random(0)
    for depth in (2, 3, 7):
        seq = [rng.randrange(4) for _ in range(120)]
        cur = TrieCursor(SuffixTrie(depth), grow=True)
        i = 0
        while i < len(seq):  # appended in ragged pieces, as accepted tokens arrive
            n = rng.randint(1, 6)
            cur.extend(seq[i:i + n])
            i += n
            rebuilt = SuffixTrie(depth)
            rebuilt.add(seq[:i])
            assert cur.trie.as_dict() == rebuilt.as_dict() == _substring_counts([seq[:i]], depth)
        _check_links(cur.trie)
        # the cursor holds the trie node of every context suffix up to the depth
        assert [len(cur.active)] == [depth + 1]
        for k, node in enumerate(cur.active):
            assert node == _node(cur.trie, seq[len(seq) - k:] if k else [])


def test_store_eviction_bound_and_refresh():
    rng = random.Random(1)
    outs = [[rng.randrange(5) for _ in range(rng.randint(1, 30))] for _ in range(12)]
    store = SuffixStore(capacity=3, max_depth=4)
    for i, o in enumerate(outs):
        store.add(o)
        assert len(store) == min(i + 1, 3)
        kept = outs[max(0, i - 2): i + 1]
        assert store.trie.as_dict() == _substring_counts(kept, 4)  # evicted outputs leave no trace
    _check_links(store.trie)
    # ids of evicted nodes are reused: the arrays never outgrow the peak (4 outputs, just before an eviction)
    peak = max(len(_substring_counts(outs[max(0, i - 3): i + 1], 4)) for i in range(len(outs)))
    assert store.trie.num_nodes() == len(store.trie.as_dict()) and len(store.trie.count) <= peak + 1
    store.add(outs[-3])  # already held: refreshed, so the next add evicts outs[-2] instead
    store.add([9, 9, 9])
    assert list(store.outputs) == [tuple(outs[-1]), tuple(outs[-3]), (9, 9, 9)]
    assert store.trie.as_dict() == _substring_counts([outs[-1], outs[-3], [9, 9, 9]], 4)
    store.resize(1)
    assert store.trie.as_dict() == _substring_counts([[9, 9, 9]], 4)
    store.add([])  # nothing to learn
    assert len(store) == 1
    with pytest.raises(SamplingError, match="capacity"):
        store.resize(0)


def test_global_cursor_follows_the_longest_known_suffix():
    store = SuffixStore(capacity=4, max_depth=5)
    store.add([1, 2, 3, 4, 5, 6])
    cur = TrieCursor(store.trie, grow=False)
    cur.extend([9, 9, 2, 3])
    assert cur.match() == (2, _node(store.trie, [2, 3]))
    cur.extend([4])
    assert cur.match()[0] == 3
    cur.extend([7])  # [7] never occurred: no match
    assert cur.match() == (0, None)
    cur.extend([6])  # [6] occurred, but nothing followed it
    assert cur.match() == (0, None)


def test_local_match_skips_the_current_occurrence_and_scores_by_frequency():
    seq = [1, 2, 3, 9, 1, 2, 4, 1, 2, 3, 7, 1, 2]
    cur = TrieCursor(SuffixTrie(8), grow=True)
    cur.extend(seq)
    m, node = cur.match()
    assert m == 2 and node == _node(cur.trie, [1, 2])  # [7, 1, 2] occurs only at the end
    tokens, parents, score = expand(cur.trie, node, m, budget=4, min_prob=0.0)
    # after [1, 2]: 3 twice, 4 once; after [1, 2, 3]: 9 once and 7 once; after [1, 2, 4]: 1
    assert tokens[:2] == [3, 4] and parents[:2] == [0, 0]
    assert sorted(zip(tokens[2:], parents[2:])) == [(7, 1), (9, 1)]
    assert score == pytest.approx(2 / 3 + 1 / 3 + 1 / 3 + 1 / 3)
    tokens, parents, score = expand(cur.trie, node, m, budget=4, min_prob=0.5)
    assert (tokens, parents) == ([3], [0]) and score == pytest.approx(2 / 3)


def test_depth_limit_continues_through_suffix_links():
    seq = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    cur = TrieCursor(SuffixTrie(3), grow=True)
    cur.extend(seq)
    m, node = cur.match()
    assert m == 2
    tokens, parents, _ = expand(cur.trie, node, m, budget=10, min_prob=0.1)
    # a chain far deeper than the trie; past the end of the data the last 2 tokens predict again (period 8)
    assert tokens == [3, 4, 5, 6, 7, 8, 1, 2, 3, 4] and parents == list(range(10))


def test_node_budget_grows_with_the_match_and_is_capped():
    assert [node_budget(m, 1.0, 5) for m in range(8)] == [0, 1, 2, 3, 4, 5, 5, 5]
    assert [node_budget(m, 0.5, 16) for m in (1, 2, 3)] == [1, 1, 2]
    assert node_budget(3, 2.5, 16) == 8


def test_global_store_is_per_model_and_resizes():
    a, b = _target(), _target()
    sa = global_store(a, 4)
    assert global_store(a, 4) is sa and global_store(b, 4) is not sa
    assert global_store(a, 4, max_depth=8) is not sa  # another trie depth: another store
    for i in range(4):
        sa.add([i, i + 1])
    assert global_store(a, 2) is sa and len(sa) == 2


# ------------------------------------------------------------------------------------------------ lossless

@pytest.fixture(scope="module")
def llama():
    m = _target()
    return m, [naive_greedy(m, p, 24) for p in PROMPTS]


@pytest.mark.parametrize("opts", [{}, {"num_draft_tokens": 3, "max_depth": 4, "spec_factor": 3.0},
                                  {"global_cache": 8}])
def test_suffix_greedy_equals_ar(llama, opts):
    m, ref = llama
    sp = SamplingParams(max_new_tokens=24)
    if "global_cache" in opts:  # the global store learns from other prompts first
        generate(m, [[7, 8, 9, 7, 8, 9, 7], [3, 1, 4, 1, 5]], sp, method="suffix", options=opts)
        assert len(global_store(m, 8)) == 2
    outs = generate(m, PROMPTS, sp, method="suffix", options=opts)
    assert [o.tokens for o in outs] == ref
    assert [generate(m, [p], sp, method="suffix", options=opts)[0].tokens for p in PROMPTS] == ref
    for o in outs:
        s = o.stats
        assert s["method"] == "suffix" and s["new_tokens"] == 24 and s["draft_forwards"] == 0
        assert s["target_forwards"] == sum(s["accept_hist"]) + 1
    assert max(len(o.stats["accept_hist"]) for o in outs) > 2  # multi-token acceptance happened
    assert len({o.stats["target_forwards"] for o in outs}) > 1  # ragged rows


def test_global_store_learns_outputs_and_can_be_frozen():
    m = _target(seed=5)
    sp = SamplingParams(max_new_tokens=16)
    first = generate(m, [[3, 4, 5]], sp, method="suffix", options={"global_cache": 4})[0]
    store = global_store(m, 4)
    assert list(store.outputs) == [tuple(first.tokens)]
    again = generate(m, [[3, 4, 5]], sp, method="suffix", options={"global_cache": 4, "global_update": False})[0]
    assert again.tokens == first.tokens
    assert again.stats["target_forwards"] < first.stats["target_forwards"]  # the learned output was drafted
    assert len(store) == 1
    generate(m, [[6, 7]], sp, method="suffix", options={"global_cache": 4, "global_update": False})
    assert len(store) == 1  # frozen: nothing learned


def _suffix_stat(setup, opts):
    target, _, _, exact = setup
    params = [SamplingParams(seed=1000 + i, **PARAMS) for i in range(N)]
    outs = generate(target, [PROMPT] * N, params, method="suffix", options=opts)
    stat, df = chi2_stat([tuple(o.tokens) for o in outs], exact)
    return stat, chi2_critical(df), sum(o.stats["tau"] for o in outs) / N


@pytest.mark.parametrize("opts", [{"num_draft_tokens": 3}, {"num_draft_tokens": 4, "global_cache": 64,
                                                            "min_token_prob": 0.0}])
def test_suffix_sampling_matches_ar(setup, opts):  # noqa: F811
    if "global_cache" in opts:  # warm the global store with sampled outputs of other prompts
        target = setup[0]
        generate(target, [[2, 3, 4, 2, 3]] * 64, [SamplingParams(seed=i, **PARAMS) for i in range(64)],
                 method="suffix", options=opts)
        opts = {**opts, "global_update": False}
    stat, crit, tau = _suffix_stat(setup, opts)
    assert stat < crit, (stat, crit)
    assert tau > 1.0


def test_suffix_wrong_residual_is_caught(setup, monkeypatch):  # noqa: F811
    from nemo_spec.inference import sampling

    monkeypatch.setattr(sampling, "residual_rows", lambda p, q: p)  # the engine's vectorised rule
    stat, crit, _ = _suffix_stat(setup, {"num_draft_tokens": 3})
    assert stat > crit, (stat, crit)


# ------------------------------------------------------------------------------------------------ options

@pytest.mark.parametrize("opts,match", [({"num_draft_tokens": 0}, "num_draft_tokens"), ({"max_depth": 1}, "max_depth"),
                                        ({"spec_factor": 0}, "spec_factor"), ({"min_token_prob": 1.5}, "min_token_prob"),
                                        ({"global_cache": -1}, "global_cache"),
                                        ({"global_update": "no"}, "global_update"),
                                        ({"max_dpeth": 3}, "unknown generation option")])
def test_bad_suffix_options_are_errors(opts, match):
    m = build_gpt(tiny_llama()).eval()
    with pytest.raises(SamplingError, match=match):
        generate(m, [[1, 2]], SamplingParams(max_new_tokens=2), method="suffix", options=opts)


def test_server_learns_from_served_responses(tmp_path):
    import time

    import httpx

    from tests.serve_utils import live_server, served_text, tiny_model, train_tokenizer

    tok = train_tokenizer(tmp_path / "tok")
    model = tiny_model(tok)
    body = {"model": "tiny", "prompt": "the cat sat", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    with live_server(model, tok, name="tiny", method="suffix", options={"global_cache": 8}) as srv:
        r1 = httpx.post(srv.url + "/v1/completions", json=body, timeout=60).json()
        store = global_store(model, 8)
        deadline = time.monotonic() + 30  # a row may be answered before its engine call ends (and learns)
        while len(store) < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        # the response's text continues the prompt (decoded after its last tokens, as vLLM does)
        assert len(store) == 1
        assert served_text(tok, tok(body["prompt"]).input_ids, list(store.outputs)[0]) == r1["choices"][0]["text"]
        r2 = httpx.post(srv.url + "/v1/completions", json=body, timeout=60).json()
    assert r2["choices"][0]["text"] == r1["choices"][0]["text"]


# ------------------------------------------------------------------------------------------------ cost, benchmark

def test_replay_reproduces_the_generation_steps(llama):
    from nemo_spec.inference.proposers.suffix import replay_cost

    m, ref = llama
    outs = generate(m, PROMPTS, SamplingParams(max_new_tokens=24), method="suffix", options={"ignore_eos": True})
    cost = replay_cost(m, PROMPTS, [o.tokens for o in outs])
    assert cost["steps"] == sum(o.stats["target_forwards"] - 1 for o in outs)  # one proposal per verification
    assert cost["propose_ms_per_step"] > 0 and cost["prefill_s"] > 0


def test_benchmark_rows_for_suffix_and_warmed_global_store(llama, tmp_path):
    from nemo_spec.inference import benchmark as bench

    m, _ = llama
    res = bench.benchmark(m, PROMPTS[:2], methods=["prompt_lookup", "suffix"], batch_sizes=(1,), max_new_tokens=8,
                          hf=False, repeats=1, suffix_options={"num_draft_tokens": 4}, warm_prompts=PROMPTS[2:])
    rows = {r["method"]: r for r in res["rows"]}
    assert set(rows) == {"ar", "prompt_lookup", "suffix", "suffix_global"}
    assert all(r["matches_ar"] == 1.0 for r in rows.values())
    assert rows["suffix_global"]["options"]["global_update"] is False
    assert len(global_store(m, bench.BENCH_GLOBAL_CACHE)) == 2  # learned the two warm prompts' outputs only
    for name in ("suffix", "suffix_global"):
        assert rows[name]["propose_ms_per_step"] > 0 and rows[name]["step_ms"] > 0
    names = {t["name"] for t in res["targets"]}
    assert {"suffix tokens/s vs our prompt_lookup", "suffix_global proposal time per step / our AR decode step"} <= names
    md = bench.to_markdown(res)
    assert "| nemo_spec | suffix_global | 1 |" in md and "proposal time per step / our AR decode step <= 0.1" in md


def test_a_repetition_is_drafted_past_its_own_latest_period():
    """The longest match of a loop ends one period before the end; the tree backs off and keeps the loop going."""
    cur = TrieCursor(SuffixTrie(24), grow=True)
    cur.extend([9, 8] + [5, 6, 7] * 4)
    m, node = cur.match()
    assert m == 9  # [5, 6, 7] * 3 occurred once before, followed by 5
    tokens, parents, score = expand(cur.trie, node, m, budget=8, min_prob=0.1)
    assert tokens == [5, 6, 7, 5, 6, 7, 5, 6] and parents == list(range(8)) and score == pytest.approx(8.0)


def test_cli_suffix_flags(tmp_path):
    import io
    import json

    from nemo_spec.checkpoint.hf import export_hf
    from nemo_spec.inference import cli
    from tests.serve_utils import tiny_model, train_tokenizer

    args = cli.build_parser().parse_args(["--model", "x", "--method", "suffix", "--num-draft-tokens", "8",
                                          "--max-depth", "12", "--spec-factor", "2", "--min-token-prob", "0.2",
                                          "--global-cache", "16", "p"])
    assert cli.options_from_args(args) == {"num_draft_tokens": 8, "max_depth": 12, "spec_factor": 2.0,
                                           "min_token_prob": 0.2, "global_cache": 16}
    tok = train_tokenizer(tmp_path / "tok")
    path = export_hf(tiny_model(tok), tmp_path / "hf", tokenizer_dir=tmp_path / "tok")
    stats = tmp_path / "stats.json"
    argv = ["--model", str(path), "-", "--max-new-tokens", "12", "--ignore-eos", "--batch-size", "1",
            "--stats-json", str(stats)]
    out = io.StringIO()
    assert cli.main(argv + ["--method", "suffix", "--global-cache", "4"], stdin=io.StringIO("the cat\nthe cat\n"),
                    stdout=out, stderr=io.StringIO()) == 0
    got = json.loads(stats.read_text())
    assert cli.main(argv, stdin=io.StringIO("the cat\n"), stdout=io.StringIO(), stderr=io.StringIO()) == 0
    ref = json.loads(stats.read_text())[0]["tokens"]
    assert [r["tokens"] for r in got] == [ref, ref] and [r["stats"]["method"] for r in got] == ["suffix"] * 2
    # the second prompt drafts from the first one's output, learned by the global store
    assert got[1]["stats"]["target_forwards"] < got[0]["stats"]["target_forwards"]
