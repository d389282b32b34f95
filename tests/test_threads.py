"""One CPU thread team per process (nemo_spec._threads): checkpoint IO keeps gloo workers serial, a served model
is loaded on a thread that ends, and the helpers behave (thread count restored, values and errors returned).
Also what else a served model does at load so that decoding is not paused later: its few-row kernels are timed."""
from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest
import torch

from nemo_spec._threads import in_fresh_thread, serial_helper_threads
from tests.helpers import ROOT, script_env, timed_rows

# A fresh interpreter: a second OpenMP team, once started, lives as long as its thread (a gloo worker lives as
# long as the process group), so the test process itself cannot be the subject. The main thread starts its own
# team first; then every thread that appears during save + load is listed. A gloo worker that copies the
# all-gathered tensor metadata with a parallel op starts its own team, whose worker threads carry its name
# (pt_gloo_runloop). 48 thin layers make that metadata larger than torch's grain size (32k elements); at the
# 2 layers of other tests it is copied serially anyway.
_SCRIPT = r"""
import json, os, sys
import torch

def threads():
    return {t: open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")}

def main():
    torch.set_num_threads(2)
    (torch.randn(1 << 20) + 1).sum()  # this thread's team exists from here on
    from nemo_spec import parallel
    from nemo_spec.checkpoint import load_model, save_checkpoint
    from nemo_spec.models import build_gpt
    from tests.helpers import tiny_llama
    parallel.initialize(1)
    model = build_gpt(tiny_llama(num_layers=48))
    before = threads()
    save_checkpoint(model, sys.argv[1])
    loaded = load_model(sys.argv[1])
    new = {t: n for t, n in threads().items() if t not in before}
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values())
               if isinstance(a, torch.Tensor))
    print(json.dumps({"new_threads": sorted(new.values()), "threads": torch.get_num_threads(), "same": same}))

if __name__ == "__main__":
    main()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")
def test_checkpoint_save_and_load_start_no_second_thread_team(tmp_path):
    script = tmp_path / "team.py"
    script.write_text(_SCRIPT)
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "ckpt")], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, env=script_env())
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["same"]
    # without serial_helper_threads around dist_checkpointing.save/load: ['pt_gloo_runloop', 'pt_gloo_runloop']
    assert res["new_threads"] == [], res
    assert res["threads"] == 2  # the caller's thread count is back


def test_serial_helper_threads_sets_one_thread_and_restores_nested():
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with serial_helper_threads():
            assert torch.get_num_threads() == 1
            with serial_helper_threads():
                assert torch.get_num_threads() == 1
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with pytest.raises(ValueError):
            with serial_helper_threads():
                raise ValueError("boom")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(n)


def test_row_counts_beyond_a_pretune_run_f_linear_instead_of_pausing_to_time_them(monkeypatch):
    """After pretune(module, N) a forward of more than N rows (a prefill chunk of short prompts on a server that
    timed its decode steps' counts) runs F.linear and times nothing (measured on SmolLM2: a 1.5-2 s pause of the
    running batch per new count); counts up to N keep their timed kernels; with no pretune (or pretune_rows 0) a
    new count is still timed at first use."""
    from nemo_spec.inference import generate
    from nemo_spec.inference.sampling import SamplingParams
    from nemo_spec.models import build_gpt, fastpath
    from tests.helpers import tiny_llama

    monkeypatch.setattr(fastpath, "SMALL_GEMM", "auto")  # the test suite pins the fixed rule
    torch.manual_seed(0)
    m = build_gpt(tiny_llama(num_layers=2)).eval()
    w = m.decoder.layers[0].mlp.linear_fc1.weight
    assert fastpath.pretune(m, 2) > 0 and timed_rows(m) == {1, 2}
    timings, real_tune = [], fastpath.tune

    def tune(group, rows, **kw):
        timings.append(rows)
        real_tune(group, rows, **kw)

    monkeypatch.setattr(fastpath, "tune", tune)
    assert fastpath.kernel(w, 7) == ("linear", 7) and fastpath.kernel(w, 2) in fastpath.candidates(2, w)
    generate(m, [[5, 9, 11, 3, 5, 9, 2, 8], [4, 4, 6]], SamplingParams(max_new_tokens=3))  # prefill: 11 rows
    assert timings == [] and timed_rows(m) == {1, 2}
    fresh = build_gpt(tiny_llama(num_layers=2)).eval()
    assert fastpath.pretune(fresh, 0) == 0
    fastpath.kernel(fresh.decoder.layers[0].mlp.linear_fc1.weight, 7)
    assert timings == [7] and 7 in timed_rows(fresh)


def test_in_fresh_thread_returns_raises_and_runs_elsewhere():
    main = threading.get_ident()
    ident, value = in_fresh_thread(lambda a, b=0: (threading.get_ident(), a + b), 2, b=3)
    assert value == 5 and ident != main

    class Boom(RuntimeError):
        pass

    def fail():
        raise Boom("load failed")

    with pytest.raises(Boom, match="load failed"):
        in_fresh_thread(fail)


def test_served_models_are_loaded_on_a_thread_that_ends(monkeypatch, model, tok):
    from nemo_spec.serve import ModelSpec
    from nemo_spec.serve import models

    seen = []
    real = models.build_served_model

    def spy(*args, **kw):
        seen.append(threading.current_thread())
        return real(*args, **kw)

    monkeypatch.setattr(models, "build_served_model", spy)
    manager = models.ModelManager(8, 0.0)
    try:
        served = manager.add(ModelSpec(name="tiny"), model=model, tokenizer=tok)
        assert served is manager.get("tiny")
        assert len(seen) == 1 and seen[0] is not threading.current_thread()
        seen[0].join(timeout=5)
        assert not seen[0].is_alive()
    finally:
        manager.close()


from tests.serve_utils import model, tok, tok_dir  # noqa: E402,F401  (module fixtures)


def test_served_model_times_its_few_row_kernels_at_load(monkeypatch, tok):
    """CPU kernels for the row counts a step can use are timed while loading (not at a request's first step);
    pretune_rows bounds that, 0 leaves it to first use, and a negative value is a config error."""
    from nemo_spec.config import ConfigError
    from nemo_spec.models import fastpath
    from nemo_spec.serve import ModelSpec
    from nemo_spec.serve import models
    from tests.serve_utils import tiny_model

    monkeypatch.setattr(fastpath, "SMALL_GEMM", "auto")  # the test suite pins the fixed rule
    for spec, want in ((ModelSpec(name="a", max_batch=2), {1, 2}),  # AR: a step has 1..max_batch rows
                       (ModelSpec(name="b", max_batch=4, pretune_rows=3), {1, 2, 3}),
                       (ModelSpec(name="c", scheduler="batch", pretune_rows=2), {1, 2}),
                       (ModelSpec(name="d", max_batch=2, pretune_rows=0), set())):
        m = tiny_model(tok)
        served = models.build_served_model(spec, model=m, tokenizer=tok)
        try:
            assert timed_rows(m) == want, spec.name
        finally:
            served.close()
    with pytest.raises(ConfigError, match="pretune_rows"):
        ModelSpec(name="e", pretune_rows=-1).validate()
