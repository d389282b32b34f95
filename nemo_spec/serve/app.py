"""The OpenAI-compatible FastAPI app: /v1/models, /v1/completions, /v1/chat/completions, /health, /metrics, /admin/*."""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import re
import time
from typing import Any, AsyncIterator, Dict, List, Optional, Sequence, Tuple, Type, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from nemo_spec.config import ConfigError
from nemo_spec.serve import protocol as P
from nemo_spec.serve.batching import BatcherClosedError, GenRequest, QueueFullError, RowSpec
from nemo_spec.serve.chat_template import ChatTemplateError, messages_to_dicts
from nemo_spec.serve.config import ModelSpec, ServeConfig
from nemo_spec.serve.metrics import PROMETHEUS_CONTENT_TYPE, ServerMetrics
from nemo_spec.serve.models import ModelLoadError, ModelManager, ServedModel, SpecError

log = logging.getLogger(__name__)

T = TypeVar("T", bound=BaseModel)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions default
DISCONNECT_POLL_S = 0.5
ENDPOINTS = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics", "/admin/models",
             "/admin/models/load", "/admin/models/unload", "/admin/models/switch")


# ---------------------------------------------------------------- helpers

_SURROGATE = re.compile("[\ud800-\udfff]")


class SafeJSONResponse(JSONResponse):
    """JSONResponse that never fails to encode (a lone surrogate echoed in a message is written escaped)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=False, allow_nan=False, indent=None,
                          separators=(",", ":")).encode("utf-8", "backslashreplace")


def _find_surrogate(obj: Any, path: str = "body") -> Optional[str]:
    """The JSON path of the first string holding a lone UTF-16 surrogate (not encodable as UTF-8), or None."""
    if isinstance(obj, str):
        return path if _SURROGATE.search(obj) else None
    if isinstance(obj, dict):
        items: Any = obj.items()
    elif isinstance(obj, list):
        items = ((i, v) for i, v in enumerate(obj) if isinstance(v, (str, list, dict)))
    else:
        return None
    for k, v in items:
        sub = f"{path}[{k}]" if isinstance(k, int) else (k if path == "body" else f"{path}.{k}")
        if isinstance(k, str) and _SURROGATE.search(k):
            return sub
        found = _find_surrogate(v, sub)
        if found:
            return found
    return None


def _decode_json_object(raw: bytes) -> Dict[str, Any]:
    try:
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise P.invalid("The request body must be a JSON object", code="invalid_json")
        bad = _find_surrogate(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise P.invalid(f"We could not parse the JSON body of your request: {e}", code="invalid_json") from e
    except RecursionError as e:  # arrays/objects nested thousands deep: no field of the API nests like that
        raise P.invalid("The JSON body of your request nests too deeply to be read", code="invalid_json") from e
    if bad:
        raise P.invalid(f"'{bad}' contains a lone UTF-16 surrogate, which is not valid Unicode text",
                        bad.split(".")[0].split("[")[0], "invalid_unicode")
    return data


async def _read_body(request: Request, limit: int) -> bytes:
    """The raw body, refusing (413) one larger than ``limit`` bytes before reading it where the length is known."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: int, limit: int) -> P.APIError:
    return P.APIError(413, f"The request body has {'at least ' if size <= limit else ''}{size} bytes, more than "
                      f"this server's limit of {limit} bytes (max_request_bytes).", "invalid_request_error",
                      None, "request_too_large")


#: bodies at least this large are parsed and validated off the event loop (a few MB of JSON take seconds)
BIG_BODY_BYTES = 65536


async def read_json_object(request: Request) -> Dict[str, Any]:
    """The request body as a JSON object; too large -> 413, malformed JSON, a non-object or invalid Unicode -> 400."""
    data, _ = await _read_json_object(request)
    return data


async def _read_json_object(request: Request) -> Tuple[Dict[str, Any], bool]:
    """(the body as a JSON object, whether it is big: see :data:`BIG_BODY_BYTES`)."""
    raw = await _read_body(request, request.app.state.config.max_request_bytes)
    if len(raw) < BIG_BODY_BYTES:
        return _decode_json_object(raw), False
    return await run_in_threadpool(_decode_json_object, raw), True  # big bodies: parse off the event loop


