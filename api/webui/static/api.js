// The server's own OpenAI API, called from the page: the model list and streamed chat completions.
// A 401 asks the user for the key (through `askKey`), keeps it and tries once more.

import {apiKey, setApiKey} from "./store.js";

export class Unauthorized extends Error {}

async function call(path, init, askKey) {
  for (let attempt = 0; ; attempt++) {
    const headers = {"Content-Type": "application/json", ...(init.headers || {})};
    if (apiKey()) headers.Authorization = `Bearer ${apiKey()}`;
    const response = await fetch(path, {...init, headers});
    if (response.status !== 401) return response;
    const key = attempt < 3 ? await askKey() : null;
    if (!key) throw new Unauthorized("the server needs its API key");
    setApiKey(key);
  }
}

async function failure(response) {
  const body = await response.json().catch(() => ({}));
  return new Error(body.error?.message || `the server answered ${response.status}`);
}

export async function listModels(askKey) {
  const response = await call("/v1/models", {method: "GET"}, askKey);
  if (!response.ok) throw await failure(response);
  return (await response.json()).data;
}

// Streams one answer: calls onDelta({content, reasoning}) per chunk and resolves to the speed and
// usage; `signal` aborts it (the server then aborts the request).
export async function streamChat({model, messages, signal, onDelta, askKey}) {
  const body = {model, messages, stream: true, stream_options: {include_usage: true}};
  const started = performance.now();
  const response = await call("/v1/chat/completions", {method: "POST", body: JSON.stringify(body), signal}, askKey);
  if (!response.ok) throw await failure(response);
  const timing = {started, first: null, last: null, chunks: 0, usage: null};
  for await (const event of serverEvents(response.body)) {
    if (event.error) throw new Error(event.error.message || "the answer failed");
    if (event.usage) timing.usage = event.usage;
    const delta = event.choices?.[0]?.delta;
    if (delta && (delta.content || delta.reasoning_content)) {
      timing.first ??= performance.now();
      timing.last = performance.now();
      timing.chunks++;
      onDelta({content: delta.content || "", reasoning: delta.reasoning_content || ""});
    }
  }
  return stats(timing);
}

// The data of each server-sent event, parsed, until [DONE].
async function* serverEvents(stream) {
  const reader = stream.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    buffer += value;
    const events = buffer.split("\n\n");
    buffer = events.pop();
    for (const event of events) {
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("");
      if (data === "[DONE]") return;
      if (data) yield JSON.parse(data);
    }
  }
}

// tok/s over the time between the first and the last token (the first one's wait is the prompt's).
function stats({started, first, last, chunks, usage}) {
  const tokens = usage?.completion_tokens ?? chunks;
  const seconds = first !== null && last > first ? (last - first) / 1000 : null;
  return {
    completionTokens: tokens,
    promptTokens: usage?.prompt_tokens ?? null,
    cachedTokens: usage?.prompt_tokens_details?.cached_tokens ?? null,
    tokensPerSecond: seconds && tokens > 1 ? (tokens - 1) / seconds : null,
    firstTokenSeconds: first !== null ? (first - started) / 1000 : null,
  };
}
