"""`base chat`: a terminal REPL over the engine.

The REPL talks to an `AsyncEngine` like any server would: each turn is one request whose
prompt is the whole conversation. The prompt of turn N+1 starts with the token ids of
turn N (its prompt and the answer the model generated), so the engine's prefix cache
finds the conversation's blocks and only the new message is prefilled: the time to
the first token does not grow with the length of the conversation (see `Conversation`).

With `--serve`, the same engine also serves the HTTP API from a background thread, so
REPL turns and HTTP requests are batched together.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from baselm.sampling import SamplingParams, SamplingParamsError
from baselm.scheduler import SchedulerStats
from baselm.tokenizer.tokenizer import Tokenizer

if TYPE_CHECKING:
    from rich.console import Console

    from baselm.engine import AsyncEngine

PROMPT = ">>> "
CONTINUATION = "... "
HISTORY_FILE = "chat_history"
SAVE_FORMAT = "base-chat"
SAVE_VERSION = 1

HELP = """\
Type a message and press Enter. Commands:
  /help                   this help
  /clear                  forget the conversation (the system prompt stays)
  /system [TEXT]          set the system prompt (without TEXT: show it)
  /set NAME VALUE         temperature, top_p, max_tokens (or none) or seed (or none)
  /save FILE, /load FILE  the conversation and settings as JSON
  /stats                  the last turn's and the session's numbers
  /quit                   leave (or Ctrl-D)
Multi-line input: end a line with \\ to continue it on the next, or put the text between
two lines of three quotes (\"\"\"). Ctrl-C stops an answer (what came so far stays in the
conversation); at the prompt it clears the line. Arrow keys browse the input history, kept
in $BASE_HOME/chat_history (default ~/.cache/base/chat_history)."""

COMMAND_HINT = "commands: /help /clear /system /set /save /load /stats /quit"


class ChatCommandError(ValueError):
    """A command with a bad argument; the message says what is wrong."""


# ---- settings ------------------------------------------------------------------------------


@dataclass(slots=True)
class ChatSettings:
    """The sampling settings a user can change with /set; every turn's SamplingParams come from these."""

    temperature: float = 0.7
    top_p: float = 0.9
    max_tokens: int | None = None  # None: until the model stops or the context is full
    seed: int | None = None

    def __post_init__(self) -> None:
        self.sampling_params()  # raises SamplingParamsError on a bad value

    def sampling_params(self, max_tokens: int | None = None) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            max_tokens=max_tokens if max_tokens is not None else self.max_tokens,
            seed=self.seed,
        )

    def with_value(self, name: str, text: str) -> ChatSettings:
        """These settings with `name` read from `text`; raises ChatCommandError saying what is wrong."""
        names = [f.name for f in fields(self)]
        if name not in names:
            raise ChatCommandError(f"/set knows {', '.join(names)}; got {name!r}")
        value = _parse_setting(name, text)
        try:
            return replace(self, **{name: value})
        except SamplingParamsError as exc:
            raise ChatCommandError(str(exc)) from None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ChatSettings:
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ChatCommandError(f"unknown settings {sorted(unknown)}")
        try:
            return cls(**data)
        except (SamplingParamsError, TypeError) as exc:
            raise ChatCommandError(f"bad settings: {exc}") from None


def _parse_setting(name: str, text: str) -> float | int | None:
    text = text.strip()
    if name in ("max_tokens", "seed") and text.lower() in ("none", "off"):
        return None
    kind = float if name in ("temperature", "top_p") else int
    try:
        return kind(text)
    except ValueError:
        wanted = "a number" if kind is float else "a whole number (or none)"
        raise ChatCommandError(f"{name} takes {wanted}, got {text!r}") from None


# ---- the conversation ----------------------------------------------------------------------


