"""Build the built-in base model (tokenizer + pretrained GPT) into a cache directory, or reuse a cached build.

A build lives in ``<cache>/base/<preset>-s<seed>-<key>/`` where ``key`` hashes the resolved preset,
the seed, the corpus fingerprint and :data:`CODE_VERSION`:

    checkpoint/      Megatron distributed checkpoint (torch_dist) + nemo_spec_config.json + tokenizer/
    tokenizer/       Hugging Face tokenizer directory
    metrics.json     held-out loss / perplexity, timings, sizes
    token_counts.pt  token frequencies of the training split (gpt_speculate.py --token_counts)
    build.json       the resolved build settings (preset, seed, corpus fingerprint, versions)
    logs/            Lightning CSV logs of the pretraining run

The whole directory is written under a temporary name and renamed when complete, so a directory
with that name is always a finished build.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, Union

import torch

from nemo_spec.base.corpus import Corpus, load_corpus
from nemo_spec.fsutil import publish_directory
from nemo_spec.base.presets import BasePreset, load_preset
from nemo_spec.config import ConfigError, dump_json

log = logging.getLogger(__name__)

#: bump when the build recipe changes in a way that changes the weights (invalidates cached builds)
CODE_VERSION = "1"
ENV_CACHE = "NEMO_SPEC_CACHE"


class BuildError(RuntimeError):
    """A base-model build failed or a cached build is unusable."""


def resolve_cache_dir(cache_dir: Union[str, Path, None] = None) -> Path:
    """The cache root: ``cache_dir`` if given, else ``$NEMO_SPEC_CACHE``, else ``~/.cache/nemo_spec``."""
    if cache_dir not in (None, ""):
        return Path(cache_dir).expanduser().resolve()
    env = os.environ.get(ENV_CACHE)
    if env:
        return Path(env).expanduser().resolve()
    return (Path.home() / ".cache" / "nemo_spec").resolve()


def build_key(preset: BasePreset, seed: int, corpus_fingerprint: str) -> str:
    """Cache key of a build: hash of the resolved preset, seed, corpus fingerprint and code version."""
    payload = json.dumps({"preset": preset.to_dict(), "seed": seed, "corpus": corpus_fingerprint,
                          "code_version": CODE_VERSION}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:12]


@dataclass
class BaseModel:
    """A finished build: where its checkpoint and tokenizer are, and its metrics."""

    path: Path
    preset: str
    seed: int
    key: str
    metrics: Dict[str, Any]
    cached: bool

    @property
    def checkpoint(self) -> Path:
        """The Megatron distributed checkpoint directory (load with nemo_spec.checkpoint.load_model)."""
        return self.path / "checkpoint"

    @property
    def token_counts(self) -> Path:
        """Token frequencies of the training split (LongTensor [vocab])."""
        return self.path / "token_counts.pt"

    @property
    def tokenizer_dir(self) -> Path:
        """The Hugging Face tokenizer directory."""
        return self.path / "tokenizer"


def _read_build(path: Path, preset: str, seed: int, key: str, cached: bool) -> BaseModel:
    metrics_file = path / "metrics.json"
    if not metrics_file.is_file() or not (path / "checkpoint").is_dir() or not (path / "tokenizer").is_dir():
        raise BuildError(f"cached build {path} is incomplete (needs metrics.json, checkpoint/, tokenizer/); "
                         f"delete it or rebuild with force=true")
    metrics = json.loads(metrics_file.read_text())
    return BaseModel(path=path, preset=preset, seed=seed, key=key, metrics=metrics, cached=cached)


def _write_json(path: Path, obj: Dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(dump_json(obj) + "\n")
    os.replace(tmp, path)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@contextlib.contextmanager
def _single_process() -> Iterator[None]:
    """Make sure a (TP=1, world 1) parallel state exists for the duration; tear down only what we set up."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from nemo_spec import parallel

    if dist.is_initialized() and dist.get_world_size() > 1:
        raise BuildError(f"build_base runs in a single process; got world size {dist.get_world_size()} "
                         f"(run scripts/build_base.py without torchrun)")
    owns_group = not dist.is_initialized()
    owns_state = not parallel_state.model_parallel_is_initialized()
    if owns_group or owns_state:
        parallel.initialize(tensor_parallel_size=1)
    elif parallel.tp_size() != 1:
        raise BuildError(f"build_base needs tensor parallel size 1, current parallel state has {parallel.tp_size()}")
    try:
        yield
    finally:
        if owns_group:
            parallel.destroy()
        elif owns_state:
            parallel_state.destroy_model_parallel()


