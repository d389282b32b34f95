"""Unit tests of the server's parts: incremental detokenization + stop strings, sandboxed chat templates,
Prometheus text, the typed config and its Hydra YAML, request validation, and the throughput benchmark."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from nemo_spec.config import ConfigError
from nemo_spec.serve.batching import IncrementalDecoder
from nemo_spec.serve.chat_template import ChatTemplate, ChatTemplateError
from nemo_spec.serve.config import ModelSpec, ServeConfig
from nemo_spec.serve.metrics import ServerMetrics
from nemo_spec.serve.protocol import ChatCompletionRequest, CompletionRequest
from tests.helpers import ROOT
from tests.serve_utils import live_server, served_text, tiny_model, train_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return train_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def byte_tok(tmp_path_factory):
    """A byte-level BPE: non-ASCII characters span several tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(["plain ascii words only here"] * 20,
                          trainers.BpeTrainer(vocab_size=280, special_tokens=["</s>"],
                                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=t, eos_token="</s>")


# ------------------------------------------------------------------------------------------------ detokenizer

def _feed(tok, ids, chunk, stop=()):
    dec = IncrementalDecoder(tok, stop)
    pieces = []
    for i in range(0, len(ids), chunk):
        pieces.append(dec.add(ids[i:i + chunk]))
        if dec.stopped:
            break
    pieces.append(dec.flush())
    return pieces, dec


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_incremental_decoder_reassembles_text(tok, chunk):
    text = "the cat sat on a mat , we read code and ship fast ."
    ids = tok(text, add_special_tokens=False).input_ids
    pieces, _ = _feed(tok, ids, chunk)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True) == text


def test_incremental_decoder_never_emits_partial_characters(byte_tok):
    text = "plain café ünïcode 漢字 and 🙂 emoji"
    ids = byte_tok(text, add_special_tokens=False).input_ids
    assert len(ids) > len(text.split())  # multi-byte characters really span tokens
    pieces, _ = _feed(byte_tok, ids, 1)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_incremental_decoder_stop_strings(tok, chunk):
    text = "the cat sat on a mat , we read code"
    ids = tok(text, add_special_tokens=False).input_ids
    pieces, dec = _feed(tok, ids, chunk, stop=["mat ,", "zzz"])
    assert "".join(pieces) == "the cat sat on a "
    assert dec.stopped
    # tokens kept = exactly those needed for the stop string to appear
    n = len(dec.tokens)
    assert "mat ," in tok.decode(ids[:n]) and "mat ," not in tok.decode(ids[:n - 1])
    # text that only looks like the start of a stop string is held back, then released at the end
    dec = IncrementalDecoder(tok, ["mat and"])
    out = dec.add(tok("the cat sat on a mat", add_special_tokens=False).input_ids)
    assert out == "the cat sat on a " and dec.flush() == "mat"


@pytest.mark.parametrize("chunk", [1, 3])
def test_incremental_decoder_continues_the_prompt(tok, chunk):
    # a SentencePiece (Metaspace) decode drops the first token's space at the start of a text: decoded alone, " a mat"
    # came back as "a mat", and echo returned "the cat sat ona mat"; primed with the prompt it is the continuation
    prompt = tok("the cat sat on", add_special_tokens=False).input_ids
    comp = tok(" a mat and the dog", add_special_tokens=False).input_ids
    assert tok.convert_ids_to_tokens(comp)[0].startswith("\u2581")
    dec = IncrementalDecoder(tok, (), prompt)
    text = "".join(dec.add(comp[i:i + chunk]) for i in range(0, len(comp), chunk)) + dec.flush()
    assert text == " a mat and the dog" == served_text(tok, prompt, comp)
    assert tok.decode(prompt) + text == tok.decode(prompt + comp)
    assert dec.tokens == comp  # what usage counts: the generated tokens only


