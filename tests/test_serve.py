"""End-to-end tests of the OpenAI-compatible server: a real uvicorn server on 127.0.0.1 serving a tiny real
megatron-core GPT with a BPE tokenizer trained in the test, driven by the official ``openai`` client."""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jinja2
import openai
import pytest

from nemo_spec.inference import SamplingParams, generate
from tests.serve_utils import CHAT_TEMPLATE, clone_model, live_server, served_text, tiny_model, train_tokenizer

PROMPTS = ["the cat sat on", "we read code ,", "hello world , this", "def main ( ) :", "birds sang in trees",
           "numbers 1 2 3", "the dog ran to", "fix bugs and ship", "a tiny model for", "write tests , fix",
           "the park while", "return 0 the cat", "sat on a mat and", "hello ! 4 5", "we ship fast .", "model for serving"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return train_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def model(tok):
    return tiny_model(tok)


@pytest.fixture(scope="module")
def ref(model):
    return clone_model(model)  # own engine + caches: reference generate() never races the server's worker


@pytest.fixture(scope="module")
def server(model, tok):
    with live_server(model, tok, name="tiny", max_batch=16) as srv:
        yield srv


def client(srv, key="unused"):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=60)


def greedy(ref, tok, ids, max_tokens):
    return generate(ref, [ids], SamplingParams(temperature=0.0, max_new_tokens=max_tokens,
                                               stop_token_ids=(tok.eos_token_id,)))[0]


def chat_ids(tok, messages):
    text = jinja2.Template(CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=True,
                                                 eos_token=tok.eos_token, bos_token=tok.bos_token)
    return tok(text, add_special_tokens=False).input_ids


def expected_usage(res):
    return len(res.tokens) + (1 if res.finish_reason == "stop" else 0)  # eos is counted, as it was generated


def long_output(ref, tok, min_chars=14, max_tokens=24):
    for p in PROMPTS:
        ids = tok(p).input_ids
        res = greedy(ref, tok, ids, max_tokens)
        text = served_text(tok, ids, res.tokens)
        if len(text) >= min_chars:
            return p, ids, res, text
    pytest.fail("no prompt gave a long enough greedy output")


# ------------------------------------------------------------------------------------------------ basics

def test_models_health_and_metrics(server):
    c = client(server)
    ids = [m.id for m in c.models.list().data]
    assert ids == ["tiny"]
    r = httpx.get(server.url + "/health")
    assert r.status_code == 200 and r.json()["models"] == ["tiny"]
    c.completions.create(model="tiny", prompt="the cat", max_tokens=3, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    for name in ("nemo_spec_requests_total", "nemo_spec_prompt_tokens_total", "nemo_spec_completion_tokens_total",
                 "nemo_spec_request_latency_seconds_bucket", "nemo_spec_acceptance_length_count",
                 "nemo_spec_queue_depth", "nemo_spec_batch_size_bucket"):
        assert name in text, name
    line = [l for l in text.splitlines()
            if l.startswith('nemo_spec_requests_total{code="200",endpoint="/v1/completions"}')]
    assert line and float(line[0].split()[-1]) >= 1


def test_completion_greedy_equals_generate(server, ref, tok):
    c = client(server)
    for p in PROMPTS[:3]:
        ids = tok(p).input_ids
        res = greedy(ref, tok, ids, 20)
        out = c.completions.create(model="tiny", prompt=p, max_tokens=20, temperature=0)
        assert out.object == "text_completion"
        assert out.choices[0].text == served_text(tok, ids, res.tokens)
        assert out.choices[0].finish_reason == res.finish_reason
        assert out.usage.prompt_tokens == len(ids)
        assert out.usage.completion_tokens == expected_usage(res)
        assert out.usage.total_tokens == len(ids) + expected_usage(res)
    out = c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=20, temperature=0, echo=True)
    ids = tok(PROMPTS[0]).input_ids
    assert out.choices[0].text == PROMPTS[0] + served_text(tok, ids, greedy(ref, tok, ids, 20).tokens)
    # token-id prompts are accepted as well
    ids = tok(PROMPTS[0]).input_ids
    out = c.completions.create(model="tiny", prompt=ids, max_tokens=20, temperature=0)
    assert out.choices[0].text == served_text(tok, ids, greedy(ref, tok, ids, 20).tokens)


def test_chat_greedy_equals_generate_with_tokenizer_template(server, ref, tok):
    c = client(server)
    messages = [{"role": "system", "content": "we read code"}, {"role": "user", "content": "hello world"}]
    ids = chat_ids(tok, messages)
    res = greedy(ref, tok, ids, 16)
    out = c.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0)
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == served_text(tok, ids, res.tokens)
    assert out.choices[0].finish_reason == res.finish_reason
    assert out.usage.prompt_tokens == len(ids)
    assert out.usage.completion_tokens == expected_usage(res)


