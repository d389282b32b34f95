"""Thread counts of decode-step phases chosen by timing (nemo_spec.inference.threads): the decision rule, that a
session restores torch's thread count and produces the same tokens with and without tuning."""
import pytest
import torch

from nemo_spec.inference import SamplingParams, generate
from nemo_spec.inference.sampling import SamplingError
from nemo_spec.inference.session import Session
from nemo_spec.inference.threads import ThreadTuner
from nemo_spec.models import build_gpt
from tests.helpers import tiny_llama


def test_the_tuner_alternates_then_keeps_one_thread_only_when_clearly_faster():
    tuner = ThreadTuner(trials=3, margin=0.9)
    assert ThreadTuner.key(("verify",), 40, 2) is None  # larger than every bucket: never tuned
    assert ThreadTuner.key(("verify",), 1, 1) is None  # torch already on one thread
    fast1, even = ThreadTuner.key(("verify",), 1, 2), ThreadTuner.key(("draft", "eagle"), 3, 2)
    assert fast1 == ("verify", 1, 2) and even == ("draft", "eagle", 4, 2)
    picks = []
    for _ in range(6):
        for key, t1, t2 in ((fast1, 0.8, 1.0), (even, 0.95, 1.0)):
            th = tuner.pick(key)
            picks.append(th)
            tuner.record(key, th, t1 if th == 1 else t2)
    assert picks[:4] == [1, 1, 2, 2]  # alternating while undecided
    assert tuner.choice == {fast1: 1, even: 2}  # 0.95 is not faster by the margin: keep torch's count
    assert tuner.pick(fast1) == 1 and tuner.pick(even) == 2
    assert tuner.describe() == {"verify/tokens<=1@2 threads": 1, "draft/eagle/tokens<=4@2 threads": 2}


@pytest.fixture
def two_threads():
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("method", ["ar", "prompt_lookup"])
def test_a_tuned_session_gives_the_same_tokens_and_restores_the_thread_count(two_threads, method):
    torch.manual_seed(0)
    model = build_gpt(tiny_llama()).eval()
    prompts = [[5, 6, 7, 5, 6, 7, 5], [9, 3, 9, 3], [1, 2]]
    opts = {"ignore_eos": True, "num_draft_tokens": 3}
    sp = SamplingParams(max_new_tokens=24)
    fixed = generate(model, prompts, sp, method=method, options={**opts, "tune_threads": False})
    sess = Session(model, method, options=opts, max_batch=2)
    hs = [sess.add(p, sp) for p in prompts]
    while sess.step():
        assert torch.get_num_threads() == 2  # every phase put torch's count back
    assert [sess.result(h).tokens for h in hs] == [r.tokens for r in fixed]
    decided = sess.stats()["threads"]
    assert decided and set(decided.values()) <= {1, 2}
    assert any(k.startswith("verify/") for k in decided)
    assert "threads" not in Session(model, method, options={**opts, "tune_threads": False}).stats()


def test_tune_threads_must_be_a_bool():
    model = build_gpt(tiny_llama(num_layers=1)).eval()
    with pytest.raises(SamplingError, match="'tune_threads' must be true or false"):
        Session(model, "ar", options={"tune_threads": "yes"})