def test_incremental_decoder_completes_a_character_the_prompt_cut(tok):
    # a prompt of token ids cut inside a multi-byte character (SentencePiece byte fallback): its bytes decode to
    # U+FFFD until the output completes the character; decoding after them cut the output's text by the length of the
    # replacement characters ('x y' for '€ x y'); the cut character is the output's now, in the server and generate()
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    from nemo_spec.inference.sampling import continuation_text

    vocab = {"<unk>": 0, "\u2581abc": 1, "<0xE2>": 2, "<0x82>": 3, "<0xAC>": 4, "\u2581x": 5, "\u2581y": 6, "<s>": 7}
    rust = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    rust.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                      decoders.Strip(" ", 1, 0)])  # Llama 2's decoder
    bf = PreTrainedTokenizerFast(tokenizer_object=rust, bos_token="<s>")
    for prompt, out in (([1, 2, 3], [4, 5, 6]), ([1, 2], [3, 4, 5, 6])):
        assert bf.decode(prompt + out) == "abc€ x y"
        for chunk in (1, 3):
            dec = IncrementalDecoder(bf, (), prompt)
            text = "".join(dec.add(out[i:i + chunk]) for i in range(0, len(out), chunk)) + dec.flush()
            assert text == "€ x y" == continuation_text(bf, prompt, out), (prompt, chunk, text)
    # a context of special tokens only (generate.py's empty prompt is [BOS]): skipped, as the server skips them, so
    # the first word's space is stripped as at the start of a text (generate() kept "<s>" and printed " x y")
    assert continuation_text(bf, [7], [5, 6]) == "x y" == served_text(bf, [7], [5, 6])
    dec = IncrementalDecoder(bf, (), [7])
    assert dec.add([5, 6]) + dec.flush() == "x y"


# ------------------------------------------------------------------------------------------------ templates

def test_chat_template_sources(tok, tmp_path):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    own = ChatTemplate.for_tokenizer(tok)
    assert own.origin == "tokenizer"
    assert own.render(msgs, True) == "<system>be brief</s><user>hi</s><assistant>"
    assert own.render(msgs, False) == "<system>be brief</s><user>hi</s>"
    assert own.stop_strings == []

    class NoTemplate:  # a tokenizer without a chat template -> the documented ChatML default
        chat_template = None
        bos_token, eos_token = "<s>", "</s>"

        def get_vocab(self):
            return {}

    default = ChatTemplate.for_tokenizer(NoTemplate())
    assert default.origin == "default"
    assert default.render(msgs, True) == ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                                          "<|im_start|>assistant\n")
    assert default.stop_strings == ["<|im_end|>"]

    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    from_file = ChatTemplate.for_tokenizer(tok, str(f))
    assert from_file.render(msgs, True) == "[system] be brief\n[user] hi\n"
    with pytest.raises(ChatTemplateError, match="neither"):
        ChatTemplate.for_tokenizer(tok, str(tmp_path / "missing.jinja"))


@pytest.mark.parametrize("evil", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",  # attribute escape
    "{% set l = [] %}{{ l.append(1) }}",  # mutation (immutable sandbox)
    "{{ raise_exception('nope') }}",
    "{% for m in messages %}{{ m['content'] ",  # does not compile
])
def test_chat_template_is_sandboxed(tok, evil):
    with pytest.raises(ChatTemplateError):
        ChatTemplate.for_tokenizer(tok, evil)


