"""Built-in base model: the `tiny` preset built end to end into a temporary cache dir."""
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from nemo_spec.base import build as B
from nemo_spec.base.presets import load_preset
from nemo_spec.config import ConfigError
from tests.helpers import script_env

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models gain nothing from more threads, and oversubscribed OpenMP threads spin (shared CI cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_build(tmp_path_factory, _one_thread):
    cache = tmp_path_factory.mktemp("cache")
    t0 = time.time()
    result = B.build_base("tiny", seed=0, cache_dir=cache, progress=False)
    return cache, result, time.time() - t0


def _weights(path: Path):
    from nemo_spec.checkpoint import load_model
    from nemo_spec.models import unwrap

    model = load_model(path)
    return {k: v.detach().clone() for k, v in unwrap(model).state_dict().items() if torch.is_tensor(v)
            and "_extra_state" not in k}


def test_tiny_build_writes_checkpoint_tokenizer_and_metrics(tiny_build):
    from transformers import AutoTokenizer

    from nemo_spec.checkpoint import find_tokenizer_dir, read_checkpoint_config

    cache, result, _ = tiny_build
    assert not result.cached
    assert result.path.parent == cache.resolve() / "base" and result.path.name.startswith("tiny-s0-")
    assert not [p for p in result.path.parent.iterdir() if p.name.startswith(".tiny") and "tmp" in p.name]
    cfg = read_checkpoint_config(result.checkpoint)
    assert cfg["model"]["vocab_size"] == 512 and cfg["model"]["hidden_size"] == 64
    assert cfg["base_build"]["preset"] == "tiny"
    tok_dir = find_tokenizer_dir(result.checkpoint)
    assert tok_dir is not None and (tok_dir / "tokenizer.json").is_file()
    tok = AutoTokenizer.from_pretrained(str(result.tokenizer_dir), local_files_only=True)
    assert tok.chat_template and len(tok) == 512
    metrics = json.loads((result.path / "metrics.json").read_text())
    assert metrics == result.metrics
    loss = metrics["heldout_loss"]
    assert math.isfinite(loss) and loss < math.log(512) - 0.5, loss
    assert math.isclose(metrics["heldout_perplexity"], math.exp(loss), rel_tol=1e-6)
    assert metrics["heldout_tokens"] == 4096 and metrics["train_tokens"] == 40 * 8 * 128
    build = json.loads((result.path / "build.json").read_text())
    assert build["seed"] == 0 and build["corpus"]["fingerprint"] and build["preset"]["name"] == "tiny"
    assert (result.path / "logs" / "metrics.csv").is_file()
    counts = torch.load(result.token_counts, weights_only=True)
    assert counts.shape == (512,) and int(counts.sum()) == metrics["corpus_train_tokens"] and counts[1] > 0


def test_second_call_hits_cache(tiny_build):
    cache, first, first_seconds = tiny_build
    mtime = (first.path / "metrics.json").stat().st_mtime_ns
    t0 = time.time()
    again = B.build_base("tiny", seed=0, cache_dir=cache, progress=False)
    assert again.cached and again.path == first.path and again.metrics == first.metrics
    assert (first.path / "metrics.json").stat().st_mtime_ns == mtime
    assert time.time() - t0 < first_seconds
    # NEMO_SPEC_CACHE is honoured when no cache_dir is given
    os.environ[B.ENV_CACHE] = str(cache)
    try:
        assert B.resolve_cache_dir() == cache.resolve()
        assert B.ensure_base("tiny").path == first.path
    finally:
        del os.environ[B.ENV_CACHE]
    assert B.resolve_cache_dir() == (Path.home() / ".cache" / "nemo_spec").resolve()


def test_same_seed_same_weights_other_seed_differs(tiny_build, tmp_path):
    _, first, _ = tiny_build
    same = B.build_base("tiny", seed=0, cache_dir=tmp_path / "a", progress=False)
    other = B.build_base("tiny", seed=1, cache_dir=tmp_path / "a", progress=False)
    assert same.key == first.key and other.key != first.key
    w0, w1, w2 = _weights(first.checkpoint), _weights(same.checkpoint), _weights(other.checkpoint)
    assert w0.keys() == w1.keys() and len(w0) > 10
    for k in w0:
        assert torch.equal(w0[k], w1[k]), k
    assert any(not torch.equal(w0[k], w2[k]) for k in w0)
    assert same.metrics["heldout_loss"] == first.metrics["heldout_loss"]
    assert (first.tokenizer_dir / "tokenizer.json").read_bytes() == (same.tokenizer_dir / "tokenizer.json").read_bytes()


def test_cache_key_covers_preset_and_seed():
    tiny = load_preset("tiny")
    k = B.build_key(tiny, 0, "abc")
    assert k == B.build_key(load_preset("tiny"), 0, "abc")
    assert k != B.build_key(tiny, 1, "abc")
    assert k != B.build_key(tiny, 0, "abd")
    assert k != B.build_key(load_preset("tiny", {"train": {"lr": 0.001}}), 0, "abc")


def test_bad_config_fails_before_work(tmp_path):
    with pytest.raises(ConfigError, match="seed must be a non-negative int"):
        B.build_base("tiny", seed=-1, cache_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['colour'\]"):
        B.run_from_config({"base": load_preset("tiny").to_dict(), "colour": 1})
    with pytest.raises(ConfigError, match="threads must be"):
        B.run_from_config({"base": load_preset("tiny").to_dict(), "threads": 0, "cache_dir": str(tmp_path)})
    assert not (tmp_path / "base").exists()


def test_cli_reuses_cache(tiny_build):
    cache, first, _ = tiny_build
    env = script_env()
    p = subprocess.run([sys.executable, "scripts/build_base.py", "base=tiny", f"cache_dir={cache}"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "[cached]" in p.stdout and str(first.checkpoint) in p.stdout
    assert f"loss {first.metrics['heldout_loss']:.4f}" in p.stdout
    assert not (ROOT / "outputs").exists() or not any((ROOT / "outputs").rglob("build_base.log"))
