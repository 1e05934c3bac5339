"""The README's client snippets (openai Responses, openai-agents, anthropic, langchain-openai, litellm, ollama),
run as written against
`base serve` of the real SmolLM2 model: each runs to the end, and the model's real answers are right."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.api.test_serve import ServeProcess

README = Path(__file__).resolve().parents[2] / "README.md"


def client_snippets() -> list[str]:
    """The Python blocks of the README's "Clients" section, in order."""
    text = README.read_text()
    section = text[text.index("### Clients") :]
    section = section[: section.index("\n### ", 1)]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_the_readme_shows_one_snippet_per_client():
    snippets = client_snippets()
    assert len(snippets) == 6
    assert "responses.create" in snippets[0] and "previous_response_id" in snippets[0]
    assert "from agents import" in snippets[1]
    assert "import anthropic" in snippets[2]
    assert "from langchain_openai import ChatOpenAI" in snippets[3] and "bind_tools(" in snippets[3]
    assert "import litellm" in snippets[4] and "stream=True" in snippets[4]
    assert "import ollama" in snippets[5] and "client.embed(" in snippets[5]


@pytest.mark.slow
def test_readme_client_snippets_run_against_smollm2(smollm2_gguf):
    served = ServeProcess(
        smollm2_gguf, "--kv-memory", "64MiB", "--max-model-len", "1024", "--api-key", "sk-local", timeout=180
    )
    try:
        headers = {"Authorization": "Bearer sk-local"}
        model = httpx.get(f"{served.url}/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
        outputs = []
        env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}  # no price-list fetch: no network here
        for snippet in client_snippets():
            code = snippet.replace("http://127.0.0.1:8080", served.url).replace("smollm2-135m-instruct", model)
            code = code.replace(  # Ollama's clients send no key: this server wants one
                'ollama.Client(host="http://127.0.0.1:11434")',
                f'ollama.Client(host="{served.url}", headers={{"Authorization": "Bearer sk-local"}})',
            )
            result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
            assert result.returncode == 0, result.stderr[-3000:]
            outputs.append(result.stdout)
        responses, agent, messages, langchain, litellm, ollama_chat = outputs
        first, follow_up = responses.split("\n", 1)
        assert "Paris" in first and follow_up.strip()
        assert agent.strip()
        assert "Paris" in messages
        answer, call = langchain.rstrip("\n").rsplit("\n", 1)
        assert "Paris" in answer and call.startswith("get_weather {'city': ")
        assert "Paris" in litellm
        assert ollama_chat.strip() and "2 vectors of 576" in ollama_chat  # SmolLM2 has a hidden size of 576
    finally:
        served.close()