# templates written the way real models' are: what each renders to is what transformers' own apply_chat_template
# (which vLLM 0.34.0 renders with: renderers/hf.py:920-925) gives for the same messages
REAL_WORLD_TEMPLATES = {
    "strftime_now": "{{ bos_token }}Today: {{ strftime_now('%Y-%m-%d') }}{% for m in messages %}[{{ m['role'] }}]"
                    "{{ m['content'] }}{% endfor %}",  # Mistral-Small-3.1: unguarded
    "loop_break": "{% for m in messages %}{% if m['role'] == 'system' %}{% break %}{% endif %}{{ m['content'] }}"
                  "{% endfor %}",
    "tools_none": "{% if tools is not none %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
                  "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{{ eos_token }}{% endfor %}",
    "special_tokens": "{{ unk_token }}|{{ pad_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
    "trailing_newline": "{% for m in messages %}{{ m['content'] }}\n{% endfor %}{{ eos_token }}\n",
    "generation_block": "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}"
                        "{{ eos_token }}{% endgeneration %}{% else %}<{{ m['role'] }}>{{ m['content'] }}{% endif %}"
                        "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}",
    "tool_calls": "{% for m in messages %}<{{ m['role'] }}>{% if m.tool_calls is defined %}{% for c in m.tool_calls %}"
                  "{{ c.function.name }}({{ c.function.arguments.x }}){% endfor %}{% endif %}{% if m.tool_call_id is "
                  "defined %}#{{ m.tool_call_id }}{% endif %}{{ m['content'] }}{% endfor %}",
    "thinking": "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}"
                "<assistant>{% if enable_thinking is defined and enable_thinking is false %}<think></think>{% endif %}"
                "{% endif %}",
    "developer": "{% for m in messages %}{% if m['role'] == 'developer' %}(dev){% endif %}{{ m['content'] }}"
                 "{% endfor %}",
}


@pytest.mark.parametrize("name", sorted(REAL_WORLD_TEMPLATES))
def test_chat_templates_render_as_transformers(tok, name):
    """Each template renders as transformers renders it (was: strftime_now and {% break %} failed to load, tools
    rendered as [], unk/pad tokens empty, trailing newlines kept, {% generation %} refused), through the server's
    ChatTemplate and through the environment used for tokenizers without apply_chat_template."""
    from nemo_spec.data.chat import _render_own
    from nemo_spec.serve.chat_template import messages_to_dicts
    from nemo_spec.serve.protocol import ChatMessage

    src = REAL_WORLD_TEMPLATES[name]
    wire = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "ok", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 3}'}}]},
            {"role": "tool", "content": "3", "tool_call_id": "c1"}, {"role": "user", "content": "more"}]
    msgs = messages_to_dicts([ChatMessage.model_validate(m) for m in wire])
    assert msgs[2]["tool_calls"][0]["function"]["arguments"] == {"x": 3}  # JSON text -> object, as vLLM passes it
    ours = ChatTemplate.for_tokenizer(tok, src)
    ref_msgs = [dict(m) for m in msgs]
    for gen in (True, False):
        want = tok.apply_chat_template(ref_msgs, chat_template=src, tokenize=False, add_generation_prompt=gen)
        assert ours.render(msgs, gen) == want
        assert _render_own(tok, src, [dict(m) for m in msgs], gen, False, {}) == want
    if name == "thinking":  # chat_template_kwargs reach the template; names it does not read are dropped
        want = tok.apply_chat_template(ref_msgs, chat_template=src, tokenize=False, add_generation_prompt=True,
                                       enable_thinking=False)
        assert want.endswith("<think></think>")
        assert ours.render(msgs, True, template_kwargs={"enable_thinking": False, "unused": 1}) == want
    if name == "developer":  # a template that knows the developer role gets it as is (vLLM: hf.py:607-608)
        dev = [{"role": "developer", "content": "d"}, {"role": "user", "content": "u"}]
        assert ours.render(dev, False) == "(dev)du"