def test_chat_extensions_as_vllm(server, ref, tok):
    """vLLM's chat extensions (vllm 0.34.0 entrypoints/openai/chat_completion/protocol.py:327-388) were accepted and
    ignored: continue_final_message closed the assistant turn, echo did nothing, chat_template_kwargs never reached
    the template, several text parts were glued without their newline (chat_message.py:419)."""
    c = client(server)
    conv = [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "sat on"}]
    text = tok.apply_chat_template(conv, tokenize=False, continue_final_message=True)  # transformers, as vLLM
    ids = tok(text, add_special_tokens=False).input_ids
    res = greedy(ref, tok, ids, 8)
    for echo in (False, True):
        out = c.chat.completions.create(model="tiny", messages=conv, max_tokens=8, temperature=0,
                                        extra_body={"continue_final_message": True, "add_generation_prompt": False,
                                                    "echo": echo})
        assert out.usage.prompt_tokens == len(ids)
        assert out.choices[0].message.content == ("sat on" if echo else "") + served_text(tok, ids, res.tokens)
        chunks = list(c.chat.completions.create(model="tiny", messages=conv, max_tokens=8, temperature=0, stream=True,
                                                extra_body={"continue_final_message": True, "echo": echo,
                                                            "add_generation_prompt": False}))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == out.choices[0].message.content
    # without a generation prompt the reply takes the last message's role, and echo applies to it (serving.py:441-444)
    user_last = [{"role": "user", "content": "the cat"}]
    out = c.chat.completions.create(model="tiny", messages=user_last, max_tokens=4, temperature=0,
                                    extra_body={"add_generation_prompt": False, "echo": True})
    assert out.choices[0].message.role == "user" and out.choices[0].message.content.startswith("the cat")
    parts = [{"role": "user", "content": [{"type": "text", "text": "the cat"}, {"type": "text", "text": "sat on"}]}]
    out = c.chat.completions.create(model="tiny", messages=parts, max_tokens=1)
    assert out.usage.prompt_tokens == len(chat_ids(tok, [{"role": "user", "content": "the cat\nsat on"}]))
    for bad, param in ((dict(extra_body={"continue_final_message": True}), "continue_final_message"),
                       (dict(stream_options={"include_usage": True}), "stream_options"),
                       (dict(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}),
                        "stream_options"),
                       (dict(tool_choice="required"), "tool_choice"),
                       (dict(extra_body={"chat_template_kwargs": {"tokenize": True}}), "chat_template_kwargs")):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="tiny", messages=conv, max_tokens=1, **bad)
        assert e.value.body["param"] == param, bad


def test_streaming_matches_non_streaming(server, ref, tok):
    c = client(server)
    p, ids, res, text = long_output(ref, tok)
    chunks = list(c.completions.create(model="tiny", prompt=p, max_tokens=24, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    pieces = [ch.choices[0].text for ch in chunks if ch.choices]
    assert "".join(pieces) == text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == res.finish_reason
    assert chunks[-1].usage.completion_tokens == expected_usage(res)
    assert chunks[-1].usage.prompt_tokens == len(ids)

    messages = [{"role": "user", "content": p}]
    cres = greedy(ref, tok, chat_ids(tok, messages), 24)
    chunks = list(c.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0,
                                            stream=True))
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    assert content == served_text(tok, chat_ids(tok, messages), cres.tokens)
    assert chunks[-1].choices[0].finish_reason == cres.finish_reason


def test_raw_sse_ends_with_done(server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "the cat"}], "max_tokens": 6,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [l for l in r.iter_lines() if l]
    assert all(l.startswith("data: ") for l in lines)
    assert lines[-1] == "data: [DONE]"
    objs = [json.loads(l[6:]) for l in lines[:-1]]
    assert {o["object"] for o in objs} == {"chat.completion.chunk"}
    assert len({o["id"] for o in objs}) == 1


def test_stop_strings(server, ref, tok):
    c = client(server)
    p, ids, res, text = long_output(ref, tok)
    stop = text[6:9]
    cut = text.find(stop)
    out = c.completions.create(model="tiny", prompt=p, max_tokens=24, temperature=0, stop=[stop, "zzzz"])
    assert out.choices[0].text == text[:cut]
    assert out.choices[0].finish_reason == "stop"
    # usage counts the tokens up to the one that completed the stop string
    n = next(k for k in range(1, len(res.tokens) + 1)
             if stop in served_text(tok, ids, res.tokens[:k]))
    assert out.usage.completion_tokens == n
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="tiny", prompt=p, max_tokens=24, temperature=0, stop=stop, stream=True) if ch.choices)
    assert streamed == text[:cut]


