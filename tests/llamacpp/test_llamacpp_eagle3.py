"""EAGLE-3 drafts served by llama.cpp itself: our vLLM-layout export, converted by llama.cpp's own converter, drafts
exactly what our engine drafts.

llama.cpp (the source vendored in llama-cpp-python 0.3.36, commit 0c1e570; `make test-llamacpp` builds its
``llama-speculative-simple`` and installs its converter's requirements) reads an EAGLE-3 draft directory with
``convert_hf_to_gguf.py <draft> --target-model-dir <base>`` (conversion/llama.py:49-103: detected by
``draft_vocab_size`` and one layer, aux ids from the top-level ``eagle_aux_hidden_state_layer_ids``) and runs it with
``--spec-type draft-eagle3`` (src/models/eagle3.cpp, common/speculative.cpp ``common_speculative_impl_draft_eagle3``).

What is compared, step by step: with ``-v`` llama.cpp logs the top 3 draft candidates at every draft position
(speculative.cpp:801-806), their probabilities renormalised over the draft's top 10 (its only sampler:
speculative.cpp:515-519), and the accepted count and the target's token after each verification
(speculative-simple.cpp:323). Our engine's EAGLE-3 chain, run greedily on the same base and draft, must give the same
candidates with the same probabilities at every step both take from the same context, and both must generate our
greedy autoregressive tokens. The one step that has no counterpart is llama.cpp's first: speculative-simple
holds the last prompt token back (speculative-simple.cpp:127-142), so it drafts the first new token too, where our
engine takes it from the prompt's forward.

The base is a tiny random Llama with a SentencePiece-style vocabulary (llama.cpp's converter accepts a Llama
byte-fallback tokenizer.json without a pre-tokenizer hash: conversion/llama.py:135-141), the draft is trained for a
few steps on the base's own greedy text so that it is right often enough for llama.cpp to accept several tokens at
once. A control shows the comparison catches a layer-numbering slip: the same draft with 0-based aux layer ids
drafts something else in llama.cpp.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
import torch

from tests.gguf_utils import spm_vocab_size, tiny_hf_model, write_gguf
from tests.train_utils import small_train_config

CPP = os.environ.get("NEMO_SPEC_LLAMACPP_CPP")
PYTHON = os.environ.get("NEMO_SPEC_LLAMACPP_PYTHON")
pytestmark = pytest.mark.skipif(not (CPP and PYTHON), reason="needs llama.cpp's speculative decoding and converter: "
                                                             "make test-llamacpp")

#: llama.cpp's per-position draft candidate log line and its per-step verification line
CANDIDATE = re.compile(r"draft candidate\s+(\d+), pos\s+(\d+):\s+(-?\d+) \(\s*([0-9.]+)\)")
ACCEPTED = re.compile(r"accepted (\d+)/(\d+) draft tokens, the last target token is: \((\d+)\)")
DEPTH, NEW_TOKENS = 3, 40
PROMPTS = ["def fibonacci(n):", "class Stack:\n    def push(self, item):"]


def _convert(src: Path, dst: Path, target: Path = None) -> None:
    extra = ["--target-model-dir", str(target)] if target else []
    proc = subprocess.run([PYTHON, str(Path(CPP) / "convert_hf_to_gguf.py"), str(src), "--outtype", "f32",
                           "--outfile", str(dst), *extra], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(Path(CPP) / "gguf-py")})
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(trained checkpoint, export dir, base GGUF, draft GGUF): base and draft converted by llama.cpp's converter."""
    from nemo_spec.checkpoint import gguf as G
    from nemo_spec.checkpoint import load_model
    from nemo_spec.export import export_checkpoint
    from nemo_spec.inference import SamplingParams, generate
    from nemo_spec.training import train
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("eagle3_llamacpp")
    hf = tiny_hf_model("llama", vocab_size=spm_vocab_size(), num_hidden_layers=8, hidden_size=64,
                       intermediate_size=128)
    write_gguf(d / "tok.gguf", hf, tokenizer="llama")
    base = d / "hf"
    G.write_tokenizer_dir(d / "tok.gguf", base)
    hf.save_pretrained(base)
    tok = AutoTokenizer.from_pretrained(base)
    g = torch.Generator().manual_seed(0)
    prompts = [[1] + torch.randint(3, spm_vocab_size() - 1, (6,), generator=g).tolist() for _ in range(48)]
    prompts += [tok(p)["input_ids"] for p in PROMPTS]
    outs = generate(load_model(base), prompts, SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS))
    (d / "data").mkdir()
    for i, (p, r) in enumerate(zip(prompts, outs)):
        (d / "data" / f"{i}.txt").write_text(tok.decode(p[1:] + r.tokens, skip_special_tokens=True))
    cfg = small_train_config(d / "run", "eagle3", steps=60)
    cfg.model_path, cfg.data.path, cfg.data.format, cfg.data.max_seq_len = str(base), str(d / "data"), "text", 64
    cfg.optim.lr = 1e-2
    train(cfg)
    final = d / "run" / "final"
    exp = export_checkpoint(final, d / "exp", target="vllm", dtype="fp32")
    _convert(exp / "base", d / "base.gguf")
    _convert(exp / "draft", d / "eagle3.gguf", target=exp / "base")
    return final, exp, d / "base.gguf", d / "eagle3.gguf"


