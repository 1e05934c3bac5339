"""The messages of a chat, and the prompt ids of the next turn built so that they extend the last turn's."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from baselm.chat.settings import ChatCommandError
from baselm.tokenizer.tokenizer import Tokenizer
from baselm.vision import Image, ImageProcessor, PromptImage, place_images


@dataclass(slots=True)
class Prompt:
    """One turn's prompt: the rendered text, its token ids, and how many ids came from the last turn."""

    text: str
    token_ids: list[int]
    num_reused_ids: int = 0
    images: list[PromptImage] = field(default_factory=list)  # every image of the conversation, placed


class Conversation:
    """The messages of a chat, and the token ids the model saw last, to build prompts that extend them.

    NOTE: a prompt is built so that it starts with the ids of the previous turn (its prompt
    followed by the ids the model generated) whenever the chat template renders the
    conversation append-only: the new render must start with the previous prompt's text
    followed by the answer. The tail is encoded on its own and appended. Re-encoding the
    whole text instead could split the answer into other tokens than the model produced,
    and the prefix cache would miss from there on. When the template rewrites the past
    (a date, trimmed or dropped content), the prompt is encoded whole.
    """

    def __init__(self, tokenizer: Tokenizer, system: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.system = system
        self.turns: list[dict[str, str]] = []  # user and assistant messages, alternating
        self._known: list[tuple[str, list[int]]] = []  # (text, ids) the next render may extend
        self._images: dict[int, list[Image]] = {}  # index in turns of a user message -> its images

    @property
    def messages(self) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [dict(m) for m in self.turns]

    def set_system(self, text: str | None) -> None:
        self.system = text or None
        self._known = []

    def clear(self) -> None:
        self.turns = []
        self._known = []
        self._images = {}

    def load(self, messages: Sequence[Mapping[str, Any]]) -> None:
        """Replaces the conversation with `messages` (OpenAI shaped; a system message first, if any)."""
        system, turns = None, []
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or not isinstance(m.get("content"), str):
                raise ChatCommandError(f"message {i} is not an object with a string 'content'")
            role = m.get("role")
            if role == "system" and i == 0:
                system = m["content"]
            elif role in ("user", "assistant"):
                turns.append({"role": role, "content": m["content"]})
            else:
                raise ChatCommandError(f"message {i} has role {role!r}; expected user or assistant (system only first)")
        self.system, self.turns, self._known, self._images = system, turns, [], {}

    @property
    def known(self) -> list[tuple[str, list[int]]]:
        """The rendered texts and the ids the model saw for them, which the next prompt may extend."""
        return [(text, list(ids)) for text, ids in self._known]

    def restore_known(self, known: Sequence[Sequence[Any]]) -> None:
        """Takes back `known` (as saved with the messages), so a resumed chat extends the same ids."""
        self._known = [
            (text, [int(i) for i in ids])
            for text, ids in known
            if isinstance(text, str) and isinstance(ids, list) and all(isinstance(i, int) for i in ids)
        ]

    def next_prompt(
        self, user_text: str, images: Sequence[Image] = (), processor: ImageProcessor | None = None
    ) -> Prompt:
        """The prompt for the next turn, with `user_text` (after `images`) as the new message (nothing
        is recorded yet). A conversation with images is encoded whole, its images placed by `processor`;
        raises ImageError when they cannot be."""
        if images or self._images:
            return self._prompt_with_images(user_text, images, processor)
        messages = self.messages + [{"role": "user", "content": user_text}]
        rendered = self.tokenizer.render_chat(messages, add_generation_prompt=True)
        text = rendered.text
        for known_text, known_ids in self._known:
            if known_ids and text.startswith(known_text):
                tail = self.tokenizer.encode_rendered(rendered, start=len(known_text))
                return Prompt(text, known_ids + tail, len(known_ids))
        return Prompt(text, self.tokenizer.encode_chat(messages, add_generation_prompt=True))

    def _prompt_with_images(self, user_text: str, images: Sequence[Image], processor: ImageProcessor | None) -> Prompt:
        if processor is None:
            raise ChatCommandError("this model reads text only; it cannot take images")
        messages = [self._with_images(i, m) for i, m in enumerate(self.turns)]
        head = [{"role": "system", "content": self.system}] if self.system else []
        new = _user_message(user_text, len(images))
        rendered = self.tokenizer.render_chat(head + messages + [new], add_generation_prompt=True)
        every = [image for i in sorted(self._images) for image in self._images[i]] + list(images)
        ids, placed = place_images(self.tokenizer, rendered, every, processor)
        return Prompt(rendered.text, ids, images=placed)

    def _with_images(self, index: int, message: dict[str, str]) -> dict[str, Any]:
        images = self._images.get(index)
        return _user_message(message["content"], len(images)) if images else dict(message)

    def add_turn(
        self, prompt: Prompt, user_text: str, answer: str, answer_ids: Sequence[int], images: Sequence[Image] = ()
    ) -> None:
        """Records a finished (or stopped) turn: `answer` is the text shown, `answer_ids` the ids
        generated for it, without a final end-of-sequence id; `images` went with the user's message."""
        if images:
            self._images[len(self.turns)] = list(images)
        self.turns += [{"role": "user", "content": user_text}, {"role": "assistant", "content": answer}]
        self._known = [(prompt.text, list(prompt.token_ids))]
        if answer_ids and self.tokenizer.decode(list(answer_ids)) == answer:
            self._known.insert(0, (prompt.text + answer, list(prompt.token_ids) + list(answer_ids)))


def _user_message(text: str, num_images: int) -> dict[str, Any]:
    """A user message with `num_images` image parts before its text (as `/image` attaches them)."""
    if not num_images:
        return {"role": "user", "content": text}
    return {
        "role": "user",
        "content": [*({"type": "image"} for _ in range(num_images)), {"type": "text", "text": text}],
    }