#: a union member's tag in a pydantic error location (``prompt.list[int].0``): a type, not a field
_UNION_TAG = re.compile(r"^(str|int|float|bool|list\[.*\]|dict\[.*\]|[A-Z]\w*)$")
_UNION_FORMS = {"str": "a string", "list[str]": "a list of strings", "list[int]": "a list of token ids (integers)",
                "list[list[int]]": "a list of token-id lists", "list[TextPart]": "a list of text parts"}


def _validation_error(e: ValidationError) -> P.APIError:
    """A 400 naming the offending field. A union field (prompt, stop, content) that matched none of its forms
    names the field and the forms it accepts, not the first form's complaint under a tag (``prompt.str``)."""
    errors = e.errors()
    locs = [tuple(err.get("loc", ())) for err in errors]
    at = next((i for i, x in enumerate(locs[0]) if isinstance(x, str) and _UNION_TAG.match(x)), None)
    if len(errors) > 1 and at is not None and all(loc[:at] == locs[0][:at] and len(loc) > at for loc in locs):
        param = ".".join(str(x) for x in locs[0][:at]) or None
        forms = list(dict.fromkeys(_UNION_FORMS.get(str(loc[at]), str(loc[at])) for loc in locs))
        return P.invalid(f"Invalid value for '{param}': expected {', '.join(forms[:-1])} or {forms[-1]}",
                         param=param, code="invalid_value")
    param = ".".join(str(x) for x in locs[0]) or None
    return P.invalid(f"Invalid value for '{param}': {errors[0].get('msg')}", param=param, code="invalid_value")


def _validate(cls: Type[T], data: Dict[str, Any]) -> T:
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise _validation_error(e) from e


async def parse_body(request: Request, cls: Type[T]) -> T:
    """Read and validate a JSON body; malformed JSON or invalid fields -> 400 with the offending param. A big body
    is validated off the event loop too (three 3.5 MB prompts validated on it stalled /health for 2.8 s)."""
    data, big = await _read_json_object(request)
    return await run_in_threadpool(_validate, cls, data) if big else _validate(cls, data)


def _bearer(request: Request) -> Optional[str]:
    h = request.headers.get("authorization", "")
    scheme, _, token = h.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _key_ok(token: Optional[str], keys: List[str]) -> bool:
    return token is not None and any(hmac.compare_digest(token.encode(), k.encode()) for k in keys)


def _sampling_params(served: ServedModel, req: P._Request, max_tokens: int, seed: Optional[int]) -> Any:
    from nemo_spec.inference import SamplingParams

    temperature = 1.0 if req.temperature is None else req.temperature
    ignore_eos = req.ignore_eos or bool(served.spec.options.get("ignore_eos"))
    try:
        return SamplingParams(temperature=temperature, top_k=req.top_k or 0,
                              top_p=1.0 if req.top_p is None else req.top_p, max_new_tokens=max_tokens,
                              stop_token_ids=() if ignore_eos else tuple(served.eos_ids), seed=seed)
    except (ValueError, TypeError, ConfigError) as e:
        raise P.invalid(f"invalid sampling parameters: {e}") from e


def _encode(served: ServedModel, text: str, add_special_tokens: bool) -> List[int]:
    tok = served.tokenizer
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:  # the Rust tokenizer: no per-call state, safe next to the worker's decode calls
        return list(backend.encode(text, add_special_tokens=add_special_tokens).ids)
    return list(tok.encode(text, add_special_tokens=add_special_tokens))


def _chat_prompt(served: ServedModel, req: P.ChatCompletionRequest) -> List[int]:
    """Render the chat template and tokenize (runs in a worker thread)."""
    try:
        text = served.template.render(messages_to_dicts(req.messages), req.add_generation_prompt,
                                      req.continue_final_message, req.documents, req.chat_template_kwargs)
    except (ChatTemplateError, ValueError) as e:
        raise P.invalid(str(e), "messages") from e
    return _encode(served, text, add_special_tokens=False)


