"""The protocol-neutral chat core: a checked `ChatRequest` in, engine jobs out.

Every chat protocol (OpenAI's chat completions and Responses, Anthropic's Messages, Ollama's
/api/chat) reads its body into a ChatRequest, its tools through `read_tool`/`read_function`,
then calls `prepare`, in this order: the tools checked against the call format the chat
template teaches, the messages through the chat template into prompt ids and the images it
places (`encode_prompt`; images.py owns a message's image parts),
the prompt checked against the context (serving.check_prompt), and the SamplingParams
(`sampling_params`: a grammar when the answer's shape is forced). Each protocol formats the
answer in its own words; answer_text.py splits it into thinking, content and tool calls.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from baselm.api import serving
from baselm.api.constrained import constrained_params
from baselm.api.errors import bad_request
from baselm.api.images import encode_messages
from baselm.api.schemas import Body, Common
from baselm.api.state import ModelState
from baselm.sampling.params import SamplingParams
from baselm.structured import grammar
from baselm.tokenizer.errors import ChatTemplateError
from baselm.toolcalls import forcing, markers
from baselm.vision import PromptImage

_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")  # fullmatch: `$` takes a trailing newline
# The chat template's own arguments, which template variables cannot set.
_TEMPLATE_ARGUMENTS = frozenset({"messages", "tools", "add_generation_prompt", "continue_final_message"})


@dataclass(slots=True)
class ChatRequest:
    """A checked chat request, whatever protocol's body it was read from."""

    common: Common
    messages: list[dict[str, Any]]
    logprobs: bool = False
    top_logprobs: int = 0
    response_format: dict[str, Any] | None = None  # {"type": "json_object"} or {"type": "json_schema", "schema": ...}
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"  # "none", "auto", "required" or {"type": "function", ...}
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # extra chat template variables
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # prefill: the answer continues the final assistant message
    regex: str | None = None  # SGLang's and vLLM's extension: the answer matches this regular expression
    format_field: str = "response_format"  # the body's name for response_format, in errors (Ollama's "format")

    @property
    def named_tool(self) -> str | None:
        return self.tool_choice["function"]["name"] if isinstance(self.tool_choice, dict) else None


def parses_tools(chat: ChatRequest) -> bool:
    """True when the tools go into the prompt and the answer is read for calls."""
    return bool(chat.tools) and chat.tool_choice != "none"


def forces_call(chat: ChatRequest) -> bool:
    """True when the answer must be a tool call ("required" or a named function)."""
    return chat.tool_choice == "required" or chat.named_tool is not None


# ---- prompt and SamplingParams ------------------------------------------------------------


def prepare(state: ModelState, chat: ChatRequest) -> list[serving.Job]:
    """The engine requests for a checked chat request: prompt ids, images and SamplingParams per job."""
    if parses_tools(chat):
        markers.check_supported(state.tool_format)
    prompt_ids, images = encode_prompt(state, chat)
    serving.check_prompt(
        state, prompt_ids, "messages", chat.common.sampling["max_tokens"], chat.common.max_tokens_field
    )
    return [serving.Job(prompt_ids, sampling_params(state, chat), 0, images=images)]


def encode_prompt(state: ModelState, chat: ChatRequest) -> tuple[list[int], list[PromptImage]]:
    """The prompt ids of the messages (and the tools it parses) through the chat template, and the
    images the template placed (images.py); a template's refusal is a 400 naming messages."""
    tool_list = chat.tools if parses_tools(chat) else None
    try:
        return encode_messages(
            state,
            chat.messages,
            add_generation_prompt=chat.add_generation_prompt,
            tools=tool_list,
            continue_final_message=chat.continue_final_message,
            **chat.chat_template_kwargs,
        )
    except ChatTemplateError as exc:
        raise bad_request(str(exc), "messages") from None


def _grammar(state: ModelState, chat: ChatRequest) -> tuple[str, str] | None:
    """(grammar, the field it enforces) when the answer's shape is constrained."""
    if chat.regex is not None:
        return grammar.regex_grammar(chat.regex), "regex"
    if chat.response_format is not None:
        schema = chat.response_format.get("schema") if chat.response_format["type"] == "json_schema" else None
        return grammar.json_schema_grammar(schema), chat.format_field
    if forces_call(chat):
        # A named function is called once; "required" may call several when parallel_tool_calls allows.
        parallel = chat.parallel_tool_calls and chat.named_tool is None
        lltokenizer = grammar.grammar_tokenizer(state.tokenizer, state.vocab_size, state.eos_token_ids)
        fmt = state.tool_format
        marker_ids = forcing.marker_token_ids(state.tokenizer, lltokenizer, markers.MARKERS.get(fmt, ()))
        lark = forcing.forced_call_lark(chat.tools, fmt, chat.named_tool, parallel, marker_ids, _template_text(state))
        return grammar.lark_grammar(lark), "tools"
    return None


