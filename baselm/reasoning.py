"""Reasoning models' thinking, told apart from their answer: `<think>...</think>` as Qwen3 and DeepSeek-R1 write it.

A model thinks when its chat template speaks of `<think>`. Its answer then opens with the
thinking, either after a `<think>` it writes itself (Qwen3) or straight away because the
prompt already ends inside `<think>` (DeepSeek-R1's template, Qwen3 templates that force
thinking). Thinking ends at the first `</think>`; the whitespace after it is dropped and the
rest is the answer. A template that closes the thinking in the prompt (Qwen3 with
`enable_thinking: false`) leaves the answer as it is.

`ReasoningSplitter` reads the answer as it grows, for a stream and a whole answer alike, so a
stream's pieces join to exactly the whole answer's. Text that may still become a tag is held
back until the next piece shows what it is.
"""

from __future__ import annotations

from collections.abc import Mapping

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def template_thinks(chat_template: str | Mapping[str, str] | None) -> bool:
    """True when a chat template teaches `<think>` blocks (a reasoning model's)."""
    text = " ".join(chat_template.values()) if isinstance(chat_template, Mapping) else chat_template or ""
    return THINK_OPEN in text and THINK_CLOSE in text


def prompt_opens_thinking(prompt_text: str) -> bool:
    """True when a rendered prompt ends inside a `<think>` block, so the answer starts with thinking."""
    return prompt_text.rfind(THINK_OPEN) > prompt_text.rfind(THINK_CLOSE)


class ReasoningSplitter:
    """Splits a growing answer into (reasoning, content) pieces.

    `feed(delta)` returns the reasoning and content now safe to show; `finish()` returns what
    was held back. States: "start" (nothing but whitespace yet; a `<think>` here opens
    thinking), "thinking", "after" (just closed: leading whitespace is dropped) and "content".
    """

    def __init__(self, in_thinking: bool = False) -> None:
        self.state = "thinking" if in_thinking else "start"
        self.buffer = ""

    def feed(self, delta: str) -> tuple[str, str]:
        self.buffer += delta
        reasoning, content = "", ""
        while self.buffer:
            if self.state == "start":
                stripped = self.buffer.lstrip()
                if THINK_OPEN.startswith(stripped):
                    break  # only whitespace or part of the tag so far: wait
                if stripped.startswith(THINK_OPEN):
                    self.state, self.buffer = "thinking", stripped[len(THINK_OPEN) :]
                else:
                    self.state = "content"
            elif self.state == "thinking":
                end = self.buffer.find(THINK_CLOSE)
                if end < 0:
                    keep = len(self.buffer) - _partial_suffix(self.buffer, THINK_CLOSE)
                    reasoning, self.buffer = reasoning + self.buffer[:keep], self.buffer[keep:]
                    break
                reasoning += self.buffer[:end]
                self.state, self.buffer = "after", self.buffer[end + len(THINK_CLOSE) :]
            elif self.state == "after":
                self.buffer = self.buffer.lstrip()
                if self.buffer:
                    self.state = "content"
            else:
                content, self.buffer = content + self.buffer, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back: an unfinished tag in thinking is thinking; anything else is content."""
        reasoning, content = self.feed("")
        rest, self.buffer = self.buffer, ""
        if self.state == "thinking":
            return reasoning + rest, content
        if self.state == "after":
            return reasoning, content
        return reasoning, content + rest


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that starts `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
