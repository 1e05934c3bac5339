"""The HTTP server (`base serve`) on starlette and uvicorn: OpenAI's, Anthropic's and Ollama's APIs.

Request flow, one module per step: app.py (routes; auth.py's Gate checks the key and counts
the request, cors.py answers browsers) -> a protocol subpackage reads its body:
openai/ (chat.py, completions.py, responses*.py), anthropic/ (messages.py, request.py),
ollama/ (chat.py, embed.py, models.py, store_routes.py, request.py) -> chat.py, the protocol-neutral chat core
(a ChatRequest's prompt ids through the chat template, the prompt checked, SamplingParams with a
grammar when the answer's shape is forced; every chat protocol calls its `prepare`) ->
serving.py, the serving core (handler opening, engine submission, merged outputs, usage, the
response envelope and stream skeleton; the model a body names comes from pool.py, the models
loaded on demand, and state.py holds the server's and each model's state) -> sse.py (SSE
events and the stream that sends them, NDJSON lines too). answer_text.py splits every chat
answer into thinking (baselm/reasoning.py), content and tool calls (baselm/toolcalls);
schemas.py reads fields, errors.py words refusals, embeddings.py and
metrics.py hold /v1/embeddings and /metrics, models.py /v1/models and llama-server's router,
request_log.py the one log line of each request, server.py runs uvicorn. A new protocol is one
more subpackage on the two cores.

Choices made where the OpenAI API leaves room:
- Sampling values and the token limit a request leaves out come from baselm/sampling/defaults.py
  (the command line's, the model's, the API's own, then llama.cpp's; at most 2,048 tokens), not
  OpenAI's temperature 1 and top_p 1 with no limit.
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
  request, streamed or not, embeddings too (counted as status 499 in /metrics).
- Embeddings take at most 2,048 inputs per request on every route (baselm/embedding.py).
- A request's text in a chat prompt is plain text even where it spells a control token; only the
  template's markers are control tokens. A raw prompt (completions, Ollama's raw generate) is the
  caller's whole prompt: its special tokens are parsed (baselm/tokenizer/plain_text.py).
- Completions `echo` with `logprobs` scores the prompt too (the engine's prompt logprobs);
  `suffix` is refused; `best_of` must equal `n`.
"""