@dataclass(slots=True)
class Prompt:
    """One turn's prompt: the rendered text, its token ids, and how many ids came from the last turn."""

    text: str
    token_ids: list[int]
    num_reused_ids: int = 0


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

    def __init__(self, tokenizer: Tokenizer, system: str | None = None):
        self.tokenizer = tokenizer
        self.system = system
        self.turns: list[dict[str, str]] = []  # user and assistant messages, alternating
        self._known: list[tuple[str, list[int]]] = []  # (text, ids) the next render may extend

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
        self.system, self.turns, self._known = system, turns, []

    def next_prompt(self, user_text: str) -> Prompt:
        """The prompt for the next turn, with `user_text` as the new message (nothing is recorded yet)."""
        messages = self.messages + [{"role": "user", "content": user_text}]
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        for known_text, known_ids in self._known:
            if known_ids and text.startswith(known_text):
                tail = self.tokenizer.encode(text[len(known_text) :], add_special_tokens=False)
                return Prompt(text, known_ids + tail, len(known_ids))
        return Prompt(text, self.tokenizer.encode_chat(messages, add_generation_prompt=True))

    def add_turn(self, prompt: Prompt, user_text: str, answer: str, answer_ids: Sequence[int]) -> None:
        """Records a finished (or stopped) turn: `answer` is the text shown, `answer_ids` the ids
        generated for it, without a final end-of-sequence id."""
        self.turns += [{"role": "user", "content": user_text}, {"role": "assistant", "content": answer}]
        self._known = [(prompt.text, list(prompt.token_ids))]
        if answer_ids and self.tokenizer.decode(list(answer_ids)) == answer:
            self._known.insert(0, (prompt.text + answer, list(prompt.token_ids) + list(answer_ids)))


# ---- numbers -------------------------------------------------------------------------------


@dataclass(slots=True)
class TurnStats:
    """One answer's numbers, as the engine reported them."""

    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    ttft_s: float = 0.0
    total_s: float = 0.0
    finish_reason: str | None = None

    @property
    def prefill_tokens_per_s(self) -> float:
        computed = self.num_prompt_tokens - self.num_cached_tokens
        return computed / self.ttft_s if self.ttft_s > 0 else 0.0

    @property
    def decode_s(self) -> float:
        return max(self.total_s - self.ttft_s, 0.0)

    @property
    def decode_tokens_per_s(self) -> float:
        n = self.num_output_tokens - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0


@dataclass(slots=True)
class SessionStats:
    turns: list[TurnStats] = field(default_factory=list)

    @property
    def last(self) -> TurnStats | None:
        return self.turns[-1] if self.turns else None

    def total(self, name: str) -> float:
        return sum(getattr(t, name) for t in self.turns)

    @property
    def decode_tokens_per_s(self) -> float:
        n = sum(max(t.num_output_tokens - 1, 0) for t in self.turns)
        s = self.total("decode_s")
        return n / s if s > 0 else 0.0


def turn_line(stats: TurnStats, max_model_len: int) -> str:
    """The dimmed line after each answer: speeds and context use."""
    used = stats.num_prompt_tokens + stats.num_output_tokens
    parts = [
        f"prefill {stats.num_prompt_tokens} tokens ({stats.num_cached_tokens} cached) "
        f"{stats.prefill_tokens_per_s:.0f} tok/s",
        f"TTFT {stats.ttft_s * 1000:.0f} ms",
        f"decode {stats.num_output_tokens} tokens {stats.decode_tokens_per_s:.1f} tok/s",
        f"context {used}/{max_model_len}",
    ]
    if stats.finish_reason == "abort":
        parts.append("stopped")
    elif stats.finish_reason == "length":
        parts.append("cut at max_tokens")
    return " · ".join(parts)


