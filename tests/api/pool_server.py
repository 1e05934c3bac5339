"""A server of several models (api/pool.py) on loopback, over a temporary store of tiny models."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import openai

from baselm.api.app import PoolSetup
from baselm.api.pool import ModelPool, PoolLimits
from baselm.api.server import ServeOptions, make_server
from baselm.api.store_models import StoreLoader
from baselm.config import EngineConfig
from tests.tiny_model import write_model_folder

TINY_MODELS = ("org/tiny:q8", "org/tiny:q4", "org/tiny:q6")  # one model, three quantizations: three answers


def make_store(root: Path, folder: Path) -> list[str]:
    """A store at `root` holding the tiny llama of `folder` in each of TINY_MODELS' quantizations."""
    from baselm.models import supported_model_types
    from baselm.store.import_local import import_local
    from baselm.store.registry import Store

    store = Store(root)
    for ref in TINY_MODELS:
        name, quant = ref.split(":")
        import_local(folder, name=name, quant=quant, supported=set(supported_model_types()), store=store)
    return list(TINY_MODELS)


def tiny_store(root: Path) -> list[str]:
    return make_store(root, write_model_folder(root.parent / f"{root.name}-source"))


def mapped_bytes() -> int:
    """This process's mapped memory (VmSize in Linux's /proc/self/status): a KV pool counts from the
    moment it is made, though on the CPU its pages become resident only as blocks are written."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


class PoolServer:
    """The models of the store at `BASE_HOME` (or `refs`), loaded on demand, served on a free port
    in threads of this process."""

    def __init__(self, limits: PoolLimits | None = None, refs: list[str] | None = None, **config) -> None:
        config.setdefault("kv_memory", 4 * 2**20)
        config.setdefault("max_num_seqs", 32)
        assert os.environ.get("BASE_HOME"), "a test store is set"
        loader = StoreLoader(EngineConfig(**config), "cpu", refs=refs)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        options = ServeOptions(port=self.port, log_level="error")
        setup = PoolSetup(loader, loader.catalog(), limits or PoolLimits(keep_alive=None))
        self.server = make_server(None, "", options, setup)
        self.loop = asyncio.new_event_loop()  # the server's, for a test to hold a lease on as a request does
        serve = self.server.serve(sockets=[self.sock])
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(serve,), daemon=True)
        self.thread.start()
        self.wait_for(lambda: self.server.started, "started")

    @property
    def pool(self) -> ModelPool:
        return self.server.config.app.state.pool

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120)

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=120)

    def hold(self, name: str) -> Callable[[], None]:
        """Takes a lease on `name` (loading it) as a request does; returns what gives it back."""
        scope: dict = {}
        asyncio.run_coroutine_threadsafe(self.pool.acquire(scope, name), self.loop).result(120)
        (entry,) = scope["base.leases"]
        return lambda: self.loop.call_soon_threadsafe(self.pool.release, entry)

    def loaded(self) -> list[str]:
        """The names of the models loaded now, as /api/ps lists them."""
        return sorted(m["name"] for m in httpx.get(f"{self.url}/api/ps", timeout=60).json()["models"])

    def wait_for(self, condition: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
        """Returns once `condition()` holds; fails at the timeout, which only bounds a test that would hang."""
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise AssertionError(f"the pool server was not {what} within {timeout:g} s")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)
        self.pool.stop(lambda state: state.client.stop())
