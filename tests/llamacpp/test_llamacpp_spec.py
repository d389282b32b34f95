"""EAGLE-3 and DFlash drafts served by llama.cpp itself: our exports, converted by llama.cpp's own converter, draft
exactly what our engine drafts.

llama.cpp (the source vendored in llama-cpp-python 0.3.36, commit 0c1e570; `make test-llamacpp` builds its
``llama-speculative-simple`` and installs its converter's requirements) reads an EAGLE-3 draft directory with
``convert_hf_to_gguf.py <draft> --target-model-dir <base>`` (conversion/llama.py:49-103: detected by
``draft_vocab_size`` and one layer, aux ids from the top-level ``eagle_aux_hidden_state_layer_ids``) and runs it with
``--spec-type draft-eagle3`` (src/models/eagle3.cpp, common/speculative.cpp ``common_speculative_impl_draft_eagle3``);
a DFlash draft (the z-lab ``DFlashDraftModel`` directory) with the same command (conversion/qwen.py:664-858: block
size, ``dflash_config.mask_token_id`` and ``target_layer_ids``, written +1 and extracted as the input of that layer,
i.e. z-lab's ``hidden_states[id + 1]``) and ``--spec-type draft-dflash`` (src/models/dflash.cpp,
``common_speculative_impl_draft_dflash``: one forward over [last token, mask x n_max], ``--spec-draft-n-max`` =
block size - 1 for the trained block).

What is compared, step by step: with ``-v`` llama.cpp logs the top 3 draft candidates at every draft position
(speculative.cpp:801-806; DFlash: 1298-1304), their probabilities renormalised over the draft's top 10 (its only
sampler: speculative.cpp:515-519; DFlash: 1032-1038), and the accepted count and the target's token after each verification
(speculative-simple.cpp:323). Our engine's EAGLE-3 chain, run greedily on the same base and draft, must give the same
candidates with the same probabilities at every step both take from the same context (its DFlash block likewise),
and both must generate our greedy autoregressive tokens. The one step that has no counterpart is llama.cpp's first: speculative-simple
holds the last prompt token back (speculative-simple.cpp:127-142), so it drafts the first new token too, where our
engine takes it from the prompt's forward.

The base is a tiny random Llama with a SentencePiece-style vocabulary (llama.cpp's converter accepts a Llama
byte-fallback tokenizer.json without a pre-tokenizer hash: conversion/llama.py:135-141), the draft is trained for a
few steps on the base's own greedy text so that it is right often enough for llama.cpp to accept several tokens at
once. A control shows the comparison catches a layer-numbering slip: the same draft with its layer ids one lower
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
from safetensors.torch import load_file

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
def base_and_data(tmp_path_factory):
    """An HF base dir (tiny random Llama, SentencePiece-style tokenizer) and its own greedy text for draft training."""
    from nemo_spec.checkpoint import gguf as G
    from nemo_spec.checkpoint import load_model
    from nemo_spec.inference import SamplingParams, generate
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("llamacpp_spec")
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
    return base, d / "data"


@pytest.fixture(scope="module", params=["eagle3", "dflash"])
def exported(request, base_and_data, tmp_path_factory):
    """(algorithm, trained checkpoint, export dir, base GGUF, draft GGUF): the draft trained for 60 steps, exported
    (EAGLE-3: the vLLM layout; DFlash: its one format) and converted, with the base, by llama.cpp's converter."""
    from nemo_spec.export import export_checkpoint
    from nemo_spec.training import train

    algorithm = request.param
    base, data = base_and_data
    d = tmp_path_factory.mktemp(algorithm)
    cfg = small_train_config(d / "run", algorithm, steps=60)
    cfg.model_path, cfg.data.path, cfg.data.format, cfg.data.max_seq_len = str(base), str(data), "text", 64
    cfg.optim.lr = 1e-2
    if algorithm == "dflash":  # blocks of DEPTH + 1: llama.cpp drafts n_max = block - 1 tokens from one
        cfg.spec.num_eagle_layers, cfg.spec.block_size, cfg.spec.num_anchors = 2, DEPTH + 1, 16
        cfg.spec.target_layer_ids = [2, 5]
    else:  # a reduced draft vocabulary (d2t, which llama.cpp's converter makes absolute) and aux layers other than
        # the converter's fallback [2, L // 2, L - 3] (vLLM ids, as written: 0-based layers + 1)
        cfg.spec.draft_vocab_size, cfg.spec.aux_layers = 256, [0, 3, 6]
    train(cfg)
    final = d / "run" / "final"
    exp = export_checkpoint(final, d / "exp", target="vllm", dtype="fp32")
    entry = json.loads((exp / "export_info.json").read_text())["llamacpp"]  # what the export tells llama.cpp users
    assert entry["unsupported"] is None and entry["dir"] == "draft" and entry["spec_type"] == f"draft-{algorithm}"
    assert algorithm == "eagle3" or entry["n_max"] == DEPTH
    conf = json.loads((exp / entry["dir"] / "config.json").read_text())
    if algorithm == "eagle3":
        assert conf["eagle_aux_hidden_state_layer_ids"] == [1, 4, 7] and conf["draft_vocab_size"] == 256
        assert "d2t" in load_file(str(exp / entry["dir"] / "model.safetensors"))
    else:
        assert conf["dflash_config"]["target_layer_ids"] == [2, 5]
    _convert(exp / "base", d / "base.gguf")
    _convert(exp / entry["dir"], d / "draft.gguf", target=exp / "base")
    return algorithm, final, exp, d / "base.gguf", d / "draft.gguf"


