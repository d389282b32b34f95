"""Tokenizer loading, chat-template rendering (sandboxed jinja) and tokenisation with an assistant loss mask.

Chat template: the tokenizer's own jinja ``chat_template`` when it has one, otherwise :data:`DEFAULT_CHAT_TEMPLATE`
(ChatML-style)::

    <|im_start|>system\\n{system}<|im_end|>\\n        (only when a system prompt is given)
    <|im_start|>user\\n{content}<|im_end|>\\n
    <|im_start|>assistant\\n{content}<|im_end|>\\n
    ... generation prompt: <|im_start|>assistant\\n

Templates are rendered with ``jinja2.sandbox.ImmutableSandboxedEnvironment``. The loss mask marks the characters
each assistant turn adds (its content and end marker); tokens are mapped back through the tokenizer's offsets.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

log = logging.getLogger(__name__)

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplateError(ValueError):
    """A chat template failed to render or does not extend its own prefixes."""


def load_tokenizer(path: str | os.PathLike) -> Any:
    """Load a Hugging Face fast tokenizer from a local directory or ``tokenizer.json`` (never the network)."""
    from transformers import PreTrainedTokenizerFast

    p = Path(path)
    if p.is_file():
        tok = PreTrainedTokenizerFast(tokenizer_file=str(p))
    elif p.is_dir():
        if not (p / "tokenizer.json").exists() and not (p / "tokenizer_config.json").exists():
            raise FileNotFoundError(f"{p}: no tokenizer.json or tokenizer_config.json")
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
        except (OSError, ValueError, KeyError) as e:
            if not (p / "tokenizer.json").exists():
                raise
            log.warning("AutoTokenizer failed on %s (%s); loading tokenizer.json directly", p, e)
            tok = PreTrainedTokenizerFast(tokenizer_file=str(p / "tokenizer.json"))
    else:
        raise FileNotFoundError(f"tokenizer path {p} does not exist")
    if not getattr(tok, "is_fast", False):
        raise TypeError(f"{p}: a fast tokenizer (tokenizers-backed) is required for offset mapping")
    return tok


def _raise(msg: str) -> None:
    raise ChatTemplateError(msg)


def template_environment() -> Any:
    """A sandboxed jinja environment with what transformers adds for chat templates: ``trim_blocks`` /
    ``lstrip_blocks``, loop controls, the ``{% generation %}`` block (rendered as its body)."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    return ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                         extensions=[_Generation, jinja2.ext.loopcontrols])


@lru_cache(maxsize=16)
def _compile(template: str) -> Any:
    """The template in the environment transformers renders chat templates in (``chat_template_utils.py``:
    sandboxed, ``trim_blocks``/``lstrip_blocks``, loop controls, ``{% generation %}``, ``raise_exception``,
    ``strftime_now``, a ``tojson`` that does not escape HTML); used for tokenizers without transformers'
    ``apply_chat_template``."""
    env = template_environment()
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def chat_template_of(tokenizer: Any) -> str:
    """The tokenizer's own chat template, or the documented default."""
    t = getattr(tokenizer, "chat_template", None)
    if isinstance(t, dict):
        t = t.get("default") or next(iter(t.values()))
    return t if isinstance(t, str) and t.strip() else DEFAULT_CHAT_TEMPLATE


_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _render_own(tokenizer: Any, template: str, messages: List[Dict[str, Any]], add_generation_prompt: bool,
                continue_final_message: bool, kwargs: Dict[str, Any]) -> str:
    """What transformers' ``render_jinja_template`` does, for a tokenizer object without it."""
    specials = {k: str(v) for k in ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                                    "mask_token") if (v := getattr(tokenizer, k, None)) is not None}
    final = None
    if continue_final_message:
        final = messages[-1].get("content")
        if not isinstance(final, str):
            raise ChatTemplateError("continue_final_message is set but the final message has no text content")
        messages = messages[:-1] + [dict(messages[-1], content=final + _CONTINUE_TAG)]
    text = _compile(template).render(**{"bos_token": "", "eos_token": "", **specials, "messages": messages,
                                        "tools": None, "documents": None, **kwargs,
                                        "add_generation_prompt": add_generation_prompt})
    if final is not None:
        tag = _CONTINUE_TAG.strip()
        if final.strip() not in text or tag not in text:
            raise ChatTemplateError("continue_final_message is set but the final message does not appear in the "
                                    "rendered chat (the template changes it)")
        at = text.rindex(tag)
        text = text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
    return text


