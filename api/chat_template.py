"""Rendering chat messages to the prompt text the worker will see, to count its tokens.

It mirrors how Hugging Face renders a chat template (sandboxed jinja2, trim_blocks, lstrip_blocks,
the special tokens as variables, `raise_exception`); where a card has no template, a ChatML-like
approximation stands in and the worker's exact length check has the last word.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from protocol import ModelCard

# What the renderer itself passes a template (transformers' apply_chat_template passes the same):
# chat_template_kwargs may add variables, never replace these.
RESERVED_TEMPLATE_VARIABLES = frozenset({
    "messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "bos_token", "eos_token", "raise_exception", "strftime_now"})


class ChatTemplateError(ValueError):
    """The template refused the conversation (e.g. roles that do not alternate): the client's fault."""


def render_chat(card: ModelCard, messages: list[dict[str, Any]],
                add_generation_prompt: bool = True,
                tools: list[dict[str, Any]] | None = None,
                continue_final_message: bool = False,
                template_kwargs: dict[str, Any] | None = None) -> tuple[str, bool]:
    """The prompt text for `messages` (and `tools`, for a template that reads them, as
    transformers' apply_chat_template passes them), and whether it came from the model's own
    template. `continue_final_message`: the text ends inside the last message (whose content
    the model continues), as transformers renders it; ChatTemplateError where it cannot.
    `template_kwargs`: more variables for the template (template_kwargs_for's)."""
    if continue_final_message:
        return _continued(card, messages, tools, template_kwargs)
    if card.chat_template:
        try:
            template = _compile(card.chat_template)
            text = template.render(
                **(template_kwargs or {}),
                messages=messages, add_generation_prompt=add_generation_prompt, bos_token=card.bos_token or "",
                eos_token=card.eos_token or "", tools=tools, documents=None,
            )
            return text, True
        except ChatTemplateError:
            raise
        except jinja2.TemplateError:
            pass  # a template using what we do not emulate: approximate, the worker decides
    return _approximate(messages, add_generation_prompt), False


# Put after the final message's content to find where it ends in the rendered text; the space
# shows whether the template kept the content's trailing whitespace (transformers' same test).
_CONTINUE_MARK = "CARPOOL_CONTINUE_FINAL_MESSAGE "


def _continued(card: ModelCard, messages: list[dict[str, Any]],
               tools: list[dict[str, Any]] | None,
               template_kwargs: dict[str, Any] | None) -> tuple[str, bool]:
    """The chat rendered up to the end of its last message's content: everything the template
    writes after it (the end of the turn, a new turn) cut, as transformers'
    apply_chat_template(continue_final_message=True) does."""
    content = messages[-1].get("content") if messages else None
    if not isinstance(content, str) or not content:
        raise ChatTemplateError("continue_final_message needs a last message with text to continue")
    marked = [*messages[:-1], {**messages[-1], "content": content + _CONTINUE_MARK}]
    text, is_exact = render_chat(card, marked, add_generation_prompt=False, tools=tools,
                                 template_kwargs=template_kwargs)
    end = text.rfind(_CONTINUE_MARK.strip())
    if end < 0 or content.strip() not in text[:end]:
        raise ChatTemplateError("the model's chat template does not keep the last message's text "
                                "as written, so it cannot be continued")
    if text[end:end + len(_CONTINUE_MARK)] == _CONTINUE_MARK:
        return text[:end], is_exact
    return text[:end].rstrip(), is_exact  # the template trimmed the content: so is what precedes


def template_kwargs_for(card: ModelCard, kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """The chat_template_kwargs the model's template reads (as vLLM keeps them): a client may
    send Qwen3's enable_thinking to any model; where no template reads it, it changes nothing."""
    read = _variables_read(card) if kwargs else frozenset()
    return {name: value for name, value in (kwargs or {}).items()
            if name in read and name not in RESERVED_TEMPLATE_VARIABLES}


def template_takes_tools(card: ModelCard) -> bool:
    """Whether the model's chat template reads the `tools` variable (renders tools itself)."""
    return "tools" in _variables_read(card)


def _variables_read(card: ModelCard) -> frozenset[str]:
    """The variables the model's chat template reads; none without one, or where jinja cannot
    parse it (the render then approximates)."""
    if not card.chat_template:
        return frozenset()
    try:
        return _variables(card.chat_template)
    except jinja2.TemplateError:
        return frozenset()


@lru_cache(maxsize=16)
def _variables(source: str) -> frozenset[str]:
    env = ImmutableSandboxedEnvironment(extensions=[jinja2.ext.loopcontrols])
    return frozenset(jinja2.meta.find_undeclared_variables(env.parse(source)))


def _approximate(messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
    parts = [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]
    return "".join(parts) + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def _raise(message: str) -> NoReturn:
    raise ChatTemplateError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
