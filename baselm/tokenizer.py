"""Tokenizers: text <-> token ids, chat templates, and streaming detokenization.

A `Tokenizer` wraps a `tokenizers.Tokenizer` (the Rust library behind HF's fast tokenizers)
built from an HF folder (tokenizer.json + tokenizer_config.json) or from a GGUF file's
tokenizer metadata. Encoding and decoding follow what transformers does with the same files;
where transformers departs from the model's own tokenizer for a GGUF, we follow the model
(see `_SPLITS` and `_sentencepiece_backend`).

Chat templates are HF's Jinja templates, rendered in jinja2's immutable sandbox with the
helpers HF templates call (`raise_exception`, `tojson`, `strftime_now`, loop controls).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

Message = Mapping[str, Any]

# GGUF `tokenizer.ggml.token_type` values (llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4

# Pre-tokenizer split patterns. GPT-2's own pattern is the one `ByteLevel(use_regex=True)` applies.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# `tokenizer.ggml.pre` -> split family. "digits-gpt2" isolates every digit, then splits like
# GPT-2: what SmolLM2's and StarCoder's tokenizer.json do (transformers gives these GGUFs the
# plain GPT-2 split, which tokenizes numbers differently for vocabularies with digit merges).
_SPLITS = {
    "default": "gpt2",
    "gpt2": "gpt2",
    "mpt": "gpt2",
    "olmo": "gpt2",
    "llama3": "llama3",
    "llama-v3": "llama3",
    "llama-bpe": "llama3",
    "falcon3": "llama3",
    "smaug-bpe": "llama3",
    "qwen2": "qwen2",
    "deepseek-r1-qwen": "qwen2",
    "smollm": "digits-gpt2",
    "starcoder": "digits-gpt2",
    "refact": "digits-gpt2",
}

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class TokenizerError(Exception):
    """A tokenizer that cannot be built or used; the message says what is wrong."""


class ChatTemplateError(TokenizerError):
    """A chat template that is missing, invalid, or refuses the given conversation."""


class Tokenizer:
    """Text <-> token ids for one model, with its chat template and end-of-sequence ids.

    Build one with `from_folder`, `from_hf_files` or `from_gguf_metadata`.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        special_tokens: Mapping[str, str | None],
        add_bos_token: bool,
        add_eos_token: bool,
        chat_template: str | dict[str, str] | None,
        eos_token_ids: Iterable[int] = (),
    ) -> None:
        self._backend = backend
        self._special_tokens = {k: v for k, v in special_tokens.items() if v is not None}
        self._add_bos_token = add_bos_token
        self._add_eos_token = add_eos_token
        self._chat_template = chat_template
        own_eos = self.token_to_id(self._special_tokens.get("eos_token", ""))
        ids = ([own_eos] if own_eos is not None else []) + [int(i) for i in eos_token_ids]
        self._eos_token_ids = tuple(dict.fromkeys(ids))

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def from_folder(cls, path: Path) -> Tokenizer:
        """The tokenizer of an HF model folder.

        Reads tokenizer.json, tokenizer_config.json, the chat template (chat_template.jinja,
        chat_template.json or the config's `chat_template`) and the end-of-sequence ids of
        generation_config.json when the folder has one.
        """
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise TokenizerError(f"{path}: no tokenizer.json; base reads only fast (tokenizer.json) tokenizers")
        config = _read_json(path / "tokenizer_config.json") if (path / "tokenizer_config.json").is_file() else {}
        template = None
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        elif (path / "chat_template.json").is_file():
            template = _read_json(path / "chat_template.json").get("chat_template")
        eos_ids: list[int] = []
        if (path / "generation_config.json").is_file():
            eos = _read_json(path / "generation_config.json").get("eos_token_id")
            eos_ids = [i for i in (eos if isinstance(eos, list) else [eos]) if isinstance(i, int)]
        tokenizer_json = (path / "tokenizer.json").read_text(encoding="utf-8")
        return cls.from_hf_files(tokenizer_json, config, chat_template=template, eos_token_ids=eos_ids)

    @classmethod
    def from_hf_files(
        cls,
        tokenizer_json: str,
        tokenizer_config: Mapping[str, Any],
        chat_template: str | None = None,
        eos_token_ids: Iterable[int] = (),
    ) -> Tokenizer:
        """A tokenizer from the text of tokenizer.json and the parsed tokenizer_config.json.

        `chat_template`, when given, wins over the config's own.
        """
        try:
            backend = Backend.from_str(tokenizer_json)
        except Exception as exc:  # tokenizers raises a bare Exception on malformed JSON
            raise TokenizerError(f"tokenizer.json is not a valid tokenizers file ({exc})") from None
        special = {name: _token_content(tokenizer_config.get(name)) for name in _SPECIAL_NAMES}
        _add_named_specials(backend, special)
        add_bos = bool(tokenizer_config.get("add_bos_token", False))
        add_eos = bool(tokenizer_config.get("add_eos_token", False))
        if "add_bos_token" in tokenizer_config or "add_eos_token" in tokenizer_config:
            # As transformers does: explicit flags replace tokenizer.json's post-processor.
            backend.post_processor = _bos_eos_processor(backend, special, add_bos, add_eos)
        else:
            add_bos, add_eos = _processor_adds(backend, special)
        template = chat_template if chat_template is not None else _config_template(tokenizer_config)
        return cls(
            backend,
            special_tokens=special,
            add_bos_token=add_bos,
            add_eos_token=add_eos,
            chat_template=template,
            eos_token_ids=eos_token_ids,
        )

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """The tokenizer a GGUF file describes, from its metadata (`store.gguf.read_metadata(path)[1]`).

        Supports `tokenizer.ggml.model` 'gpt2' (byte-level BPE; `tokenizer.ggml.pre` picks the
        split) and 'llama' (SentencePiece BPE with byte fallback; merges from the file or derived
        from the token scores). Control tokens become special tokens, user-defined ones added tokens.
        """
        kind = metadata.get("tokenizer.ggml.model")
        tokens = metadata.get("tokenizer.ggml.tokens")
        if not tokens:
            raise TokenizerError("the GGUF file has no tokenizer vocabulary (tokenizer.ggml.tokens)")
        if kind == "gpt2":
            backend, vocab = _byte_level_backend(metadata)
        elif kind == "llama":
            backend, vocab = _sentencepiece_backend(metadata)
        else:
            raise TokenizerError(f"GGUF tokenizer model {kind!r} is not supported (supported: 'gpt2', 'llama')")
        _add_gguf_tokens(backend, metadata, vocab, byte_level=kind == "gpt2")

        def token_at(key: str) -> str | None:
            index = metadata.get(f"tokenizer.ggml.{key}")
            return tokens[index] if isinstance(index, int) and 0 <= index < len(tokens) else None

        special = {
            "bos_token": token_at("bos_token_id"),
            "eos_token": token_at("eos_token_id"),
            "unk_token": token_at("unknown_token_id"),
            "pad_token": token_at("padding_token_id"),
        }
        _add_named_specials(backend, special)
        # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise.
        add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", kind == "llama"))
        add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
        backend.post_processor = _bos_eos_processor(backend, special, add_bos, add_eos)
        # End of turn / end of message end a generation too (llama.cpp stops on them).
        turn_keys = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        extra_eos = [metadata[k] for k in turn_keys if isinstance(metadata.get(k), int)]
        return cls(
            backend,
            special_tokens=special,
            add_bos_token=add_bos,
            add_eos_token=add_eos,
            chat_template=metadata.get("tokenizer.chat_template"),
            eos_token_ids=extra_eos,
        )

    def with_eos_ids(self, eos_token_ids: Iterable[int]) -> Tokenizer:
        """This tokenizer with more end-of-sequence ids (e.g. generation_config's `eos_token_id`)."""
        other = copy.copy(self)
        other._eos_token_ids = tuple(dict.fromkeys([*self._eos_token_ids, *(int(i) for i in eos_token_ids)]))
        return other

    def to_hf_files(self) -> tuple[str, dict[str, Any]]:
        """(tokenizer.json text, tokenizer_config dict) that `from_hf_files` turns back into this tokenizer."""
        config: dict[str, Any] = dict(self._special_tokens)
        config["add_bos_token"] = self.add_bos_token
        config["add_eos_token"] = self.add_eos_token
        if self._chat_template is not None:
            config["chat_template"] = self._chat_template
        return self._backend.to_str(), config

    # ---- properties ---------------------------------------------------------------------

    @property
    def add_bos_token(self) -> bool:
        """Whether `encode` (with special tokens) starts a text with BOS."""
        return self._add_bos_token

    @property
    def add_eos_token(self) -> bool:
        """Whether `encode` (with special tokens) ends a text with EOS."""
        return self._add_eos_token

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self.token_to_id(self._special_tokens.get("bos_token", ""))

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end a generation: the tokenizer's EOS first, then any added ones."""
        return self._eos_token_ids

    @property
    def special_tokens(self) -> dict[str, str]:
        """bos_token, eos_token, unk_token, pad_token: those this tokenizer has."""
        return dict(self._special_tokens)

    @cached_property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of the special added tokens: the ones `skip_special_tokens` leaves out."""
        return frozenset(i for i, t in self._backend.get_added_tokens_decoder().items() if t.special)

    @property
    def has_chat_template(self) -> bool:
        return bool(self._chat_template)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token) if token else None

    # ---- encode / decode ----------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; BOS/EOS are added only when the tokenizer's config says so."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def detokenizer(self, skip_special_tokens: bool = False) -> StreamingDetokenizer:
        """A fresh streaming detokenizer for one generated sequence."""
        return StreamingDetokenizer(self, skip_special_tokens=skip_special_tokens)

    @cached_property
    def byte_fallback_ids(self) -> frozenset[int]:
        """Ids of <0xNN> byte tokens when the decoder joins them into characters, else empty."""
        decoder = self._backend.decoder
        if decoder is None or b"ByteFallback" not in decoder.__getstate__():
            return frozenset()
        ids = (self._backend.token_to_id(f"<0x{b:02X}>") for b in range(256))
        return frozenset(i for i in ids if i is not None)

    # ---- chat ---------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """The prompt text the model's chat template makes of `messages`.

        Messages are OpenAI/HF shaped dicts (system, user, assistant, tool; assistant
        `tool_calls`; content a string or a list of content parts). Keys whose value is None are
        dropped, as transformers does. For a template that only takes string content, the text
        parts of a list are joined with newlines; tool-call arguments given as a JSON string are
        parsed into a dict, which is what templates expect. `extra` goes to the template as
        variables (e.g. `enable_thinking=False`).
        """
        template = self._select_template(tools)
        compiled = _compile_template(template)
        wants_parts = _template_iterates_content(template)
        plain = [_prepare_message(m, wants_parts) for m in messages]
        variables = {**self._special_tokens, **_plain(extra)}
        try:
            return compiled.render(
                messages=plain,
                tools=_plain(list(tools)) if tools is not None else None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except ChatTemplateError:
            raise
        except Exception as exc:  # any failure inside a model's template is the template's
            raise ChatTemplateError(f"the chat template failed on this conversation: {exc}") from None

    def encode_chat(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **extra: Any,
    ) -> list[int]:
        """Prompt ids of a conversation: the rendered template, encoded.

        NOTE: special tokens written by the template are encoded as such; BOS is prepended only
        when the config adds BOS and the template did not already write it; EOS is never added.
        """
        text = self.apply_chat_template(messages, add_generation_prompt, tools, **extra)
        ids = self._backend.encode(text, add_special_tokens=False).ids
        bos = self.bos_token_id
        if self.add_bos_token and bos is not None and ids[:1] != [bos]:
            ids.insert(0, bos)
        return ids

    def _select_template(self, tools: Sequence[Mapping[str, Any]] | None) -> str:
        template = self._chat_template
        if isinstance(template, dict):
            name = "tool_use" if tools is not None and "tool_use" in template else "default"
            if name not in template:
                raise ChatTemplateError(f"the model has named chat templates {sorted(template)} but none is 'default'")
            template = template[name]
        if not template:
            raise ChatTemplateError("this model has no chat template; send a plain prompt instead of chat messages")
        return template


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
        self._backend = tokenizer._backend
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
        return self._backend.decode(self.token_ids[self._start :], skip_special_tokens=self._skip_special_tokens)

    def _send(self, text: str, end: int) -> str:
        if end <= self._num_sent:
            return ""
        delta = text[self._num_sent : end]
        self._num_sent = end
        return delta


# ---- HF files ---------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"{path}: not a readable JSON file ({exc})") from None


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config writes it: a string or an AddedToken dict."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value if isinstance(value, str) else None


def _config_template(config: Mapping[str, Any]) -> str | dict[str, str] | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        return {entry["name"]: entry["template"] for entry in template}
    return template


def _add_named_specials(backend: Backend, special: Mapping[str, str | None]) -> None:
    """bos/eos/unk/pad that are in the vocabulary are matched whole in text, as special tokens."""
    added = {t.content for t in backend.get_added_tokens_decoder().values()}
    missing = [t for t in special.values() if t and t not in added and backend.token_to_id(t) is not None]
    if missing:
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in dict.fromkeys(missing)])


def _bos_eos_processor(backend: Backend, special: Mapping[str, str | None], add_bos: bool, add_eos: bool):
    bos, eos = special.get("bos_token"), special.get("eos_token")
    add_bos = add_bos and bos is not None and backend.token_to_id(bos) is not None
    add_eos = add_eos and eos is not None and backend.token_to_id(eos) is not None
    single = ([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else [])
    pair = single + ([f"{bos}:1"] if add_bos else []) + ["$B:1"] + ([f"{eos}:1"] if add_eos else [])
    used = ([bos] if add_bos else []) + ([eos] if add_eos else [])
    return processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[(t, backend.token_to_id(t)) for t in dict.fromkeys(used)]
    )


def _processor_adds(backend: Backend, special: Mapping[str, str | None]) -> tuple[bool, bool]:
    """Whether tokenizer.json's own post-processor adds BOS / EOS to a single text."""
    with_specials = backend.encode("", add_special_tokens=True).ids
    bos, eos = (backend.token_to_id(special.get(k) or "") for k in ("bos_token", "eos_token"))
    return (bos is not None and with_specials[:1] == [bos], eos is not None and with_specials[-1:] == [eos])