def build_dir(preset: BasePreset, seed: int, corpus: Corpus, cache_dir: Union[str, Path, None] = None) -> Path:
    """Where the build of ``preset`` with ``seed`` on ``corpus`` lives (whether or not it exists yet)."""
    key = build_key(preset, seed, corpus.fingerprint)
    return resolve_cache_dir(cache_dir) / "base" / f"{preset.name}-s{seed}-{key}"


def _as_preset(preset: Union[str, BasePreset]) -> BasePreset:
    if isinstance(preset, BasePreset):
        return preset.validate()
    if isinstance(preset, str):
        return load_preset(preset)
    raise ConfigError(f"preset must be a preset name or a BasePreset, got {type(preset).__name__}")


def build_base(preset: Union[str, BasePreset] = "small", seed: int = 0, cache_dir: Union[str, Path, None] = None,
               force: bool = False, progress: bool = True) -> BaseModel:
    """Return the built-in base model for ``preset``/``seed``, building it into the cache when absent."""
    preset = _as_preset(preset)
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ConfigError(f"seed must be a non-negative int, got {seed!r}")
    corpus = load_corpus(heldout_fraction=preset.corpus.heldout_fraction, max_bytes=preset.corpus.max_bytes)
    key = build_key(preset, seed, corpus.fingerprint)
    final = resolve_cache_dir(cache_dir) / "base" / f"{preset.name}-s{seed}-{key}"
    if final.is_dir() and not force:
        log.info("base model %r (seed %d) found in cache: %s", preset.name, seed, final)
        return _read_build(final, preset.name, seed, key, cached=True)
    with _file_lock(final.parent / f".{final.name}.lock"):
        if final.is_dir() and not force:  # built by a concurrent process while we waited
            return _read_build(final, preset.name, seed, key, cached=True)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
        try:
            metrics = _build_into(tmp, preset, seed, corpus, key, progress)
            publish_directory(tmp, final)  # force: the old build is removed only once the new one is in place
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    log.info("base model %r built in %.0f s: held-out loss %.4f (perplexity %.2f) -> %s", preset.name,
             metrics["build_seconds"], metrics["heldout_loss"], metrics["heldout_perplexity"], final)
    return BaseModel(path=final, preset=preset.name, seed=seed, key=key, metrics=metrics, cached=False)