def test_chat_template_developer_role_and_continue_final_message(tok):
    own = ChatTemplate.for_tokenizer(tok)  # <role>content</s>: names no developer role
    # developer -> system, all system messages merged at the front (vLLM 0.34.0 renderers/hf.py:611-663)
    msgs = [{"role": "system", "content": "a"}, {"role": "user", "content": "u"}, {"role": "developer", "content": "b"}]
    assert own.render(msgs, False) == "<system>a\n\nb</s><user>u</s>"
    # continue_final_message: the last message is left open, as transformers renders it
    conv = [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "sat on"}]
    want = tok.apply_chat_template(conv, tokenize=False, continue_final_message=True)
    assert want == "<user>the cat</s><assistant>sat on"
    assert own.render(conv, False, continue_final_message=True) == want
    from nemo_spec.data.chat import _render_own
    assert _render_own(tok, own.source, [dict(m) for m in conv], False, True, {}) == want
    with pytest.raises(ChatTemplateError, match="continue_final_message"):
        own.render(conv, True, continue_final_message=True)


# ------------------------------------------------------------------------------------------------ metrics

def test_prometheus_text():
    m = ServerMetrics()
    m.requests.inc(endpoint="/v1/completions", code="200")
    m.requests.inc(endpoint="/v1/completions", code="200")
    m.requests.inc(endpoint='we"ird\\', code="400")
    m.latency.observe(0.3)
    m.latency.observe(7.0)
    m.queue_depth.set(3, model="tiny")
    text = m.render()
    lines = text.splitlines()
    assert "# TYPE nemo_spec_requests_total counter" in lines
    assert 'nemo_spec_requests_total{code="200",endpoint="/v1/completions"} 2' in lines
    assert 'nemo_spec_requests_total{code="400",endpoint="we\\"ird\\\\"} 1' in lines
    assert 'nemo_spec_request_latency_seconds_bucket{le="0.25"} 0' in lines
    assert 'nemo_spec_request_latency_seconds_bucket{le="0.5"} 1' in lines
    assert 'nemo_spec_request_latency_seconds_bucket{le="+Inf"} 2' in lines
    assert "nemo_spec_request_latency_seconds_count 2" in lines
    assert "nemo_spec_request_latency_seconds_sum 7.3" in lines
    assert 'nemo_spec_queue_depth{model="tiny"} 3' in lines
    assert text.endswith("\n")


# ------------------------------------------------------------------------------------------------ config

def test_serve_yaml_maps_onto_serve_config():
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose("serve", overrides=["model.path=/ckpt/a", "model.method=eagle_tree", "model.max_batch=16",
                                          "port=9000", "api_keys=[k1,k2]", "admin_key=adm",
                                          "+model.options.depth=4"])
    sc = ServeConfig.from_dict(OmegaConf.to_container(cfg, resolve=True), "serve.yaml")
    assert (sc.port, sc.api_keys, sc.admin_key) == (9000, ["k1", "k2"], "adm")
    assert len(sc.models) == 1
    m = sc.models[0]
    assert (m.path, m.method, m.max_batch, m.options) == ("/ckpt/a", "eagle_tree", 16, {"depth": 4})
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        bare = compose("serve")
    assert ServeConfig.from_dict(OmegaConf.to_container(bare, resolve=True)).models == []  # path null: none


def test_serve_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="method"):
        ModelSpec(name="m", path="/x", method="speculate").validate()
    with pytest.raises(ConfigError, match="draft_path"):
        ModelSpec(name="m", path="/x", method="draft_model").validate()
    with pytest.raises(ConfigError, match="max_batch"):
        ModelSpec(name="m", path="/x", max_batch=0).validate()
    with pytest.raises(ConfigError, match="unknown ModelSpec field"):
        ModelSpec.from_dict({"name": "m", "pth": "/x"})
    with pytest.raises(ConfigError, match="unknown serve key"):
        ServeConfig.from_dict({"hots": "0.0.0.0"})
    with pytest.raises(ConfigError, match="duplicate"):
        ServeConfig.from_dict({"models": [{"name": "a", "path": "/x"}, {"name": "a", "path": "/y"}]})
    with pytest.raises(ConfigError, match="max_queue"):
        ServeConfig(max_queue=0).validate()
    with pytest.raises(ConfigError, match=r"unknown generation option\(s\) \['top-k'\]"):
        ModelSpec(name="m", path="/x", method="eagle_tree", options={"top-k": 4}).validate()