def stats_report(session: SessionStats, kv: SchedulerStats | None, max_model_len: int) -> str:
    """What /stats prints: the last turn, the session's totals and the KV cache's use."""
    lines = []
    last = session.last
    if last is None:
        lines.append("last turn: none yet")
    else:
        lines += [
            f"last turn: {last.num_prompt_tokens} prompt tokens, {last.num_cached_tokens} cached, "
            f"{last.num_output_tokens} generated ({last.finish_reason})",
            f"  TTFT {last.ttft_s * 1000:.0f} ms, prefill {last.prefill_tokens_per_s:.0f} tok/s, "
            f"decode {last.decode_tokens_per_s:.1f} tok/s, "
            f"context {last.num_prompt_tokens + last.num_output_tokens}/{max_model_len}",
        ]
    n = len(session.turns)
    mean_ttft = session.total("ttft_s") / n * 1000 if n else 0.0
    lines.append(
        f"session: {n} turns, {session.total('num_prompt_tokens'):.0f} prompt tokens "
        f"({session.total('num_cached_tokens'):.0f} cached), {session.total('num_output_tokens'):.0f} generated, "
        f"mean TTFT {mean_ttft:.0f} ms, decode {session.decode_tokens_per_s:.1f} tok/s"
    )
    if kv is not None:
        lines.append(
            f"KV cache: {kv.num_used_blocks}/{kv.num_used_blocks + kv.num_free_blocks} blocks in use "
            f"({kv.kv_usage:.1%}), prefix cache hit rate {kv.prefix_cache_hit_rate:.1%}"
        )
    return "\n".join(lines)


# ---- saving --------------------------------------------------------------------------------


def save_chat(path: Path, conversation: Conversation, settings: ChatSettings, model_name: str) -> None:
    data = {
        "format": SAVE_FORMAT,
        "version": SAVE_VERSION,
        "model": model_name,
        "settings": asdict(settings),
        "messages": conversation.messages,
    }
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


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
    return settings


# ---- input ---------------------------------------------------------------------------------


def join_continued(first: str, read_more: Callable[[], str]) -> str:
    """One message from input lines: a trailing backslash continues a line; \"\"\" opens a block
    that runs to the line ending in \"\"\"."""
    if first.strip().startswith('"""'):
        body = first.strip()[3:]
        if body.endswith('"""'):
            return body[:-3]
        lines = [body] if body else []
        while True:
            line = read_more()
            if line.rstrip().endswith('"""'):
                lines.append(line.rstrip()[:-3])
                return "\n".join(lines).strip("\n")
            lines.append(line)
    lines = []
    line = first
    while line.endswith("\\"):
        lines.append(line[:-1])
        line = read_more()
    lines.append(line)
    return "\n".join(lines)


class LineReader:
    """Reads lines with readline (arrow keys, history kept under BASE_HOME) when it is available."""

    def __init__(self, history_path: Path | None, interactive: bool):
        self.interactive = interactive
        self.history_path = history_path
        self._readline = None
        if interactive and history_path is not None:
            self._readline = _setup_readline(history_path)

    def read(self, prompt: str) -> str:
        """One line; raises EOFError at end of input and KeyboardInterrupt on Ctrl-C."""
        return input(prompt if self.interactive else "")

    def remember(self) -> None:
        if self._readline is None:
            return
        with contextlib.suppress(OSError):
            self._readline.write_history_file(str(self.history_path))


def _setup_readline(path: Path):
    try:
        import readline
    except ImportError:  # e.g. Windows without pyreadline: plain input() still works
        return None
    readline.set_history_length(2000)
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_file():
            readline.read_history_file(str(path))
    return readline


# ---- output --------------------------------------------------------------------------------


class _LiveAnswer:
    """What the terminal shows while an answer streams: the last screenful of its markdown and a footer."""

    def __init__(self) -> None:
        self.text = ""
        self.num_tokens = 0

    def __rich_console__(self, console, options):
        from rich.markdown import Markdown
        from rich.segment import Segment
        from rich.text import Text

        room = max(console.height - 3, 1)
        lines = console.render_lines(Markdown(self.text), options.update(height=None), pad=False)
        for line in lines[-room:]:
            yield from line
            yield Segment.line()
        yield Text(f"{self.num_tokens} tokens · Ctrl-C stops", style="dim")


