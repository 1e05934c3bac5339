"""A server restarted on its prefix cache file answers a repeated prompt from cached blocks, identically."""

from __future__ import annotations

from tests.api.conftest import MODEL, RunningServer

LONG = " ".join(f"word{i % 37}" for i in range(300))


def ask(server: RunningServer) -> tuple[str, int]:
    answer = server.openai().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": LONG}], temperature=0, max_tokens=8
    )
    return answer.choices[0].message.content, answer.usage.prompt_tokens_details.cached_tokens


def test_a_restarted_server_serves_a_repeated_prompt_from_its_cache_file(tmp_path) -> None:
    path = tmp_path / "prefix.kvc"
    first = RunningServer(prefix_cache_file=str(path))
    try:
        cold, cached = ask(first)
        assert cached == 0
    finally:
        first.stop()  # the engine thread saves the cache as it stops
    second = RunningServer(prefix_cache_file=str(path))
    try:
        warm, cached = ask(second)
        assert warm == cold and cached > 0
        second.wait_idle()
    finally:
        second.stop()