def _resolve_max_tokens(served: ServedModel, prompts: List[List[int]], requested: Optional[int],
                        default: int, prompt_param: str) -> int:
    longest = max(len(p) for p in prompts)
    ctx = served.max_context
    if longest == 0:
        raise P.invalid("the prompt is empty", prompt_param)
    empty = [i for i, p in enumerate(prompts) if not p]
    if empty:
        raise P.invalid(f"{prompt_param}[{empty[0]}] is empty; every prompt needs at least one token", prompt_param)
    if longest >= ctx:
        raise P.invalid(f"This model's maximum context length is {ctx} tokens. However, your prompt has "
                        f"{longest} tokens. Please reduce the length of the prompt.", prompt_param,
                        "context_length_exceeded")
    if requested is None:
        return max(1, min(default, ctx - longest))
    if longest + requested > ctx:
        raise P.invalid(f"This model's maximum context length is {ctx} tokens. However, you requested "
                        f"{longest + requested} tokens ({longest} in the prompt, {requested} in the completion). "
                        f"Please reduce the prompt or max_tokens.", "max_tokens", "context_length_exceeded")
    return requested


class ClientGone(Exception):
    """The client of a non-streamed request disconnected while it was generating."""


class _Job:
    """A submitted request plus the bookkeeping the response needs."""

    def __init__(self, served: ServedModel, gen: GenRequest, prompt_tokens: int, num_choices: int) -> None:
        self.served, self.gen, self.prompt_tokens, self.num_choices = served, gen, prompt_tokens, num_choices
        self.texts = [""] * num_choices
        self.finish: List[Optional[str]] = [None] * num_choices
        self.counts = [0] * num_choices
        self.t0 = time.monotonic()
        self._checked = self.t0

    @property
    def finished(self) -> bool:
        return all(f is not None for f in self.finish)

    def usage(self) -> P.Usage:
        ct = sum(self.counts)
        return P.Usage(prompt_tokens=self.prompt_tokens, completion_tokens=ct, total_tokens=self.prompt_tokens + ct)

    def apply(self, ev: Tuple) -> None:
        """Update state from one batcher event; raises APIError for error events."""
        kind = ev[0]
        if kind == "delta":
            self.texts[ev[1]] += ev[2]
        elif kind == "finish":  # token, latency and TTFT metrics are counted by the batcher
            _, choice, reason, count, _stats = ev
            self.finish[choice] = reason
            self.counts[choice] = count
        elif kind == "error":
            code = ev[3] if len(ev) > 3 else None
            raise P.APIError(ev[1], ev[2], "server_error" if ev[1] >= 500 else "invalid_request_error", None, code)

    def drain(self) -> List[Tuple]:
        """Events already queued (no waiting)."""
        out = []
        while True:
            try:
                out.append(self.gen.events.get_nowait())
            except asyncio.QueueEmpty:
                return out

    async def next_event(self, request: Optional[Request]) -> Tuple:
        """The next batcher event; polls for client disconnects while waiting (non-streamed requests)."""
        while True:
            if request is not None and time.monotonic() - self._checked > DISCONNECT_POLL_S:
                self._checked = time.monotonic()  # events may flow continuously: check on a clock, not on idle
                if await request.is_disconnected():
                    self.gen.cancelled = True
                    raise ClientGone("client disconnected")
            try:
                return await asyncio.wait_for(self.gen.events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                continue


def _sse(obj: Dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _stream(job: _Job, base: Dict[str, Any], chat: bool, include_usage: bool,
                  first: List[List[Dict[str, Any]]]) -> AsyncIterator[str]:
    """SSE body: chunks as tokens arrive (events already queued are merged, so a chunk may carry several
    tokens), finish chunks, optional usage chunk, then ``data: [DONE]``; closing it cancels generation."""

    def delta(i: int, text: str) -> Dict[str, Any]:
        if chat:
            return {"index": i, "delta": {"content": text}, "finish_reason": None, "logprobs": None}
        return {"index": i, "text": text, "finish_reason": None, "logprobs": None}

    def finish(i: int, reason: str) -> Dict[str, Any]:
        if chat:
            return {"index": i, "delta": {}, "finish_reason": reason, "logprobs": None}
        return {"index": i, "text": "", "finish_reason": reason, "logprobs": None}

    try:
        for choices in first:
            yield _sse({**base, "choices": choices})
        failed = False
        while not job.finished and not failed:
            events = [await job.next_event(None)] + job.drain()
            out: List[str] = []
            pending: Dict[int, str] = {}
            for ev in events:
                try:
                    job.apply(ev)
                except P.APIError as e:
                    out.extend(_sse({**base, "choices": [delta(i, t)]}) for i, t in pending.items())
                    pending.clear()
                    out.append(_sse(e.to_dict()))
                    failed = True
                    break
                if ev[0] == "delta":
                    pending[ev[1]] = pending.get(ev[1], "") + ev[2]
                elif ev[0] == "finish":
                    if ev[1] in pending:
                        out.append(_sse({**base, "choices": [delta(ev[1], pending.pop(ev[1]))]}))
                    out.append(_sse({**base, "choices": [finish(ev[1], ev[2])]}))
            out.extend(_sse({**base, "choices": [delta(i, t)]}) for i, t in pending.items())
            if out:
                yield "".join(out)
        if include_usage and job.finished:
            yield _sse({**base, "choices": [], "usage": job.usage().model_dump()})
        yield "data: [DONE]\n\n"
    finally:
        if not job.finished:  # client went away (generator closed) -> cancel the rows in the engine
            job.gen.cancelled = True
            log.info("stream %s closed before the end; generation cancelled", base["id"])


# ---------------------------------------------------------------- app

def create_app(cfg: ServeConfig, manager: Optional[ModelManager] = None) -> FastAPI:
    """Build the FastAPI app; loads ``cfg.models`` unless a ready ``manager`` is given."""
    cfg.validate()
    metrics = manager.metrics if manager is not None else ServerMetrics()
    if manager is None:
        manager = ModelManager(cfg.max_queue, cfg.batch_wait_ms / 1000.0, metrics)
        for spec in cfg.models:
            manager.add(spec)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await run_in_threadpool(manager.close)

    async def require_api_key(request: Request) -> None:
        if request.url.path.startswith("/admin") or (request.url.path == "/health" and not cfg.health_requires_key):
            return
        if cfg.api_keys and not _key_ok(_bearer(request), cfg.api_keys):
            raise P.APIError(401, "Incorrect API key provided.", "invalid_request_error", None, "invalid_api_key")

    async def require_admin_key(request: Request) -> None:
        if not cfg.admin_key:
            raise P.APIError(403, "Admin endpoints are disabled (no admin_key configured).",
                             "invalid_request_error", None, "admin_disabled")
        if not _key_ok(_bearer(request), [cfg.admin_key]):
            raise P.APIError(401, "Incorrect admin key provided.", "invalid_request_error", None, "invalid_api_key")

    app = FastAPI(title="nemo_spec OpenAI-compatible server", lifespan=lifespan,
                  dependencies=[Depends(require_api_key)])
    app.state.manager = manager
    app.state.metrics = metrics
    app.state.config = cfg
    app.state.shutting_down = False

    def refuse_if_shutting_down() -> None:
        if app.state.shutting_down:
            raise P.APIError(503, "The server is shutting down.", "server_error", None, "server_shutdown")

    # ------------------------------------------------------------ errors
    @app.exception_handler(P.APIError)
    async def _api_error(request: Request, exc: P.APIError) -> JSONResponse:
        return SafeJSONResponse(exc.to_dict(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        param = ".".join(str(x) for x in errs[0].get("loc", ())) if errs else None
        msg = errs[0].get("msg") if errs else "invalid request"
        return SafeJSONResponse(P.invalid(f"Invalid value for '{param}': {msg}", param).to_dict(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = P.APIError(exc.status_code, str(exc.detail), "invalid_request_error",
                         code="not_found" if exc.status_code == 404 else None)
        return SafeJSONResponse(err.to_dict(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(request: Request, exc: ClientDisconnect) -> Response:
        # the client hung up while its request body was still arriving: nobody to answer, nothing went wrong here
        log.info("client disconnected while sending its request to %s", request.url.path)
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        err = P.APIError(500, f"internal server error: {type(exc).__name__}: {exc}", "server_error")
        return SafeJSONResponse(err.to_dict(), status_code=500)

    # ------------------------------------------------------------ info endpoints
    @app.get("/health")
    async def health() -> JSONResponse:
        models = manager.all()
        dead = [m.name for m in models if not m.batcher.alive]
        body = {"status": "ok" if not dead else "unhealthy", "models": [m.name for m in models]}
        if dead:
            body["dead_workers"] = dead
        return JSONResponse(body, status_code=200 if not dead else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return PlainTextResponse(metrics.render(), media_type=PROMETHEUS_CONTENT_TYPE)

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        cards = [P.ModelCard(id=m.name, created=m.created, max_model_len=m.max_context) for m in manager.all()]
        return JSONResponse(P.ModelList(data=cards).model_dump())

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> JSONResponse:
        m = manager.get(model_id)
        return JSONResponse(P.ModelCard(id=m.name, created=m.created, max_model_len=m.max_context).model_dump())

    # ------------------------------------------------------------ generation
    def submit(served: ServedModel, req: P._Request, prompts: List[List[int]], max_tokens: int,
               loop: asyncio.AbstractEventLoop, extra_stop: Sequence[str] = ()) -> _Job:
        n = req.n
        rows: List[RowSpec] = []  # more rows than max_batch are split over engine batches by the batcher
        refuse_if_shutting_down()
        check_rows(len(prompts), n)
        for p_idx, prompt in enumerate(prompts):
            for j in range(n):
                # choice j samples with seed + j, wrapped into a signed 64-bit integer as the seed itself is
                seed = None if req.seed is None else (req.seed + j + 2**63) % 2**64 - 2**63
                rows.append(RowSpec(list(prompt), _sampling_params(served, req, max_tokens, seed), p_idx * n + j))
        prompt_tokens = sum(len(p) for p in prompts)
        gen = GenRequest(rows=rows, stop=req.stop_list() + [s for s in extra_stop if s not in req.stop_list()],
                         loop=loop, prompt_tokens=prompt_tokens)
        try:
            served.batcher.submit(gen)
        except QueueFullError as e:
            metrics.rejected.inc()
            raise P.APIError(503, f"The server is overloaded: {e}. Retry later.", "server_error", None,
                             "queue_full", headers={"Retry-After": str(cfg.retry_after_s)}) from e
        except BatcherClosedError as e:
            code = "server_shutdown" if app.state.shutting_down else "model_unloading"
            raise P.APIError(503, str(e), "server_error", None, code) from e
        return _Job(served, gen, prompt_tokens, len(rows))

    #: how many times a request is prepared again for a model switched while it was being prepared
    SWITCH_RETRIES = 3

    async def submit_current(req: P._Request, prepare: Any) -> Tuple[ServedModel, _Job, Any]:
        """Prepare the request for the model serving ``req.model`` (``await prepare(served)`` -> (prompts,
        max_tokens, extra stop strings, anything else)) and submit it. A switch that replaced the model while the
        request was being prepared (tokenized for the old instance, whose batcher now refuses it) is not the
        client's problem: the request is prepared again for the instance serving the name now."""
        served = manager.get(req.model)
        for attempt in range(SWITCH_RETRIES + 1):
            prompts, max_tokens, stop, extra = await prepare(served)
            try:
                return served, submit(served, req, prompts, max_tokens, asyncio.get_running_loop(), stop), extra
            except P.APIError as e:
                if e.code != "model_unloading" or attempt == SWITCH_RETRIES:
                    raise
                newer = manager.get(req.model)  # 404 when the model was unloaded, not switched
                if newer is served:
                    raise
                log.info("model %r was switched while a request was being prepared; preparing it again",
                         req.model)
                served = newer
        raise AssertionError("unreachable")

    async def collect(job: _Job, request: Request) -> bool:
        """Wait for all choices; False when the client went away (generation cancelled)."""
        try:
            while not job.finished:
                job.apply(await job.next_event(request))
            return True
        except ClientGone:
            log.info("client of a non-streamed request disconnected; generation cancelled")
            return False
        finally:
            if not job.finished:
                job.gen.cancelled = True

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = await parse_body(request, P.ChatCompletionRequest)
        req.check_supported()
        refuse_if_shutting_down()
        manager.get(req.model)
        check_rows(1, req.n)
        chars = sum(len(m.text()) for m in req.messages)
        check_prompt_chars(chars, "messages")

        async def prepare(served: ServedModel) -> Tuple[List[List[int]], int, Sequence[str], None]:
            prompt = await run_in_threadpool(_chat_prompt, served, req)  # rendering + tokenizing: off the event loop
            max_tokens = _resolve_max_tokens(served, [prompt], req.effective_max_tokens(),
                                             served.spec.default_max_tokens, "messages")
            return [prompt], max_tokens, served.template.stop_strings, None

        served, job, _ = await submit_current(req, prepare)
        rid, created = P.new_id("chatcmpl"), P.now()
        # the reply's role: the assistant's, or without a generation prompt the last message's; echo (vLLM's
        # extension) starts it with the last message when the roles match (vllm 0.34.0 entrypoints/openai/
        # chat_completion/serving.py:441-444, 649-662, 1091-1100)
        last = req.messages[-1]
        role = "assistant" if req.add_generation_prompt else last.role
        echo = last.text() if req.echo and last.role == role else ""
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            first = [[{"index": i, "delta": {"role": role, "content": ""}, "finish_reason": None,
                       "logprobs": None} for i in range(job.num_choices)]]
            if echo:
                first.append([{"index": i, "delta": {"content": echo}, "finish_reason": None, "logprobs": None}
                              for i in range(job.num_choices)])
            return StreamingResponse(_stream(job, {"id": rid, "object": "chat.completion.chunk", "created": created,
                                                   "model": req.model}, True, include_usage, first),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        if not await collect(job, request):
            return Response(status_code=499)
        choices = [P.ChatChoice(index=i, message=P.ChatResponseMessage(role=role, content=echo + job.texts[i]),
                                finish_reason=job.finish[i]) for i in range(job.num_choices)]
        resp = P.ChatCompletionResponse(id=rid, created=created, model=req.model, choices=choices, usage=job.usage())
        return JSONResponse(resp.model_dump())

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = await parse_body(request, P.CompletionRequest)
        req.check_supported()
        refuse_if_shutting_down()
        manager.get(req.model)
        prompt_list = [req.prompt] if isinstance(req.prompt, str) or isinstance(req.prompt[0], int) else req.prompt
        check_rows(len(prompt_list), req.n)  # before any prompt is tokenized or decoded
        check_prompt_chars(sum(len(p) for p in prompt_list if isinstance(p, str)), "prompt")

        async def prepare(served: ServedModel) -> Tuple[List[List[int]], int, Sequence[str], List[str]]:
            prompts, texts = await run_in_threadpool(_completion_prompts, served, prompt_list, req.echo)  # off loop
            max_tokens = _resolve_max_tokens(served, prompts, req.effective_max_tokens(),
                                             COMPLETIONS_DEFAULT_MAX_TOKENS, "prompt")
            return prompts, max_tokens, (), texts

        served, job, texts = await submit_current(req, prepare)
        rid, created = P.new_id("cmpl"), P.now()
        echo = [texts[i // req.n] if req.echo else "" for i in range(job.num_choices)]
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            first = [[{"index": i, "text": e, "finish_reason": None, "logprobs": None}] for i, e in enumerate(echo) if e]
            return StreamingResponse(_stream(job, {"id": rid, "object": "text_completion", "created": created,
                                                   "model": req.model}, False, include_usage, first),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        if not await collect(job, request):
            return Response(status_code=499)
        choices = [P.CompletionChoice(index=i, text=echo[i] + job.texts[i], finish_reason=job.finish[i])
                   for i in range(job.num_choices)]
        resp = P.CompletionResponse(id=rid, created=created, model=req.model, choices=choices, usage=job.usage())
        return JSONResponse(resp.model_dump())

    def check_rows(prompts: int, n: int) -> None:
        if prompts * n > cfg.max_rows_per_request:
            raise P.invalid(f"{prompts} prompt(s) x n={n} = {prompts * n} sequences exceed this server's "
                            f"limit of {cfg.max_rows_per_request} per request (max_rows_per_request)", "n",
                            "too_many_sequences")

    def check_prompt_chars(chars: int, param: str) -> None:
        if chars > cfg.max_prompt_chars:
            raise P.invalid(f"The prompt has {chars} characters, more than this server's limit of "
                            f"{cfg.max_prompt_chars} (max_prompt_chars).", param, "prompt_too_long")

    def _completion_prompts(served: ServedModel, prompt: List[Any], echo: bool) -> Tuple[List[List[int]], List[str]]:
        """Token ids of each prompt (a string or token ids), and its text where ``echo`` needs it."""
        vocab = len(served.tokenizer)
        ids: List[List[int]] = []
        texts: List[str] = []
        for i, p in enumerate(prompt):
            if isinstance(p, str):
                ids.append(_encode(served, p, add_special_tokens=True))
                texts.append(p)
            else:
                bad = [t for t in p if not 0 <= t < vocab]
                if bad:
                    raise P.invalid(f"prompt[{i}] has token ids outside [0, {vocab}): {bad[:5]}", "prompt")
                ids.append(list(p))
                texts.append(served.tokenizer.decode(list(p), skip_special_tokens=False) if echo else "")
        return ids, texts

    # ------------------------------------------------------------ admin
    admin = [Depends(require_admin_key)]

    @app.get("/admin/models", dependencies=admin)
    async def admin_models() -> JSONResponse:
        return JSONResponse({"models": [m.describe() for m in manager.all()]})

    async def _load(request: Request, replace: bool) -> JSONResponse:
        data = await read_json_object(request)
        if replace:
            # a switch keeps what the request leaves out (method, options, max_batch, ...) of the model as it is when
            # the switch runs: merged under the manager's admin lock, so that two switches sent together both apply
            # (404 if there is no such model)
            load, arg = manager.switch, data
        else:
            try:
                arg = ModelSpec.from_dict(data, "admin request")
            except (ConfigError, TypeError) as e:
                raise P.invalid(str(e)) from e
            if arg.name in manager.names():
                raise P.APIError(409, f"model `{arg.name}` is already loaded; unload it or use /admin/models/switch",
                                 "invalid_request_error", "name", "model_exists")
            load = manager.add
        try:
            served = await run_in_threadpool(load, arg)
        except SpecError as e:
            raise P.invalid(str(e)) from e
        except (ModelLoadError, ConfigError) as e:
            raise P.invalid(str(e), "path", "model_load_failed") from e
        return JSONResponse({"status": "switched" if replace else "loaded", "model": served.describe()})

    @app.post("/admin/models/load", dependencies=admin)
    async def admin_load(request: Request) -> JSONResponse:
        return await _load(request, replace=False)

    @app.post("/admin/models/switch", dependencies=admin)
    async def admin_switch(request: Request) -> JSONResponse:
        return await _load(request, replace=True)

    @app.post("/admin/models/unload", dependencies=admin)
    async def admin_unload(request: Request) -> JSONResponse:
        body = await parse_body(request, _UnloadRequest)
        manager.get(body.name)
        await run_in_threadpool(manager.remove, body.name, body.drain)
        return JSONResponse({"status": "unloaded", "model": body.name})

    app.add_middleware(_MetricsMiddleware, metrics=metrics)
    return app


class _UnloadRequest(BaseModel):
    """POST /admin/models/unload body."""

    name: str
    drain: bool = False


class _MetricsMiddleware:
    """Pure ASGI middleware counting requests by endpoint and status (streaming-safe)."""

    def __init__(self, app: FastAPI, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [500]

        async def _send(msg: Dict[str, Any]) -> None:
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
            await send(msg)

        path = scope.get("path", "")
        endpoint = path if path in ENDPOINTS else ("/v1/models/{id}" if path.startswith("/v1/models/") else "other")
        try:
            await self.app(scope, receive, _send)
        finally:
            self.metrics.requests.inc(endpoint=endpoint, code=str(status[0]))
