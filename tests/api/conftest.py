"""Real servers on loopback over the tiny fixture llama model and the fixture BPE tokenizer (ChatML)."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest

from baselm.api.server import ServeOptions, make_server
from baselm.async_engine import AsyncEngine
from baselm.config import EngineConfig
from baselm.engine import LLMEngine
from baselm.loader import LoadedModel
from baselm.sampling.defaults import NO_DEFAULTS, SamplingDefaults
from tests.tiny_model import loaded_widened_llama

MODEL = "tiny"
_BUSY = ("base_num_requests_running", "base_num_requests_waiting", "base_kv_blocks_used")  # all 0 when idle


class RunningServer:
    """An engine thread and a uvicorn server on a free loopback port, in threads of this process."""

    def __init__(
        self,
        api_key: str | None = None,
        max_body_bytes: int = 8 * 2**20,
        loaded: LoadedModel | None = None,
        model_name: str = MODEL,
        cors_origins: tuple[str, ...] = (),
        allowed_hosts: tuple[str, ...] = (),
        host: str = "127.0.0.1",
        read_timeout: float = 30.0,
        sampling: SamplingDefaults = NO_DEFAULTS,
        allow_image_urls: bool = False,
        **config,
    ) -> None:
        config.setdefault("kv_memory", 4 * 2**20)
        config.setdefault("max_num_seqs", 32)
        self.model_name = model_name
        self.engine = LLMEngine(loaded or loaded_widened_llama(MODEL), EngineConfig(**config))
        self.client = AsyncEngine(self.engine).start()
        # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets that say so.
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        # `host`: the address the server believes it is bound to (its Host check follows it); it listens on loopback.
        options = ServeOptions(
            host=host,
            port=self.port,
            api_key=api_key,
            max_body_bytes=max_body_bytes,
            log_level="error",
            cors_origins=cors_origins,
            allowed_hosts=allowed_hosts,
            read_timeout=read_timeout,
            sampling=sampling,
            allow_image_urls=allow_image_urls,
        )
        self.server = make_server(self.client, model_name, options)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def openai(self, api_key: str = "none", **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=60, **kwargs)

    def http(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, **kwargs)

    def metrics(self) -> dict[str, float]:
        """Gauge and counter values by name (summed over labels) and by labelled name (histogram buckets skipped)."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        values: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("#") or "_bucket" in line:
                continue
            name, value = line.rsplit(" ", 1)
            values[name.split("{")[0]] = values.get(name.split("{")[0], 0.0) + float(value)
            if "{" in name:
                values[name] = float(value)
        return values

    def wait_until(
        self, condition: Callable[[dict[str, float]], bool], what: str, timeout: float = 60.0
    ) -> dict[str, float]:
        """Metrics once `condition` holds for them; fails the test, with the last reading, at the timeout.

        The timeout is generous: it only bounds a test that would otherwise hang, on a loaded machine too."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if condition(m):
                return m
            if time.monotonic() > deadline:
                busy = {name: m[name] for name in _BUSY}
                pytest.fail(f"the test server was not {what} within {timeout:g} s; last reading: {busy}")
            time.sleep(0.02)

    def wait_idle(self, timeout: float = 60.0) -> dict[str, float]:
        """Metrics once no request runs or waits and no KV block is used; fails the test at the timeout."""
        return self.wait_until(lambda m: all(m[name] == 0 for name in _BUSY), "idle", timeout)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.client.stop()


@pytest.fixture(scope="session")
def server() -> Iterator[RunningServer]:
    """One shared server with default limits and no API key."""
    running = RunningServer()
    yield running
    running.stop()


@pytest.fixture(scope="session")
def smollm2_server(smollm2_gguf) -> Iterator[RunningServer]:
    """SmolLM2-135M-Instruct served in this process (for `slow` tests)."""
    from baselm.backend import select_backend
    from baselm.loader import load_model

    loaded = load_model(str(smollm2_gguf), select_backend("cpu"))
    running = RunningServer(loaded=loaded, model_name="smollm2", kv_memory=256 * 2**20)
    yield running
    running.stop()


@dataclass(frozen=True, slots=True)
class ClientTarget:
    """Where a real client library's tests send their requests."""

    url: str
    model: str


@pytest.fixture(scope="session")
def client_target(request) -> ClientTarget:
    """`$BASE_PEER_URL` serving `$BASE_PEER_MODEL` when tests/tools/peer_suites.py runs these tests against its own
    `base serve`; otherwise SmolLM2-135M served in this process."""
    url = os.environ.get("BASE_PEER_URL")
    if url:
        return ClientTarget(url, os.environ["BASE_PEER_MODEL"])
    running = request.getfixturevalue("smollm2_server")
    return ClientTarget(running.url, running.model_name)


@pytest.fixture
def make_server_with():
    started: list[RunningServer] = []

    def make(**kwargs) -> RunningServer:
        started.append(RunningServer(**kwargs))
        return started[-1]

    yield make
    for running in started:
        running.stop()
