"""Served models: loading a checkpoint + tokenizer, binding the generation engine, load/unload/switch."""
from __future__ import annotations

import functools
import gc
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

import torch

from nemo_spec._threads import in_fresh_thread
from nemo_spec.checkpoint.hf import resolve_dtype
from nemo_spec.config import ConfigError
from nemo_spec.data.chat import load_tokenizer
from nemo_spec.inference.generate import end_of_sequence_ids
from nemo_spec.models import fastpath
from nemo_spec.serve.batching import Batcher, SessionBatcher
from nemo_spec.serve.chat_template import ChatTemplate, ChatTemplateError
from nemo_spec.serve.config import ModelSpec
from nemo_spec.serve.metrics import ServerMetrics
from nemo_spec.serve.protocol import APIError

log = logging.getLogger(__name__)


class ModelLoadError(RuntimeError):
    """A model named in the serve config could not be loaded (message names the model and path)."""


class SpecError(ValueError):
    """An admin switch's fields, applied to the model's spec, do not make a valid ModelSpec (message names them)."""


def _model_max_len(model: torch.nn.Module) -> int:
    from nemo_spec.models.gpt import model_config

    return int(model_config(model).max_position_embeddings)


@dataclass
class ServedModel:
    """A loaded model with its tokenizer, chat template, limits and batcher."""

    spec: ModelSpec
    model: torch.nn.Module
    tokenizer: Any
    template: ChatTemplate
    max_context: int
    eos_ids: List[int]
    batcher: Any  # SessionBatcher (continuous) or Batcher (fixed batches)
    draft_model: Optional[torch.nn.Module] = None
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def name(self) -> str:
        """The model id clients use."""
        return self.spec.name

    def describe(self) -> Dict[str, Any]:
        """Admin view of this model."""
        return {"id": self.name, "path": self.spec.path, "method": self.spec.method, "options": self.spec.options,
                "dtype": str(next(self.model.parameters()).dtype).replace("torch.", ""),
                "max_batch": self.spec.max_batch, "max_context": self.max_context, "scheduler": self.spec.scheduler,
                "chat_template": self.template.origin, "queue_depth": self.batcher.queue_depth(),
                "running_rows": self.batcher.running_rows, "batches_run": self.batcher.batches_run,
                **({"session": self.batcher.session.stats()} if getattr(self.batcher, "session", None) else {})}

    def close(self, drain: bool = True, cancel_running: bool = False) -> None:
        """Stop the batcher (finishing or failing queued requests, optionally cancelling the running batch)
        and drop the weights."""
        self.batcher.close(drain=drain, cancel_running=cancel_running)
        self.batcher.engine = None  # type: ignore[assignment]
        if hasattr(self.batcher, "session"):
            self.batcher.session = None
        self.model = None  # type: ignore[assignment]
        self.draft_model = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _engine(model: torch.nn.Module, method: str, options: Dict[str, Any], draft_model: Optional[torch.nn.Module],
            tokenizer: Any, prompts: List[List[int]], params: List[Any], on_tokens: Any,
            on_finish: Any = None) -> List[Any]:
    from nemo_spec.inference import generate

    # end-of-sequence is handled per row through SamplingParams.stop_token_ids (so requests may ignore_eos)
    opts = {**options, "ignore_eos": True}
    with torch.inference_mode():
        return generate(model, prompts, params, method=method, draft_model=draft_model, options=opts,
                        tokenizer=tokenizer, on_tokens=on_tokens, on_finish=on_finish)


def _pretune(spec: ModelSpec, models: List[Optional[torch.nn.Module]], step_rows: int) -> None:
    """Time the few-row CPU kernels now (``spec.pretune_rows``, default: the row counts a step can use) rather than
    at first use, where each new row count would pause the running batch (fastpath.pretune)."""
    rows = min(step_rows if spec.pretune_rows is None else spec.pretune_rows, fastpath.MAX_TUNED_ROWS)
    t0 = time.perf_counter()
    n = sum(fastpath.pretune(m, rows) for m in models if m is not None)
    if n:
        log.info("model %r: few-row CPU kernels timed for 1-%d rows in %.1fs", spec.name, rows,
                 time.perf_counter() - t0)