def _build_into(out: Path, preset: BasePreset, seed: int, corpus: Corpus, key: str, progress: bool) -> Dict[str, Any]:
    """Train tokenizer and model, evaluate, and write everything into ``out``; returns the metrics."""
    from nemo_spec.base.pretrain import pack_documents, pretrain
    from nemo_spec.base.tokenizer import encode_documents, save_tokenizer, train_bpe

    try:  # fail before heavy work if the checkpoint writer is missing
        from nemo_spec.checkpoint import save_checkpoint
    except ImportError as e:
        raise BuildError(f"nemo_spec.checkpoint.save_checkpoint is not available ({e}); cannot save the base model") from e

    t0 = time.time()
    tok = train_bpe(corpus.texts("train"), preset.tokenizer.vocab_size, preset.tokenizer.min_frequency)
    vocab = tok.get_vocab_size()
    tok_dir = save_tokenizer(tok, out / "tokenizer", model_max_length=preset.model_config().max_position_embeddings)
    t_tok = time.time() - t0
    train_stream = pack_documents(encode_documents(tok, corpus.texts("train")))
    heldout_stream = pack_documents(encode_documents(tok, corpus.texts("heldout")))
    t_enc = time.time() - t0 - t_tok
    log.info("tokenizer (vocab %d) in %.1f s; encoded %.2fM train / %.3fM held-out tokens in %.1f s", vocab, t_tok,
             train_stream.numel() / 1e6, heldout_stream.numel() / 1e6, t_enc)
    counts = torch.bincount(train_stream, minlength=vocab)  # for EAGLE-3 draft vocabularies (gpt_speculate)
    torch.save(counts, out / "token_counts.pt")
    model_cfg = preset.model_config(vocab_size=vocab)
    info = {"preset": preset.to_dict(), "seed": seed, "key": key, "code_version": CODE_VERSION,
            "corpus": {"root": str(corpus.root), "fingerprint": corpus.fingerprint, "train_files": len(corpus.train),
                       "heldout_files": len(corpus.heldout), "train_bytes": corpus.num_bytes("train"),
                       "heldout_bytes": corpus.num_bytes("heldout")},
            "model": model_cfg.to_dict(), "python": sys.version.split()[0], "torch": torch.__version__}
    _write_json(out / "build.json", info)
    with _single_process():
        t1, c1 = time.time(), time.process_time()
        module, metrics = pretrain(model_cfg, preset.train, train_stream, heldout_stream, seed,
                                   log_dir=out / "logs", progress=progress)
        t_train, c_train = time.time() - t1, time.process_time() - c1
        model = module.model
        metrics.update(
            preset=preset.name, seed=seed, key=key, vocab_size=vocab,
            num_parameters=sum(p.numel() for p in model.parameters()),
            corpus_train_tokens=int(train_stream.numel()), corpus_heldout_tokens=int(heldout_stream.numel()),
            epochs=round(preset.train.train_tokens / max(1, train_stream.numel()), 3),
            tokenizer_seconds=round(t_tok, 2), encode_seconds=round(t_enc, 2), train_seconds=round(t_train, 2),
            train_cpu_seconds=round(c_train, 2),
            torch_threads=torch.get_num_threads(),
        )
        if not math.isfinite(metrics["heldout_loss"]):
            raise BuildError(f"pretraining of preset {preset.name!r} diverged: held-out loss {metrics['heldout_loss']}")
        save_checkpoint(model, out / "checkpoint", tokenizer_dir=tok_dir,
                        extra={"base_build": {"preset": preset.name, "seed": seed, "key": key,
                                              "heldout_loss": metrics["heldout_loss"]}})
    metrics["build_seconds"] = round(time.time() - t0, 2)
    _write_json(out / "metrics.json", metrics)
    return metrics


def ensure_base(preset: Union[str, BasePreset] = "small", seed: int = 0,
                cache_dir: Union[str, Path, None] = None) -> BaseModel:
    """The cached built-in base model, built first if needed (alias of :func:`build_base` without force)."""
    return build_base(preset, seed=seed, cache_dir=cache_dir, force=False)


def run_from_config(cfg: Any) -> BaseModel:
    """Build (or fetch) the base model from a Hydra/OmegaConf config shaped like ``conf/build_base.yaml``."""
    from omegaconf import OmegaConf

    container = OmegaConf.to_container(cfg, resolve=True) if not isinstance(cfg, dict) else dict(cfg)
    unknown = sorted(set(container) - {"base", "seed", "cache_dir", "force", "threads", "progress"})
    if unknown:
        raise ConfigError(f"build_base config: unknown key(s) {unknown}")
    if "base" not in container:
        raise ConfigError("build_base config: missing 'base' (choose a preset: base=tiny|small|base)")
    preset = BasePreset.from_dict(container["base"], source="build_base config 'base'")
    threads = container.get("threads")
    if threads is not None:
        if not isinstance(threads, int) or threads < 1:
            raise ConfigError(f"build_base config: threads must be a positive int or null, got {threads!r}")
        torch.set_num_threads(threads)
    return build_base(preset, seed=int(container.get("seed", 0)), cache_dir=container.get("cache_dir"),
                      force=bool(container.get("force", False)), progress=bool(container.get("progress", True)))


def summary(result: BaseModel) -> str:
    """A few human-readable lines about a build (for the CLI)."""
    m = result.metrics
    return "\n".join([
        f"base model : {result.preset} (seed {result.seed}){' [cached]' if result.cached else ''}",
        f"checkpoint : {result.checkpoint}",
        f"tokenizer  : {result.tokenizer_dir}",
        f"parameters : {m.get('num_parameters', 0) / 1e6:.2f}M, vocab {m.get('vocab_size')}",
        f"trained on : {m.get('train_tokens', 0) / 1e6:.2f}M tokens ({m.get('epochs')} epochs) "
        f"in {m.get('train_seconds')} s (build {m.get('build_seconds')} s)",
        f"held-out   : loss {m.get('heldout_loss', float('nan')):.4f}, "
        f"perplexity {m.get('heldout_perplexity', float('nan')):.2f} on {m.get('heldout_tokens')} tokens",
    ])
