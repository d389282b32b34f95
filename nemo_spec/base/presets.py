"""Typed schema of a base-model build (corpus, tokenizer, model, training) and the named presets.

The preset values live in ``conf/base/<name>.yaml`` (the Hydra config group ``base``); this module
is their typed, validated form. ``load_preset("small")`` reads the YAML without Hydra.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

from nemo_spec.config import ConfigError, ModelConfig
from nemo_spec.base.tokenizer import BOS, EOS, PAD, SPECIAL_TOKENS

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
PRESET_NAMES = ("tiny", "small", "base")


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@dataclass
class CorpusConfig:
    """Which source files to use and how much to hold out."""

    heldout_fraction: float = 0.05
    max_bytes: Optional[int] = None

    def validate(self) -> None:
        """Raise ConfigError naming the invalid field."""
        _check(0.0 < self.heldout_fraction < 1.0,
               f"base.corpus.heldout_fraction must be in (0, 1), got {self.heldout_fraction!r}")
        _check(self.max_bytes is None or (isinstance(self.max_bytes, int) and self.max_bytes > 0),
               f"base.corpus.max_bytes must be a positive int or null, got {self.max_bytes!r}")


@dataclass
class TokenizerConfig:
    """Byte-level BPE size."""

    vocab_size: int = 8192
    min_frequency: int = 2

    def validate(self) -> None:
        """Raise ConfigError naming the invalid field."""
        lo = len(SPECIAL_TOKENS) + 256
        _check(isinstance(self.vocab_size, int) and self.vocab_size >= lo,
               f"base.tokenizer.vocab_size must be an int >= {lo}, got {self.vocab_size!r}")
        _check(isinstance(self.min_frequency, int) and self.min_frequency >= 1,
               f"base.tokenizer.min_frequency must be an int >= 1, got {self.min_frequency!r}")


@dataclass
class TrainConfig:
    """Pretraining schedule on packed fixed-length sequences."""

    seq_len: int = 256
    micro_batch_size: int = 16
    max_steps: int = 100
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_tokens: int = 32768

    def validate(self) -> None:
        """Raise ConfigError naming the invalid field."""
        for name in ("seq_len", "micro_batch_size", "max_steps", "eval_tokens"):
            v = getattr(self, name)
            _check(isinstance(v, int) and v > 0, f"base.train.{name} must be a positive int, got {v!r}")
        _check(isinstance(self.warmup_steps, int) and 0 <= self.warmup_steps <= self.max_steps,
               f"base.train.warmup_steps must be in [0, max_steps={self.max_steps}], got {self.warmup_steps!r}")
        _check(self.lr > 0, f"base.train.lr must be > 0, got {self.lr!r}")
        _check(0.0 <= self.min_lr_ratio <= 1.0, f"base.train.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        _check(self.weight_decay >= 0, f"base.train.weight_decay must be >= 0, got {self.weight_decay!r}")
        _check(self.grad_clip >= 0, f"base.train.grad_clip must be >= 0 (0 = off), got {self.grad_clip!r}")

    @property
    def train_tokens(self) -> int:
        """Tokens seen during pretraining."""
        return self.max_steps * self.micro_batch_size * self.seq_len


@dataclass
class BasePreset:
    """Everything that determines a built-in base model (with the seed and the corpus fingerprint)."""

    name: str
    model: Dict[str, Any]
    corpus: CorpusConfig = field(default_factory=CorpusConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def validate(self) -> "BasePreset":
        """Raise ConfigError naming the first invalid field; returns self."""
        _check(isinstance(self.name, str) and self.name != "", f"base.name must be a non-empty string, got {self.name!r}")
        self.corpus.validate()
        self.tokenizer.validate()
        self.train.validate()
        _check("vocab_size" not in self.model,
               "base.model.vocab_size is set by base.tokenizer.vocab_size; remove it from base.model")
        cfg = self.model_config()
        _check(self.train.seq_len <= cfg.max_position_embeddings,
               f"base.train.seq_len={self.train.seq_len} exceeds base.model.max_position_embeddings="
               f"{cfg.max_position_embeddings}")
        return self

    def model_config(self, vocab_size: Optional[int] = None) -> ModelConfig:
        """The ModelConfig of the base GPT (token ids of the specials filled in)."""
        d = dict(self.model)
        d.update(vocab_size=vocab_size or self.tokenizer.vocab_size, bos_token_id=SPECIAL_TOKENS.index(BOS),
                 eos_token_id=SPECIAL_TOKENS.index(EOS), pad_token_id=SPECIAL_TOKENS.index(PAD))
        return ModelConfig.from_dict(d, source=f"base preset {self.name!r} model")

    def to_dict(self) -> Dict[str, Any]:
        """Plain-JSON representation."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str = "<dict>") -> "BasePreset":
        """Build and validate from a (YAML/Hydra) mapping, rejecting unknown keys with ``source`` in the message."""
        d = dict(d)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        _check(not unknown, f"{source}: unknown base preset key(s) {unknown}")
        _check("name" in d and "model" in d, f"{source}: a base preset needs 'name' and 'model'")
        parts: Dict[str, Any] = {"name": d["name"], "model": dict(d["model"])}
        for key, typ in (("corpus", CorpusConfig), ("tokenizer", TokenizerConfig), ("train", TrainConfig)):
            sub = dict(d.get(key) or {})
            fields = {f.name for f in dataclasses.fields(typ)}
            bad = sorted(set(sub) - fields)
            _check(not bad, f"{source}: unknown key(s) {bad} in base.{key}")
            parts[key] = typ(**sub)
        return cls(**parts).validate()


def preset_path(name: str) -> Path:
    """The YAML file of preset ``name``."""
    return CONF_DIR / "base" / f"{name}.yaml"


def available_presets() -> List[str]:
    """Names of the presets found in ``conf/base``."""
    return sorted(p.stem for p in (CONF_DIR / "base").glob("*.yaml"))


def load_preset(name: str, overrides: Optional[Mapping[str, Any]] = None) -> BasePreset:
    """Load preset ``name`` from ``conf/base/<name>.yaml``; ``overrides`` is a nested dict merged on top."""
    from omegaconf import OmegaConf

    path = preset_path(name)
    if not path.is_file():
        raise ConfigError(f"unknown base preset {name!r}: {path} not found (available: {available_presets()})")
    conf = OmegaConf.load(path)
    if overrides:
        conf = OmegaConf.merge(conf, OmegaConf.create(dict(overrides)))
    return BasePreset.from_dict(OmegaConf.to_container(conf, resolve=True), source=str(path))