def test_n_and_seed(server, ref, tok):
    c = client(server)
    p = PROMPTS[1]
    res = greedy(ref, tok, tok(p).input_ids, 10)
    out = c.completions.create(model="tiny", prompt=p, max_tokens=10, temperature=0, n=3)
    assert [ch.index for ch in out.choices] == [0, 1, 2]
    assert {ch.text for ch in out.choices} == {served_text(tok, tok(p).input_ids, res.tokens)}
    assert out.usage.completion_tokens == 3 * expected_usage(res)
    assert out.usage.prompt_tokens == len(tok(p).input_ids)

    kw = dict(model="tiny", messages=[{"role": "user", "content": p}], max_tokens=12, temperature=1.5, top_p=0.95,
              n=4, seed=7, extra_body={"top_k": 40})
    a = c.chat.completions.create(**kw)
    b = c.chat.completions.create(**kw)
    assert [ch.message.content for ch in a.choices] == [ch.message.content for ch in b.choices]  # seeded
    assert len({ch.message.content for ch in a.choices}) > 1  # each choice samples its own sequence
    assert a.usage.completion_tokens >= 4
    streamed = {}
    for ch in c.chat.completions.create(**kw, stream=True):
        for choice in ch.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + (choice.delta.content or "")
    assert [streamed[i] for i in range(4)] == [ch.message.content for ch in a.choices]


# ------------------------------------------------------------------------------------------------ concurrency

def test_16_concurrent_streams(server, ref, tok):
    expected = {}
    for p in PROMPTS:
        ids = chat_ids(tok, [{"role": "user", "content": p}])
        expected[p] = served_text(tok, ids, greedy(ref, tok, ids, 16).tokens)
    batches_before = server.manager.get("tiny").batcher.batches_run
    barrier = threading.Barrier(len(PROMPTS))

    def one(p):
        c = client(server)
        barrier.wait(timeout=30)
        chunks = 0
        text = ""
        for ch in c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": p}], max_tokens=16,
                                            temperature=0, stream=True):
            if ch.choices and ch.choices[0].delta.content:
                text += ch.choices[0].delta.content
                chunks += 1
        return p, text, chunks

    t0 = time.monotonic()
    with ThreadPoolExecutor(len(PROMPTS)) as ex:
        results = list(ex.map(one, PROMPTS, timeout=120))
    assert time.monotonic() - t0 < 120
    assert len(results) == 16
    for p, text, chunks in results:
        assert text == expected[p], p
    batches = server.manager.get("tiny").batcher.batches_run - batches_before
    assert batches < 16, f"16 concurrent requests ran in {batches} engine batches: no dynamic batching"


# ------------------------------------------------------------------------------------------------ errors

