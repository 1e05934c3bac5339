"""`Tokenizer`: text <-> token ids for one model, with its chat template and end-of-sequence ids.

A `Tokenizer` wraps a `tokenizers.Tokenizer` (the Rust library behind HF's fast tokenizers)
built from an HF folder (tokenizer.json + tokenizer_config.json) or from a GGUF file's
tokenizer metadata (see `gguf_vocab.py`). Encoding and decoding follow what transformers does
with the same files. Chat templates are rendered by `chat_template.py`, streamed text by
`detokenizer.py`; a request's own text inside a chat prompt is encoded as plain text even where
it spells a control token (`plain_text.py`).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as Backend

from baselm.store import hf
from baselm.tokenizer.chat_template import Message, render_chat_template, select_template
from baselm.tokenizer.detokenizer import StreamingDetokenizer
from baselm.tokenizer.errors import TokenizerError
from baselm.tokenizer.gguf_vocab import gguf_backend, gguf_end_of_turn_ids, gguf_special_tokens
from baselm.tokenizer.plain_text import ControlText, RenderedChat

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
# `tokenizer.ggml.model` -> whether llama.cpp adds (BOS, EOS) when the file does not say.
_GGUF_ADDS = {"llama": (True, False), "bert": (True, True)}


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
        files = hf.read_tokenizer_files(path)
        generation = path / "generation_config.json"
        eos = hf.read_json(generation).get("eos_token_id") if generation.is_file() else None
        eos_ids = [i for i in (eos if isinstance(eos, list) else [eos]) if isinstance(i, int)]
        return cls.from_hf_files(
            files["tokenizer.json"], files["tokenizer_config.json"], files["chat_template"], eos_token_ids=eos_ids
        )

    @classmethod
    def from_hf_files(
        cls,
        tokenizer_json: str,
        tokenizer_config: Mapping[str, Any],
        chat_template: str | list[dict[str, str]] | None = None,
        eos_token_ids: Iterable[int] = (),
    ) -> Tokenizer:
        """A tokenizer from the text of tokenizer.json and the parsed tokenizer_config.json.

        `chat_template`, when given, wins over the config's own; either may be a list of named
        templates (`[{"name": ..., "template": ...}]`).
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
        template = _named_templates(
            chat_template if chat_template is not None else tokenizer_config.get("chat_template")
        )
        return cls(
            backend,
            special_tokens=special,
            add_bos_token=add_bos,
            add_eos_token=add_eos,
            chat_template=template,
            eos_token_ids=eos_token_ids,
        )

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any], cache: Path | None = None) -> Tokenizer:
        """The tokenizer a GGUF file describes, from its metadata (`store.gguf.read_metadata(path)[1]`).

        Supports `tokenizer.ggml.model` 'gpt2' (byte-level BPE; `tokenizer.ggml.pre` picks the
        split), 'llama' (SentencePiece BPE with byte fallback; merges from the file or derived
        from the token scores), 'gemma4' and 'bert' (WordPiece); another model or pre-tokenizer
        is a TokenizerError naming it. Control tokens become special tokens, user-defined ones
        added tokens. `cache`: a folder where a vocabulary whose merges are derived (Gemma's) is kept
        once built (`vocab_cache.py`; the loader passes base's).
        """
        backend = gguf_backend(metadata, cache)
        special = gguf_special_tokens(metadata)
        _add_named_specials(backend, special)
        # Unless the file says otherwise, llama.cpp adds BOS to a SentencePiece vocabulary and
        # frames a WordPiece one with CLS ... SEP.
        default_bos, default_eos = _GGUF_ADDS.get(metadata.get("tokenizer.ggml.model"), (False, False))
        add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", default_bos))
        add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", default_eos))
        backend.post_processor = _bos_eos_processor(backend, special, add_bos, add_eos)
        extra_eos = gguf_end_of_turn_ids(metadata)
        return cls(
            backend,
            special_tokens=special,
            add_bos_token=add_bos,
            add_eos_token=add_eos,
            chat_template=_gguf_templates(metadata),
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

    @property
    def chat_template(self) -> str | dict[str, str] | None:
        """The chat template (or named templates) as the model ships it."""
        return self._chat_template

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token) if token else None

    # ---- encode / decode ----------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; BOS/EOS are added only when the tokenizer's config says so.

        NOTE: through `encode_batch`, the same ids: `tokenizers` releases the GIL there and not in
        `encode`, whose megabyte of text held the server's event loop for a second from a worker thread.
        """
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_pair(self, first: str, second: str) -> list[int]:
        """Token ids of a pair of texts, framed by the special tokens the tokenizer puts around a pair
        (its post-processor's pair template), as transformers' `tokenizer(first, second)` gives them."""
        return self._backend.encode_batch([(first, second)], add_special_tokens=True)[0].ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of `token_ids` (through `decode_batch`, which releases the GIL, as `encode` does)."""
        return self._backend.decode_batch([list(token_ids)], skip_special_tokens=skip_special_tokens)[0]

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
        continue_final_message: bool = False,
        **extra: Any,
    ) -> str:
        """The prompt text the model's chat template makes of `messages`.

        Messages are OpenAI/HF shaped dicts (system, user, assistant, tool; assistant
        `tool_calls`; content a string, a list of content parts, or None beside tool calls); see
        `render_chat_template` for how they reach the template. `continue_final_message` ends
        the text inside the last message, for the model to continue. `extra` goes to the
        template as variables (e.g. `enable_thinking=False`).
        """
        return self.render_chat(messages, add_generation_prompt, tools, continue_final_message, **extra).text

    def render_chat(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        continue_final_message: bool = False,
        **extra: Any,
    ) -> RenderedChat:
        """`apply_chat_template`'s text, with the spans where the messages, tools or `extra` spell
        special tokens (which `encode_rendered` encodes as plain text; see plain_text.py)."""
        control = self._control_text
        text = render_chat_template(
            select_template(self._chat_template, tools),
            control.mark(list(messages)),
            add_generation_prompt=add_generation_prompt,
            tools=control.mark(list(tools)) if tools is not None else None,
            variables={**self._special_tokens, **control.mark(extra)},
            continue_final_message=continue_final_message,
        )
        return control.unmark(text)

    def encode_chat(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        continue_final_message: bool = False,
        **extra: Any,
    ) -> list[int]:
        """Prompt ids of a conversation: the rendered template, encoded.

        NOTE: special tokens written by the template are encoded as such, and those the messages,
        tools or `extra` spell as ordinary text; BOS is prepended only when the config adds BOS and
        the template did not already write it; EOS is never added.
        """
        rendered = self.render_chat(messages, add_generation_prompt, tools, continue_final_message, **extra)
        return self.encode_prompt(rendered)

    def encode_prompt(self, rendered: RenderedChat) -> list[int]:
        """Prompt ids of a rendered chat (`render_chat`, perhaps rewritten: images placed in it):
        `encode_rendered`, with BOS prepended as `encode_chat` says."""
        ids = self.encode_rendered(rendered)
        bos = self.bos_token_id
        if self.add_bos_token and bos is not None and ids[:1] != [bos]:
            ids.insert(0, bos)
        return ids

    def encode_rendered(self, rendered: RenderedChat, start: int = 0) -> list[int]:
        """Ids of `rendered.text[start:]` (no BOS or EOS added): the special tokens in it are control
        tokens, except in `plain_spans`, which are encoded as ordinary text.

        Where there is such a span, the stretch between the two control tokens around it is encoded
        again with special tokens off; the rest keeps the ids of the whole text, so a prompt without
        one has exactly the ids of `encode(text, add_special_tokens=False)`.
        """
        text = rendered.text[start:]
        spans = [(a - start, b - start) for a, b in rendered.plain_spans if a >= start]
        encoding = self._backend.encode_batch([text], add_special_tokens=False)[0]  # releases the GIL (see encode)
        if not spans:
            return encoding.ids
        ids: list[int] = []
        first, begin = 0, 0  # the stretch since the last control token: its first token and character
        for i, (token_id, (a, b)) in enumerate(zip(encoding.ids, encoding.offsets)):
            if token_id in self.special_token_ids and not _overlaps(spans, a, b):
                ids += self._stretch_ids(text, encoding.ids[first:i], begin, a, spans)
                ids.append(token_id)
                first, begin = i + 1, b
        return ids + self._stretch_ids(text, encoding.ids[first:], begin, len(text), spans)

    def _stretch_ids(self, text: str, ids: list[int], begin: int, end: int, spans: list[tuple[int, int]]) -> list[int]:
        """The ids of `text[begin:end]`, which lies between control tokens: `ids` as the whole text had
        them, or, where a plain span falls in it, the stretch encoded with special tokens off.

        NOTE: a stretch after the text's start is encoded as it is in context: not as a text's first
        piece, which some pre-tokenizers treat apart (Metaspace prepends its "▁" there only)."""
        if not _overlaps(spans, begin, end):
            return ids
        backend = self._plain_backends[0 if begin == 0 else 1]
        return backend.encode(text[begin:end], add_special_tokens=False).ids

    @cached_property
    def _control_text(self) -> ControlText:
        decoder = self._backend.get_added_tokens_decoder()
        return ControlText(t.content for t in decoder.values() if t.special)

    @cached_property
    def _plain_backends(self) -> tuple[Backend, Backend]:
        """This vocabulary with special tokens read as text: for a text's first piece, and for later ones."""
        config = json.loads(self._backend.to_str())
        first, later = Backend.from_str(json.dumps(config)), Backend.from_str(json.dumps(_prepend_never(config)))
        first.encode_special_tokens = later.encode_special_tokens = True
        return first, later


