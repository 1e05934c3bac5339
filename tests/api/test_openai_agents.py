"""An openai-agents agent with one function tool, run against a real server in both of its model modes.

The tiny model calls the tool only when forced (tool_choice "required"); the agents SDK then
sends the tool's result back and, with tool_choice reset to auto, the model answers in text.
Both modes send the same conversation, so their greedy answers agree."""

from __future__ import annotations

import asyncio
from typing import Literal

import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

from tests.api.conftest import MODEL

MODES = {"responses": OpenAIResponsesModel, "chat_completions": OpenAIChatCompletionsModel}


def _run(server, mode: str, stop_on_first_tool: bool) -> tuple[str, list[str]]:
    """The agent's final output and the zones its tool was called with."""
    set_tracing_disabled(True)  # no traces to upload: nothing outside this machine is reached
    zones: list[str] = []

    @function_tool
    def get_time(zone: Literal["UTC", "CET"]) -> str:
        """The current time in a time zone."""
        zones.append(zone)
        return f"It is 12:00 in {zone}."

    async def run() -> str:
        client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
        agent = Agent(
            name="clock",
            instructions="Tell the time.",
            tools=[get_time],
            model=MODES[mode](model=MODEL, openai_client=client),
            # Room for the greedy answer to end by itself: the SDK's Responses mode fails an incomplete response.
            model_settings=ModelSettings(tool_choice="required", max_tokens=600, temperature=0),
            tool_use_behavior="stop_on_first_tool" if stop_on_first_tool else "run_llm_again",
        )
        try:
            result = await Runner.run(agent, "What time is it?", max_turns=3)
        finally:
            await client.close()
        return str(result.final_output)

    return asyncio.run(run()), zones


@pytest.mark.parametrize("mode", sorted(MODES))
def test_agent_calls_its_tool_and_stops_on_its_result(server, mode):
    output, zones = _run(server, mode, stop_on_first_tool=True)
    assert len(zones) == 1 and zones[0] in ("UTC", "CET")
    assert output == f"It is 12:00 in {zones[0]}."


def test_agent_answers_after_the_tool_result_alike_in_both_modes(server):
    answers = {mode: _run(server, mode, stop_on_first_tool=False) for mode in MODES}
    assert answers["responses"] == answers["chat_completions"]
    output, zones = answers["responses"]
    assert len(zones) == 1 and isinstance(output, str)