def test_bad_requests_get_openai_errors_and_server_keeps_serving(server, tok):
    url = server.url
    c = client(server)

    def check(resp, status, param=None):
        assert resp.status_code == status, resp.text
        err = resp.json()["error"]
        assert set(err) >= {"message", "type", "param", "code"} and err["message"]
        if param:
            assert err["param"] == param
        ok = c.completions.create(model="tiny", prompt="the cat", max_tokens=2, temperature=0)
        assert ok.choices[0].finish_reason in ("stop", "length")

    post = lambda path, **kw: httpx.post(url + path, timeout=30, **kw)
    check(post("/v1/chat/completions", content=b'{"model": "tiny", "messages": [', headers={"content-type": "application/json"}), 400)
    check(post("/v1/completions", content=b"[1, 2]"), 400)
    check(post("/v1/completions", json={"model": "tiny", "prompt": "x", "temperature": -1}), 400, "temperature")
    check(post("/v1/completions", json={"model": "tiny", "prompt": "x", "top_p": 1.5}), 400, "top_p")
    check(post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 0}), 400, "max_tokens")
    check(post("/v1/completions", json={"model": "tiny", "prompt": "x", "n": 0}), 400, "n")
    check(post("/v1/completions", json={"model": "tiny", "prompt": "x", "n": 65}), 400, "n")  # n <= 64
    check(post("/v1/completions", json={"model": "tiny", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}), 400)
    check(post("/v1/completions", json={"model": "tiny", "prompt": "x", "logprobs": 2}), 400, "logprobs")
    check(post("/v1/completions", json={"model": "tiny", "prompt": "x", "logprobs": 0}), 400, "logprobs")  # was ignored
    for field, value in (("presence_penalty", 0.5), ("frequency_penalty", -1), ("logit_bias", {"5": 100})):
        check(post("/v1/completions", json={"model": "tiny", "prompt": "x", field: value}), 400, field)
    # vLLM's sampling extensions were ignored silently (unknown fields are); any value but their off value is a 400
    for field, value in (("repetition_penalty", 1.2), ("min_p", 0.1), ("min_tokens", 4), ("stop_token_ids", [5]),
                         ("include_stop_str_in_output", True), ("skip_special_tokens", False), ("bad_words", ["x"]),
                         ("structured_outputs", {"choice": ["a"]})):
        check(post("/v1/completions", json={"model": "tiny", "prompt": "x", field: value}), 400, field)
        check(post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                                 field: value}), 400, field)
    for field, value in (("repetition_penalty", 1.0), ("min_tokens", 0), ("stop_token_ids", []), ("min_p", None),
                         ("skip_special_tokens", True), ("some_other_field", 3)):  # off, or unknown: served
        assert post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1, field: value}) \
            .status_code == 200
    check(post("/v1/completions", json={"model": "tiny", "prompt": [10**6]}), 400, "prompt")
    check(post("/v1/completions", json={"prompt": "x"}), 400, "model")
    check(post("/v1/chat/completions", json={"model": "tiny", "messages": []}), 400, "messages")
    check(post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}), 400)
    check(post("/v1/chat/completions", json={"model": "nope", "messages": [{"role": "user", "content": "x"}]}), 404,
          "model")
    long_prompt = " ".join(["the cat sat on a mat"] * 100)
    check(post("/v1/completions", json={"model": "tiny", "prompt": long_prompt}), 400, "prompt")
    check(post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": long_prompt}]}),
          400, "messages")
    check(post("/v1/completions", json={"model": "tiny", "prompt": "the cat", "max_tokens": 10**5}), 400, "max_tokens")
    check(httpx.get(url + "/v1/nothing-here"), 404)
    # the official client maps them to its exception types
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="tiny", prompt=long_prompt, max_tokens=5)
    assert e.value.code == "context_length_exceeded"


# ------------------------------------------------------------------------------------------------ queue, cancel

@pytest.fixture(scope="module")
def slow_server(model, tok):
    # one row per batch, one waiting slot
    # long context so a 3000-token request runs for many seconds unless it is cancelled
    with live_server(tiny_model(tok, max_position_embeddings=4096), tok, name="slow", max_batch=1, max_queue=1, batch_wait_ms=0) as srv:
        yield srv


def _wait(cond, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


def test_queue_full_gives_503_and_disconnect_cancels(slow_server):
    srv = slow_server
    batcher = srv.manager.get("slow").batcher
    body = {"model": "slow", "prompt": "the cat", "max_tokens": 3000, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", srv.url + "/v1/completions", json=body) as running:
            it = running.iter_lines()
            first = next(l for l in it if l.startswith("data: "))
            assert json.loads(first[6:])["object"] == "text_completion"
            # real streaming: text arrives while the 3000-token generation is still running
            assert batcher.running_rows == 1
            assert srv.app.state.metrics.completion_tokens.total() == 0
            # one request waits in the queue ...
            waiting = ThreadPoolExecutor(1).submit(
                httpx.post, srv.url + "/v1/completions",
                json={"model": "slow", "prompt": "the dog", "max_tokens": 3, "temperature": 0}, timeout=120)
            _wait(lambda: batcher.queue_depth() == 1)
            # ... so the next one is rejected, OpenAI style
            r = h.post(srv.url + "/v1/completions", json={"model": "slow", "prompt": "x", "max_tokens": 2})
            assert r.status_code == 503
            assert r.json()["error"]["code"] == "queue_full"
            # closing the stream (client disconnect) cancels the 200-token generation
        cancelled = srv.app.state.metrics.cancelled
        _wait(lambda: cancelled.total() >= 1)
        assert waiting.result(timeout=60).status_code == 200
        assert srv.app.state.metrics.rejected.total() >= 1
        ok = h.post(srv.url + "/v1/completions", json={"model": "slow", "prompt": "the cat", "max_tokens": 3,
                                                       "temperature": 0, "ignore_eos": True})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


def test_non_streamed_disconnect_cancels(slow_server):
    srv = slow_server
    cancelled = srv.app.state.metrics.cancelled
    before = cancelled.total()
    body = {"model": "slow", "prompt": "the cat", "max_tokens": 3000, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
    _wait(lambda: cancelled.total() > before, timeout=30)
    _wait(lambda: srv.manager.get("slow").batcher.running_rows == 0, timeout=30)
    ok = httpx.post(srv.url + "/v1/completions", json={"model": "slow", "prompt": "the cat", "max_tokens": 2,
                                                       "temperature": 0, "ignore_eos": True}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
