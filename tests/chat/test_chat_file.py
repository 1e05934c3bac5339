"""/save and /load: the conversation and settings round-trip; other files are refused with a message."""

from __future__ import annotations

import re

import pytest

from baselm.chat.chat_file import load_chat, save_chat
from baselm.chat.conversation import Conversation
from baselm.chat.settings import ChatCommandError, ChatSettings


def test_save_then_load_gives_the_same_conversation_and_settings(tokenizer, tmp_path):
    conversation = Conversation(tokenizer, system="Be brief.")
    prompt = conversation.next_prompt("Hi")
    conversation.add_turn(prompt, "Hi", "Hello", tokenizer.encode("Hello", add_special_tokens=False))
    settings = ChatSettings(temperature=0.3, top_p=0.8, max_tokens=12, seed=5)
    save_chat(tmp_path / "chat.json", conversation, settings, "tiny")
    restored = Conversation(tokenizer)
    assert load_chat(tmp_path / "chat.json", restored) == settings
    assert restored.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "is not JSON"),
        ('{"messages": []}', "is not a saved chat (no format 'base-chat' with a messages list)"),
        ('{"format": "base-chat", "messages": [{"role": "tool", "content": "x"}]}', "message 0 has role 'tool'"),
        ('{"format": "base-chat", "messages": [], "settings": {"top_p": 2}}', "bad settings: top_p must lie in"),
    ],
)
def test_load_refuses_a_file_that_is_not_a_saved_chat(tokenizer, tmp_path, text, message):
    (tmp_path / "chat.json").write_text(text)
    with pytest.raises(ChatCommandError, match=re.escape(message)):
        load_chat(tmp_path / "chat.json", Conversation(tokenizer))
