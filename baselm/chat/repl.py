"""The REPL: reads messages and /commands, streams each answer from the shared AsyncEngine.

`open_chat_engine` runs the engine thread on a loaded model that the REPL (and, with
`base chat --serve`, the HTTP API the command starts beside it) talks to.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from rich.console import Console

from baselm.async_engine import AsyncEngine
from baselm.chat.answer import Answer
from baselm.chat.chat_file import load_chat, save_chat
from baselm.chat.conversation import Conversation, Prompt
from baselm.chat.line_reader import LineReader, join_continued
from baselm.chat.settings import ChatCommandError, ChatSettings
from baselm.chat.stats import SessionStats, stats_report, turn_line
from baselm.chat.switch import ModelSwitch
from baselm.chat.view import AnswerView
from baselm.config import EngineConfig
from baselm.engine import LLMEngine, QueueFullError
from baselm.loader import LoadedModel
from baselm.outputs import quiet_runaway_log
from baselm.reasoning import ReasoningSplitter, prompt_opens_thinking, template_thinks
from baselm.sampling.params import SamplingParams, SamplingParamsError
from baselm.scheduler import RequestTooLongError, effective_max_tokens
from baselm.tokenizer.errors import ChatTemplateError
from baselm.vision import Image, ImageError, decode_image

PROMPT = ">>> "
REQUEST_PREFIX = "repl-"  # this REPL's request ids
CONTINUATION = "... "

HELP = """\
Type a message and press Enter. Commands:
  /help                   this help
  /clear                  forget the conversation (the system prompt stays)
  /system [TEXT]          set the system prompt (without TEXT: show it)
  /set [NAME VALUE]       temperature, top_p, top_k, min_p, repetition_penalty, max_tokens
                          (or none: the context's room) or seed (or none); alone: show them
  /save FILE, /load FILE  the conversation and settings as JSON
  /model [NAME]           go on with another model (a store name or a file); alone: show it
  /image PATH             attach an image (PNG, JPEG, WebP, GIF) to your next message
  /stats                  the last turn's and the session's numbers
  /quit                   leave (or Ctrl-D)
Multi-line input: end a line with \\ to continue it on the next, or put the text between
two lines of three quotes (\"\"\"). Ctrl-C stops an answer (what came so far stays in the
conversation); at the prompt it clears the line. Arrow keys browse the input history, kept
in $BASE_HOME/chat_history (default ~/.cache/base/chat_history)."""

COMMAND_HINT = "commands: /help /clear /system /set /save /load /model /image /stats /quit"


@contextlib.contextmanager
def open_chat_engine(loaded: LoadedModel, config: EngineConfig) -> Iterator[AsyncEngine]:
    """Runs an engine thread on `loaded` while the block runs; refuses a model without a chat template."""
    engine = LLMEngine(loaded, config)
    if not loaded.tokenizer.has_chat_template:
        raise ChatTemplateError(f"{loaded.name} has no chat template, so it cannot chat; use `base run --raw`")
    client = AsyncEngine(engine).start()
    try:
        yield client
    finally:
        client.stop()  # returns once the engine's OS thread is gone (see AsyncEngine.stop)


class ChatREPL:
    """Reads messages and commands, streams answers from a shared AsyncEngine."""

    def __init__(
        self,
        client: AsyncEngine,
        model_name: str,
        settings: ChatSettings,
        system: str | None = None,
        history_path: Path | None = None,
        last_chat: Path | None = None,
        switch: ModelSwitch | None = None,
    ) -> None:
        """`switch`: what `/model NAME` loads another model with (None: this chat keeps its model)."""
        self._use(client, model_name)
        self.settings = settings
        self.switch = switch
        self._set_by_user: dict[str, str] = {}  # /set NAME VALUE, kept over a /model switch
        self.conversation = Conversation(self.engine.tokenizer, system)
        self.session = SessionStats()
        self.rich_output = sys.stdout.isatty()
        self.console = Console(highlight=False)
        # Notes and numbers go to stderr when stdout is not a terminal, so stdout holds only answers.
        self.notes = self.console if self.rich_output else Console(stderr=True, highlight=False)
        self.reader = LineReader(history_path, interactive=sys.stdin.isatty())
        self._num_requests = 0
        self._images: list[Image] = []  # attached with /image, for the next message
        self.last_chat = last_chat  # the conversation is kept here after each turn, for --resume

    def _use(self, client: AsyncEngine, model_name: str) -> None:
        """Talks to `client`'s engine from now on."""
        self.client, self.engine, self.model_name = client, client.engine, model_name
        self._eos_ids = frozenset(self.engine.eos_token_ids)
        self._thinks = template_thinks(self.engine.tokenizer.chat_template)  # show <think> apart

    def resume(self) -> None:
        """Reopens the conversation kept in `last_chat`, if there is one."""
        if self.last_chat is None or not self.last_chat.exists():
            self.note("no earlier conversation to resume")
            return
        try:
            self.settings = load_chat(self.last_chat, self.conversation)
        except ChatCommandError as exc:
            self.note(f"cannot resume: {exc}", style="yellow")
            return
        self.note(f"resumed {len(self.conversation.turns)} messages; {self.settings.to_text()}")

    def run(self) -> None:
        """The loop: until /quit or end of input."""
        self.note(f"base chat · {self.model_name} · context {self.engine.max_model_len} tokens · /help for help")
        # The line after an answer says when the runaway guard cut it; the engine's log line would
        # land inside the streamed text (requests served beside the chat keep theirs).
        with asyncio.Runner() as runner, quiet_runaway_log(REQUEST_PREFIX):
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
        try:
            prompt = self.conversation.next_prompt(user_text, self._images, self.engine.image_processor)
        except (ImageError, ChatCommandError) as exc:
            self.note(f"error: {exc}", style="red")
            return
        answer = Answer()
        self._num_requests += 1
        request_id = f"{REQUEST_PREFIX}{self._num_requests}"
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
        kv_tokens = self.engine.kv_manager.num_blocks * self.engine.kv_manager.block_size
        capacity = min(self.engine.max_model_len, kv_tokens)
        try:
            room = effective_max_tokens(len(prompt.token_ids), None, capacity)
        except RequestTooLongError:
            raise RequestTooLongError(
                f"the conversation is {len(prompt.token_ids)} tokens and the context holds {capacity}; "
                "/clear to start over",
                field="prompt",
            ) from None
        return self.settings.sampling_params(max_tokens=min(self.settings.max_tokens or room, room))

    async def _stream(self, request_id: str, prompt: Prompt, params: SamplingParams, answer: Answer) -> None:
        answer.stats.num_prompt_tokens = len(prompt.token_ids)
        splitter = ReasoningSplitter(prompt_opens_thinking(prompt.text)) if self._thinks else None
        with AnswerView(self.console, self.rich_output, splitter) as view:
            start = time.perf_counter()
            outputs = await self.client.submit(prompt.token_ids, params, request_id, prompt.images)
            try:
                async with contextlib.aclosing(outputs):  # leaving early aborts the request
                    async for out in outputs:
                        answer.add(out, time.perf_counter() - start)
                        view.add(out.text, len(out.token_ids))
            finally:
                answer.stats.total_s = time.perf_counter() - start

    def _record(self, prompt: Prompt, user_text: str, answer: Answer) -> None:
        ids = answer.token_ids
        if answer.stats.finish_reason == "stop" and ids and ids[-1] in self._eos_ids:
            ids = ids[:-1]  # the template writes the end of turn itself
        self.conversation.add_turn(prompt, user_text, answer.text, ids, self._images)
        self._images = []
        self.session.turns.append(answer.stats)
        self.note(turn_line(answer.stats, self.engine.max_model_len))
        if self.last_chat is not None:
            try:
                self.last_chat.parent.mkdir(parents=True, exist_ok=True)
                save_chat(self.last_chat, self.conversation, self.settings, self.model_name)
            except OSError as exc:
                self.note(f"could not keep the conversation for --resume: {exc}", style="yellow")

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
            "/model": self._model,
            "/stats": self._stats,
            "/image": self._image,
            "/quit": lambda arg: False,
            "/exit": lambda arg: False,
        }

    def _image(self, arg: str) -> None:
        """/image PATH: decodes the file now, so a bad one is told before the message is typed."""
        if not arg:
            raise ChatCommandError("/image needs the path of an image file")
        if self.engine.image_processor is None:
            raise ChatCommandError(f"{self.model_name} {self.engine.image_refusal}")
        try:
            image = decode_image(Path(arg).expanduser().read_bytes(), what=arg)
        except OSError as exc:
            raise ChatCommandError(f"cannot read {arg}: {exc.strerror or exc}") from None
        except ImageError as exc:
            raise ChatCommandError(str(exc)) from None
        self._images.append(image)
        width, height = image.size
        self.note(f"{arg} ({width}x{height}) goes with your next message")

    def _clear(self, arg: str) -> None:
        self.conversation.clear()
        self._images = []
        self.note("conversation cleared")

    def _system(self, arg: str) -> None:
        if not arg:
            self.note(f"system prompt: {self.conversation.system!r}")
            return
        self.conversation.set_system(arg)
        self.note("system prompt set")

    def _set(self, arg: str) -> None:
        name, _, value = arg.partition(" ")
        if not name:  # /set alone: what the next turns sample with
            self.note(self.settings.to_text(), style="")
            return
        if not value.strip():
            raise ChatCommandError(
                f"usage: /set temperature|top_p|top_k|min_p|repetition_penalty|max_tokens|seed VALUE "
                f"(now: {self.settings.to_text()})"
            )
        self.settings = self.settings.with_value(name, value)
        self._set_by_user[name] = value
        self.note(self.settings.to_text())

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
        self.note(f"loaded {len(self.conversation.turns)} messages from {path}; {self.settings.to_text()}")

    def _model(self, arg: str) -> None:
        ref = arg.strip()
        if not ref:
            self.note(f"model: {self.model_name} · context {self.engine.max_model_len} tokens · /model NAME switches")
            return
        if self.switch is None:
            raise ChatCommandError(
                "this chat cannot switch models: its engine also serves HTTP (--serve) or spans several "
                "processes; start base chat again with the other model"
            )
        self.note(f"loading {ref}")
        try:
            opened = self.switch.switch(ref)
        except Exception as exc:  # a name not stored, a file that does not load: the chat goes on as it was
            now = f"; still chatting with {self.model_name}" if self.switch.ref is not None else ""
            raise ChatCommandError(f"cannot switch to {ref}: {exc}{now}") from None
        self._use(opened.client, opened.client.engine.loaded.name)
        self.settings = opened.settings
        for name, value in self._set_by_user.items():  # what /set chose stays chosen
            self.settings = self.settings.with_value(name, value)
        messages = self.conversation.messages
        self.conversation = Conversation(self.engine.tokenizer)
        self.conversation.load(messages)  # rendered anew with this model's template on the next turn
        self.note(
            f"now chatting with {self.model_name} · context {self.engine.max_model_len} tokens · "
            f"{len(self.conversation.turns)} messages kept; {self.settings.to_text()}"
        )

    def _stats(self, arg: str) -> None:
        try:
            kv = self.client.call(LLMEngine.stats).result(timeout=5)
        except Exception:  # the numbers are informative; a busy or stopped engine leaves them out
            kv = None
        self.note(stats_report(self.session, kv, self.engine.max_model_len), style="")
