"""The one generation API for every method: ``generate(model, prompts, params, method=...)``."""
from __future__ import annotations

import logging
import weakref
from typing import Any, Dict, List, Optional, Sequence, Union

import torch

from nemo_spec.inference.engine import Engine, GenerationResult, OnFinish, OnTokens
from nemo_spec.inference.sampling import SamplingError, SamplingParams, token_id_list
from nemo_spec.inference.proposers import METHODS

log = logging.getLogger(__name__)


def end_of_sequence_ids(model: torch.nn.Module, tokenizer: Any = None) -> List[int]:
    """Every id generation stops at by default: the tokenizer's EOS and the model's (``ModelConfig.stop_token_ids``),
    in that order — what the server and ``generate.py`` stop at."""
    from nemo_spec.models.gpt import model_config

    ids: List[int] = []
    for v in (getattr(tokenizer, "eos_token_id", None), *model_config(model).stop_token_ids()):
        if isinstance(v, int) and v not in ids:
            ids.append(v)
    return ids

_ENGINES: "weakref.WeakKeyDictionary[torch.nn.Module, Engine]" = weakref.WeakKeyDictionary()


def get_engine(model: torch.nn.Module) -> Engine:
    """The engine (and its reusable KV caches) attached to ``model``."""
    eng = _ENGINES.get(model)
    if eng is None:
        eng = Engine(model)
        _ENGINES[model] = eng
    return eng


def _as_params(params: Union[SamplingParams, Sequence[SamplingParams], None], n: int) -> List[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise SamplingError(f"got {len(params)} SamplingParams for {n} prompts")
    for i, p in enumerate(params):
        if not isinstance(p, SamplingParams):
            raise SamplingError(f"params[{i}] must be a SamplingParams, got {type(p).__name__}")
    return params


def generate(model: torch.nn.Module, prompts: Sequence[Sequence[int]],
             params: Union[SamplingParams, Sequence[SamplingParams], None] = None, method: str = "ar",
             draft_model: Optional[torch.nn.Module] = None, options: Optional[Dict[str, Any]] = None,
             tokenizer: Any = None, on_tokens: Optional[OnTokens] = None,
             on_finish: Optional[OnFinish] = None) -> List[GenerationResult]:
    """Generate continuations of token-id prompts with method ar | eagle | eagle_tree | medusa | draft_model |
    prompt_lookup | suffix.

    ``options``: method knobs (``num_draft_tokens``, ``depth``, ``top_k``, ``total_tokens``, ``score_temperature``,
    ``medusa_choices``, ``max_ngram``, ``min_ngram``), engine knobs (``pad_id``, ``max_cache_len``,
    ``ignore_eos``) and session knobs (``max_batch``: rows generating at once, default all — more prompts join
    as rows finish; ``prefill_chunk_tokens``; ``prefill_pad_tokens``; ``adaptive``: choose the draft size per step); an unknown name
    is an error. Runs on :class:`nemo_spec.inference.session.Session`.
    ``on_tokens(row, ids)`` streams accepted tokens; returning False cancels that row. ``on_finish(row, reason)``
    is called when a row ends by itself ("stop" or "length"), before the rest of the batch has finished.
    """
    if method not in METHODS:
        raise SamplingError(f"unknown generation method {method!r}; choose one of {METHODS}")
    if isinstance(prompts, (str, bytes)) or not all(isinstance(p, (list, tuple)) for p in prompts):
        raise SamplingError("prompts must be a list of token-id lists (tokenize text first)")
    prompts = [token_id_list(p, f"prompts[{i}]") for i, p in enumerate(prompts)]
    plist = _as_params(params, len(prompts))
    options = dict(options or {})
    from nemo_spec.inference.session import run_session

    was_training = model.training
    try:
        return run_session(model, prompts, plist, method, draft_model, options, tokenizer, on_tokens, on_finish)
    finally:
        if was_training:
            model.train()
