"""Server model management, auth and speculative serving: admin load/switch/unload of real checkpoints,
Bearer keys, and EAGLE / Medusa / P-EAGLE / DFlash / prompt-lookup decoding at batch > 1 matching plain greedy
decoding."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from nemo_spec.inference import SamplingParams, generate
from tests.serve_utils import clone_model, live_server, poison_steps, served_text, tiny_model
from tests.serve_utils import model, tok, tok_dir  # noqa: F401  (pytest fixtures)


def _greedy_text(ref, tok, prompt, max_tokens):
    ids = tok(prompt).input_ids
    res = generate(ref, [ids], SamplingParams(temperature=0.0, max_new_tokens=max_tokens,
                                                                stop_token_ids=(tok.eos_token_id,)))[0]
    return served_text(tok, ids, res.tokens)


def test_api_keys_and_admin_load_switch_unload(model, tok, tok_dir, tmp_path):
    from nemo_spec.checkpoint.hf import export_hf

    other = tiny_model(tok, seed=1)
    ckpt_a = export_hf(clone_model(model), tmp_path / "hf_a", tokenizer_dir=tok_dir)
    ckpt_b = export_hf(other, tmp_path / "hf_b", tokenizer_dir=tok_dir)
    ref_a, ref_b = clone_model(model), clone_model(other)
    prompt = "the cat sat on"
    with live_server(model, tok, name="tiny", api_keys=("sk-user",), admin_key="sk-admin") as srv:
        url = srv.url
        # Bearer auth on every endpoint but /health (open for load balancers unless health_requires_key)
        assert httpx.get(url + "/health").status_code == 200
        for path in ("/v1/models", "/metrics"):
            assert httpx.get(url + path).status_code == 401
            assert httpx.get(url + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert httpx.get(url + path, headers={"Authorization": "Bearer sk-user"}).status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        c = openai.OpenAI(base_url=url + "/v1", api_key="sk-user", max_retries=0, timeout=120)
        assert c.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0).choices[0].text \
            == _greedy_text(ref_a, tok, prompt, 8)

        # admin endpoints need the admin key, not a user key
        user, admin = {"Authorization": "Bearer sk-user"}, {"Authorization": "Bearer sk-admin"}
        spec = {"name": "second", "path": str(ckpt_b), "max_batch": 4}
        assert httpx.post(url + "/admin/models/load", json=spec, headers=user).status_code == 401
        bad = httpx.post(url + "/admin/models/load", json={"name": "x", "path": str(tmp_path / "missing")},
                         headers=admin, timeout=60)
        assert bad.status_code == 400 and "does not exist" in bad.json()["error"]["message"]
        bad = httpx.post(url + "/admin/models/load", json={"name": "x", "path": str(ckpt_b), "methd": "ar"},
                         headers=admin, timeout=60)
        assert bad.status_code == 400 and "methd" in bad.json()["error"]["message"]
        r = httpx.post(url + "/admin/models/load", json=spec, headers=admin, timeout=300)
        assert r.status_code == 200, r.text
        assert sorted(m.id for m in c.models.list().data) == ["second", "tiny"]
        assert httpx.post(url + "/admin/models/load", json=spec, headers=admin).status_code == 409
        out = c.completions.create(model="second", prompt=prompt, max_tokens=8, temperature=0)
        assert out.choices[0].text == _greedy_text(ref_b, tok, prompt, 8)

        # switch "second" to checkpoint A: same name, new weights
        r = httpx.post(url + "/admin/models/switch", json={"name": "second", "path": str(ckpt_a)}, headers=admin,
                       timeout=300)
        assert r.status_code == 200, r.text
        out = c.completions.create(model="second", prompt=prompt, max_tokens=8, temperature=0)
        assert out.choices[0].text == _greedy_text(ref_a, tok, prompt, 8)
        listing = httpx.get(url + "/admin/models", headers=admin).json()["models"]
        assert {m["id"]: m["path"] for m in listing}["second"] == str(ckpt_a)
        # what the switch left out is kept from the model it replaced (it used to fall back to the defaults)
        assert {m["id"]: m["max_batch"] for m in listing}["second"] == 4
        r = httpx.post(url + "/admin/models/switch", json={"name": "nothing", "path": str(ckpt_a)}, headers=admin)
        assert r.status_code == 404

        r = httpx.post(url + "/admin/models/unload", json={"name": "second"}, headers=admin, timeout=60)
        assert r.status_code == 200
        with pytest.raises(openai.NotFoundError):
            c.completions.create(model="second", prompt=prompt, max_tokens=2)
        assert httpx.post(url + "/admin/models/unload", json={"name": "second"}, headers=admin).status_code == 404
        assert [m.id for m in c.models.list().data] == ["tiny"]


def test_admin_disabled_without_admin_key(model, tok):
    with live_server(model, tok, name="tiny") as srv:
        r = httpx.post(srv.url + "/admin/models/unload", json={"name": "tiny"},
                       headers={"Authorization": "Bearer anything"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_disabled"
        assert httpx.get(srv.url + "/v1/models").status_code == 200  # no api_keys -> open


@pytest.mark.parametrize("method,transform,options", [
    ("prompt_lookup", None, {"num_draft_tokens": 3}),
    ("eagle", "eagle1", {"num_draft_tokens": 3}),
    ("eagle_tree", "eagle1", {}),
    ("medusa", "medusa", {}),
    ("peagle", "peagle", {"num_draft_tokens": 3}),
    ("dflash", "dflash", {}),
])
def test_speculative_serving_batched_matches_greedy(model, tok, method, transform, options):
    from nemo_spec.speculative import SpeculativeTransform

    served = clone_model(model)
    if transform:
        kw = {"eagle1": {"num_eagle_layers": 1}, "medusa": {"num_medusa_heads": 2},
              "peagle": {"num_eagle_layers": 1, "parallel_depth": 3},  # untrained: greedy output is still AR's
              "dflash": {"num_layers": 1, "block_size": 4, "target_layer_ids": [0]}}[transform]
        served = SpeculativeTransform(algorithm=transform, **kw)(served).eval()
    ref = clone_model(model)
    prompts = ["the cat sat on a mat and the cat sat on", "we read code , write tests , we read code ,",
               "hello world , this is a tiny", "numbers 1 2 3 4 5 6 1 2 3"]
    expected = [_greedy_text(ref, tok, p, 12) for p in prompts]
    with live_server(served, tok, name="spec", method=method, options=options, max_batch=4,
                     batch_wait_ms=200) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)

        def one(p):
            return c.completions.create(model="spec", prompt=p, max_tokens=12, temperature=0).choices[0].text

        with ThreadPoolExecutor(len(prompts)) as ex:
            got = list(ex.map(one, prompts, timeout=120))
        assert got == expected
        batcher = srv.manager.get("spec").batcher
        assert batcher.batches_run < len(prompts)  # rows really shared engine batches
        metrics = httpx.get(srv.url + "/metrics").text
        tau = [l for l in metrics.splitlines() if l.startswith("nemo_spec_acceptance_length_count")]
        assert tau and float(tau[0].split()[-1]) >= len(prompts)


@pytest.mark.slow
def test_serve_script_loads_checkpoint_from_config(model, tok, tok_dir, tmp_path):
    """scripts/serve.py (Hydra overrides) loads a checkpoint at start-up and answers on 127.0.0.1."""
    import signal
    import subprocess
    import sys
    import time

    from nemo_spec.checkpoint.hf import export_hf
    from tests.helpers import ROOT, _free_port, script_env

    ckpt = export_hf(clone_model(model), tmp_path / "hf", tokenizer_dir=tok_dir)
    port = _free_port()
    env = script_env()
    cmd = [sys.executable, str(ROOT / "scripts" / "serve.py"), f"model.path={ckpt}", "model.name=tiny",
           f"port={port}", "model.max_batch=4", "api_keys=[sk-test]", f"hydra.run.dir={tmp_path / 'run'}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, proc.stdout.read()[-4000:]
            try:
                if httpx.get(url + "/health", headers={"Authorization": "Bearer sk-test"}).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.5)
        c = openai.OpenAI(base_url=url + "/v1", api_key="sk-test", max_retries=0, timeout=120)
        assert [m.id for m in c.models.list().data] == ["tiny"]
        out = c.completions.create(model="tiny", prompt="the cat sat on", max_tokens=8, temperature=0)
        assert out.choices[0].text == _greedy_text(clone_model(model), tok, "the cat sat on", 8)
        assert (tmp_path / "run" / ".hydra" / "config.yaml").exists()  # resolved config next to the run
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def test_engine_failure_is_a_500_and_the_worker_survives(model, tok, monkeypatch):
    poison = poison_steps(monkeypatch, tok)  # the real engine raises inside the batch while this row is in it
    with live_server(model, tok, name="tiny") as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": poison,
                                                          "max_tokens": 40, "temperature": 0}, timeout=60)
        assert r.status_code == 500
        assert r.json()["error"]["type"] == "server_error" and "poison row" in r.json()["error"]["message"]
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=60,
                          json={"model": "tiny", "prompt": poison, "max_tokens": 40, "stream": True}) as s:
            lines = [l for l in s.iter_lines() if l.startswith("data: ")]
        assert '"server_error"' in lines[-2] and lines[-1] == "data: [DONE]"
        ok = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "the cat", "max_tokens": 3,
                                                           "temperature": 0, "ignore_eos": True}, timeout=60)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
        assert httpx.get(srv.url + "/health").status_code == 200


def test_request_prepared_during_a_switch_goes_to_the_new_model(model, tok, tok_dir, tmp_path, monkeypatch):
    """A request being tokenized when its model is switched used to reach the old instance's closed batcher and get
    503 model_unloading although the name was still served: it is now prepared again for the new instance."""
    from nemo_spec.checkpoint.hf import export_hf
    from nemo_spec.serve import app as app_mod

    other = tiny_model(tok, seed=1)
    ckpt_b = export_hf(clone_model(other), tmp_path / "hf_b", tokenizer_dir=tok_dir)
    admin = {"Authorization": "Bearer sk-admin"}
    prompt = "the cat sat on"
    with live_server(model, tok, name="tiny", admin_key="sk-admin") as srv:
        switched = []
        orig_encode = app_mod._encode

        def encode_then_switch(served, text, add_special_tokens):  # the switch lands while this request is prepared
            if not switched:
                switched.append(httpx.post(srv.url + "/admin/models/switch", headers=admin, timeout=300,
                                           json={"name": "tiny", "path": str(ckpt_b)}).status_code)
            return orig_encode(served, text, add_special_tokens)

        monkeypatch.setattr(app_mod, "_encode", encode_then_switch)
        r = httpx.post(srv.url + "/v1/completions", timeout=300,
                       json={"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0})
        assert switched == [200]
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == _greedy_text(clone_model(other), tok, prompt, 8)  # the new weights


def test_concurrent_switches_both_apply(model, tok, tok_dir, tmp_path, monkeypatch):
    """Two switches sent together both apply: each merges onto the spec as the other left it (the second used to
    merge onto the spec from before the first, silently undoing it)."""
    import threading

    from nemo_spec.checkpoint.hf import export_hf
    from nemo_spec.serve import models as models_mod

    ckpt_b = export_hf(clone_model(tiny_model(tok, seed=1)), tmp_path / "hf_b", tokenizer_dir=tok_dir)
    admin = {"Authorization": "Bearer sk-admin"}
    with live_server(model, tok, name="tiny", admin_key="sk-admin", path=str(ckpt_b)) as srv:
        orig_build = models_mod.build_served_model

        def slow_build(*a, **kw):  # a load that takes a while, as a real checkpoint's does
            time.sleep(0.5)
            return orig_build(*a, **kw)

        monkeypatch.setattr(models_mod, "build_served_model", slow_build)
        codes = []

        def switch(body):
            codes.append(httpx.post(srv.url + "/admin/models/switch", json={"name": "tiny", **body}, headers=admin,
                                    timeout=300).status_code)

        first = threading.Thread(target=switch, args=({"method": "prompt_lookup"},))
        first.start()
        time.sleep(0.1)
        switch({"max_batch": 2})
        first.join()
        assert codes == [200, 200]
        (m,) = httpx.get(srv.url + "/admin/models", headers=admin).json()["models"]
        assert (m["method"], m["max_batch"], m["path"]) == ("prompt_lookup", 2, str(ckpt_b))


def test_client_hanging_up_mid_body_is_not_a_server_error(model, tok):
    """A client that declares a body and hangs up before sending it all used to be logged as an unhandled error
    (two tracebacks) and counted as a 500; it is a 499 (client closed request) now, and the server answers on."""
    import socket

    with live_server(model, tok, name="tiny") as srv:
        host, port = srv.url.split("//")[1].split(":")
        for _ in range(2):
            with socket.create_connection((host, int(port)), timeout=10) as s:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 100\r\n\r\n{\"model\":")
        ok = httpx.post(srv.url + "/v1/completions", timeout=60,
                        json={"model": "tiny", "prompt": "the cat", "max_tokens": 2, "temperature": 0})
        assert ok.status_code == 200
        for _ in range(50):  # the server notices the hang-ups asynchronously
            metrics = httpx.get(srv.url + "/metrics").text
            if metrics.count('code="499",endpoint="/v1/completions"'):
                break
            time.sleep(0.1)
        assert 'nemo_spec_requests_total{code="499",endpoint="/v1/completions"} 2' in metrics
        assert 'code="500"' not in metrics