def _fit_cache(spec: ModelSpec, model: torch.nn.Module, draft_model: Optional[torch.nn.Module],
               max_context: int) -> int:
    """The context a request may use under ``options.max_cache_len``: the cache also holds one step's drafts
    (the method's lookahead + 1 positions) past a row's tokens, so a request that fits ``max_context`` always fits
    the cache and a longer one is refused as context_length_exceeded (400), not failed by the engine (500)."""
    cap = spec.options.get("max_cache_len")
    if cap is None:
        return max_context
    from nemo_spec.inference.generate import get_engine
    from nemo_spec.inference.proposers import make_proposer
    from nemo_spec.inference.sampling import SamplingError

    try:
        extra = make_proposer(spec.method, model, get_engine(model), draft_model, spec.options).lookahead + 1
    except SamplingError as e:
        raise ConfigError(f"serve model {spec.name!r}: {e}") from e
    fits = int(cap) - extra
    where = (f"serve model {spec.name!r}: options.max_cache_len={cap} holds {fits} tokens beside the {extra} "
             f"positions a step of method {spec.method!r} writes past a row")
    if fits < 2:
        raise ConfigError(f"{where}; a request needs at least 2 (one prompt token, one generated)")
    if spec.max_context is not None and spec.max_context > fits:
        log.warning("%s, fewer than max_context=%d: serving a context of %d tokens (max_model_len)", where,
                    spec.max_context, fits)
    return min(max_context, fits)


def build_served_model(spec: ModelSpec, max_queue: int = 64, batch_wait_s: float = 0.005,
                       metrics: Optional[ServerMetrics] = None, model: Optional[torch.nn.Module] = None,
                       tokenizer: Any = None, draft_model: Optional[torch.nn.Module] = None) -> ServedModel:
    """Load (or take) the model and tokenizer for ``spec`` and start its batcher."""
    spec.validate()
    if model is None:
        if not spec.path:
            raise ConfigError(f"serve model {spec.name!r}: path is required")
        if not Path(spec.path).exists():
            raise ModelLoadError(f"serve model {spec.name!r}: checkpoint path {spec.path} does not exist")
        from nemo_spec.checkpoint import load_model

        log.info("loading model %r from %s", spec.name, spec.path)
        try:
            model = load_model(spec.path, dtype=resolve_dtype(spec.dtype))
        except Exception as e:
            raise ModelLoadError(f"serve model {spec.name!r}: loading {spec.path} failed: {e}") from e
    if tokenizer is None:
        tok_dir = spec.tokenizer
        if tok_dir is None and spec.path:
            from nemo_spec.checkpoint import find_tokenizer_dir

            found = find_tokenizer_dir(spec.path)
            tok_dir = str(found) if found else None
        if tok_dir is None:
            raise ModelLoadError(f"serve model {spec.name!r}: no tokenizer found in {spec.path}; set tokenizer=<dir>")
        try:
            tokenizer = load_tokenizer(tok_dir)
        except (OSError, TypeError, ValueError) as e:
            raise ModelLoadError(f"serve model {spec.name!r}: tokenizer {tok_dir}: {e}") from e
    if spec.method == "draft_model" and draft_model is None:
        from nemo_spec.checkpoint import load_model

        if not Path(str(spec.draft_path)).exists():
            raise ModelLoadError(f"serve model {spec.name!r}: draft_path {spec.draft_path} does not exist")
        draft_model = load_model(str(spec.draft_path))
    dtype = resolve_dtype(spec.dtype)
    model = model.to(dtype).eval()
    if draft_model is not None:
        draft_model = draft_model.to(dtype).eval()
    limit = _model_max_len(model)
    if draft_model is not None:  # draft-model speculation needs every position in the draft's context too
        limit = min(limit, _model_max_len(draft_model))
    max_context = spec.max_context or limit
    if max_context > limit:
        raise ConfigError(f"serve model {spec.name!r}: max_context={max_context} exceeds the model's "
                          f"max_position_embeddings={limit}")
    max_context = _fit_cache(spec, model, draft_model, max_context)
    try:
        template = ChatTemplate.for_tokenizer(tokenizer, spec.chat_template)
    except ChatTemplateError as e:
        raise ModelLoadError(f"serve model {spec.name!r}: {e}") from e
    if spec.scheduler == "continuous":
        from nemo_spec.inference.sampling import SamplingError
        from nemo_spec.inference.session import Session

        # end-of-sequence is handled per row through SamplingParams.stop_token_ids (so requests may ignore_eos)
        try:
            session = Session(model, spec.method, draft_model, {**spec.options, "ignore_eos": True}, tokenizer,
                              max_batch=spec.max_batch, max_seq_len=max_context,
                              prefill_chunk_tokens=spec.prefill_chunk_tokens)
        except SamplingError as e:
            raise ConfigError(f"serve model {spec.name!r}: {e}") from e
        _pretune(spec, [model, draft_model], spec.max_batch * (session.proposer.lookahead + 1))
        batcher: Any = SessionBatcher(session, tokenizer, spec.max_batch, max_queue, batch_wait_s, metrics, spec.name)
    else:
        _pretune(spec, [model, draft_model], fastpath.MAX_TUNED_ROWS)
        engine = functools.partial(_engine, model, spec.method, spec.options, draft_model, tokenizer)
        batcher = Batcher(engine, tokenizer, spec.max_batch, max_queue, batch_wait_s, metrics, spec.name)
    eos_ids = end_of_sequence_ids(model, tokenizer)
    served = ServedModel(spec=spec, model=model, tokenizer=tokenizer, template=template, max_context=max_context,
                         eos_ids=eos_ids + [t for t in template.end_of_turn_ids() if t not in eos_ids],
                         batcher=batcher, draft_model=draft_model)
    log.info("model %r ready: method=%s scheduler=%s max_batch=%d max_context=%d dtype=%s", spec.name, spec.method,
             spec.scheduler, spec.max_batch, max_context, dtype)
    return served