Steps = Dict[int, List[List[Tuple[int, float]]]]


def _llama_cpp(base: Path, draft: Path, prompt: str, n_prompt: int) -> Tuple[Steps, List[int], int]:
    """llama.cpp's greedy EAGLE-3 run: ({tokens in the target's cache: top-3 (id, p) per draft position}, generated
    ids, accepted draft tokens)."""
    proc = subprocess.run([str(Path(CPP) / "build" / "bin" / "llama-speculative-simple"), "-m", str(base), "-md",
                           str(draft), "--spec-type", "draft-eagle3", "--spec-draft-n-max", str(DEPTH),
                           "--spec-draft-n-min", "0", "--spec-draft-p-min", "0", "--no-spec-draft-backend-sampling",
                           "-p", prompt, "-n", str(NEW_TOKENS), "--temp", "0", "--top-k", "1", "--seed", "0",
                           "-c", "256", "-t", "2", "-v"], capture_output=True)
    err = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 0, err[-3000:]
    steps: Steps = {}
    gen: List[int] = []
    n_past, cur, accepted = n_prompt - 1, {}, 0  # the last prompt token is held back (speculative-simple.cpp:127)
    for line in err.splitlines():
        m = CANDIDATE.search(line)
        if m:
            cur[(int(m[2]), int(m[1]))] = (int(m[3]), float(m[4]))
            continue
        m = ACCEPTED.search(line)
        if m:
            a, drafted, last = int(m[1]), int(m[2]), int(m[3])
            steps[n_past] = [[cur[(pos, k)] for k in range(3) if (pos, k) in cur] for pos in range(drafted)]
            gen += [cur[(pos, 0)][0] for pos in range(a)] + [last]
            n_past, cur, accepted = n_past + a + 1, {}, accepted + a
    return steps, gen[:NEW_TOKENS], accepted


def _ours(model, ids: List[int], monkeypatch) -> Tuple[Steps, List[int], List[int]]:
    """Our greedy EAGLE-3 chain: ({tokens in the target's cache: top-3 (id, p over the top 10) per draft position},
    its tokens, greedy AR tokens)."""
    import nemo_spec.inference.proposers.eagle as eagle
    from nemo_spec.inference import SamplingParams, generate

    steps: Steps = {}
    chain, choose = eagle.EagleProposer._chain, eagle.choose
    cur: List[list] = []

    def record_chain(self, sess, st, view, depth):
        cur[:] = [int(st.lengths[0]), self.d2t_ids, []]
        out = chain(self, sess, st, view, depth)
        steps[cur[0]] = cur[2]
        return out

    def record_choose(st, logits, greedy):
        top = logits[0].float().topk(10)
        p = torch.softmax(top.values, -1)
        cur[2].append([(int(cur[1][t]), float(q)) for t, q in zip(top.indices[:3], p[:3])])
        return choose(st, logits, greedy)

    params = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS)
    ar = generate(model, [ids], params, method="ar")[0].tokens
    with monkeypatch.context() as mp:
        mp.setattr(eagle.EagleProposer, "_chain", record_chain)
        mp.setattr(eagle, "choose", record_choose)
        spec = generate(model, [ids], params, method="eagle", options={"num_draft_tokens": DEPTH})[0].tokens
    return steps, spec, ar


