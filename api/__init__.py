"""The OpenAI-compatible HTTP server (`base serve`), on starlette and uvicorn.

Request flow, one module per step: app.py (routes; auth.Gate checks the key and counts
the request) -> openai_chat.py / openai_completions.py (the protocol: its body, prompt ids
and SamplingParams, its choices) -> serving.py (the core: handler opening, engine
submission, merged outputs, usage, the response envelope and stream skeleton) -> sse.py
(the bytes). A new protocol is one more module on serving.py; schemas.py reads fields,
errors.py words refusals, grammar.py and tools.py constrain and parse chat answers.
OpenAI's Responses (openai_responses.py, responses_request.py, responses_store.py) and
Anthropic's Messages (anthropic_messages.py, anthropic_request.py) read their bodies into a
chat request and run chat's prompt and grammar path; answer_text.py splits every answer into
thinking (baselm/reasoning.py), content and tool calls.

Choices made where the OpenAI API leaves room:
- Unknown fields are a 400 naming them; only `user` (informational) is accepted and ignored.
- `n` is at most 16; `logprobs`/`top_logprobs` at most 20; `stop` at most 16 strings.
- `tool_choice: "none"` leaves the tools out of the prompt and parses no calls. A named
  `tool_choice` forces exactly one call of that function; `"required"` forces one or more
  (exactly one with `parallel_tool_calls: false`), arguments following each function's schema.
- A tool call cut off by `max_tokens` (or with broken JSON) is not a call: its text is
  returned as content, with finish_reason "length" (or "stop").
- `response_format` and forced tool calls are enforced by llguidance; an answer that runs
  out of tokens mid-JSON ends with finish_reason "length" and partial JSON, as OpenAI's does.
  `min_tokens` and `ignore_eos` are refused with them: the grammar decides where the answer ends.
- A full waiting queue is a 429 (code "queue_full"); a client that disconnects aborts its
  request, streamed or not (counted as status 499 in /metrics).
- Completions `echo` with `logprobs` is refused (no prompt logprobs); `suffix` is refused;
  `best_of` must equal `n`.
"""
