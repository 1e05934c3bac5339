"""The OpenAI-compatible HTTP server (`base serve`), on starlette and uvicorn.

Request flow: app.py (routes, auth, errors) -> schemas.py (every field checked) ->
routes_chat.py / routes_completions.py (prompt ids, SamplingParams, grammar) ->
generate.py (engine submission, merged outputs, usage) -> sse.py (streams).

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