class AnswerView:
    """Shows an answer as it streams: markdown in a terminal, plain text otherwise."""

    def __init__(self, console: Console, rich_output: bool):
        self.console = console
        self.rich_output = rich_output
        self._live = None
        self._answer = _LiveAnswer()

    def __enter__(self) -> AnswerView:
        if self.rich_output:
            from rich.live import Live

            self._live = Live(self._answer, console=self.console, transient=True, refresh_per_second=8)
            self._live.__enter__()
        return self

    def add(self, text: str, num_tokens: int) -> None:
        self._answer.text += text
        self._answer.num_tokens += num_tokens
        if not self.rich_output and text:
            sys.stdout.write(text)
            sys.stdout.flush()

    def __exit__(self, *exc) -> None:
        if self._live is None:
            sys.stdout.write("\n")
            sys.stdout.flush()
            return
        self._live.__exit__(None, None, None)
        if self._answer.text.strip():
            from rich.markdown import Markdown

            self.console.print(Markdown(self._answer.text))


# ---- the REPL ------------------------------------------------------------------------------


@dataclass(slots=True)
class _Answer:
    """A turn's answer as it arrives; kept outside the coroutine so a stopped turn keeps what came."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    stats: TurnStats = field(default_factory=TurnStats)


class ChatREPL:
    """Reads messages and commands, streams answers from a shared AsyncEngine."""

    def __init__(
        self,
        client: AsyncEngine,
        model_name: str,
        settings: ChatSettings,
        system: str | None = None,
        history_path: Path | None = None,
    ):
        from rich.console import Console

        self.client = client
        self.engine = client.engine
        self.model_name = model_name
        self.settings = settings
        self.conversation = Conversation(self.engine.tokenizer, system)
        self.session = SessionStats()
        self.rich_output = sys.stdout.isatty()
        self.console = Console(highlight=False)
        # Notes and numbers go to stderr when stdout is not a terminal, so stdout holds only answers.
        self.notes = self.console if self.rich_output else Console(stderr=True, highlight=False)
        self.reader = LineReader(history_path, interactive=sys.stdin.isatty())
        self._eos_ids = frozenset(self.engine.eos_token_ids)
        self._num_requests = 0

    def run(self) -> None:
        """The loop: until /quit or end of input."""
        self.note(f"base chat · {self.model_name} · context {self.engine.max_model_len} tokens · /help for help")
        with asyncio.Runner() as runner:
            while True:
                try:
                    line = self._read_message()
                except KeyboardInterrupt:  # Ctrl-C at the prompt: drop the line, ask again
                    self.console.print()
                    continue
                except EOFError:
                    if self.reader.interactive:
                        self.console.print()
                    return
                if not line.strip():
                    continue
                if line.startswith("/"):
                    if not self.command(line):
                        return
                    continue
                self._turn(runner, line)

    def note(self, text: str, style: str = "dim") -> None:
        self.notes.print(text, style=style, markup=False, soft_wrap=True)

    def _read_message(self) -> str:
        first = self.reader.read(PROMPT)
        message = join_continued(first, lambda: self.reader.read(CONTINUATION))
        self.reader.remember()
        return message

    # ---- turns ---------------------------------------------------------------------------

    def _turn(self, runner: asyncio.Runner, user_text: str) -> None:
        from baselm.engine import QueueFullError
        from baselm.scheduler import RequestTooLongError

        prompt = self.conversation.next_prompt(user_text)
        answer = _Answer()
        self._num_requests += 1
        request_id = f"repl-{self._num_requests}"
        try:
            params = self._params_for(prompt)
            runner.run(self._stream(request_id, prompt, params, answer))
        except KeyboardInterrupt:
            # Also covers a Ctrl-C that lands while the request is being queued, before its stream exists.
            self.client.abort(request_id)
            answer.stats.finish_reason = "abort"
        except (RequestTooLongError, QueueFullError, SamplingParamsError) as exc:
            self.note(f"error: {exc}", style="red")
            return
        except Exception as exc:  # the engine failed this request; the chat itself can go on
            self.note(f"error: the engine failed on this turn ({type(exc).__name__}: {exc})", style="red")
            return
        self._record(prompt, user_text, answer)

    def _params_for(self, prompt: Prompt) -> SamplingParams:
        """This turn's sampling; max_tokens is capped to what the context and the KV cache still hold."""
        from baselm.scheduler import RequestTooLongError

        kv_tokens = self.engine.kv_manager.num_blocks * self.engine.kv_manager.block_size
        capacity = min(self.engine.max_model_len, kv_tokens)
        room = capacity - len(prompt.token_ids)
        if room < 1:
            raise RequestTooLongError(
                f"the conversation is {len(prompt.token_ids)} tokens and the context holds {capacity}; "
                "/clear to start over"
            )
        return self.settings.sampling_params(max_tokens=min(self.settings.max_tokens or room, room))

    async def _stream(self, request_id: str, prompt: Prompt, params: SamplingParams, answer: _Answer) -> None:
        stats = answer.stats
        stats.num_prompt_tokens = len(prompt.token_ids)
        with AnswerView(self.console, self.rich_output) as view:
            start = time.perf_counter()
            outputs = await self.client.submit(prompt.token_ids, params, request_id)
            try:
                async with contextlib.aclosing(outputs):  # leaving early aborts the request
                    async for out in outputs:
                        if out.token_ids and not answer.token_ids:
                            stats.ttft_s = time.perf_counter() - start
                        answer.text += out.text
                        answer.token_ids += out.token_ids
                        stats.num_cached_tokens = out.num_cached_tokens
                        stats.finish_reason = out.finish_reason
                        view.add(out.text, len(out.token_ids))
            finally:
                stats.total_s = time.perf_counter() - start
                stats.num_output_tokens = len(answer.token_ids)

    def _record(self, prompt: Prompt, user_text: str, answer: _Answer) -> None:
        ids = answer.token_ids
        if answer.stats.finish_reason == "stop" and ids and ids[-1] in self._eos_ids:
            ids = ids[:-1]  # the template writes the end of turn itself
        self.conversation.add_turn(prompt, user_text, answer.text, ids)
        self.session.turns.append(answer.stats)
        self.note(turn_line(answer.stats, self.engine.max_model_len))

    # ---- commands ------------------------------------------------------------------------

    def command(self, line: str) -> bool:
        """Runs one /command; returns False to leave."""
        name, _, arg = line.strip().partition(" ")
        arg = arg.strip()
        handler = self._commands().get(name)
        if handler is None:
            self.note(f"unknown command {name}; {COMMAND_HINT}", style="yellow")
            return True
        try:
            return handler(arg) is not False
        except ChatCommandError as exc:
            self.note(f"error: {exc}", style="red")
            return True

    def _commands(self) -> dict[str, Callable[[str], bool | None]]:
        return {
            "/help": lambda arg: self.console.print(HELP, markup=False, highlight=False),
            "/clear": self._clear,
            "/system": self._system,
            "/set": self._set,
            "/save": self._save,
            "/load": self._load,
            "/stats": self._stats,
            "/quit": lambda arg: False,
            "/exit": lambda arg: False,
        }

    def _clear(self, arg: str) -> None:
        self.conversation.clear()
        self.note("conversation cleared")

    def _system(self, arg: str) -> None:
        if not arg:
            self.note(f"system prompt: {self.conversation.system!r}")
            return
        self.conversation.set_system(arg)
        self.note("system prompt set")

    def _set(self, arg: str) -> None:
        name, _, value = arg.partition(" ")
        if not value.strip():
            raise ChatCommandError(
                f"usage: /set temperature|top_p|max_tokens|seed VALUE (now: {_settings_text(self.settings)})"
            )
        self.settings = self.settings.with_value(name, value)
        self.note(_settings_text(self.settings))

    def _save(self, arg: str) -> None:
        if not arg:
            raise ChatCommandError("usage: /save FILE")
        path = Path(arg).expanduser()
        try:
            save_chat(path, self.conversation, self.settings, self.model_name)
        except OSError as exc:
            raise ChatCommandError(f"cannot write {path}: {exc.strerror or exc}") from None
        self.note(f"saved {len(self.conversation.turns)} messages to {path}")

    def _load(self, arg: str) -> None:
        if not arg:
            raise ChatCommandError("usage: /load FILE")
        path = Path(arg).expanduser()
        self.settings = load_chat(path, self.conversation)
        self.note(f"loaded {len(self.conversation.turns)} messages from {path}; {_settings_text(self.settings)}")

    def _stats(self, arg: str) -> None:
        from baselm.engine import LLMEngine

        try:
            kv = self.client.call(LLMEngine.stats).result(timeout=5)
        except Exception:  # the numbers are informative; a busy or stopped engine leaves them out
            kv = None
        self.note(stats_report(self.session, kv, self.engine.max_model_len), style="")


