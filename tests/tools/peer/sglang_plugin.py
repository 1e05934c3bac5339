"""A pytest plugin that runs SGLang's OpenAI server tests against a running `base serve`.

SGLang's tests (test/srt/openai_server/...) import a few helpers from the `sglang` package to
launch their server and load the model's tokenizer. This plugin registers stand-ins for those
imports before the tests are collected, without changing a test: launching is a no-op (the server
already runs, with their API key), the URL and model name are the served ones, and the tokenizer
is the served model's own, through its /tokenize and /detokenize routes.
Environment: BASE_PEER_URL, BASE_PEER_MODEL, BASE_PEER_KEY.
"""

from __future__ import annotations

import os
import sys
import types
import unittest

import httpx

URL = os.environ["BASE_PEER_URL"]
MODEL = os.environ["BASE_PEER_MODEL"]
KEY = os.environ["BASE_PEER_KEY"]


class ServedTokenizer:
    """encode/decode as SGLang's tests call them, answered by the server's tokenizer routes."""

    def _post(self, path: str, body: dict) -> dict:
        answer = httpx.post(URL + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        answer.raise_for_status()
        return answer.json()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._post("/tokenize", {"prompt": text, "add_special_tokens": add_special_tokens})["tokens"]

    def decode(self, token_ids: list[int]) -> str:
        return self._post("/detokenize", {"tokens": list(token_ids)})["prompt"]


class _Launched:
    pid = 0  # what kill_process_tree receives; nothing to stop


class CustomLogitProcessor:
    """The base class their custom-processor tests subclass; this server takes no such code."""

    def to_str(self) -> str:
        return type(self).__name__


def _module(name: str, **attrs: object) -> None:
    module = types.ModuleType(name)
    module.__path__ = []  # a package, so submodules resolve
    module.__dict__.update(attrs)
    sys.modules[name] = module


def _register() -> None:
    tokenizer = {"get_tokenizer": lambda *args, **kwargs: ServedTokenizer()}
    for name in ("sglang", "sglang.srt", "sglang.srt.sampling", "sglang.test"):
        _module(name)
    _module("sglang.srt.utils", kill_process_tree=lambda pid, *args, **kwargs: None)
    _module("sglang.srt.hf_transformers_utils", **tokenizer)  # older releases
    _module("sglang.srt.utils.hf_transformers_utils", **tokenizer)
    _module("sglang.srt.sampling.custom_logit_processor", CustomLogitProcessor=CustomLogitProcessor)
    _module("sglang.test.runners", TEST_RERANK_QUERY_DOCS=[{"query": "q", "documents": ["a"]}] * 2)
    _module(
        "sglang.test.test_utils",
        DEFAULT_SMALL_MODEL_NAME_FOR_TEST=MODEL,
        DEFAULT_SMALL_CROSS_ENCODER_MODEL_NAME_FOR_TEST=MODEL,
        DEFAULT_URL_FOR_TEST=URL,
        DEFAULT_TIMEOUT_FOR_SERVER_LAUNCH=600,
        CustomTestCase=unittest.TestCase,
        popen_launch_server=lambda *args, **kwargs: _Launched(),
    )


_register()