def test_serve_methods_are_the_engine_methods(tok):
    """Every generation method is servable (the serve config keeps its own copy of the list: no heavy import)."""
    from nemo_spec.inference.proposers import METHODS as ENGINE_METHODS
    from nemo_spec.serve.config import METHODS
    from nemo_spec.serve.models import build_served_model
    from nemo_spec.speculative import SpeculativeTransform

    assert METHODS == ENGINE_METHODS
    for m in ("peagle", "dflash"):
        assert ModelSpec(name="m", path="/x", method=m, options={"num_draft_tokens": 2}).validate().method == m
    eagle = SpeculativeTransform(algorithm="eagle1", num_eagle_layers=1)(tiny_model(tok)).eval()
    for m in ("peagle", "dflash"):  # a draft of another algorithm: refused at load, naming the method
        with pytest.raises(ConfigError, match=m):
            build_served_model(ModelSpec(name="m", method=m), model=eagle, tokenizer=tok)


def test_max_context_beyond_model_is_rejected(tok):
    from nemo_spec.serve.models import build_served_model

    with pytest.raises(ConfigError, match="max_context"):
        build_served_model(ModelSpec(name="m", max_context=10_000), model=tiny_model(tok), tokenizer=tok)


# ------------------------------------------------------------------------------------------------ protocol

def test_request_models():
    r = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        "stop": "x", "unknown_field": 1})
    # text parts are joined with newlines, as vLLM joins them (vllm 0.34.0 renderers/chat_utils/chat_message.py:419)
    assert r.messages[0].text() == "a\nb" and r.stop_list() == ["x"] and r.n == 1
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "a"}],
                                              "stop": ["a", "b", "c", "d", "e"]})
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"model": "m", "prompt": []})
    assert CompletionRequest.model_validate({"model": "m", "prompt": [[1, 2], [3]]}).prompt == [[1, 2], [3]]


# ------------------------------------------------------------------------------------------------ benchmark

@pytest.mark.slow
def test_benchmark_counts_exact_tokens(tok):
    from nemo_spec.serve.benchmark import format_table, run_benchmark

    with live_server(tiny_model(tok), tok, name="tiny", max_batch=8) as srv:
        res = run_benchmark(srv.url + "/v1", "tiny", levels=(1, 4), requests=4, max_tokens=6,
                            prompts=["the cat", "we read"], warmup=False, client_process=True)
        assert srv.manager.get("tiny").batcher.batches_run < 8  # the 4-stream level shared batches
    assert [r.concurrency for r in res] == [1, 4]
    assert all(r.completion_tokens == 4 * 6 for r in res)  # ignore_eos: every stream runs max_tokens
    assert res[0].speedup_vs_sequential == 1.0 and res[1].speedup_vs_sequential > 0
    assert "x_sequential" in format_table(res)


def test_shutdown_cancels_running_generation(tok):
    """Server shutdown stops a long generation at its next step instead of waiting for it to finish."""
    import threading
    import time

    import httpx

    body = {"model": "tiny", "prompt": "the cat", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with live_server(tiny_model(tok, max_position_embeddings=4096), tok, name="tiny") as srv:
        batcher = srv.manager.get("tiny").batcher
        got = []

        def client():
            try:
                with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=120) as r:
                    for line in r.iter_lines():
                        got.append(line)
            except httpx.HTTPError:
                pass

        t = threading.Thread(target=client, daemon=True)
        t.start()
        deadline = time.monotonic() + 60
        while batcher.running_rows == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        t0 = time.monotonic()
        srv.manager.close()
        assert time.monotonic() - t0 < 20 and not batcher.alive
        t.join(30)
        assert not t.is_alive()  # the open stream was ended, not left hanging
    finals = [l for l in got if '"finish_reason": "cancelled"' in l]
    assert finals and [l for l in got if l][-1] == "data: [DONE]"