def _settings_text(settings: ChatSettings) -> str:
    return ", ".join(f"{k}={v}" for k, v in asdict(settings).items())


# ---- wiring --------------------------------------------------------------------------------


def history_path() -> Path:
    from baselm.store.default_model import base_home

    return base_home() / HISTORY_FILE


def run_chat(
    model: str,
    *,
    settings: ChatSettings,
    system: str | None,
    device: str,
    kv_memory: str | None,
    serve: bool = False,
    host: str = "127.0.0.1",
    port: int = 8080,
) -> None:
    """Loads `model`, starts the engine thread (and the HTTP server with `serve`), runs the REPL."""
    from rich.console import Console

    from baselm.backend import select_backend
    from baselm.config import EngineConfig, parse_size
    from baselm.engine import AsyncEngine, LLMEngine
    from baselm.loader import load_model

    config = EngineConfig(kv_memory=parse_size(kv_memory) if kv_memory else None)
    with Console(stderr=True).status(f"loading {model}"):
        loaded = load_model(model, select_backend(device))
        engine = LLMEngine(loaded, config)
    if not loaded.tokenizer.has_chat_template:
        from baselm.tokenizer.errors import ChatTemplateError

        raise ChatTemplateError(f"{loaded.name} has no chat template, so it cannot chat; use `base run --raw`")
    client = AsyncEngine(engine).start()
    server = None
    try:
        if serve:
            server = start_server(client, loaded.name, host, port)
        repl = ChatREPL(client, loaded.name, settings, system, history_path())
        if server is not None:
            repl.note(f"serving the OpenAI API at {server.url} on this chat's engine")
        repl.run()
    finally:
        if server is not None:
            server.stop()
        client.stop()  # returns once the engine's OS thread is gone (see AsyncEngine.stop)