def _template_text(state: ModelState) -> str:
    """The model's chat template, its named templates joined (forced_formats tells variants by it)."""
    template = state.tokenizer.chat_template
    return " ".join(template.values()) if isinstance(template, dict) else template or ""


def sampling_params(state: ModelState, chat: ChatRequest) -> SamplingParams:
    """The request's SamplingParams; with a grammar, each of its n copies makes its own processor."""
    sampling = dict(chat.common.sampling)
    if parses_tools(chat) and markers.needs_special_tokens(state.tool_format, state.tokenizer):
        sampling["skip_special_tokens"] = False  # the call markers are special tokens
    if state.tool_format == markers.HARMONY:
        sampling["skip_special_tokens"] = False  # harmony's message markers tell reasoning from the answer
    logprobs = chat.top_logprobs if chat.logprobs else None
    constrained = _grammar(state, chat)
    if constrained is None:
        return serving.make_params(sampling, chat.common.max_tokens_field, "top_logprobs", logprobs=logprobs)
    text, param = constrained
    grammar.check_endable(sampling, param)
    lltokenizer = grammar.grammar_tokenizer(state.tokenizer, state.vocab_size, state.eos_token_ids)
    if param == "tools":  # name the tool whose schema cannot be enforced
        for i, tool in enumerate(chat.tools):
            where, function = f"tools[{i}].function.parameters", tool["function"]
            what = f"invalid 'parameters' schema in {where} ({function['name']})"
            grammar.check_grammar(grammar.json_schema_grammar(function["parameters"], where), lltokenizer, where, what)
    return constrained_params(
        state,
        sampling,
        chat.common.max_tokens_field,
        text,
        param,
        lltokenizer=lltokenizer,
        tool_format=state.tool_format if param == "tools" else None,
        tool_close=forcing.forced_close(state.tool_format, _template_text(state)) if param == "tools" else "",
        logprobs_field="top_logprobs",
        logprobs=logprobs,
    )


# ---- what every protocol's body shares ----------------------------------------------------


def template_kwargs(value: Any, name: str = "chat_template_kwargs") -> dict[str, Any]:
    """Extra chat template variables (e.g. {"enable_thinking": false}): an object of names to JSON values."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and k.isidentifier() for k in value):
        raise bad_request(f"{name} must be an object whose keys are template variable names", name)
    reserved = sorted(set(value) & _TEMPLATE_ARGUMENTS)
    if reserved:
        raise bad_request(f"{name} cannot set {reserved[0]!r}; it comes from the request itself", name)
    return dict(value)


def read_tool(data: Any, index: int) -> dict[str, Any]:
    """tools[index], OpenAI's function tool (Ollama's tools are the same shape)."""
    where = f"tools[{index}]"
    body = Body(data, where)
    if body.string("type", required=True) != "function":
        raise bad_request(f"{where}.type must be 'function'", f"{where}.type")
    fn = Body(body.raw("function"), f"{where}.function")
    function = read_function(fn, f"{where}.function")
    fn.finish()
    body.finish()
    return {"type": "function", "function": function}


def read_function(body: Body, where: str, schema_field: str = "parameters", schema_required: bool = False) -> dict:
    """A tool's function as the chat template takes it: `name`, `description` and its JSON Schema
    (`body[schema_field]`; an empty object schema when it may be left out), with `strict` read and
    left to the grammar (arguments follow the schema whenever a call is forced; see
    baselm/toolcalls/forcing.py). Every API's tools (chat, Responses, Messages, Ollama) come through here."""
    name = body.string("name", required=True)
    _check_function_name(name, f"{where}.name")
    function: dict[str, Any] = {"name": name}
    description = body.string("description")
    if description is not None:
        function["description"] = description
    schema = body.raw(schema_field)
    if (schema is not None or schema_required) and not isinstance(schema, dict):
        raise bad_request(f"{where}.{schema_field} must be a JSON Schema object", f"{where}.{schema_field}")
    function["parameters"] = schema if schema is not None else {"type": "object", "properties": {}}
    body.boolean("strict")
    return function


def _check_function_name(name: str, param: str) -> None:
    """A 400 naming `param` unless `name` is a function name every client takes (OpenAI's rule)."""
    if not _FUNCTION_NAME.fullmatch(name):
        raise bad_request(f"{param} {name!r} must be 1-64 letters, digits, _ . or -", param)