Steps = Dict[int, List[List[Tuple[int, float]]]]


def _llama_cpp(algorithm: str, base: Path, draft: Path, prompt: str, n_prompt: int
               ) -> Tuple[Steps, List[int], List[int]]:
    """llama.cpp's greedy speculative run: ({tokens in the target's cache: top-3 (id, p) per draft position}, generated
    ids, the cache lengths of the steps that follow an acceptance of 2 or more draft tokens)."""
    proc = subprocess.run([str(Path(CPP) / "build" / "bin" / "llama-speculative-simple"), "-m", str(base), "-md",
                           str(draft), "--spec-type", f"draft-{algorithm}", "--spec-draft-n-max", str(DEPTH),
                           "--spec-draft-n-min", "0", "--spec-draft-p-min", "0", "--no-spec-draft-backend-sampling",
                           "-p", prompt, "-n", str(NEW_TOKENS), "--temp", "0", "--top-k", "1", "--seed", "0",
                           "-c", "256", "-t", "2", "-v"], capture_output=True)
    err = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 0, err[-3000:]
    steps: Steps = {}
    gen: List[int] = []
    n_past, cur, after_multi = n_prompt - 1, {}, []  # the last prompt token is held back (speculative-simple.cpp:127)
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
            n_past, cur = n_past + a + 1, {}
            if a >= 2:
                after_multi.append(n_past)
    return steps, gen[:NEW_TOKENS], after_multi


def _top4(logits: torch.Tensor, ids: torch.Tensor = None) -> List[Tuple[int, float]]:
    """Top 4 (base id, probability over the top 10) of draft logits [V] (``ids``: draft -> base ids); llama.cpp logs
    3, the 4th tells a tie at the 3rd."""
    top = logits.float().topk(10)
    p = torch.softmax(top.values, -1)
    return [(int(t if ids is None else ids[t]), float(q)) for t, q in zip(top.indices[:4], p[:4])]


def _ours(algorithm: str, model, ids: List[int], monkeypatch) -> Tuple[Steps, List[int], List[int]]:
    """Our greedy speculative run with the same draft length: ({tokens in the target's cache: top-4 (id, p over the
    top 10) per draft position}, its tokens, greedy AR tokens)."""
    from nemo_spec.inference import SamplingParams, generate
    from nemo_spec.inference.proposers import dflash, eagle

    steps: Steps = {}
    cur: List[list] = []
    if algorithm == "eagle3":  # the chain: one draft pass per position, each choosing from its logits
        chain, choose = eagle.EagleProposer._chain, eagle.choose

        def record_chain(self, sess, st, view, depth):
            cur[:] = [int(st.lengths[0]), self.d2t_ids, []]
            out = chain(self, sess, st, view, depth)
            steps[cur[0]] = cur[2]
            return out

        def record_choose(st, logits, greedy):
            cur[2].append(_top4(logits[0], cur[1]))
            return choose(st, logits, greedy)

        patches = [(eagle.EagleProposer, "_chain", record_chain), (eagle, "choose", record_choose)]
    else:  # DFlash: one forward over the block; its last call in propose gives the slots' logits [b, k, V]
        propose = dflash.DFlashProposer.propose

        def record_propose(self, sess, st, level=None):
            seen: List[torch.Tensor] = []
            hook = self.spec.eagle_module.register_forward_hook(lambda m, a, out: seen.append(out[1]))
            try:
                tree = propose(self, sess, st, level)
            finally:
                hook.remove()
            steps[int(st.lengths[0])] = [_top4(row) for row in seen[-1][0]]
            return tree

        patches = [(dflash.DFlashProposer, "propose", record_propose)]
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS)
    ar = generate(model, [ids], params, method="ar")[0].tokens
    method = "eagle" if algorithm == "eagle3" else "dflash"
    with monkeypatch.context() as mp:
        for obj, name, fn in patches:
            mp.setattr(obj, name, fn)
        spec = generate(model, [ids], params, method=method, options={"num_draft_tokens": DEPTH})[0].tokens
    return steps, spec, ar


