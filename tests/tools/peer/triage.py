"""Why a peer-suite test fails against `base serve` with SmolLM2-135M, where it does not concern the OpenAI API.

Each failing test is sorted by its name (fnmatch patterns, first match wins; a unittest class's
tests are named `Class::test`):
- not applicable: another server's own endpoints, fields, launch flags and test harness, or
  where that server departs from OpenAI's API (which this server follows);
- model-limited: the response is well-formed per the API, and only the 135M model's answer (or
  the exact text and token counts of the suite's own test model) is not what the test expects.
A failing test not listed here is counted as failed: a defect to fix. docs/testing.md ("Peer suites")
gives the same list.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

NOT_APPLICABLE = "not applicable"
MODEL_LIMITED = "model-limited"

_FIRST_DELTA = (
    "llama.cpp's first streamed delta has content null and its harness rejects an empty content "
    'delta; OpenAI (and this server) send "content": "" with the role'
)
_THEIR_MODEL = "exact prompt/answer token counts and answer text of llama.cpp's own test model"

LLAMACPP_CHAT = [
    ("test_chat_completion[[]*", NOT_APPLICABLE, _THEIR_MODEL + "; system_fingerprint of their build ('b...')"),
    ("test_chat_completion_cached_tokens", NOT_APPLICABLE, _THEIR_MODEL + " and cache (77-token prompts)"),
    ("test_chat_completion_stream[[]*", NOT_APPLICABLE, _THEIR_MODEL + "; also " + _FIRST_DELTA),
    ("test_chat_completion_with_openai_library", NOT_APPLICABLE, _THEIR_MODEL + " ('Suddenly'), build fingerprint"),
    ("test_chat_template", NOT_APPLICABLE, "llama.cpp's --chat-template flag and debug '__verbose' field"),
    ("test_chat_template_assistant_prefill*", NOT_APPLICABLE, "their template file and debug '__verbose' field"),
    ("test_chat_template_continue_final_message_vllm_compat", NOT_APPLICABLE, "debug '__verbose' field"),
    ("test_apply_chat_template", NOT_APPLICABLE, "llama.cpp's /apply-template endpoint"),
    ("test_completion_with_json_schema*", NOT_APPLICABLE, "llama.cpp's top-level json_schema field"),
    ("test_completion_with_grammar*", NOT_APPLICABLE, "llama.cpp's GBNF grammar field"),
    (
        "test_invalid_chat_completion_req[[]messages7]",
        NOT_APPLICABLE,
        "two assistant turns in a row: OpenAI takes them",
    ),
    ("test_chat_completion_with_timings_per_token", NOT_APPLICABLE, "llama.cpp's timings_per_token field"),
    ("test_logprobs_stream", NOT_APPLICABLE, _FIRST_DELTA),
    (
        "test_context_size_exceeded*",
        NOT_APPLICABLE,
        "llama.cpp's exceed_context_size_error type with n_ctx; "
        "OpenAI's is invalid_request_error, code context_length_exceeded (sent)",
    ),
    ("test_return_progress*", NOT_APPLICABLE, "llama.cpp's return_progress field"),
    ("test_chat_completions_multiple_choices", NOT_APPLICABLE, "llama.cpp's id_slot field (n=2 itself works)"),
    ("test_chat_completions_token_count", NOT_APPLICABLE, "llama.cpp's /chat/completions/input_tokens endpoint"),
    ("test_verbose_debug", NOT_APPLICABLE, "llama.cpp's verbose field"),
]

LLAMACPP_TOOLS = [
    ("test_completion_without_tool_call_fast[[]*STREAMED]", NOT_APPLICABLE, _FIRST_DELTA),
]

LLAMACPP_SECURITY = [
    ("test_access_static_assets_without_api_key", NOT_APPLICABLE, "llama.cpp's web UI files"),
    ("test_correct_api_key*", NOT_APPLICABLE, "llama.cpp's native /completions endpoint ('content' field)"),
    (
        "test_cors_options[[]*",
        NOT_APPLICABLE,
        "llama.cpp by default answers any origin's preflight (even "
        "'localhost', 'origin'), with credentials; this server answers only --cors-origins",
    ),
    ("test_cors_proxy_only_forwards_explicit_proxy_headers", NOT_APPLICABLE, "llama.cpp's /cors-proxy endpoint"),
    ("test_local_media_file[[]*", NOT_APPLICABLE, "a vision model and llama.cpp's --media-path flag"),
]

_NOT_SERVED = "served model's name only: OpenAI answers another model's name with 404 (as here)"
_CUT = (
    "the answer runs past max_output_tokens (16/32), so the response is 'incomplete' as OpenAI marks it; "
    "their test takes only 'completed'"
)
_UNCLOSED = (
    "sampled (unseeded) answers where the model does not close an argument string within max_tokens "
    "(the answer ends at length, no call) or makes one call where the test wants two"
)

SGLANG_SERVER = [
    (
        "*::test_regex",
        MODEL_LIMITED,
        "the regex allows any number of digits and the model writes '1111...' to max_tokens, so the JSON never closes",
    ),
    ("*::test_response_prefill", NOT_APPLICABLE, "asks for meta-llama/Llama-3.1-8B-Instruct by name; " + _NOT_SERVED),
    (
        "TestOpenAIServerv1Responses::test_response",
        NOT_APPLICABLE,
        "reads usage.prompt_tokens, SGLang's name; OpenAI's Responses usage has input_tokens (sent); also " + _CUT,
    ),
    ("TestOpenAIServerv1Responses::test_response_stream", MODEL_LIMITED, _CUT),
    ("TestOpenAIServerv1Responses::test_response_completion*", MODEL_LIMITED, _CUT),
    (
        "TestOpenAIServerv1Responses::test_penalty",
        NOT_APPLICABLE,
        "frequency_penalty on /v1/responses, which is not a Responses API field "
        "(OpenAI refuses it too; the chat test_penalty passes)",
    ),
    ("TestOpenAIV1Rerank::*", NOT_APPLICABLE, "SGLang's /v1/rerank with a cross-encoder model"),
    ("TestOpenAIV1Score::*", NOT_APPLICABLE, "SGLang's /v1/score"),
    (
        "TestOpenAIServerCustomLogitProcessor::*",
        NOT_APPLICABLE,
        "SGLang's custom_logit_processor (serialized Python code)",
    ),
]

SGLANG_TOOLS = [
    (
        "*::test_conflicting_defs_required_tool_choice",
        NOT_APPLICABLE,
        "expects SGLang's refusal of two tools whose "
        "$defs share a name ('multiple schemas ... not supported'); here each tool keeps its own definitions and "
        "the call is made",
    ),
    ("*::test_tool_choice_required_*", MODEL_LIMITED, _UNCLOSED),
    ("*::test_tool_choice_specific_function_*", MODEL_LIMITED, _UNCLOSED),
    ("*::test_required_streaming_arguments_chunks_json", MODEL_LIMITED, _UNCLOSED),
    ("*::test_complex_parameters_required_non_streaming", MODEL_LIMITED, _UNCLOSED),
    ("*::test_multi_tool_scenario_*", MODEL_LIMITED, _UNCLOSED),
]

TRIAGE = {
    "llamacpp-chat": LLAMACPP_CHAT,
    "llamacpp-tools": LLAMACPP_TOOLS,
    "llamacpp-security": LLAMACPP_SECURITY,
    "sglang-server": SGLANG_SERVER,
    "sglang-tools": SGLANG_TOOLS,
}


def classify(suite: str, test: str) -> tuple[str, str] | None:
    """(category, reason) for a failing test of `suite`; None when it is not explained here."""
    for pattern, category, reason in TRIAGE.get(suite, ()):
        if fnmatchcase(test, pattern):
            return category, reason
    return None
