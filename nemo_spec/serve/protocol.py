"""OpenAI API request/response models (pydantic v2) and OpenAI-style errors."""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

MAX_STOP_SEQUENCES = 4


class APIError(Exception):
    """An error returned to the client as OpenAI-style JSON with an HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[Dict[str, str]] = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers  # extra response headers (e.g. Retry-After on 503)

    def to_dict(self) -> Dict[str, Any]:
        """The OpenAI error body: {"error": {message, type, param, code}}."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    """A 400 invalid_request_error."""
    return APIError(400, message, "invalid_request_error", param, code)


# vLLM's sampling extensions (vllm 0.34.0 entrypoints/openai/completion/protocol.py:77-117, 268; the guided_* fields of
# earlier releases) with the value that leaves the output as this server makes it: any other value would be ignored
# silently, as unknown fields are, so it is refused by name
VLLM_EXTENSIONS_OFF: Dict[str, Any] = {
    "use_beam_search": False, "min_p": 0.0, "repetition_penalty": 1.0, "watermarking": False, "length_penalty": 1.0,
    "stop_token_ids": [], "include_stop_str_in_output": False, "min_tokens": 0, "skip_special_tokens": True,
    "spaces_between_special_tokens": True, "truncate_prompt_tokens": None, "allowed_token_ids": None,
    "prompt_logprobs": None, "logprob_token_ids": None, "bad_words": [], "prompt_embeds": None,
    "structured_outputs": None, "repetition_detection": None, "vllm_xargs": None, "logits_processors": None,
    "guided_json": None, "guided_regex": None, "guided_choice": None, "guided_grammar": None,
}


class _Request(BaseModel):
    """Fields shared by completion and chat-completion requests (unknown fields are ignored, as OpenAI clients expect;
    vLLM's sampling extensions set to anything but their off value are refused, see :data:`VLLM_EXTENSIONS_OFF`)."""

    model_config = ConfigDict(extra="allow")

    model: str
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(default=None, ge=0)  # extension (vLLM-style); 0 = disabled
    ignore_eos: bool = False  # extension (vLLM-style): generate max_tokens even past the end-of-sequence token
    n: int = Field(default=1, ge=1, le=64)
    stream: bool = False
    stream_options: Optional["StreamOptions"] = None
    stop: Optional[Union[str, List[str]]] = None
    max_tokens: Optional[int] = Field(default=None, ge=1)
    seed: Optional[int] = Field(default=None, ge=-(2**63), le=2**63 - 1)  # a signed 64-bit integer, as vLLM
    presence_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: Optional[Dict[str, float]] = None
    user: Optional[str] = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        """A field sent as null takes its default, as OpenAI's API does (the official client sends n=None etc.)."""
        if isinstance(data, dict):
            nulls = [k for k, v in data.items() if v is None and k in cls.model_fields
                     and not cls.model_fields[k].is_required() and cls.model_fields[k].default is not None]
            if nulls:
                return {k: v for k, v in data.items() if k not in nulls}
        return data

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: Optional[Union[str, List[str]]]) -> Optional[Union[str, List[str]]]:
        if isinstance(v, list):
            if len(v) > MAX_STOP_SEQUENCES:
                raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed, got {len(v)}")
            if any(s == "" for s in v):
                raise ValueError("stop sequences must be non-empty strings")
        elif v == "":
            raise ValueError("stop sequences must be non-empty strings")
        return v

    def stop_list(self) -> List[str]:
        """Stop strings as a list."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def check_supported(self) -> None:
        """Raise a 400 for OpenAI parameters this server accepts syntactically but does not implement."""
        if self.presence_penalty not in (None, 0.0):
            raise invalid("presence_penalty is not supported by this server (use 0)", "presence_penalty")
        if self.frequency_penalty not in (None, 0.0):
            raise invalid("frequency_penalty is not supported by this server (use 0)", "frequency_penalty")
        if self.logit_bias:
            raise invalid("logit_bias is not supported by this server", "logit_bias")
        if self.stream_options is not None and not self.stream:  # as vLLM (chat protocol.py:862-870)
            raise invalid("Stream options can only be defined when `stream=True`.", "stream_options")
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            raise invalid("stream_options.continuous_usage_stats (usage on every chunk) is not supported by this "
                          "server; include_usage sends it once, at the end", "stream_options")
        for name, value in (self.model_extra or {}).items():
            if name in VLLM_EXTENSIONS_OFF and value is not None and value != VLLM_EXTENSIONS_OFF[name]:
                off = VLLM_EXTENSIONS_OFF[name]
                hint = f" (leave it out{'' if off is None else f' or send {json.dumps(off)}'})"
                raise invalid(f"{name} (a vLLM sampling extension) is not supported by this server{hint}", name)


class StreamOptions(BaseModel):
    """stream_options: include_usage adds a final chunk carrying usage (vLLM's continuous_usage_stats, usage on
    every chunk, is refused)."""

    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class TextPart(BaseModel):
    """A text content part of a chat message (the Responses API's input_text / output_text too, as vLLM reads
    them: vllm 0.34.0 renderers/chat_utils/chat_message.py:104-106)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "input_text", "output_text"]
    text: str


class ChatMessage(BaseModel):
    """One chat message; content is a string or a list of text parts (joined with newlines, as vLLM:
    chat_message.py:419); an assistant's tool_calls and a tool message's tool_call_id reach the template."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, List[TextPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[List[Dict[str, Any]]] = None
    tool_call_id: Optional[str] = None

    def text(self) -> str:
        """The message content as plain text."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content)