def render_chat(tokenizer: Any, messages: Sequence[Dict[str, Any]], add_generation_prompt: bool = False,
                template: Optional[str] = None, continue_final_message: bool = False,
                **template_kwargs: Any) -> str:
    """Render OpenAI-style messages to text with the (sandboxed) jinja chat template, as vLLM does: through the
    tokenizer's own ``apply_chat_template`` (transformers: its special tokens, ``tools``/``documents``, extra
    ``template_kwargs``, ``continue_final_message`` leaving the last message open)."""
    if continue_final_message and add_generation_prompt:
        raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be set: the first "
                                "continues the last message, the second opens a new assistant turn")
    if continue_final_message and not messages:
        raise ChatTemplateError("continue_final_message is set but there are no messages")
    source = template or chat_template_of(tokenizer)
    msgs = [dict(m) for m in messages]
    try:
        if msgs and callable(getattr(tokenizer, "apply_chat_template", None)):  # (it refuses no messages: the
            # generation prompt alone, which a record opening with the assistant's turn needs, is rendered here)
            return tokenizer.apply_chat_template(msgs, chat_template=source, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt,
                                                 continue_final_message=continue_final_message, **template_kwargs)
        return _render_own(tokenizer, source, msgs, add_generation_prompt, continue_final_message, template_kwargs)
    except ChatTemplateError:
        raise
    except Exception as e:  # jinja errors of many kinds (raise_exception's among them); transformers' ValueErrors
        raise ChatTemplateError(f"chat template failed to render: {type(e).__name__}: {e}") from e


def record_messages(record: Dict[str, Any], system_prompt: Optional[str] = None) -> List[Dict[str, str]]:
    """OpenAI messages for a record; ``system_prompt`` is used when the record has no system message."""
    system = record.get("system") or system_prompt
    msgs = [{"role": "system", "content": system}] if system else []
    return msgs + [{"role": t["role"], "content": t["content"]} for t in record["turns"]]


def assistant_spans(tokenizer: Any, messages: Sequence[Dict[str, str]],
                    template: Optional[str] = None) -> Tuple[str, List[Tuple[int, int]]]:
    """Rendered text and the character spans each assistant turn adds to it."""
    full = render_chat(tokenizer, messages, template=template)
    spans: List[Tuple[int, int]] = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render_chat(tokenizer, messages[:i], add_generation_prompt=True, template=template)
        after = render_chat(tokenizer, messages[: i + 1], template=template)
        if not full.startswith(after) or not after.startswith(before):
            raise ChatTemplateError("chat template output is not prefix-stable across turns; "
                                    "cannot locate assistant tokens (use loss_on=all)")
        spans.append((len(before), len(after)))
    return full, spans


@dataclass
class Encoded:
    """Token ids, loss mask (1 = train on this token as a target) and whether the sample was truncated."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    truncated: bool


def encode_chat(tokenizer: Any, record: Dict[str, Any], max_len: int, loss_on: str = "assistant",
                system_prompt: Optional[str] = None, template: Optional[str] = None) -> Encoded:
    """Render and tokenise one chat record; loss mask on assistant tokens (``loss_on='assistant'``) or all."""
    if loss_on not in ("assistant", "all"):
        raise ValueError(f"loss_on must be 'assistant' or 'all', got {loss_on!r}")
    messages = record_messages(record, system_prompt)
    if loss_on == "assistant":
        text, spans = assistant_spans(tokenizer, messages, template)
    else:
        text, spans = render_chat(tokenizer, messages, template=template), []
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"]
    if loss_on == "all":
        mask = [1] * len(ids)
    else:
        mask = [0] * len(ids)
        j = 0
        for k, (a, b) in enumerate(enc["offset_mapping"]):
            while j < len(spans) and spans[j][1] <= a:
                j += 1
            if j < len(spans) and a < spans[j][1] and b > spans[j][0]:
                mask[k] = 1
    truncated = len(ids) > max_len
    return Encoded(torch.tensor(ids[:max_len], dtype=torch.long), torch.tensor(mask[:max_len], dtype=torch.long),
                   truncated)


def encode_text(tokenizer: Any, text: str, max_len: int, min_len: int = 8) -> List[Encoded]:
    """Tokenise a plain-text document into consecutive chunks of at most ``max_len`` tokens (loss on all)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    out = []
    for a in range(0, len(ids), max_len):
        chunk = ids[a:a + max_len]
        if len(chunk) >= min_len:
            t = torch.tensor(chunk, dtype=torch.long)
            out.append(Encoded(t, torch.ones_like(t), False))
    return out


def apply_chat_template(tokenizer: Any, messages: Sequence[Dict[str, str]], add_generation_prompt: bool = True,
                        system_prompt: Optional[str] = None) -> List[int]:
    """Token ids of a chat prompt rendered with the tokenizer's template (default template otherwise)."""
    msgs = list(messages)
    if system_prompt and not any(m["role"] == "system" for m in msgs):
        msgs = [{"role": "system", "content": system_prompt}] + msgs
    text = render_chat(tokenizer, msgs, add_generation_prompt=add_generation_prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
