"""Regression tests of the server's hardening: one bad request never fails another, big or malformed inputs
never block or break the server, unload frees the model, SIGTERM ends every stream well-formed, and the metrics
count what was really generated. Real uvicorn on 127.0.0.1, real engine, ``openai`` client / raw HTTP."""
from __future__ import annotations

import gc
import http.client
import json
import signal
import subprocess
import sys
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from nemo_spec.inference import SamplingParams, generate, get_engine
from tests.helpers import ROOT, _free_port, script_env
from tests.serve_utils import clone_model, live_server, poison_steps, served_text, tiny_model
from tests.serve_utils import model, tok, tok_dir  # noqa: F401  (pytest fixtures)


def _post(srv, path, body, timeout=60, **kw):
    return httpx.post(srv.url + path, json=body, timeout=timeout, **kw)


def _greedy_text(ref, tok, prompt, n):
    ids = tok(prompt).input_ids
    res = generate(ref, [ids], SamplingParams(temperature=0.0, max_new_tokens=n, stop_token_ids=(tok.eos_token_id,)))
    return served_text(tok, ids, res[0].tokens)


def _wait(cond, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


# ------------------------------------------------------------------------------------ 1. poison requests

def test_seed_out_of_range_is_a_400(model, tok):
    with live_server(model, tok, name="tiny") as srv:
        for seed in (2**64, 2**63, -(2**63) - 1):
            r = _post(srv, "/v1/completions", {"model": "tiny", "prompt": "the cat", "max_tokens": 2, "seed": seed})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "seed"
        # n rows take seeds seed .. seed+n-1, wrapped into a signed 64-bit integer: the largest seed is a valid
        # request at any n (it was refused), and its second choice samples as seed -2**63 does alone
        ids = tok("the cat").input_ids
        body = {"model": "tiny", "prompt": ids, "max_tokens": 6, "temperature": 1.0, "ignore_eos": True}
        r = _post(srv, "/v1/completions", {**body, "seed": 2**63 - 1, "n": 2})
        assert r.status_code == 200, r.text
        for seed, choice in zip((2**63 - 1, -(2**63)), r.json()["choices"]):
            alone = _post(srv, "/v1/completions", {**body, "seed": seed})
            assert alone.status_code == 200 and choice["text"] == alone.json()["choices"][0]["text"]


@pytest.mark.parametrize("scheduler", ["continuous", "batch"])
def test_a_failing_row_never_fails_the_requests_batched_with_it(model, tok, scheduler, monkeypatch):
    """A request the engine refuses (its row check raises, as for a row that cannot run) arrives with three good
    ones: only the bad request gets the 500. The fixed-batch scheduler runs them in one batch, which fails and is
    rerun request by request; the continuous one refuses the bad request when it would join, before any step."""
    from nemo_spec.inference.engine import Engine
    from nemo_spec.inference.sampling import SamplingError

    ref = clone_model(model)
    poison = tok("numbers 9 9 9").input_ids
    orig = Engine.check_row

    def check_row(self, r, prompt, *a, **kw):
        if list(prompt[: len(poison)]) == poison:
            raise SamplingError(f"prompt {r}: poison row")
        return orig(self, r, prompt, *a, **kw)

    monkeypatch.setattr(Engine, "check_row", check_row)
    prompts = ["the cat sat on", "we read code ,", "hello world , this"]
    with live_server(model, tok, name="tiny", max_batch=8, batch_wait_ms=400, scheduler=scheduler) as srv:
        batcher = srv.manager.get("tiny").batcher
        before = batcher.batches_run
        with ThreadPoolExecutor(4) as ex:
            bad = ex.submit(_post, srv, "/v1/completions", {"model": "tiny", "prompt": poison,
                                                             "max_tokens": 6, "temperature": 0})
            good = [ex.submit(_post, srv, "/v1/completions", {"model": "tiny", "prompt": p, "max_tokens": 6,
                                                              "temperature": 0}) for p in prompts]
            bad, good = bad.result(), [g.result() for g in good]
        assert bad.status_code == 500 and "poison row" in bad.json()["error"]["message"]
        for p, g in zip(prompts, good):
            assert g.status_code == 200, g.text
            assert g.json()["choices"][0]["text"] == _greedy_text(ref, tok, p, 6)
        if scheduler == "batch":
            assert batcher.batches_run - before >= 1 + 4  # one shared batch, then each request alone
        else:
            assert batcher.step_failures == 0 and batcher.batches_run - before <= 2  # good ones ran together


def test_a_step_that_fails_is_resumed_request_by_request(model, tok, monkeypatch):
    """Continuous batching: a step raises whenever one (poison) request is in the batch. The session is reset,
    every running request resumes alone from the tokens it has streamed; only the poison one fails (its stream
    ends with an error event), the others finish with exactly the greedy text."""
    ref = clone_model(model)
    poison = poison_steps(monkeypatch, tok)
    prompts = ["the cat sat on", "we read code ,", "hello world , this"]
    with live_server(model, tok, name="tiny", max_batch=8, batch_wait_ms=300) as srv:
        with ThreadPoolExecutor(4) as ex:
            bad = ex.submit(_post, srv, "/v1/completions", {"model": "tiny", "prompt": poison, "max_tokens": 8,
                                                             "temperature": 0, "stream": True})
            good = [ex.submit(_post, srv, "/v1/completions", {"model": "tiny", "prompt": p, "max_tokens": 8,
                                                              "temperature": 0, "ignore_eos": True}) for p in prompts]
            bad, good = bad.result(), [g.result() for g in good]
        batcher = srv.manager.get("tiny").batcher
        assert batcher.step_failures == 2  # shared, then the poison request alone
    lines = [l for l in bad.text.splitlines() if l.startswith("data: ")]
    assert '"server_error"' in lines[-2] and "poison row" in lines[-2] and lines[-1] == "data: [DONE]"
    for p, g in zip(prompts, good):
        assert g.status_code == 200, g.text
        ids = tok(p).input_ids
        want = generate(ref, [ids], SamplingParams(max_new_tokens=8), options={"ignore_eos": True})[0].tokens
        assert g.json()["choices"][0]["text"] == served_text(tok, ids, want)


@pytest.mark.parametrize("method,options,extra", [("ar", {}, 1), ("prompt_lookup", {"num_draft_tokens": 4}, 5)])
def test_a_small_max_cache_len_bounds_the_advertised_context(model, tok, method, options, extra):
    """``options.max_cache_len`` below the model context used to leave max_model_len at the model's context and
    fail a longer request inside the engine (500). The served context now is what the cache holds beside one
    step's drafts: /v1/models says so, a longer request is a 400 context_length_exceeded, one that fits runs."""
    from nemo_spec.config import ConfigError
    from nemo_spec.serve import ModelSpec
    from nemo_spec.serve.models import build_served_model

    fits = 24 - extra
    with live_server(model, tok, name="tiny", method=method, options={"max_cache_len": 24, **options}) as srv:
        assert httpx.get(srv.url + "/v1/models").json()["data"][0]["max_model_len"] == fits
        ids = tok("the cat sat on").input_ids
        r = _post(srv, "/v1/completions", {"model": "tiny", "prompt": ids, "max_tokens": fits - len(ids) + 1})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        ok = _post(srv, "/v1/completions", {"model": "tiny", "prompt": ids, "max_tokens": fits - len(ids),
                                            "temperature": 0, "ignore_eos": True})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == fits - len(ids), ok.text
    served = build_served_model(ModelSpec(name="t", method=method, max_context=30,
                                          options={"max_cache_len": 24, **options}), model=model, tokenizer=tok)
    assert served.max_context == fits  # a larger max_context is served as what fits (with a warning)
    served.batcher.close()
    with pytest.raises(ConfigError, match="at least 2"):
        build_served_model(ModelSpec(name="t", method=method, options={"max_cache_len": extra + 1, **options}),
                           model=model, tokenizer=tok)
    with pytest.raises(ConfigError, match="max_cache_len must be an int"):
        ModelSpec(name="t", method=method, options={"max_cache_len": "24"}).validate()


# ------------------------------------------------------------------------------------ 2. big inputs

def test_oversized_body_is_a_413_and_never_blocks_the_loop(model, tok):
    with live_server(model, tok, name="tiny", serve={"max_request_bytes": 1 << 20}) as srv:
        big = {"model": "tiny", "prompt": "the cat " * (20 * 1024 * 1024 // 8), "max_tokens": 2}
        t0 = time.monotonic()
        r = _post(srv, "/v1/completions", big)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        assert time.monotonic() - t0 < 10
        # chunked upload (no Content-Length): refused once the limit is crossed
        body = json.dumps(big).encode()
        r = httpx.post(srv.url + "/v1/completions", content=iter([body[i:i + 65536] for i in range(0, len(body),
                                                                                                 65536)]),
                       headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == 413
        assert _post(srv, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1}).status_code == 200


def test_prompt_character_limit_is_checked_before_tokenizing(model, tok, monkeypatch):
    import nemo_spec.serve.app as app_mod

    calls = []
    orig = app_mod._encode
    monkeypatch.setattr(app_mod, "_encode", lambda *a, **k: calls.append(1) or orig(*a, **k))
    with live_server(model, tok, name="tiny", serve={"max_prompt_chars": 1000}) as srv:
        r = _post(srv, "/v1/completions", {"model": "tiny", "prompt": "x" * 1001, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["code"] == "prompt_too_long"
        r = _post(srv, "/v1/chat/completions", {"model": "tiny", "max_tokens": 1, "messages": [
            {"role": "system", "content": "y" * 600}, {"role": "user", "content": "z" * 600}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        assert not calls  # neither was tokenized
        assert _post(srv, "/v1/completions", {"model": "tiny", "prompt": "x" * 999, "max_tokens": 1}).status_code \
            in (200, 400)  # tokenized (may exceed the context: a 400 naming it)
        assert calls


def test_tokenizing_runs_off_the_event_loop(model, tok, monkeypatch):
    """While a request's tokenization is stuck, /health and other requests are answered."""
    import nemo_spec.serve.app as app_mod

    release = threading.Event()
    orig = app_mod._encode

    def slow_encode(served, text, add_special_tokens):
        if "SLOW" in text:
            assert release.wait(60)
        return orig(served, text, add_special_tokens)

    monkeypatch.setattr(app_mod, "_encode", slow_encode)
    with live_server(model, tok, name="tiny") as srv:
        with ThreadPoolExecutor(2) as ex:
            slow = ex.submit(_post, srv, "/v1/chat/completions", {"model": "tiny", "max_tokens": 2, "messages": [
                {"role": "user", "content": "SLOW the cat"}]})
            time.sleep(0.3)
            t0 = time.monotonic()
            assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
            other = _post(srv, "/v1/completions", {"model": "tiny", "prompt": "the dog", "max_tokens": 2}, timeout=10)
            assert other.status_code == 200 and time.monotonic() - t0 < 8
            assert not slow.done()
            release.set()
            assert slow.result().status_code == 200


# ------------------------------------------------------------------------------------ 3. invalid unicode

@pytest.mark.parametrize("body", [
    b'{"model": "tiny", "prompt": "a\\ud800b", "max_tokens": 2}',
    b'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "a\\udc00b"}]}',
    b'{"model": "tiny", "prompt": "a\xed\xa0\x80b", "max_tokens": 2}',  # the surrogate as raw (invalid) UTF-8
])
def test_lone_surrogate_is_a_400_and_the_connection_stays_usable(model, tok, body):
    with live_server(model, tok, name="tiny") as srv:
        path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        err = json.loads(r.read())
        assert r.status == 400, err
        assert err["error"]["param"] in ("prompt", "messages")
        # same keep-alive connection: the next request is answered
        conn.request("POST", "/v1/completions", body=json.dumps({"model": "tiny", "prompt": "the cat",
                                                                "max_tokens": 2}).encode(),
                     headers={"Content-Type": "application/json"})
        r2 = conn.getresponse()
        assert r2.status == 200 and json.loads(r2.read())["choices"]
        conn.close()


# ------------------------------------------------------------------------------------ 5. unload frees the model

def test_generate_does_not_keep_the_model_alive(tok):
    m = tiny_model(tok)
    generate(m, [[5, 6, 7]], SamplingParams(max_new_tokens=4))
    refs = [weakref.ref(m), weakref.ref(get_engine(m).caches["target"].k)]
    del m
    gc.collect()
    assert [r() for r in refs] == [None, None]


def test_admin_unload_frees_model_and_kv_cache(tok, tmp_path):
    from nemo_spec.serve import ModelSpec, ServeConfig
    from nemo_spec.serve.models import ModelManager
    from nemo_spec.serve.server import ServerThread

    cfg = ServeConfig(admin_key="sk-admin")
    manager = ModelManager()
    manager.add(ModelSpec(name="a"), model=tiny_model(tok), tokenizer=tok)
    with ServerThread(cfg, manager) as srv:
        for stream in (False, True):
            r = _post(srv, "/v1/completions", {"model": "a", "prompt": "the cat", "max_tokens": 4, "stream": stream})
            assert r.status_code == 200
        m = manager.get("a").model
        kv = manager.get("a").batcher.session.kv  # the serving session's own KV cache
        refs = [weakref.ref(m), weakref.ref(kv.k)]
        del m, kv
        r = _post(srv, "/admin/models/unload", {"name": "a"}, headers={"Authorization": "Bearer sk-admin"})
        assert r.status_code == 200
        gc.collect()
        assert [x() for x in refs] == [None, None]


# ------------------------------------------------------------------------------------ 6. tiny temperatures

def test_tiny_temperature_is_greedy(model, tok):
    ids = tok("the cat sat on").input_ids
    greedy = generate(clone_model(model), [ids], SamplingParams(temperature=0.0, max_new_tokens=12))[0].tokens
    for t in (1e-40, 1e-7):
        p = SamplingParams(temperature=t, max_new_tokens=12, seed=3)
        assert p.greedy
        assert generate(clone_model(model), [ids], p)[0].tokens == greedy
    with live_server(model, tok, name="tiny") as srv:
        r = _post(srv, "/v1/completions", {"model": "tiny", "prompt": ids, "max_tokens": 12, "temperature": 1e-40,
                                           "ignore_eos": True})
        assert r.status_code == 200
        assert r.json()["choices"][0]["text"] == served_text(tok, ids, greedy)


# ------------------------------------------------------------------------------------ 7. metrics and batching

def test_cancelled_tokens_are_counted_and_latency_matches_ttft(tok):
    slow = tiny_model(tok, max_position_embeddings=4096)
    with live_server(slow, tok, name="slow", max_batch=1, batch_wait_ms=0) as srv:
        metrics = srv.app.state.metrics
        body = {"model": "slow", "prompt": "the cat", "max_tokens": 3000, "temperature": 0, "stream": True,
                "ignore_eos": True}
        received = 0
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as s:
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    received += 1
                if received >= 5:
                    break
        _wait(lambda: metrics.cancelled.total() >= 1)
        assert metrics.completion_tokens.total() >= received  # each chunk carried >= 1 token
        ok = _post(srv, "/v1/completions", {"model": "slow", "prompt": "the cat", "max_tokens": 3, "ignore_eos": True})
        assert ok.status_code == 200
        _wait(lambda: metrics.latency.count() == 2)
        assert metrics.ttft.count() == metrics.latency.count() == 2
        assert metrics.prompt_tokens.total() == 2 * len(tok("the cat").input_ids)


def test_health_can_require_the_key_and_queue_full_sends_retry_after(tok):
    slow = tiny_model(tok, max_position_embeddings=4096)
    with live_server(slow, tok, name="slow", api_keys=("sk-u",), max_batch=1, max_queue=1, batch_wait_ms=0,
                     serve={"health_requires_key": True, "retry_after_s": 3}) as srv:
        assert httpx.get(srv.url + "/health").status_code == 401
        auth = {"Authorization": "Bearer sk-u"}
        assert httpx.get(srv.url + "/health", headers=auth).status_code == 200
        batcher = srv.manager.get("slow").batcher
        body = {"model": "slow", "prompt": "the cat", "max_tokens": 3000, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, headers=auth, timeout=60) as s:
            it = s.iter_lines()  # kept alive: a dropped iterator closes the stream (= client disconnect)
            next(line for line in it if line.startswith("data: {"))
            waiting = ThreadPoolExecutor(1).submit(
                _post, srv, "/v1/completions", {"model": "slow", "prompt": "x", "max_tokens": 2}, headers=auth)
            _wait(lambda: batcher.queue_depth() == 1)
            r = _post(srv, "/v1/completions", {"model": "slow", "prompt": "x", "max_tokens": 2}, headers=auth)
            assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full"
            assert r.headers["retry-after"] == "3"
        assert waiting.result(60).status_code == 200


def test_n_above_max_batch_is_split_over_batches(model, tok):
    ref = clone_model(model)
    ids = tok("the cat sat on").input_ids
    with live_server(model, tok, name="tiny", max_batch=2) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
        out = c.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0.9, seed=11, n=5,
                                   extra_body={"ignore_eos": True})
        r = _post(srv, "/v1/completions", {"model": "tiny", "prompt": [[5]] * 65, "n": 4, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_sequences"  # 260 > 256 rows
    assert len(out.choices) == 5 and out.usage.completion_tokens == 40
    for ch in out.choices:  # each choice is its own seeded row: the same as generating it alone
        want = generate(ref, [ids], SamplingParams(temperature=0.9, max_new_tokens=8, seed=11 + ch.index),
                        options={"ignore_eos": True})[0]
        assert ch.text == served_text(tok, ids, want.tokens)


@pytest.mark.parametrize("scheduler", ["continuous", "batch"])
def test_free_slots_are_filled_from_queued_requests(model, tok, scheduler):
    """max_batch 3 with two n=2 requests queued: the first batch runs 3 rows (one of the second request's
    rows joins), not 2."""
    with live_server(model, tok, name="tiny", max_batch=3, batch_wait_ms=500, scheduler=scheduler) as srv:
        sizes = srv.app.state.metrics.batch_size
        with ThreadPoolExecutor(2) as ex:
            rs = [ex.submit(_post, srv, "/v1/completions", {"model": "tiny", "prompt": p, "max_tokens": 4, "n": 2})
                  for p in ("the cat", "the dog")]
            assert all(r.result().status_code == 200 for r in rs)
        series = sizes._series[()]
        buckets = dict(zip(sizes.buckets, series[0]))
        if scheduler == "batch":
            # cumulative buckets: two batches, one of 1 row and one of 3 (was: two batches of 2)
            assert series[1][1] == 2 and buckets[1] == 1 and buckets[2] == 1 and buckets[4] == 2
        else:
            # rows in the batch at each admission: the first joined 3 rows; the last row joins when a slot frees
            n = series[1][1]
            assert n >= 2 and n - buckets[2] >= 1 and buckets[4] == n


# ------------------------------------------------------------------------------------ 4. SIGTERM

def test_sigterm_ends_every_stream_well_formed(model, tok, tok_dir, tmp_path):
    """scripts/serve.py gets SIGTERM with streams running and queued: queued ones are answered at once (503
    error event / JSON), running ones get the drain time, then end with an error event; every stream ends with
    ``data: [DONE]``, a short running one finishes normally, and the process exits."""
    from nemo_spec.checkpoint.hf import export_hf

    # long streams that cannot finish within the drain time, however fast the machine: 15,000 tokens each
    long_model = tiny_model(tok, max_position_embeddings=16384)
    ckpt = export_hf(long_model, tmp_path / "hf", tokenizer_dir=tok_dir)
    port = _free_port()
    env = script_env()
    cmd = [sys.executable, str(ROOT / "scripts" / "serve.py"), f"model.path={ckpt}", "model.name=tiny",
           f"port={port}", "model.max_batch=4", "shutdown_drain_s=6", "batch_wait_ms=300",
           f"hydra.run.dir={tmp_path / 'run'}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_up(proc, url)
        results: dict = {}

        def stream(i, max_tokens):
            lines = []
            try:
                with httpx.stream("POST", url + "/v1/completions", timeout=120, json={
                        "model": "tiny", "prompt": "the cat", "max_tokens": max_tokens, "stream": True,
                        "ignore_eos": True}) as r:
                    results[i] = {"status": r.status_code, "lines": lines}
                    for line in r.iter_lines():
                        if line:
                            lines.append(line)
            except httpx.HTTPError as e:
                results[i] = {"error": repr(e), "lines": lines}

        def plain(i):
            try:
                r = httpx.post(url + "/v1/completions", timeout=120, json={
                    "model": "tiny", "prompt": "the dog", "max_tokens": 15000, "ignore_eos": True})
                results[i] = {"status": r.status_code, "body": r.text, "type": r.headers.get("content-type")}
            except httpx.HTTPError as e:
                results[i] = {"error": repr(e)}

        # stream 0 is short (finishes within the drain time), 1-3 run 15,000 tokens, 4-7 and 8 wait in the queue
        threads = [threading.Thread(target=stream, args=(0, 200))]
        threads += [threading.Thread(target=stream, args=(i, 15000)) for i in range(1, 8)]
        threads += [threading.Thread(target=plain, args=(8,))]
        for t in threads[:4]:  # one engine batch (within batch_wait_ms): 0-3 run
            t.start()
        lines_of = lambda i: results.get(i, {}).get("lines", [])  # noqa: E731
        _wait(lambda: len(lines_of(0)) >= 5 and all(lines_of(i) for i in (1, 2, 3)), timeout=60)
        for t in threads[4:]:  # these wait in the queue behind the running batch
            t.start()

        def queued() -> float:  # the server's own gauge: requests 4-8 accepted and waiting (not still connecting)
            text = httpx.get(url + "/metrics", timeout=10).text
            return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith("nemo_spec_queue_depth{"))

        _wait(lambda: queued() >= 5, timeout=60)
        assert not any(line.endswith("[DONE]") for line in lines_of(0))  # still running at SIGTERM
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        assert proc.wait(60) is not None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    out = proc.stdout.read()
    for i in range(8):
        r = results[i]
        assert "error" not in r, (i, r, out[-3000:])
        lines = r["lines"]
        assert lines[-1] == "data: [DONE]", (i, lines[-3:])
        last = json.loads(lines[-2][6:])
        if i == 0:
            assert last.get("choices", [{}])[0].get("finish_reason") == "length", (lines[-3:], len(lines), out[-3000:])
        else:
            assert last["error"]["code"] == "server_shutdown", last
    r = results[8]
    assert r["status"] == 503 and r["type"].startswith("application/json")
    assert json.loads(r["body"])["error"]["code"] == "server_shutdown"


def _wait_up(proc, url, timeout=240):
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        try:
            if httpx.get(url + "/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "server did not come up"
        time.sleep(0.3)


# ------------------------------------------------------------------------------------ batcher edge cases
# The batcher driven by a scripted engine function, to reach failure orders the real engine produces rarely.

class _Tok:
    def decode(self, ids, **kw):
        return "".join(f"<{i}>" for i in ids)


class _Loop:
    """An asyncio loop in a thread collecting each request's events."""

    def __init__(self):
        import asyncio

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def request(self, prompts, n=1):
        import asyncio

        from nemo_spec.serve.batching import GenRequest, RowSpec

        async def make():
            rows = [RowSpec(list(p), SamplingParams(max_new_tokens=3), i * n + j) for i, p in enumerate(prompts)
                    for j in range(n)]
            return GenRequest(rows=rows, stop=[], loop=self.loop, prompt_tokens=1)

        return asyncio.run_coroutine_threadsafe(make(), self.loop).result()

    def events(self, req):
        import asyncio

        async def drain():
            out = []
            while not req.events.empty():
                out.append(req.events.get_nowait())
            return out

        time.sleep(0.05)
        return asyncio.run_coroutine_threadsafe(drain(), self.loop).result()

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def _engine(gate=None):
    """Rows get tokens [1, 2, 3] unless their prompt is [9] (first token is EOS: on_finish only); a batch with a
    prompt [666] in it raises after the rows' first step."""

    def run(prompts, params, on_tokens, on_finish):
        if gate is not None:
            assert gate.wait(30)
        poison = [666] in prompts
        out = []
        for r, p in enumerate(prompts):
            if p == [9]:
                on_finish(r, "stop")
                out.append(type("R", (), {"tokens": [], "finish_reason": "stop", "stats": {}})())
                continue
            if poison:
                continue
            for t in (1, 2, 3):
                on_tokens(r, [t])
            on_finish(r, "length")
            out.append(type("R", (), {"tokens": [1, 2, 3], "finish_reason": "length", "stats": {}})())
        if poison:
            raise RuntimeError("poison row")
        return out

    return run


def _kinds(events):
    return [e[0] for e in events]


def test_split_request_survives_a_poison_request_in_its_second_batch():
    from nemo_spec.serve.batching import Batcher

    lp, gate = _Loop(), threading.Event()
    b = Batcher(_engine(gate), _Tok(), max_batch=2, max_queue=8, batch_wait_s=0.2)
    try:
        split = lp.request([[5]], n=3)  # rows 0,1 in batch 1; row 2 shares batch 2 with the poison request
        poison = lp.request([[666]])
        b.submit(split)
        b.submit(poison)
        gate.set()
        _wait(lambda: split.done and poison.failed)
        ev = lp.events(split)
        assert _kinds(ev).count("finish") == 3 and "error" not in _kinds(ev), ev
        assert [e for e in lp.events(poison) if e[0] == "error"]
        assert b.metrics.latency.count() == 1 == b.metrics.ttft.count()
    finally:
        b.close()
        lp.close()


def test_a_row_that_ended_before_its_batch_failed_is_not_answered_twice():
    from nemo_spec.serve.batching import Batcher

    lp, gate = _Loop(), threading.Event()
    b = Batcher(_engine(gate), _Tok(), max_batch=4, max_queue=8, batch_wait_s=0.2)
    try:
        eos_first = lp.request([[9]])  # ends through on_finish alone, then the shared batch fails
        poison = lp.request([[666]])
        b.submit(eos_first)
        b.submit(poison)
        gate.set()
        _wait(lambda: poison.failed)
        time.sleep(0.2)
        ev = lp.events(eos_first)
        assert _kinds(ev) == ["finish"], ev
        assert eos_first.rows_done == eos_first.num_rows == 1
        assert b.metrics.completion_tokens.total() == 1  # the eos, once
    finally:
        b.close()
        lp.close()


def test_shutdown_lets_a_running_split_request_drain():
    from nemo_spec.serve.batching import Batcher

    lp, gate = _Loop(), threading.Event()
    b = Batcher(_engine(gate), _Tok(), max_batch=2, max_queue=8, batch_wait_s=0.05)
    try:
        split = lp.request([[5]], n=4)  # two batches of two rows
        queued = lp.request([[6]])
        b.submit(split)
        _wait(lambda: split.next_row == 2)
        b.submit(queued)
        b.begin_shutdown()
        assert [e[0] for e in lp.events(queued)] == ["error"] and not split.failed  # queued: 503 at once
        gate.set()  # the running split request goes on through its second batch during the drain
        _wait(lambda: split.done)
        assert _kinds(lp.events(split)).count("finish") == 4
        gate.clear()
        late = lp.request([[5]], n=4)
        with pytest.raises(Exception):
            b.submit(late)  # closed for new requests
    finally:
        gate.set()
        b.close()
        lp.close()


def test_abort_after_the_drain_ends_running_and_not_yet_started_slices():
    from nemo_spec.serve.batching import Batcher

    lp, gate = _Loop(), threading.Event()
    b = Batcher(_engine(gate), _Tok(), max_batch=2, max_queue=8, batch_wait_s=0.05)
    try:
        split = lp.request([[5]], n=4)
        b.submit(split)
        _wait(lambda: split.next_row == 2)
        b.begin_shutdown()
        b.abort_running()
        gate.set()
        _wait(lambda: split.failed)
        ev = lp.events(split)
        assert ev[-1][0] == "error" and ev[-1][3] == "server_shutdown" and "finish" not in _kinds(ev), ev
        b.close(timeout=10)
        assert not b.alive
    finally:
        gate.set()
        lp.close()


@pytest.mark.parametrize("method,transform,kw", [
    ("eagle", "eagle1", {"num_eagle_layers": 1}),
    ("peagle", "peagle", {"num_eagle_layers": 1, "parallel_depth": 3}),
])
def test_a_client_leaving_mid_batch_does_not_stop_the_worker(tok, method, transform, kw):
    """A speculative server with two running rows: the client of the first (slot 0) disconnects, so its row is
    cancelled and the other moves into its slot with the proposer's per-slot state (draft cache rows, roots,
    pending pairs). The other row runs to its end with the tokens of greedy decoding, the worker stays up and the
    server answers the next request."""
    from nemo_spec.speculative import SpeculativeTransform

    base = tiny_model(tok, max_position_embeddings=4096)
    served = SpeculativeTransform(algorithm=transform, **kw)(clone_model(base)).eval()
    long_body = {"model": "spec", "prompt": "the cat", "max_tokens": 3000, "temperature": 0, "stream": True,
                 "ignore_eos": True}
    other = {"model": "spec", "prompt": "we read code", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    with live_server(served, tok, name="spec", method=method, options={"num_draft_tokens": 3}, max_batch=2,
                     batch_wait_ms=0) as srv:
        batcher = srv.manager.get("spec").batcher
        step = batcher.session.step
        batcher.session.step = lambda: (time.sleep(0.02), step())[1]  # the long row outlives the other's join
        with httpx.Client(timeout=120) as h:
            with h.stream("POST", srv.url + "/v1/completions", json=long_body) as running:
                lines = running.iter_lines()  # kept: a dropped line iterator closes the stream
                next(l for l in lines if l.startswith("data: "))
                pending = ThreadPoolExecutor(1).submit(_post, srv, "/v1/completions", other, 120)
                _wait(lambda: batcher.running_rows == 2)
            # the stream is closed: its row (slot 0) is cancelled while the other one runs
            r = pending.result(timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 40
        ids = tok(other["prompt"], add_special_tokens=False).input_ids
        ref = generate(base, [ids], SamplingParams(max_new_tokens=40), options={"ignore_eos": True})[0].tokens
        assert r.json()["choices"][0]["text"] == served_text(tok, ids, ref)
        assert batcher.alive and srv.app.state.metrics.cancelled.total() >= 1
        nxt = _post(srv, "/v1/completions", {**other, "max_tokens": 4}, 60)
        assert nxt.status_code == 200 and nxt.json()["usage"]["completion_tokens"] == 4


def test_review_found_requests_get_4xx_or_their_defaults(model, tok):
    """Requests an HTTP review found answered with a 500 or wrongly refused: a prompt list with one empty entry
    (500 "generation failed: prompt 1 is empty"), a body nested thousands deep (500 RecursionError), an admin
    load with a non-string path or chat_template (500 TypeError), and null for fields OpenAI lets be null (400;
    the official client sends n=None). Now 400s naming the problem, or the field's default; the server then
    answers a normal request."""
    with live_server(model, tok, name="tiny", admin_key="adm") as srv:
        for prompt in (["the cat", ""], [[5, 6], []]):
            r = _post(srv, "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 2})
            assert r.status_code == 400 and "prompt[1] is empty" in r.json()["error"]["message"], r.text
        deep = ('{"model": "tiny", "prompt": ' + "[" * 5000 + "]" * 5000 + "}").encode()
        for path in ("/v1/completions", "/v1/chat/completions", "/admin/models/load"):
            r = httpx.post(srv.url + path, content=deep, timeout=60, headers={
                "Content-Type": "application/json", "Authorization": "Bearer adm"})
            assert r.status_code == 400 and "nests too deeply" in r.json()["error"]["message"], (path, r.text)
        for field in ("path", "chat_template"):
            r = _post(srv, "/admin/models/load", {"name": "x", "path": "/no/such", field: 5},
                      headers={"Authorization": "Bearer adm"})
            assert r.status_code == 400 and f"{field} must be a string" in r.json()["error"]["message"], r.text
        for field in ("n", "stream", "echo"):
            r = _post(srv, "/v1/completions", {"model": "tiny", "prompt": "the cat", "max_tokens": 2,
                                               "ignore_eos": True, field: None})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, (field, r.text)
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        out = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                        n=None, stream=None)
        assert len(out.choices) == 1 and 1 <= out.usage.completion_tokens <= 2


def test_union_fields_bool_ids_top_logprobs_and_row_limits_are_400s(model, tok, monkeypatch):
    """From a review: a prompt that matched none of its forms was reported as 'prompt.str: Input should be a valid
    string' (same for stop and message content); JSON booleans were taken as token ids 1/0; top_logprobs without
    logprobs was accepted and ignored; a completion of thousands of token-id prompts over max_rows_per_request
    decoded every prompt before it was refused. Now: the field and its accepted forms, 400s, refusal first."""
    with live_server(model, tok, name="tiny", serve={"max_rows_per_request": 8}) as srv:
        cases = [({"prompt": [True, False]}, "prompt", "token ids"), ({"prompt": 5}, "prompt", "a list of strings"),
                 ({"prompt": [[1, 2], "a"]}, "prompt", "token-id lists"),
                 ({"prompt": "x", "stop": 5}, "stop", "a list of strings")]
        for body, param, words in cases:
            r = _post(srv, "/v1/completions", {"model": "tiny", "max_tokens": 2, **body})
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == param and words in err["message"], (body, r.text)
            assert ".str" not in err["message"] and ".list" not in err["message"]
        msg = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": 5}]}
        r = _post(srv, "/v1/chat/completions", msg)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content", r.text
        assert "a list of text parts" in r.json()["error"]["message"]
        chat = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        for extra, words in (({"top_logprobs": 3}, "needs logprobs=true"), ({"top_logprobs": -1}, "top_logprobs")):
            r = _post(srv, "/v1/chat/completions", {**chat, **extra})
            assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
        assert _post(srv, "/v1/chat/completions", {**chat, "top_logprobs": 0}).status_code == 200
        decoded = []
        orig = type(tok).decode
        monkeypatch.setattr(type(tok), "decode", lambda self, ids, *a, **kw: decoded.append(list(ids)) or
                            orig(self, ids, *a, **kw))
        r = _post(srv, "/v1/completions", {"model": "tiny", "max_tokens": 2, "prompt": [[5, 6]] * 3000})
        assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_sequences", r.text
        assert [5, 6] not in decoded  # refused before any prompt was decoded (the worker may still decode output)
        ok = _post(srv, "/v1/completions", {"model": "tiny", "max_tokens": 2, "prompt": [5, 6], "echo": True,
                                            "ignore_eos": True, "temperature": 0})
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"].startswith(tok.decode([5, 6]))


def test_a_big_body_is_validated_off_the_event_loop(model, tok, monkeypatch):
    """A few MB of JSON take seconds to validate: three 3.5 MB prompts validated on the event loop stalled /health
    for 2.8 s (found by review). A body of BIG_BODY_BYTES or more is now validated in a worker thread (as it was
    already parsed there); a small one stays on the loop. Checked by where the validation runs, not by timing."""
    import nemo_spec.serve.app as app_mod

    where, real = [], app_mod._validate
    monkeypatch.setattr(app_mod, "_validate", lambda cls, data: (where.append(threading.get_ident()),
                                                                  real(cls, data))[1])
    with live_server(model, tok, name="tiny") as srv:
        small = _post(srv, "/v1/completions", {"model": "tiny", "prompt": "the cat", "max_tokens": 1})
        big = _post(srv, "/v1/completions", {"model": "tiny", "prompt": [[5]] * 40000, "max_tokens": 1})
    assert small.status_code == 200 and big.status_code == 400  # more rows than max_rows_per_request
    assert where == [srv._thread.ident, where[1]] and where[1] != srv._thread.ident  # loop thread, then a worker
