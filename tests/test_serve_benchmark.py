"""The serving benchmark's late-request measurement (scripts/benchmark_serve.py --late) on a real server."""
from nemo_spec.checkpoint import save_checkpoint
from nemo_spec.serve.benchmark import format_late, late_request
from tests.serve_utils import tiny_model, tok, tok_dir  # noqa: F401  (fixtures)


def test_late_short_request_joins_the_running_batch_only_with_the_continuous_scheduler(tok, tok_dir, tmp_path):
    """A 3-token request sent while a 240-token one streams (after its 8th token: a fixed delay would depend on the
    machine's speed): the session admits it at the next step and it finishes long before the long one; the old
    batcher starts it only after the long request's batch has finished."""
    ckpt = save_checkpoint(tiny_model(tok, num_layers=4), tmp_path / "ckpt", tokenizer_dir=tok_dir)
    res = {r.scheduler: r for r in late_request(str(ckpt), long_tokens=240, short_tokens=3, delay_s=0.0,
                                                max_batch=4, prompt="hello world", after_tokens=8)}
    cont, old = res["continuous"], res["batch"]
    assert cont.short_done_before_long_s > 0 > old.short_done_before_long_s
    assert cont.late_ttft_s < old.late_ttft_s
    assert cont.step_s > 0 and old.step_s > 0
    table = format_late(list(res.values()))
    assert "continuous" in table and "batch" in table


def _max_in_flight(out) -> int:
    """Most requests in flight at once, from their (sent at, ended at) offsets."""
    events = sorted([(o[3], 1) for o in out] + [(o[4], -1) for o in out], key=lambda e: (e[0], e[1]))
    most = cur = 0
    for _, d in events:
        cur += d
        most = max(most, cur)
    return most


def test_poisson_closed_loop_clients_wait_for_their_responses(tok):
    """--clients N: each client sends its next request only after its previous response has ended, so at most N
    are in flight, even at a rate far above what the server decodes; the same rate open-loop sends everything at
    once. Every request streams its drawn budget (ignore_eos) in both modes."""
    import asyncio
    import random

    from nemo_spec.serve.benchmark import _arrivals, _poisson
    from tests.serve_utils import live_server

    budget = (6, 14)
    with live_server(tiny_model(tok), tok, name="tiny", max_batch=8, batch_wait_ms=0.0) as srv:
        url = srv.url + "/v1"
        closed, _ = asyncio.run(_poisson(url, "tiny", ["the cat", "we read"], 10000.0, 8, budget, 0, clients=2))
        opened, _ = asyncio.run(_poisson(url, "tiny", ["the cat", "we read"], 10000.0, 8, budget, 0))
    _, drawn = _arrivals(1.0, 8, budget, random.Random(0))
    for out in (closed, opened):
        assert [o[0] for o in out] == drawn
        assert all(o[3] <= o[4] for o in out)
    assert _max_in_flight(closed) == 2
    assert all(closed[i + 2][3] >= closed[i][4] for i in range(6))  # client i % 2: next request after the last
    assert _max_in_flight(opened) > 2


def test_compare_schedulers_alternates_rounds_over_one_loaded_model(tok, tok_dir, tmp_path, monkeypatch):
    """compare_schedulers(rounds=2): the checkpoint is loaded once; each (round, rate) serves it with both schedulers,
    the order reversed in the second round; results pool both rounds (every streamed token counted)."""
    import nemo_spec.checkpoint as checkpoint
    from nemo_spec.serve import benchmark as bench

    ckpt = save_checkpoint(tiny_model(tok, num_layers=2), tmp_path / "ckpt", tokenizer_dir=tok_dir)
    loads, order = [], []
    real_load, real_served = checkpoint.load_model, bench._served
    monkeypatch.setattr(checkpoint, "load_model", lambda *a, **kw: loads.append(a) or real_load(*a, **kw))

    def served(pool, checkpoint, sched, *a, **kw):
        order.append(sched)
        return real_served(pool, checkpoint, sched, *a, **kw)

    monkeypatch.setattr(bench, "_served", served)
    res = bench.compare_schedulers(str(ckpt), rates=[200.0], requests=3, max_tokens=4, max_batch=4,
                                   prompts=["hello world", "the cat"], clients=2, rounds=2)
    assert len(loads) == 1 and order == ["batch", "continuous", "continuous", "batch"]
    assert [(r.scheduler, r.requests, r.completion_tokens, r.rounds) for r in res] == \
        [("batch", 6, 24, 2), ("continuous", 6, 24, 2)]
    assert "2 rounds, schedulers alternating" in bench.format_poisson(res)