def _overlaps(spans: list[tuple[int, int]], begin: int, end: int) -> bool:
    return any(a < end and begin < b for a, b in spans)


def _prepend_never(config: dict[str, Any]) -> dict[str, Any]:
    """tokenizer.json's config with each Metaspace pre-tokenizer that prepends "▁" to a text's first
    piece only (`prepend_scheme: first`) prepending it nowhere: what it does to every later piece."""

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            node = {k: walk(v) for k, v in node.items()}
            if node.get("type") == "Metaspace" and node.get("prepend_scheme") == "first":
                node["prepend_scheme"] = "never"
            return node
        return [walk(v) for v in node] if isinstance(node, list) else node

    return {**config, "pre_tokenizer": walk(config.get("pre_tokenizer"))}


# ---- HF files ---------------------------------------------------------------------------


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config writes it: a string or an AddedToken dict."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value if isinstance(value, str) else None


def _named_templates(template: Any) -> str | dict[str, str] | None:
    """A chat template as given, with a list of named templates made a name -> template dict."""
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        return {entry["name"]: entry["template"] for entry in template}
    return template


def _gguf_templates(metadata: Mapping[str, Any]) -> str | dict[str, str] | None:
    """A GGUF's chat template, or its named ones (`tokenizer.chat_templates` lists the names)."""
    default = metadata.get("tokenizer.chat_template")
    names = metadata.get("tokenizer.chat_templates") or []
    named = {n: metadata[f"tokenizer.chat_template.{n}"] for n in names if f"tokenizer.chat_template.{n}" in metadata}
    if not named:
        return default
    return {**({"default": default} if default else {}), **named}


def _add_named_specials(backend: Backend, special: Mapping[str, str | None]) -> None:
    """bos/eos/unk/pad that are in the vocabulary are matched whole in text, as special tokens."""
    added = {t.content for t in backend.get_added_tokens_decoder().values()}
    missing = [t for t in special.values() if t and t not in added and backend.token_to_id(t) is not None]
    if missing:
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in dict.fromkeys(missing)])


def _bos_eos_processor(
    backend: Backend, special: Mapping[str, str | None], add_bos: bool, add_eos: bool
) -> processors.PostProcessor:
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