class ServeError(RuntimeError):
    """The HTTP server of `--serve` could not start; the message says why."""


class BackgroundServer:
    """The HTTP API (baselm.api) under uvicorn on a thread of its own, over the REPL's AsyncEngine."""

    def __init__(self, client: AsyncEngine, model_name: str, host: str, port: int, api_key: str | None = None):
        from baselm.api.server import ServeOptions, make_server

        self.options = ServeOptions(host=host, port=port, api_key=api_key, log_level="warning")
        self.server = make_server(client, model_name, self.options)
        self._thread = threading.Thread(target=self.server.run, name="base-http", daemon=True)

    @property
    def url(self) -> str:
        host = f"[{self.options.host}]" if ":" in self.options.host else self.options.host
        return f"http://{host}:{self.options.port}/v1"

    def start(self, timeout_s: float = 10.0) -> BackgroundServer:
        """Starts serving; raises ServeError when uvicorn does not come up (a port in use, say)."""
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self.server.started:
            self.stop()
            raise ServeError(f"could not serve on {self.options.host}:{self.options.port}; is the port in use?")
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self.server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout_s)


def start_server(client: AsyncEngine, model_name: str, host: str, port: int) -> BackgroundServer:
    """Serves the HTTP API on `client`'s engine from a background thread (API key: $BASE_API_KEY)."""
    import os

    from baselm.api.server import is_loopback

    api_key = os.environ.get("BASE_API_KEY") or None
    if not api_key and not is_loopback(host):
        print(f"WARNING: serving on {host} without an API key; set BASE_API_KEY.", file=sys.stderr)
    return BackgroundServer(client, model_name, host, port, api_key).start()
