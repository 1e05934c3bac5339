"""Chat templates: HF's Jinja templates, rendered in jinja2's immutable sandbox.

The sandbox has the helpers HF templates call (`raise_exception`, `tojson`, `strftime_now`,
loop controls, the `{% generation %}` tag). Messages are handed over as plain JSON-shaped
copies, so a template can neither reach Python objects nor change the caller's messages.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from baselm.tokenizer.errors import ChatTemplateError

Message = Mapping[str, Any]

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def select_template(chat_template: str | dict[str, str] | None, tools: Sequence[Mapping[str, Any]] | None) -> str:
    """The template to render: of named templates, 'tool_use' when tools are given, else 'default'."""
    template = chat_template
    if isinstance(template, dict):
        name = "tool_use" if tools is not None and "tool_use" in template else "default"
        if name not in template:
            raise ChatTemplateError(f"the model has named chat templates {sorted(template)} but none is 'default'")
        template = template[name]
    if not template:
        raise ChatTemplateError("this model has no chat template; send a plain prompt instead of chat messages")
    return template


def render_chat_template(
    template: str,
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool,
    tools: Sequence[Mapping[str, Any]] | None,
    variables: Mapping[str, Any],
    continue_final_message: bool = False,
) -> str:
    """The text `template` makes of `messages`; `variables` (special tokens, extras) become template variables.

    A template that only takes string content gets the text parts of a content list joined with
    newlines; tool-call arguments given as a JSON string are parsed into a dict; keys whose value
    is None are dropped (all as transformers does). An assistant message with `content: None`
    beside its tool calls (what OpenAI clients send back) thus has no content; a template that
    fails without one (it adds the content to strings) gets "" there instead, as vLLM and
    llama.cpp render it, where transformers would refuse. `continue_final_message`: the text
    ends where the last message's content ends, for the model to continue it (as transformers
    cuts it).
    """
    compiled = _compile_template(template)
    wants_parts = _template_iterates_content(template)
    plain = [_prepare_message(m, wants_parts) for m in messages]
    render = functools.partial(
        compiled.render,
        tools=_plain(list(tools)) if tools is not None else None,
        add_generation_prompt=add_generation_prompt,
        **_plain(variables),
    )
    try:
        try:
            text = render(messages=plain)
        except Exception:
            nulls = [i for i, m in enumerate(messages) if isinstance(m, Mapping) and m.get("content", "") is None]
            if not nulls:
                raise
            text = render(messages=[{**m, "content": ""} if i in nulls else m for i, m in enumerate(plain)])
    except ChatTemplateError:
        raise
    except Exception as exc:  # any failure inside a model's template is the template's
        raise ChatTemplateError(f"the chat template failed on this conversation: {exc}") from None
    return _cut_after_final_message(text, messages) if continue_final_message else text


def _cut_after_final_message(text: str, messages: Sequence[Message]) -> str:
    """`text` up to the end of the last message's content (its stripped form when the template stripped it)."""
    if not messages:
        raise ChatTemplateError("continue_final_message needs a final message to continue")
    content = messages[-1].get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    content = content or ""
    for needle in (content, content.strip()):
        at = text.rfind(needle)
        if at >= 0:
            return text[: at + len(needle)]
    raise ChatTemplateError("the final message does not appear in the rendered chat, so it cannot be continued")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (marks assistant text for training masks): renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"the chat template refused this conversation: {message}")


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # jinja's own tojson escapes HTML characters; HF templates expect plain json.dumps.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@lru_cache(maxsize=16)
def _compile_template(template: str) -> jinja2.Template:
    try:
        return _environment().from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        where = f"line {exc.lineno}: {exc.message}"
        raise ChatTemplateError(f"the model's chat template is not valid Jinja ({where})") from None


@lru_cache(maxsize=16)
def _template_iterates_content(template: str) -> bool:
    """Whether the template loops over a message's content, directly or through a variable.

    Such a template takes OpenAI content parts; any other gets their text joined. (A type test
    like `content is string` alone does not count: some templates render '' for other types.)
    """
    try:
        tree = _environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return False

    def is_content(node: jinja2.nodes.Node) -> bool:
        if isinstance(node, jinja2.nodes.Getattr):
            return node.attr == "content"
        if isinstance(node, jinja2.nodes.Getitem):
            return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "content"
        return False

    aliases = {
        assign.target.name
        for assign in tree.find_all(jinja2.nodes.Assign)
        if isinstance(assign.target, jinja2.nodes.Name) and is_content(assign.node)
    }
    return any(
        is_content(loop.iter) or (isinstance(loop.iter, jinja2.nodes.Name) and loop.iter.name in aliases)
        for loop in tree.find_all(jinja2.nodes.For)
    )


def _prepare_message(message: Message, wants_parts: bool) -> dict[str, Any]:
    """A plain-dict copy of a message, shaped the way HF chat templates read messages."""
    if not isinstance(message, Mapping):
        kind = type(message).__name__
        raise ChatTemplateError(f"a chat message must be a dict with 'role' and 'content', not {kind}")
    plain = {k: _plain(v) for k, v in message.items() if v is not None}
    content = plain.get("content")
    if isinstance(content, list) and not wants_parts:
        texts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        plain["content"] = "\n".join(texts)
    reasoning = next((plain[k] for k in _REASONING_FIELDS if k in plain), None)
    if reasoning is not None:
        plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
    for call in plain.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except ValueError:
                pass  # not JSON: the template gets the string as it came
    return plain


def _plain(value: Any) -> Any:
    """JSON-shaped copy: templates see only dicts, lists and scalars."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if hasattr(value, "model_dump"):
        return _plain(value.model_dump())
    return str(value)
