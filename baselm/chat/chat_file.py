"""The JSON file /save writes and /load reads: the conversation's messages and the chat's settings."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from baselm.chat.conversation import Conversation
from baselm.chat.settings import ChatCommandError, ChatSettings
from baselm.store.fs import atomic_write

SAVE_FORMAT = "base-chat"
SAVE_VERSION = 1


def save_chat(path: Path, conversation: Conversation, settings: ChatSettings, model_name: str) -> None:
    """Writes the chat as JSON: its messages, settings, and the ids the model saw last (so a resumed
    chat's next prompt extends them and hits the prefix cache). Written whole or not at all."""
    data = {
        "format": SAVE_FORMAT,
        "version": SAVE_VERSION,
        "model": model_name,
        "settings": asdict(settings),
        "messages": conversation.messages,
        "known_prompts": conversation.known,
    }
    with atomic_write(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def load_chat(path: Path, conversation: Conversation) -> ChatSettings:
    """Reads a file `save_chat` wrote into `conversation`; returns its settings."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ChatCommandError(f"cannot read {path}: {exc.strerror or exc}") from None
    except ValueError:
        raise ChatCommandError(f"{path} is not JSON") from None
    if not isinstance(data, dict) or data.get("format") != SAVE_FORMAT or not isinstance(data.get("messages"), list):
        raise ChatCommandError(f"{path} is not a saved chat (no format {SAVE_FORMAT!r} with a messages list)")
    settings = ChatSettings.from_dict(data.get("settings") or {})
    conversation.load(data["messages"])
    known = data.get("known_prompts")
    if isinstance(known, list):
        conversation.restore_known([k for k in known if isinstance(k, list) and len(k) == 2])
    return settings
