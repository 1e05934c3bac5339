"""Generated text handed out one token at a time, never splitting a character."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the tokenizer makes detokenizers; this module needs its type only
    from baselm.tokenizer.tokenizer import Tokenizer


class StreamingDetokenizer:
    """Text of a generated sequence, handed out one token at a time.

    NOTE: the deltas of `add` followed by `finish` concatenate to `tokenizer.decode(all ids)`,
    and no delta ends inside a character: an incomplete UTF-8 tail (a byte-level piece of an
    emoji, a run of <0xNN> byte tokens) is held back until it completes or `finish` is called.

    Each step decodes only a window: from the last token whose text is settled to the end.
    That relies on the decoder property transformers' and vLLM's streaming also rely on:
    decode(a + b) starts with decode(a) when a ends on a complete character. The window grows
    only while every new token ends inside a character (a run of byte tokens, say).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._hidden_ids = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        self._byte_ids = tokenizer.byte_fallback_ids
        self.token_ids: list[int] = []
        self._start = 0  # first token of the decode window
        self._num_sent = 0  # characters of decode(window) already handed out

    def add(self, token_id: int) -> str:
        """Adds one token; returns the text that became certain (often "", never a broken character)."""
        self.token_ids.append(token_id)
        # Skipped tokens change nothing; a byte run may still turn into U+FFFD as a whole.
        if token_id in self._hidden_ids or token_id in self._byte_ids:
            return ""
        text = self._decode_window()
        if text.endswith("\ufffd"):  # an incomplete character: hold it back
            return self._send(text, len(text) - 1)
        delta = self._send(text, len(text))
        # Settled: restart the window at this token (visible, not a byte token).
        self._start = len(self.token_ids) - 1
        self._num_sent = len(self._decode_window())
        return delta

    def finish(self) -> str:
        """The text still held back, incomplete characters included (as U+FFFD, like decode)."""
        text = self._decode_window()
        return self._send(text, len(text))

    def _decode_window(self) -> str:
        return self._tokenizer.decode(self.token_ids[self._start :], skip_special_tokens=self._skip_special_tokens)

    def _send(self, text: str, end: int) -> str:
        if end <= self._num_sent:
            return ""
        delta = text[self._num_sent : end]
        self._num_sent = end
        return delta
