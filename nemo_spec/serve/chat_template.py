"""Chat prompts for the server: the tokenizer's jinja chat template, rendered in jinja2's ImmutableSandboxedEnvironment.

Template resolution (first that applies):

1. ``chat_template`` in the model's serve config: a jinja string, or a path to a ``.jinja`` file;
2. the tokenizer's own ``chat_template`` (``tokenizer_config.json`` / ``chat_template.jinja``);
3. the project default, :data:`nemo_spec.data.DEFAULT_CHAT_TEMPLATE` (ChatML-style, the same one the training
   data pipeline uses, so drafts trained on our data see the prompts the server builds)::

       <|im_start|>system\\n{system}<|im_end|>\\n     (only when a system message is given)
       <|im_start|>user\\n{content}<|im_end|>\\n
       <|im_start|>assistant\\n                        (add_generation_prompt)

   With the default template a reply ends at the tokenizer's eos token or at the text ``<|im_end|>``
   (added as a stop string for chat requests).

Rendering goes through :func:`nemo_spec.data.render_chat` (sandboxed; ``bos_token``/``eos_token``/``raise_exception``
available to templates), so the server and the data pipeline share one renderer.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import jinja2

from nemo_spec.data.chat import DEFAULT_CHAT_TEMPLATE, render_chat
from nemo_spec.data.chat import ChatTemplateError as _DataTemplateError

log = logging.getLogger(__name__)

DEFAULT_END_OF_TURN = "<|im_end|>"


class ChatTemplateError(ValueError):
    """A chat template failed to load, compile or render (message names the template's origin)."""


def resolve_template(tokenizer: Any, override: Optional[str] = None) -> tuple[str, str]:
    """Return (template source, origin) for ``tokenizer`` with an optional override string or file path."""
    if override:
        if "{" in override:
            return override, "config"
        p = Path(override)
        if not p.is_file():
            raise ChatTemplateError(f"chat_template {override!r} is neither a jinja template nor an existing file")
        return p.read_text(encoding="utf-8"), str(p)
    tmpl = getattr(tokenizer, "chat_template", None)
    if isinstance(tmpl, dict):  # named templates: prefer "default"
        tmpl = tmpl.get("default") or next(iter(tmpl.values()), None)
    if isinstance(tmpl, str) and tmpl.strip():
        return tmpl, "tokenizer"
    return DEFAULT_CHAT_TEMPLATE, "default"


class ChatTemplate:
    """The chat template of one served model."""

    def __init__(self, tokenizer: Any, source: str, origin: str) -> None:
        self.tokenizer = tokenizer
        self.source = source
        self.origin = origin
        self.stop_strings: List[str] = []
        if origin == "default":
            vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
            if DEFAULT_END_OF_TURN not in vocab:  # end-of-turn is plain text for this tokenizer: stop on it
                self.stop_strings.append(DEFAULT_END_OF_TURN)
        self.render([{"role": "user", "content": "ping"}], True)  # fail at load time, not on the first request

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, override: Optional[str] = None) -> "ChatTemplate":
        """The template to use with ``tokenizer`` (override > tokenizer's own > project default)."""
        source, origin = resolve_template(tokenizer, override)
        log.info("chat template: %s", origin)
        return cls(tokenizer, source, origin)

    def end_of_turn_ids(self) -> List[int]:
        """Token ids that end an assistant turn under the default template (``<|im_end|>`` when it is one token)."""
        if self.origin != "default" or not hasattr(self.tokenizer, "get_vocab"):
            return []
        tid = self.tokenizer.get_vocab().get(DEFAULT_END_OF_TURN)
        return [int(tid)] if tid is not None else []

    def render(self, messages: Sequence[Dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """Render ``messages`` ([{role, content}]) to prompt text."""
        try:
            return render_chat(self.tokenizer, messages, add_generation_prompt, template=self.source)
        except (_DataTemplateError, jinja2.exceptions.TemplateError, ValueError, TypeError) as e:
            raise ChatTemplateError(f"chat template from {self.origin} failed: {e}") from e


def messages_to_dicts(messages: Sequence[Any]) -> List[Dict[str, Any]]:
    """Protocol ChatMessage objects -> the plain dicts templates expect (developer -> system)."""
    out = []
    for m in messages:
        d: Dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.name:
            d["name"] = m.name
        out.append(d)
    return out
