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


@lru_cache(maxsize=16)
def _compile(template: str) -> Any:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = _raise
    return env.from_string(template)


def chat_template_of(tokenizer: Any) -> str:
    """The tokenizer's own chat template, or the documented default."""
    t = getattr(tokenizer, "chat_template", None)
    if isinstance(t, dict):
        t = t.get("default") or next(iter(t.values()))
    return t if isinstance(t, str) and t.strip() else DEFAULT_CHAT_TEMPLATE


def render_chat(tokenizer: Any, messages: Sequence[Dict[str, str]], add_generation_prompt: bool = False,
                template: Optional[str] = None) -> str:
    """Render OpenAI-style messages to text with the (sandboxed) jinja chat template."""
    tpl = _compile(template or chat_template_of(tokenizer))
    try:
        return tpl.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                          bos_token=getattr(tokenizer, "bos_token", None) or "",
                          eos_token=getattr(tokenizer, "eos_token", None) or "")
    except ChatTemplateError:
        raise
    except Exception as e:  # jinja errors of many kinds
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