def _mismatches(ours: Steps, theirs: Steps) -> List[str]:
    """Where the two runs' candidates differ, at the steps both took from the same context (top-1 always; the
    runners-up unless their probabilities lie within llama.cpp's printed precision of the next one's)."""
    bad = []
    for n_past in sorted(set(ours) & set(theirs)):
        for pos, (a, b) in enumerate(zip(ours[n_past], theirs[n_past])):
            for k, ((ta, pa), (tb, pb)) in enumerate(zip(a, b)):
                tie = k + 1 < len(a) and abs(a[k][1] - a[k + 1][1]) < 2e-3 or k and abs(a[k - 1][1] - pa) < 2e-3
                if abs(pa - pb) > 2e-3 or (ta != tb and not (k and tie)):
                    bad.append(f"cache {n_past}, draft position {pos}, candidate {k}: ours {ta} ({pa:.4f}), "
                               f"llama.cpp {tb} ({pb:.3f})")
    return bad


@pytest.mark.parametrize("prompt", PROMPTS)
def test_llama_cpp_drafts_what_our_engine_drafts(exported, prompt, monkeypatch):
    from nemo_spec.checkpoint import load_model
    from transformers import AutoTokenizer

    final, exp, base_gguf, draft_gguf = exported
    ids = AutoTokenizer.from_pretrained(exp / "base")(prompt)["input_ids"]
    theirs, their_tokens, accepted = _llama_cpp(base_gguf, draft_gguf, prompt, len(ids))
    ours, our_tokens, ar = _ours(load_model(final), ids, monkeypatch)
    assert our_tokens == ar and their_tokens == ar  # both lossless, on the same base
    common = sorted(set(ours) & set(theirs))
    assert len(common) >= 5, (sorted(ours), sorted(theirs))
    # drafts after multi-token acceptances are compared too (the draft's cache catches up over several pairs)
    assert accepted >= 3 and any(len(theirs[n]) == DEPTH for n in common)
    assert _mismatches(ours, theirs) == []
    assert sum(len(ours[n]) for n in common) >= 5 * DEPTH


def test_a_layer_numbering_slip_shows(exported, tmp_path, monkeypatch):
    """The control: our 0-based aux layers written where llama.cpp (like vLLM) expects the input of layer id — the
    features of one layer lower — make llama.cpp draft something else at once."""
    from nemo_spec.checkpoint import load_model
    from transformers import AutoTokenizer

    final, exp, base_gguf, _ = exported
    slip = tmp_path / "draft"
    shutil.copytree(exp / "draft", slip)
    conf = json.loads((slip / "config.json").read_text())
    conf["eagle_aux_hidden_state_layer_ids"] = [i - 1 for i in conf["eagle_aux_hidden_state_layer_ids"]]
    (slip / "config.json").write_text(json.dumps(conf))
    _convert(slip, tmp_path / "slip.gguf", target=exp / "base")
    ids = AutoTokenizer.from_pretrained(exp / "base")(PROMPTS[0])["input_ids"]
    theirs, their_tokens, _ = _llama_cpp(base_gguf, tmp_path / "slip.gguf", PROMPTS[0], len(ids))
    ours, _, ar = _ours(load_model(final), ids, monkeypatch)
    assert their_tokens == ar  # still lossless: only the drafts are wrong
    assert len(_mismatches(ours, theirs)) >= 5
