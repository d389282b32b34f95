"""Typed server configuration (conf/serve.yaml maps onto these dataclasses)."""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from nemo_spec.config import ConfigError, dataclass_from_dict

# the generation methods the engine has (nemo_spec.inference.proposers.METHODS; a test keeps them equal)
METHODS = ("ar", "eagle", "eagle_tree", "medusa", "draft_model", "prompt_lookup", "suffix", "peagle", "dflash",
           "peagle_tree", "dflash_tree")
DTYPES = ("auto", "float32", "bfloat16", "float16")
SCHEDULERS = ("continuous", "batch")


@dataclass
class ModelSpec:
    """One served model: where to load it from and how to generate with it."""

    name: str = "default"
    path: Optional[str] = None  # checkpoint dir (nemo_spec torch_dist, Megatron legacy or Hugging Face)
    tokenizer: Optional[str] = None  # tokenizer dir; None -> the checkpoint's tokenizer/ (or the HF dir itself)
    dtype: str = "auto"  # auto = bfloat16 on CUDA, float32 on CPU
    method: str = "ar"  # ar | eagle | eagle_tree | medusa | draft_model | prompt_lookup | suffix | peagle[_tree] | dflash[_tree]
    options: Dict[str, Any] = field(default_factory=dict)  # passed to generate(options=...)
    draft_path: Optional[str] = None  # method=draft_model: the small draft model's checkpoint
    max_batch: int = 8  # rows generating at once (KV slots)
    scheduler: str = "continuous"  # continuous: rows join the running batch each step | batch: fixed batches
    prefill_chunk_tokens: int = 512  # continuous: prompt tokens read per step (long prompts in chunks)
    max_context: Optional[int] = None  # prompt + completion tokens; None -> model max_position_embeddings
    default_max_tokens: int = 256  # when a request gives no max_tokens (completions: OpenAI's 16)
    chat_template: Optional[str] = None  # jinja string or file; None -> tokenizer's template, else the default
    pretune_rows: Optional[int] = None  # CPU: time the few-row kernels for 1..N rows at load; None: what a step can use

    def validate(self) -> "ModelSpec":
        """Raise ConfigError naming the invalid field; returns self."""
        where = f"serve model {self.name!r}"
        if not self.name or not isinstance(self.name, str):
            raise ConfigError(f"{where}: name must be a non-empty string, got {self.name!r}")
        for key in ("path", "tokenizer", "draft_path", "chat_template"):
            v = getattr(self, key)
            if v is not None and not isinstance(v, str):
                raise ConfigError(f"{where}: {key} must be a string or null, got {v!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"{where}: dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.method not in METHODS:
            raise ConfigError(f"{where}: method must be one of {METHODS}, got {self.method!r}")
        if self.method == "draft_model" and not self.draft_path:
            raise ConfigError(f"{where}: method 'draft_model' needs draft_path")
        if not isinstance(self.max_batch, int) or self.max_batch < 1:
            raise ConfigError(f"{where}: max_batch must be an int >= 1, got {self.max_batch!r}")
        if self.scheduler not in SCHEDULERS:
            raise ConfigError(f"{where}: scheduler must be one of {SCHEDULERS}, got {self.scheduler!r}")
        if not isinstance(self.prefill_chunk_tokens, int) or self.prefill_chunk_tokens < 1:
            raise ConfigError(f"{where}: prefill_chunk_tokens must be an int >= 1, got {self.prefill_chunk_tokens!r}")
        if self.max_context is not None and (not isinstance(self.max_context, int) or self.max_context < 2):
            raise ConfigError(f"{where}: max_context must be an int >= 2 or null, got {self.max_context!r}")
        if not isinstance(self.default_max_tokens, int) or self.default_max_tokens < 1:
            raise ConfigError(f"{where}: default_max_tokens must be an int >= 1, got {self.default_max_tokens!r}")
        if self.pretune_rows is not None and (not isinstance(self.pretune_rows, int) or isinstance(self.pretune_rows, bool)
                                              or self.pretune_rows < 0):
            raise ConfigError(f"{where}: pretune_rows must be an int >= 0 or null, got {self.pretune_rows!r}")
        if not isinstance(self.options, dict):
            raise ConfigError(f"{where}: options must be a mapping, got {type(self.options).__name__}")
        from nemo_spec.inference.sampling import SamplingError
        from nemo_spec.inference.proposers import check_options

        try:
            check_options(self.options)
        except SamplingError as e:
            raise ConfigError(f"{where}: {e}") from None
        return self

    @classmethod
    def from_dict(cls, d: Dict[str, Any], source: str = "<dict>") -> "ModelSpec":
        """Build from a dict, rejecting unknown keys with a message naming ``source``."""
        return dataclass_from_dict(cls, d, source).validate()

    def to_dict(self) -> Dict[str, Any]:
        """Plain-JSON representation."""
        return dataclasses.asdict(self)


@dataclass
class ServeConfig:
    """Server-level settings plus the models loaded at start-up."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: List[str] = field(default_factory=list)  # non-empty -> Bearer auth on every endpoint
    admin_key: Optional[str] = None  # required by /admin/*; None -> admin endpoints disabled
    max_queue: int = 64  # waiting requests per model before 503
    batch_wait_ms: float = 5.0  # how long the batcher waits for more requests to join a batch
    max_request_bytes: int = 8 * 1024 * 1024  # larger bodies -> 413, refused before they are read
    max_prompt_chars: int = 1_000_000  # longer prompts (all messages together) -> 400, checked before tokenizing
    health_requires_key: bool = False  # /health is open by default (load balancers), like vLLM
    retry_after_s: int = 1  # Retry-After on 503 queue_full
    max_rows_per_request: int = 256  # prompts x n of one request (split over engine batches); more -> 400
    shutdown_drain_s: float = 10.0  # SIGTERM: queued requests -> 503 at once; running ones get this long
    log_level: str = "info"
    models: List[ModelSpec] = field(default_factory=list)

    def validate(self) -> "ServeConfig":
        """Raise ConfigError naming the invalid field; returns self."""
        if not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ConfigError(f"serve.port must be in [0, 65535], got {self.port!r}")
        if not isinstance(self.max_queue, int) or self.max_queue < 1:
            raise ConfigError(f"serve.max_queue must be an int >= 1, got {self.max_queue!r}")
        if self.batch_wait_ms < 0:
            raise ConfigError(f"serve.batch_wait_ms must be >= 0, got {self.batch_wait_ms!r}")
        for key in ("max_request_bytes", "max_prompt_chars", "retry_after_s", "max_rows_per_request"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"serve.{key} must be an int >= 1, got {v!r}")
        if not isinstance(self.shutdown_drain_s, (int, float)) or not self.shutdown_drain_s >= 0:
            raise ConfigError(f"serve.shutdown_drain_s must be a number >= 0, got {self.shutdown_drain_s!r}")
        if not isinstance(self.health_requires_key, bool):
            raise ConfigError(f"serve.health_requires_key must be true or false, got {self.health_requires_key!r}")
        if any(not isinstance(k, str) or not k for k in self.api_keys):
            raise ConfigError("serve.api_keys must be non-empty strings")
        names = [m.name for m in self.models]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ConfigError(f"serve.models: duplicate model name(s) {dup}")
        for m in self.models:
            m.validate()
        return self

    @classmethod
    def from_dict(cls, d: Dict[str, Any], source: str = "<dict>") -> "ServeConfig":
        """Build from a (Hydra-resolved) dict; ``model`` (one spec) and ``models`` (a list) are both accepted."""
        d = copy.deepcopy(dict(d))
        models = [ModelSpec.from_dict(m, f"{source}: models[{i}]") for i, m in enumerate(d.pop("models", None) or [])]
        one = d.pop("model", None)
        if one and one.get("path") is not None:
            models.insert(0, ModelSpec.from_dict(one, f"{source}: model"))
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"{source}: unknown serve key(s) {unknown}; known: {sorted(known | {'model'})}")
        d["api_keys"] = [str(k) for k in (d.get("api_keys") or [])]
        return cls(models=models, **d).validate()