class ModelManager:
    """The set of served models, by name; load/unload/switch are serialised, lookups are lock-free."""

    def __init__(self, max_queue: int = 64, batch_wait_s: float = 0.005,
                 metrics: Optional[ServerMetrics] = None) -> None:
        self.max_queue = max_queue
        self.batch_wait_s = batch_wait_s
        self.metrics = metrics or ServerMetrics()
        self._models: Dict[str, ServedModel] = {}
        self._admin_lock = threading.Lock()
        self.metrics.queue_depth.add_callback(
            lambda: {(("model", n),): float(m.batcher.queue_depth()) for n, m in list(self._models.items())})
        self.metrics.running.add_callback(
            lambda: {(("model", n),): float(m.batcher.running_rows) for n, m in list(self._models.items())})

    def names(self) -> List[str]:
        """Names of the loaded models."""
        return list(self._models)

    def all(self) -> List[ServedModel]:
        """The loaded models."""
        return list(self._models.values())

    def get(self, name: str) -> ServedModel:
        """The model called ``name``; 404 (OpenAI model_not_found) otherwise."""
        m = self._models.get(name)
        if m is None:
            raise APIError(404, f"The model `{name}` does not exist. Loaded models: {sorted(self._models)}",
                           "invalid_request_error", "model", "model_not_found")
        return m

    def add(self, spec: ModelSpec, replace: bool = False, **kw: Any) -> ServedModel:
        """Load ``spec`` and serve it; an existing model of that name is replaced (after draining) if ``replace``."""
        with self._admin_lock:
            return self._add_locked(spec, replace, **kw)

    def switch(self, changes: Mapping[str, Any]) -> ServedModel:
        """Replace the model ``changes["name"]`` by its spec with ``changes`` applied (what they leave out stays as
        the model has it when the switch runs: merged under the admin lock, so concurrent switches all apply);
        404 if no such model, :class:`SpecError` if the merged spec is invalid."""
        with self._admin_lock:
            current = self.get(str(changes.get("name", ModelSpec.name)))
            try:
                spec = ModelSpec.from_dict({**current.spec.to_dict(), **changes}, "admin request")
            except (ConfigError, TypeError) as e:
                raise SpecError(str(e)) from e
            return self._add_locked(spec, replace=True)

    def _add_locked(self, spec: ModelSpec, replace: bool, **kw: Any) -> ServedModel:
        """:meth:`add` with the admin lock held by the caller."""
        if spec.name in self._models and not replace:
            raise APIError(409, f"model `{spec.name}` is already loaded; unload it or use switch",
                           "invalid_request_error", "name", "model_exists")
        # loaded on a thread that ends here: the scheduler thread that decodes then holds the process's only
        # CPU thread team (two teams make libgomp throttle every parallel op; see nemo_spec._threads)
        served = in_fresh_thread(build_served_model, spec, self.max_queue, self.batch_wait_s, self.metrics, **kw)
        old = self._models.get(spec.name)
        self._models[spec.name] = served
        if old is not None:
            log.info("switched model %r; draining the previous instance", spec.name)
            threading.Thread(target=old.close, kwargs={"drain": True}, daemon=True).start()
        return served

    def remove(self, name: str, drain: bool = False) -> None:
        """Unload ``name``: queued requests fail with 503 (or finish, with drain); running ones finish."""
        with self._admin_lock:
            m = self.get(name)
            del self._models[name]
        m.close(drain=drain)
        log.info("unloaded model %r", name)

    def begin_shutdown(self) -> None:
        """Server shutdown: every model refuses new requests and answers its queued ones with 503."""
        for m in self.all():
            m.batcher.begin_shutdown()

    def abort_running(self) -> None:
        """Server shutdown, after the drain time: end every running generation with a 503 error event."""
        for m in self.all():
            m.batcher.abort_running()

    def close(self) -> None:
        """Unload everything (server shutdown)."""
        with self._admin_lock:
            models, self._models = list(self._models.values()), {}
        for m in models:
            m.close(drain=False, cancel_running=True)