class ChatCompletionRequest(_Request):
    """POST /v1/chat/completions body."""

    messages: List[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    tools: Optional[List[Dict[str, Any]]] = None
    response_format: Optional[Dict[str, Any]] = None
    tool_choice: Optional[Union[str, Dict[str, Any]]] = None
    # extensions (vLLM's, same meaning: vllm 0.34.0 entrypoints/openai/chat_completion/protocol.py:327-388)
    echo: bool = False  # the reply starts with the last message's content when their roles match
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last message is left open and continued (a prefill)
    documents: Optional[List[Dict[str, Any]]] = None  # passed to the template (RAG templates)
    chat_template_kwargs: Optional[Dict[str, Any]] = None  # extra template variables (e.g. enable_thinking)
    chat_template: Optional[str] = None  # not accepted from clients; see check_supported

    def check_supported(self) -> None:
        """Reject unsupported chat parameters with a 400."""
        super().check_supported()
        if self.logprobs:
            raise invalid("logprobs is not supported by this server", "logprobs")
        if self.top_logprobs:  # as OpenAI's API: top_logprobs asks for logprobs=true
            raise invalid("top_logprobs needs logprobs=true, and logprobs is not supported by this server",
                          "top_logprobs")
        if self.tools:
            raise invalid("tools are not supported by this server", "tools")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise invalid("only response_format type 'text' is supported", "response_format")
        if self.tool_choice not in (None, "none") and not self.tools:  # as vLLM (protocol.py:999-1006)
            raise invalid("When using `tool_choice`, `tools` must be set.", "tool_choice")
        if self.chat_template is not None:
            raise invalid("chat_template cannot be set per request; configure it on the server", "chat_template")
        if self.continue_final_message and self.add_generation_prompt:  # as vLLM (protocol.py:1065-1070)
            raise invalid("Cannot set both `continue_final_message` and `add_generation_prompt` to True (send "
                          "add_generation_prompt=false to continue the last message)", "continue_final_message")
        reserved = sorted(set(self.chat_template_kwargs or {}) & {"chat_template", "tokenize"})
        if reserved:  # as vLLM (renderers/hf.py:818-825)
            raise invalid(f"chat_template_kwargs may not set {', '.join(reserved)}", "chat_template_kwargs")

    def effective_max_tokens(self) -> Optional[int]:
        """max_completion_tokens, else max_tokens."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# token ids are strict: JSON true/false are not ids 1/0
PromptType = Union[str, List[str], List[StrictInt], List[List[StrictInt]]]


class CompletionRequest(_Request):
    """POST /v1/completions body."""

    prompt: PromptType
    echo: bool = False
    logprobs: Optional[int] = None
    suffix: Optional[str] = None
    best_of: Optional[int] = None

    @model_validator(mode="after")
    def _prompt_nonempty(self) -> "CompletionRequest":
        p = self.prompt
        if isinstance(p, list) and len(p) == 0:
            raise ValueError("prompt must not be empty")
        return self

    def check_supported(self) -> None:
        """Reject unsupported completion parameters with a 400."""
        super().check_supported()
        if self.logprobs is not None:  # logprobs=0 asks for the sampled tokens' logprobs
            raise invalid("logprobs is not supported by this server", "logprobs")
        if self.suffix:
            raise invalid("suffix is not supported by this server", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise invalid("best_of different from n is not supported", "best_of")

    def effective_max_tokens(self) -> Optional[int]:
        """max_tokens (OpenAI's legacy default of 16 is applied by the server when None)."""
        return self.max_tokens


_Request.model_rebuild()
ChatCompletionRequest.model_rebuild()
CompletionRequest.model_rebuild()


# ---------------------------------------------------------------- responses

class Usage(BaseModel):
    """Token usage of one request."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ModelCard(BaseModel):
    """An entry of GET /v1/models."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "nemo_spec"
    max_model_len: Optional[int] = None


class ModelList(BaseModel):
    """GET /v1/models."""

    object: Literal["list"] = "list"
    data: List[ModelCard]


class ChatResponseMessage(BaseModel):
    """The message of a chat choice: the assistant's, or with add_generation_prompt=false the last message's role
    (vLLM's get_chat_request_role: chat_completion/serving.py:441-444)."""

    role: str = "assistant"
    content: str


class ChatChoice(BaseModel):
    """One chat completion choice."""

    index: int
    message: ChatResponseMessage
    finish_reason: Optional[str]
    logprobs: None = None


class ChatCompletionResponse(BaseModel):
    """The chat.completion object."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: List[ChatChoice]
    usage: Usage
    system_fingerprint: Optional[str] = None


class ChatDelta(BaseModel):
    """A streamed chat delta."""

    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None


class ChatChunkChoice(BaseModel):
    """One choice of a chat.completion.chunk."""

    index: int
    delta: ChatDelta
    finish_reason: Optional[str] = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    """The chat.completion.chunk object."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: List[ChatChunkChoice]
    usage: Optional[Usage] = None
    system_fingerprint: Optional[str] = None


class CompletionChoice(BaseModel):
    """One text completion choice (also used for streamed chunks)."""

    index: int
    text: str
    finish_reason: Optional[str] = None
    logprobs: None = None


class CompletionResponse(BaseModel):
    """The text_completion object (non-streamed and streamed chunks share the shape)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: List[CompletionChoice]
    usage: Optional[Usage] = None
    system_fingerprint: Optional[str] = None


def new_id(prefix: str) -> str:
    """A fresh response id like 'chatcmpl-<hex>'."""
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    """Unix time in seconds."""
    return int(time.time())
