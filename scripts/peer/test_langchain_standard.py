"""langchain-tests' standard chat-model integration tests, with langchain-openai's ChatOpenAI
pointed at a running `base serve` (BASE_PEER_URL, BASE_PEER_MODEL)."""

from __future__ import annotations

import os

from langchain_openai import ChatOpenAI
from langchain_tests.integration_tests import ChatModelIntegrationTests


class TestBaseServe(ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[ChatOpenAI]:
        return ChatOpenAI

    @property
    def chat_model_params(self) -> dict:
        return {
            "model": os.environ["BASE_PEER_MODEL"],
            "base_url": os.environ["BASE_PEER_URL"] + "/v1",
            "api_key": "none",
            "temperature": 0,
            "max_tokens": 200,
            "stream_usage": True,  # usage in streams too (stream_options.include_usage), as the suite expects
            "timeout": 300,
        }

    # What the server offers, so that the suite tests it (and skips the rest).
    @property
    def has_tool_calling(self) -> bool:
        return True

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def has_structured_output(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def returns_usage_metadata(self) -> bool:
        return True

    @property
    def supports_image_inputs(self) -> bool:
        return False

    @property
    def supports_audio_inputs(self) -> bool:
        return False

    @property
    def supports_pdf_inputs(self) -> bool:
        return False

    @property
    def supports_video_inputs(self) -> bool:
        return False
