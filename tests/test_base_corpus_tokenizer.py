"""Built-in base model: corpus selection/split/prompts, BPE tokenizer + chat template, presets schema."""
import math
from pathlib import Path

import pytest

from nemo_spec.base import corpus as C
from nemo_spec.base import tokenizer as T
from nemo_spec.base.presets import BasePreset, load_preset
from nemo_spec.config import ConfigError


def _write(root: Path, rel: str, text: str) -> None:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


@pytest.fixture(scope="module")
def fake_root(tmp_path_factory):
    """A small source tree with test dirs, third-party packages and caches that must be excluded."""
    root = tmp_path_factory.mktemp("lib")
    body = "def f{i}(x):\n    '''Doc.'''\n    y = x + {i}\n    return y * 2\n\n"
    for i in range(40):
        _write(root, f"pkg{i % 4}/mod{i}.py", "import os\n\n" + "".join(body.format(i=i * 10 + j) for j in range(6)))
    _write(root, "top.py", "X = 1\n")
    for rel in ("test/test_x.py", "pkg0/tests/a.py", "idlelib/idle_test/b.py", "lib2to3/tests/c.py",
                "site-packages/d.py", "pkg1/__pycache__/e.py", "pkg2/test_thing.py", "pkg3/thing_test.py"):
        _write(root, rel, "BAD = 1\n")
    _write(root, "notes.txt", "not python\n")
    return root


def test_listing_excludes_tests_and_is_sorted(fake_root):
    files = C.list_source_files(fake_root)
    assert files == sorted(files)
    assert "top.py" in files and len(files) == 41
    for rel in files:
        parts = rel.split("/")
        assert not set(parts[:-1]) & {"test", "tests", "idle_test", "site-packages", "__pycache__"}, rel
        assert not parts[-1].startswith("test_") and not parts[-1].endswith("_test.py"), rel
        assert "BAD" not in (fake_root / rel).read_text()


def test_real_stdlib_corpus_excludes_tests_and_is_deterministic():
    a = C.load_corpus()
    b = C.load_corpus()
    assert a.train == b.train and a.heldout == b.heldout and a.fingerprint == b.fingerprint
    assert a.root == C.stdlib_dir()
    every = a.train + a.heldout
    assert not set(a.train) & set(a.heldout)
    for rel in every:
        parts = rel.split("/")
        assert not set(parts[:-1]) & {"test", "tests", "idle_test", "site-packages"}, rel
    assert "os.py" in every and "json/decoder.py" in every
    assert not any(r.startswith("lib2to3/tests/") or r.startswith("idlelib/idle_test/") for r in every)
    # roughly 5% of files held out, and the split is by path: independent of which other files exist
    assert 0.02 < len(a.heldout) / len(every) < 0.10
    assert all(C.is_heldout(r, 0.05) for r in a.heldout)
    assert a.num_bytes("train") > 5_000_000


def test_split_is_stable_and_capped(fake_root):
    full = C.load_corpus(fake_root, heldout_fraction=0.3)
    assert full.heldout and full.train
    assert [r for r in C.list_source_files(fake_root) if C.is_heldout(r, 0.3)] == full.heldout
    capped = C.load_corpus(fake_root, heldout_fraction=0.3, max_bytes=2000)
    assert capped.train == full.train[:len(capped.train)] and len(capped.train) < len(full.train)
    assert capped.fingerprint != full.fingerprint
    with pytest.raises(C.CorpusError, match="heldout_fraction"):
        C.load_corpus(fake_root, heldout_fraction=1.5)
    with pytest.raises(C.CorpusError, match="not a directory"):
        C.list_source_files(fake_root / "missing")


def test_fingerprint_changes_with_content(tmp_path, fake_root):
    import shutil

    root = tmp_path / "copy"
    shutil.copytree(fake_root, root)
    before = C.load_corpus(root, heldout_fraction=0.3).fingerprint
    (root / "top.py").write_text("X = 2\n")
    assert C.load_corpus(root, heldout_fraction=0.3).fingerprint != before


