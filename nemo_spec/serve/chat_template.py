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

import json
import logging
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import jinja2

from nemo_spec.data.chat import DEFAULT_CHAT_TEMPLATE, render_chat, template_environment
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


def template_variables(source: str) -> frozenset:
    """The variables a template reads from its context (jinja2.meta, as vLLM resolves chat_template_kwargs)."""
    import jinja2.meta

    try:
        return frozenset(jinja2.meta.find_undeclared_variables(template_environment().parse(source)))
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not compile: {e}") from e


class ChatTemplate:
    """The chat template of one served model."""

    def __init__(self, tokenizer: Any, source: str, origin: str) -> None:
        self.tokenizer = tokenizer
        self.source = source
        self.origin = origin
        self.stop_strings: List[str] = []
        self.variables = template_variables(source)
        self.knows_developer = '"developer"' in source or "'developer'" in source
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

    def render(self, messages: Sequence[Dict[str, Any]], add_generation_prompt: bool = True,
               continue_final_message: bool = False, documents: Optional[List[Dict[str, Any]]] = None,
               template_kwargs: Optional[Dict[str, Any]] = None) -> str:
        """Render ``messages`` ([{role, content, ...}]) to prompt text. ``template_kwargs`` reach the template where
        it reads them (others are dropped, as vLLM drops them: renderers/hf.py:827-838)."""
        extra = {k: v for k, v in (template_kwargs or {}).items() if k in self.variables and k not in _OWN_ARGS}
        if documents is not None:
            extra["documents"] = documents
        try:
            return render_chat(self.tokenizer, self._developer_as_system(messages), add_generation_prompt,
                               template=self.source, continue_final_message=continue_final_message, **extra)
        except (_DataTemplateError, jinja2.exceptions.TemplateError, ValueError, TypeError) as e:
            raise ChatTemplateError(f"chat template from {self.origin} failed: {e}") from e

    def _developer_as_system(self, messages: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
        """A template that names no developer role gets developer messages as system messages, all system messages
        merged into the first (as vLLM 0.34.0: renderers/hf.py:607-663)."""
        msgs = list(messages)
        if self.knows_developer or not any(m["role"] == "developer" for m in msgs):
            return msgs
        msgs = [dict(m, role="system") if m["role"] == "developer" else m for m in msgs]
        systems = [i for i, m in enumerate(msgs) if m["role"] == "system"]
        if systems == [0]:
            return msgs
        merged = "\n\n".join(msgs[i]["content"] for i in systems if msgs[i]["content"])
        return [{"role": "system", "content": merged}] + [m for m in msgs if m["role"] != "system"]


# what render passes itself: a template_kwargs entry of these names does not override them
_OWN_ARGS = frozenset({"messages", "add_generation_prompt", "continue_final_message", "tools", "documents"})


def _tool_calls_for_template(calls: List[Dict[str, Any]], where: str) -> List[Dict[str, Any]]:
    """An assistant message's tool calls with their JSON ``arguments`` as objects, as chat templates expect them
    (vLLM 0.34.0 renderers/chat_utils/chat_message.py:699-760: arguments that are not a JSON object become {})."""
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or call.get("type", "function") != "function":
            raise ValueError(f"{where}.tool_calls.{j}: only tool calls of type 'function' (with a 'function' "
                             "object) are supported")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                args = {}
        out.append({**call, "function": {**fn, "arguments": args if isinstance(args, dict) else {}}})
    return out


def messages_to_dicts(messages: Sequence[Any]) -> List[Dict[str, Any]]:
    """Protocol ChatMessage objects -> the plain dicts templates expect (name, an assistant's tool_calls, a tool
    message's tool_call_id kept; raises ValueError naming a malformed tool call)."""
    out = []
    for i, m in enumerate(messages):
        d: Dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name:
            d["name"] = m.name
        if m.role == "assistant" and m.tool_calls:
            d["tool_calls"] = _tool_calls_for_template(m.tool_calls, f"messages.{i}")
        if m.role == "tool" and m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out
