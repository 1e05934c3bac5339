"""gpt-oss's harmony answers: the `analysis` channel is the model's reasoning, the rest its answer.

A harmony answer is a run of messages, each `[<|start|>assistant]<|channel|>NAME[ to=...]<|message|>
BODY` closed by `<|end|>`, `<|call|>` or `<|return|>` (the last two are stop tokens, so often
absent at the very end). `HarmonySplitter` takes the `analysis` messages' bodies out as reasoning
and passes every other message on as it is, markers included, for the harmony reader
(`baselm/toolcalls/formats.py`) to turn into content (`final`, `commentary` text) and tool calls
(`commentary to=functions.NAME`). It has ReasoningSplitter's interface: `feed(delta)` returns the
(reasoning, rest) now safe to hand on, `finish()` what was held back; a stream's pieces join to
the whole answer's. An answer that opens with no harmony marker is passed on as it is.
"""

from __future__ import annotations

from baselm.toolcalls.formats import held_back

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
ANALYSIS = "analysis"


class HarmonySplitter:
    """Splits a growing harmony answer into (reasoning, the other messages as written)."""

    def __init__(self) -> None:
        self.state = "header"  # "header" (until <|message|>), "analysis", "message" (passed on), "plain"
        self.buffer = ""
        self._first = True  # nothing seen yet: an answer without markers is plain text

    def feed(self, delta: str) -> tuple[str, str]:
        self.buffer += delta
        reasoning, rest = "", ""
        while self.buffer:
            if self.state == "plain":
                rest, self.buffer = rest + self.buffer, ""
            elif self.state == "header":
                if self._first and not self._may_open(self.buffer):
                    self.state = "plain"
                    continue
                end = self.buffer.find(MESSAGE)
                if end < 0:
                    break  # the header is still coming
                self._first = False
                header, self.buffer = self.buffer[:end], self.buffer[end + len(MESSAGE) :]
                if _channel(header) == ANALYSIS:
                    self.state = "analysis"
                else:
                    self.state, rest = "message", rest + header + MESSAGE
            else:
                body, closed = self._body()
                if self.state == "analysis":
                    reasoning += body
                else:
                    rest += body + closed
                if not closed:
                    break
                self.state = "header"
        return reasoning, rest

    def finish(self) -> tuple[str, str]:
        """What was held back: the end of an analysis body is reasoning; anything else is passed on."""
        reasoning, rest = self.feed("")
        held, self.buffer = self.buffer, ""
        if self.state == "analysis":
            return reasoning + held, rest
        return reasoning, rest + held

    def _body(self) -> tuple[str, str]:
        """The body up to its end marker, and the marker ("" while the body may go on; its tail that may
        still become a marker is held back)."""
        ends = [(i, m) for m in ENDS if (i := self.buffer.find(m)) >= 0]
        if ends:
            at, marker = min(ends)
            body, self.buffer = self.buffer[:at], self.buffer[at + len(marker) :]
            return body, marker
        keep = len(self.buffer) - held_back(self.buffer, ENDS)
        body, self.buffer = self.buffer[:keep], self.buffer[keep:]
        return body, ""

    @staticmethod
    def _may_open(text: str) -> bool:
        """Whether `text` starts, or may still start, a harmony message."""
        stripped = text.lstrip()
        return any(m.startswith(stripped) or stripped.startswith(m) for m in (START, CHANNEL))


def _channel(header: str) -> str:
    """A message header's channel name: `<|start|>assistant<|channel|>analysis` -> "analysis"."""
    return header.partition(CHANNEL)[2].split(" ")[0].split("<|")[0].strip()