# ---- GGUF -------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map that byte-level vocabularies are spelled in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return mapping


def _byte_level_backend(metadata: Mapping[str, Any]) -> tuple[Backend, dict[str, int]]:
    tokens = metadata["tokenizer.ggml.tokens"]
    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    # A token spelled outside the byte alphabet (a stray added token) is respelled as its bytes.
    vocab = {
        t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i for i, t in enumerate(tokens)
    }
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges") or []]
    backend = Backend(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = _byte_level_split(metadata.get("tokenizer.ggml.pre") or "default")
    backend.decoder = decoders.ByteLevel()
    return backend, vocab


def _byte_level_split(pre: str) -> pre_tokenizers.PreTokenizer:
    family = _SPLITS.get(pre)
    if family is None:
        raise TokenizerError(
            f"GGUF pre-tokenizer {pre!r} is not supported (supported: {', '.join(sorted(_SPLITS))}); "
            "convert the model from its HF folder instead"
        )
    if family == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if family == "digits-gpt2":
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    pattern = {"llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}[family]
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _sentencepiece_backend(metadata: Mapping[str, Any]) -> tuple[Backend, dict[str, int]]:
    """SentencePiece vocabulary as a byte-fallback BPE, the way transformers builds it.

    NOTE: a file with `tokenizer.ggml.add_space_prefix = false` gets no leading "▁" (as in
    llama.cpp); transformers ignores that flag.
    """
    arch = metadata.get("general.architecture")
    if arch in ("gemma", "gemma2", "gemma3", "phi3"):
        raise TokenizerError(f"GGUF SentencePiece tokenizers of {arch!r} models are not supported yet")
    tokens = metadata["tokenizer.ggml.tokens"]
    vocab = {t: i for i, t in enumerate(tokens)}
    if metadata.get("tokenizer.ggml.merges"):
        merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
    else:
        scores = metadata.get("tokenizer.ggml.scores")
        if not scores or len(scores) != len(tokens):
            raise TokenizerError("the GGUF SentencePiece vocabulary has neither merges nor one score per token")
        merges = _merges_from_scores(tokens, scores, vocab)
    backend = Backend(models.BPE(vocab, merges, fuse_unk=True, byte_fallback=True))
    prefix = metadata.get("tokenizer.ggml.add_space_prefix", True)
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(steps)
    return backend, vocab


def _merges_from_scores(
    tokens: Sequence[str], scores: Sequence[float], vocab: Mapping[str, int]
) -> list[tuple[str, str]]:
    """BPE merges implied by a scored vocabulary: every split of a token into two tokens.

    Ranked by the merged token's score (highest first), then longer left and right pieces
    first; ties keep vocabulary order. This is the order transformers derives.
    """
    candidates = []
    for token, score in dict(zip(tokens, scores)).items():
        splits = [(token[:k], token[k:]) for k in range(1, len(token)) if token[:k] in vocab and token[k:] in vocab]
        splits.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        candidates.extend((left, right, score) for left, right in splits)
    candidates.sort(key=lambda c: (c[2], len(c[0]), len(c[1])), reverse=True)
    return [(left, right) for left, right, _ in candidates]


def _add_gguf_tokens(backend: Backend, metadata: Mapping[str, Any], vocab: Mapping[str, int], byte_level: bool) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens.

    In a byte-level vocabulary a control token spelled outside the byte alphabet is a
    mislabel by the converter and is left alone (adding it would grow the vocabulary).
    """
    tokens = metadata["tokenizer.ggml.tokens"]
    types = metadata.get("tokenizer.ggml.token_type") or []
    alphabet = set(_byte_alphabet().values()) if byte_level else None
    control = [
        AddedToken(t, special=True, normalized=False)
        for t, kind in zip(tokens, types)
        if kind == _CONTROL and (alphabet is None or set(t) <= alphabet)
    ]
    if control:
        backend.add_special_tokens(control)
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, kind in zip(tokens, types)
        if kind == _USER_DEFINED and t in vocab
    ]
    if user:
        backend.add_tokens(user)


# ---- chat templates ---------------------------------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (marks assistant text for training masks): renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"the chat template refused this conversation: {message}")


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # jinja's own tojson escapes HTML characters; HF templates expect plain json.dumps.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@lru_cache(maxsize=16)
def _compile_template(template: str) -> jinja2.Template:
    try:
        return _environment().from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        where = f"line {exc.lineno}: {exc.message}"
        raise ChatTemplateError(f"the model's chat template is not valid Jinja ({where})") from None


@lru_cache(maxsize=16)
def _template_iterates_content(template: str) -> bool:
    """Whether the template loops over a message's content, directly or through a variable.

    Such a template takes OpenAI content parts; any other gets their text joined. (A type test
    like `content is string` alone does not count: some templates render '' for other types.)
    """
    try:
        tree = _environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return False

    def is_content(node: jinja2.nodes.Node) -> bool:
        if isinstance(node, jinja2.nodes.Getattr):
            return node.attr == "content"
        if isinstance(node, jinja2.nodes.Getitem):
            return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "content"
        return False

    aliases = {
        assign.target.name
        for assign in tree.find_all(jinja2.nodes.Assign)
        if isinstance(assign.target, jinja2.nodes.Name) and is_content(assign.node)
    }
    return any(
        is_content(loop.iter) or (isinstance(loop.iter, jinja2.nodes.Name) and loop.iter.name in aliases)
        for loop in tree.find_all(jinja2.nodes.For)
    )


def _prepare_message(message: Message, wants_parts: bool) -> dict[str, Any]:
    """A plain-dict copy of a message, shaped the way HF chat templates read messages."""
    if not isinstance(message, Mapping):
        kind = type(message).__name__
        raise ChatTemplateError(f"a chat message must be a dict with 'role' and 'content', not {kind}")
    plain = {k: _plain(v) for k, v in message.items() if v is not None}
    content = plain.get("content")
    if isinstance(content, list) and not wants_parts:
        texts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        plain["content"] = "\n".join(texts)
    reasoning = next((plain[k] for k in _REASONING_FIELDS if k in plain), None)
    if reasoning is not None:
        plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
    for call in plain.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except ValueError:
                pass  # not JSON: the template gets the string as it came
    return plain


def _plain(value: Any) -> Any:
    """JSON-shaped copy: templates see only dicts, lists and scalars."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if hasattr(value, "model_dump"):
        return _plain(value.model_dump())
    return str(value)