def test_heldout_prompts_cut_at_function_bodies():
    corpus = C.load_corpus()
    samples = C.heldout_samples(corpus, n=8, seed=0)
    again = C.heldout_samples(corpus, n=8, seed=0)
    other = C.heldout_samples(corpus, n=8, seed=1)
    assert [s.prompt for s in samples] == [s.prompt for s in again]
    assert [s.prompt for s in samples] != [s.prompt for s in other]
    assert len(samples) == 8
    for s in samples:
        assert s.path in corpus.heldout
        text = C.read_source(corpus.root / s.path)
        assert (s.prompt + s.reference) in text  # a real cut of a held-out file
        last = s.prompt.rstrip("\n").splitlines()[-1]
        assert "def " in s.prompt and s.prompt.endswith("\n") and 200 <= len(s.prompt) <= 1200
        assert last.strip()  # ends right before the body's first line
    assert C.heldout_prompts(corpus, n=3) == [s.prompt for s in samples[:3]]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    corpus = C.load_corpus(max_bytes=120_000)
    tok = T.train_bpe(corpus.texts("train"), vocab_size=400)
    out = T.save_tokenizer(tok, tmp_path_factory.mktemp("tok") / "tokenizer")
    return corpus, tok, out


def test_bpe_is_deterministic_and_has_specials(trained):
    corpus, tok, _ = trained
    again = T.train_bpe(corpus.texts("train"), vocab_size=400)
    assert tok.to_str() == again.to_str()
    assert tok.get_vocab_size() == 400
    for i, t in enumerate(T.SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i
    with pytest.raises(T.TokenizerError, match="vocab_size"):
        T.train_bpe(["x"], vocab_size=100)


def test_saved_tokenizer_loads_offline_and_round_trips(trained):
    import json

    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    _, tok, path = trained
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= {p.name for p in path.iterdir()}
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] == T.CHAT_TEMPLATE and cfg["eos_token"] == T.EOS
    hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    fast = PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
    text = "class Übung:\n\tdef f(self, x):  # naïve — ok\n        return {'a': [1, 2]}\r\n"
    for t in (hf, fast):
        ids = t(text).input_ids
        assert ids[0] == t.bos_token_id == 1
        assert t.decode(ids, skip_special_tokens=True) == text
        assert t.eos_token == T.EOS and t.pad_token == T.PAD and t.pad_token_id == 0
    assert hf(text).input_ids == [1] + tok.encode(text, add_special_tokens=False).ids
    docs = T.encode_documents(tok, [text, "x = 1\n"])
    assert docs[0][0] == 1 and docs[0][-1] == 2 and docs[1][-1] == 2
    with pytest.raises(T.TokenizerError, match="already exists"):
        T.save_tokenizer(tok, path)


def test_chat_template(trained):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(trained[2]), local_files_only=True)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sort a list?"},
            {"role": "assistant", "content": "sorted(xs)"}]
    text = hf.apply_chat_template(msgs, tokenize=False)
    assert text == ("<|bos|><|system|>\nBe brief.<|eos|>\n<|user|>\nSort a list?<|eos|>\n"
                    "<|assistant|>\nsorted(xs)<|eos|>\n")
    prompt = hf.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|user|>\nSort a list?<|eos|>\n<|assistant|>\n")
    ids = hf(prompt, add_special_tokens=False).input_ids
    assert ids.count(1) == 1 and hf.convert_tokens_to_ids("<|assistant|>") in ids  # markers are single tokens
    with pytest.raises(Exception, match="unsupported chat role"):
        hf.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_presets_load_and_validate():
    tiny = load_preset("tiny")
    assert tiny.name == "tiny" and tiny.tokenizer.vocab_size == 512
    cfg = tiny.model_config()
    assert cfg.vocab_size == 512 and (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (1, 2, 0)
    for name in ("small", "base"):
        p = load_preset(name)
        assert p.model_config().num_query_groups < p.model_config().num_attention_heads  # GQA
        assert p.tokenizer.vocab_size == 8192
    assert load_preset("tiny", {"train": {"max_steps": 5}}).train.max_steps == 5
    with pytest.raises(ConfigError, match="unknown base preset 'huge'"):
        load_preset("huge")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['stepz'\] in base.train"):
        load_preset("tiny", {"train": {"stepz": 3}})
    with pytest.raises(ConfigError, match="base.train.seq_len"):
        load_preset("tiny", {"train": {"seq_len": 0}})
    with pytest.raises(ConfigError, match="exceeds base.model.max_position_embeddings"):
        load_preset("tiny", {"train": {"seq_len": 4096}})
    with pytest.raises(ConfigError, match="vocab_size is set by"):
        BasePreset.from_dict({"name": "x", "model": {"vocab_size": 3}})
    assert math.isclose(load_preset("tiny").train.train_tokens, 40 * 8 * 128)
