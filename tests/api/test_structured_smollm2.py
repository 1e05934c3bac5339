"""Structured output and tool calls with the real SmolLM2-135M at temperature 0: answers that parse and end."""

from __future__ import annotations

import json

import pytest

from baselm.sampling.params import SamplingParams
from baselm.structured import grammar
from tests.structured.schemas import validate

pytestmark = pytest.mark.slow


def _obj(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties) if required is None else required}


STRING, INTEGER, NUMBER, BOOLEAN = ({"type": t} for t in ("string", "integer", "number", "boolean"))
ADDRESS = _obj({"street": STRING, "city": STRING})
STARS = {"type": "integer", "minimum": 1, "maximum": 5}
MEMBERS = {"type": "array", "items": _obj({"name": STRING, "age": INTEGER}), "maxItems": 4}
LINES = {"type": "array", "items": _obj({"sku": {"type": "string", "maxLength": 8}, "qty": INTEGER}), "maxItems": 3}
# Twenty questions, each with a schema of the kind applications send: nested objects, arrays,
# enums, numbers, optional fields. Arrays of records carry maxItems, as real schemas for lists
# of records do (at temperature 0 a small model repeats records forever without it).
CASES = [
    ("Give the capital of France and its population.", _obj({"city": STRING, "population": INTEGER})),
    ("Describe a person named Ann who is 31.", _obj({"name": STRING, "age": INTEGER})),
    ("Is the sky blue? Answer with a boolean and a reason.", _obj({"answer": BOOLEAN, "reason": STRING})),
    ("What is the price of a coffee in euros?", _obj({"item": STRING, "price": NUMBER})),
    ("Pick a color for a stop sign.", _obj({"color": {"enum": ["red", "green", "blue"]}})),
    ("List three fruits.", _obj({"fruits": {"type": "array", "items": STRING}})),
    ("Give the coordinates of Paris.", _obj({"lat": NUMBER, "lon": NUMBER})),
    ("Describe a book: title, author and year.", _obj({"title": STRING, "author": STRING, "year": INTEGER})),
    ("Create a user with an address in Paris.", _obj({"name": STRING, "address": ADDRESS})),
    ("Rate the movie Titanic from 1 to 5.", _obj({"movie": STRING, "stars": STARS})),
    ("Give two numbers that add up to ten.", _obj({"numbers": {"type": "array", "items": INTEGER}})),
    ("What is the weather like today?", _obj({"temperature": NUMBER, "condition": {"enum": ["sunny", "rainy"]}})),
    ("Describe a dog, with an optional nickname.", _obj({"breed": STRING, "nickname": STRING}, ["breed"])),
    ("Make a todo item that is not done.", _obj({"task": STRING, "done": BOOLEAN, "level": INTEGER}, ["task", "done"])),
    ("Give a team of two people with their ages.", _obj({"members": MEMBERS})),
    ("What is 2 plus 2?", _obj({"result": INTEGER})),
    ("Give the name and size of a planet.", _obj({"planet": STRING, "radius_km": NUMBER, "has_rings": BOOLEAN})),
    ("Convert 3 kilometers to meters.", _obj({"meters": NUMBER, "unit": {"const": "m"}})),
    ("Say hello in JSON.", _obj({"greeting": STRING, "language": {"type": ["string", "null"]}})),
    ("Give an order with an id and items with quantities.", _obj({"order_id": INTEGER, "items": LINES})),
]


def test_json_schema_answer_with_a_string_and_an_integer_parses(smollm2_server):
    schema = _obj({"city": STRING, "population": INTEGER})
    response = smollm2_server.openai().chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "What is the capital of France and its population? Answer in JSON."}],
        temperature=0,
        max_tokens=100,
        response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": schema}},
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    answer = json.loads(choice.message.content)
    assert set(answer) == {"city", "population"}
    assert isinstance(answer["city"], str) and isinstance(answer["population"], int)


def test_forced_tool_call_parses_with_finish_reason_tool_calls(smollm2_server):
    weather = {
        "type": "function",
        "function": {"name": "get_weather", "parameters": _obj({"city": STRING, "days": INTEGER})},
    }
    messages = [{"role": "user", "content": "What's the weather in Paris for the next 3 days?"}]
    client = smollm2_server.openai()
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        # parallel calls allowed (the default): a model that repeats its call is stopped at the repeat
        response = client.chat.completions.create(
            model="smollm2", messages=messages, temperature=0, max_tokens=100, tools=[weather], tool_choice=choice
        )
        answer = response.choices[0]
        assert answer.finish_reason == "tool_calls" and answer.message.content is None
        [call] = answer.message.tool_calls
        assert call.function.name == "get_weather"
        validate(json.loads(call.function.arguments), weather["function"]["parameters"])
        # the OpenAI client's follow-up turn: the call with content null, then the tool's result
        follow_up = [
            *messages,
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
            {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
        ]
        after = client.chat.completions.create(model="smollm2", messages=follow_up, temperature=0, max_tokens=5)
        assert after.choices[0].message.content


def test_twenty_schemas_in_one_batch_all_give_valid_json_within_128_tokens(smollm2_server):
    engine = smollm2_server.engine
    lltokenizer = grammar.grammar_tokenizer(engine.tokenizer, engine.vocab_size, engine.eos_token_ids)
    prompts, params = [], []
    for question, schema in CASES:
        text = grammar.json_schema_grammar(schema)
        grammar.check_grammar(text, lltokenizer, "response_format")
        prompts.append(engine.tokenizer.encode_chat([{"role": "user", "content": f"{question} Answer in JSON."}]))
        params.append(
            SamplingParams(
                temperature=0,
                max_tokens=128,
                stop_token_ids=engine.eos_token_ids,
                make_logits_processors=lambda text=text: [
                    grammar.GrammarProcessor(lltokenizer, text, engine.eos_token_ids)
                ],
            )
        )

    def generate(engine, prompts, params):  # on the engine's own thread, all twenty in one batch
        return engine.generate(prompts, params)

    results = smollm2_server.client.call(generate, prompts, params).result(600)
    for (question, schema), result in zip(CASES, results):
        [answer] = result.completions
        assert answer.finish_reason == "stop", (question, answer.text)
        validate(json.loads(answer.text), schema)