def _mismatches(ours: Steps, theirs: Steps) -> List[str]:
    """Where the two runs' candidates differ, at the steps both took from the same context (top-1 always; the
    runners-up unless their probabilities lie within llama.cpp's printed precision of the next one's)."""
    bad = []
    for n_past in sorted(set(ours) & set(theirs)):
        for pos, (a, b) in enumerate(zip(ours[n_past], theirs[n_past])):
            for k, ((ta, pa), (tb, pb)) in enumerate(zip(a, b)):
                tie = ((k + 1 < len(a) and abs(a[k + 1][1] - pa) < 2e-3)  # our next candidate (4 recorded)
                       or (k > 0 and abs(a[k - 1][1] - pa) < 2e-3))
                if abs(pa - pb) > 2e-3 or (ta != tb and (k == 0 or not tie)):
                    bad.append(f"cache {n_past}, draft position {pos}, candidate {k}: ours {ta} ({pa:.4f}), "
                               f"llama.cpp {tb} ({pb:.3f})")
    return bad


@pytest.mark.parametrize("prompt", PROMPTS)
def test_llama_cpp_drafts_what_our_engine_drafts(exported, prompt, monkeypatch):
    from nemo_spec.checkpoint import load_model
    from transformers import AutoTokenizer

    algorithm, final, exp, base_gguf, draft_gguf = exported
    ids = AutoTokenizer.from_pretrained(exp / "base")(prompt)["input_ids"]
    theirs, their_tokens, after_multi = _llama_cpp(algorithm, base_gguf, draft_gguf, prompt, len(ids))
    ours, our_tokens, ar = _ours(algorithm, load_model(final), ids, monkeypatch)
    assert our_tokens == ar and their_tokens == ar  # both lossless, on the same base
    common = sorted(set(ours) & set(theirs))
    assert len(common) >= 5, (sorted(ours), sorted(theirs))
    # steps after multi-token acceptances are compared too (the draft's cache catches up over several pairs)
    assert sum(len(theirs[n]) == DEPTH for n in common) >= 5
    if prompt == PROMPTS[0]:  # this one's drafts are right 2-3 tokens at a time (the other's 1 at most)
        assert set(after_multi) & set(common), (after_multi, common)
    assert _mismatches(ours, theirs) == []
    assert sum(len(ours[n]) for n in common) >= 5 * DEPTH


def test_a_layer_numbering_slip_shows(exported, tmp_path, monkeypatch):
    """The control: layer ids one lower (for EAGLE-3 our 0-based aux layers written where llama.cpp, like vLLM,
    expects the input of layer id) make llama.cpp draft from other features, and the comparison sees it."""
    from nemo_spec.checkpoint import load_model
    from transformers import AutoTokenizer

    algorithm, final, exp, base_gguf, _ = exported
    slip = tmp_path / "draft"
    shutil.copytree(exp / "draft", slip)
    conf = json.loads((slip / "config.json").read_text())
    ids_of = conf if algorithm == "eagle3" else conf["dflash_config"]
    key = "eagle_aux_hidden_state_layer_ids" if algorithm == "eagle3" else "target_layer_ids"
    ids_of[key] = [i - 1 for i in ids_of[key]]
    (slip / "config.json").write_text(json.dumps(conf))
    _convert(slip, tmp_path / "slip.gguf", target=exp / "base")
    ids = AutoTokenizer.from_pretrained(exp / "base")(PROMPTS[0])["input_ids"]
    theirs, their_tokens, _ = _llama_cpp(algorithm, base_gguf, tmp_path / "slip.gguf", PROMPTS[0], len(ids))
    ours, _, ar = _ours(algorithm, load_model(final), ids, monkeypatch)
    assert their_tokens == ar  # still lossless: only the drafts are wrong
    assert len(_mismatches(ours, theirs)) >= 5
