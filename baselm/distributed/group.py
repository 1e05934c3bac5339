"""Process groups over MLX's own distributed layer (`mx.distributed`): start, join, describe.

A group is N processes (ranks) that run collectives together. Two ways to form one:
- `start_local(argv, size)`: this process becomes rank 0 and starts ranks 1..N-1 of `argv`
  (a Python entry point) on free loopback ports, writing MLX's hostfile to a temporary folder;
  the children die with their parent. The ports stay reserved (`reserve_ports`) until the
  group is formed, so no other program can take one between the pick and MLX's bind.
- `join(hostfile, rank)`: this process is rank `rank` of a user's hostfile in MLX's JSON format
  (`[["host:port"], ...]` for ring), as `mlx.launch` would start it.
Either way `init` forms the group and returns a `DistGroup`: the MLX group with a description
for `base doctor`.

What it trusts: MLX's ring has no authentication. Each rank listens on the address its hostfile
entry gives (MLX binds exactly that one; local groups use 127.0.0.1) and takes the first
connection that arrives, and every byte a rank receives is a peer's word. So the ranks of a
group are trusted, and a group belongs on a private network (docs/distributed.md). What this
program reads from a peer is still checked before it sizes or indexes anything (comm.py).

Failures are for people: a rank that fails to start or dies later gives the others a
`RankFailedError` or `DistError`, never a hang. MLX's ring backend raises when a peer's
socket closes (a process that exits or is killed), though not always; so rank 0 also watches
the ranks it started and a step deadline (dist/tp_engine.py), and the other ranks end
themselves when a step outlasts theirs (dist/watchdog.py).
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx

log = logging.getLogger("baselm.distributed")

BACKENDS = ("ring", "jaccl", "mpi", "nccl")
WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]")  # a rank listening on one of these listens on every interface
RANK_ENV, HOSTFILE_ENV = "MLX_RANK", "MLX_HOSTFILE"
STOP_GRACE_S = 10.0  # how long a stopping rank 0 waits for ranks it told to stop to leave (their files written)
PARENT_ENV = "BASE_DIST_PARENT"  # the pid a started rank exits with
READY_ENV = "BASE_DIST_READY_FD"  # the pipe a started rank writes one byte to before joining
INIT_TIMEOUT_S = 60.0


class DistError(RuntimeError):
    """A process group cannot be formed or used: bad hostfile, unknown backend, a rank that would not start."""


class RankFailedError(DistError):
    """A rank of the group died or stopped answering; the group cannot run collectives any more."""


@dataclass(slots=True)
class DistGroup:
    """A formed group: MLX's `Group`, which backend formed it and where its ranks are."""

    group: Any  # mx.distributed.Group
    backend: str
    hosts: list[str] = field(default_factory=list)  # one address per rank ("" when the backend has none)
    children: list[subprocess.Popen] = field(default_factory=list)  # ranks this process started
    folder: Path | None = None  # the hostfile's temporary folder, when this process wrote it (start_local)

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def size(self) -> int:
        return self.group.size()

    def describe(self) -> dict[str, Any]:
        """Plain data for `base doctor --json` and logs."""
        return {"backend": self.backend, "rank": self.rank, "size": self.size, "hosts": list(self.hosts)}

    def check_children(self) -> None:
        """Raises RankFailedError when a rank this process started has exited."""
        for rank, child in enumerate(self.children, start=1):
            code = child.poll()
            if code is not None:
                how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
                raise RankFailedError(f"rank {rank} (pid {child.pid}) {how}; restart every rank")

    def stop(self, timeout: float = 5.0, grace: float = 0.0) -> None:
        """Stops the ranks this process started: waits up to `grace` seconds for each to leave on its
        own (it was told to stop, and may still be writing a file: a prefix cache save), then asks,
        then kills. Removes the hostfile folder this process wrote."""
        try:
            self._stop_children(timeout, grace)
        finally:
            if self.folder is not None:
                shutil.rmtree(self.folder, ignore_errors=True)

    def _stop_children(self, timeout: float, grace: float) -> None:
        for child in self.children:
            try:
                child.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        for child in self.children:
            if child.poll() is None:
                child.terminate()
        for child in self.children:
            try:
                child.wait(timeout)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


# ---- hostfiles ---------------------------------------------------------------------------


class PortReservation:
    """`count` ports the kernel picked on `host`, held by this process until `release`.

    A port picked and let go at once can be given to any other program before MLX's ring binds
    it, which then either fails to bind or, worse, has its neighbour connect to that program.
    So each port stays bound here, not listening, with SO_REUSEPORT and not SO_REUSEADDR: on
    Linux a bind by another user, or by a socket without SO_REUSEPORT, fails with EADDRINUSE,
    and no bind to port 0 is handed it; MLX's ring sets SO_REUSEPORT, so the ranks (this user)
    bind it. A socket that is not listening takes no connections: they go to the rank's.
    """

    def __init__(self, count: int, host: str = "127.0.0.1"):
        self._sockets: list[socket.socket] = []
        try:
            for _ in range(count):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                self._sockets.append(s)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                s.bind((host, 0))
        except OSError as e:
            self.release()
            raise DistError(f"cannot reserve {count} ports on {host}: {e.strerror or e}") from e
        self.ports = [s.getsockname()[1] for s in self._sockets]

    def release(self) -> None:
        """Lets the ports go: once the ranks hold them (the group is formed), or when it failed."""
        for s in self._sockets:
            s.close()
        self._sockets = []

    def __enter__(self) -> PortReservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def reserve_ports(count: int, host: str = "127.0.0.1") -> PortReservation:
    """`count` distinct ports free on `host`, held until the reservation is released (see PortReservation)."""
    return PortReservation(count, host)


def write_hostfile(folder: Path, hosts: Sequence[str]) -> Path:
    """MLX's ring hostfile: one list of addresses per rank."""
    path = Path(folder) / "hosts.json"
    path.write_text(json.dumps([[h] for h in hosts]))
    return path


def read_hostfile(path: str | Path) -> list[str]:
    """The first address of each rank in an MLX hostfile; a clear error for a bad file."""
    path = Path(path).expanduser()
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise DistError(f"cannot read the hostfile {path}: {e.strerror or e}") from e
    except json.JSONDecodeError as e:
        raise DistError(f'{path} is not JSON ({e.msg} at line {e.lineno}); MLX wants [["host:port"], ...]') from e
    hosts: list[str] = []
    for i, entry in enumerate(data if isinstance(data, list) else [None]):
        if isinstance(entry, dict):  # mlx.launch's richer format: {"ssh": ..., "ips": [...]}
            entry = entry.get("ips") or [entry.get("ssh", "")]
        if not isinstance(entry, list) or not entry or not all(isinstance(a, str) for a in entry):
            raise DistError(f'{path}: rank {i} is not a list of "host:port" strings')
        for address in entry:
            _check_address(address, f"{path}: rank {i}")
        hosts.append(entry[0])
    if len(hosts) < 2:
        raise DistError(f"{path} lists {len(hosts)} rank(s); a group needs at least 2")
    return hosts


def _check_address(address: str, where: str) -> None:
    """A "host:port" MLX's ring can listen on and connect to: a host, and a port in 1..65535."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DistError(
            f'{where}: {address!r} is not "host:port" (the address this rank listens on, e.g. 10.0.0.1:40100)'
        )


def _warn_if_every_interface(address: str, rank: int) -> None:
    """MLX binds exactly the address a rank is given; a wildcard one listens on every interface."""
    if address.rpartition(":")[0] in WILDCARD_HOSTS:
        log.warning(
            "rank %d listens on %s, every network interface: the ring has no authentication, so give the "
            "address of a private network instead (docs/distributed.md)",
            rank,
            address,
        )


# ---- forming a group ---------------------------------------------------------------------


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise DistError(f"unknown distributed backend {backend!r} (choose from {', '.join(BACKENDS)})")
    if not mx.distributed.is_available(backend):
        raise DistError(f"MLX's {backend} backend is not available in this build of MLX")


def init(backend: str = "ring", hosts: Sequence[str] = (), timeout: float = INIT_TIMEOUT_S, children=()) -> DistGroup:
    """Forms the group from this process's MLX_RANK / MLX_HOSTFILE (or the backend's own variables).

    MLX's ring init blocks, holding Python's lock, until every peer has connected, and forever
    when one never comes. Ranks this process started say they are ready first (`_await_ready`),
    so one that fails to start is a DistError; a peer still missing after `timeout` seconds ends
    this process with faulthandler's report, the one timer that runs while MLX holds the lock.
    """
    check_backend(backend)
    group = DistGroup(None, backend, list(hosts), list(children))
    _await_ready(group.children, timeout)
    _say_ready()
    faulthandler.dump_traceback_later(timeout, exit=True)
    try:
        group.group = mx.distributed.init(strict=True, backend=backend)
    except RuntimeError as e:
        raise DistError(f"cannot form the {backend} group: {e}") from e
    finally:
        faulthandler.cancel_dump_traceback_later()
    return group


def _await_ready(children: Sequence[subprocess.Popen], timeout: float) -> None:
    """Waits until each started rank has written its ready byte; a rank that exits first or stays
    silent for `timeout` seconds is a DistError."""
    deadline = time.monotonic() + timeout
    for rank, child in enumerate(children, start=1):
        ready = child.ready_pipe  # type: ignore[attr-defined]
        left = deadline - time.monotonic()
        readable, _, _ = select.select([ready], [], [], max(0.0, left))
        byte = os.read(ready, 1) if readable else b""
        os.close(ready)
        if byte:
            continue
        if readable:  # end of file: the rank exited before joining
            raise DistError(f"rank {rank} (pid {child.pid}) exited with status {child.wait()} before joining the group")
        raise DistError(f"rank {rank} (pid {child.pid}) did not start within {timeout:.0f} s")


def _say_ready() -> None:
    """In a started rank: tells the parent this rank is about to join."""
    fd = os.environ.pop(READY_ENV, None)
    if fd is not None:
        os.write(int(fd), b"1")
        os.close(int(fd))


def join(hostfile: str | Path, rank: int, backend: str = "ring", timeout: float = INIT_TIMEOUT_S) -> DistGroup:
    """Joins rank `rank` of the group a user's hostfile describes."""
    hosts = read_hostfile(hostfile)
    if not 0 <= rank < len(hosts):
        raise DistError(f"rank {rank} is outside the hostfile's {len(hosts)} ranks (0..{len(hosts) - 1})")
    _warn_if_every_interface(hosts[rank], rank)
    os.environ[RANK_ENV] = str(rank)
    os.environ[HOSTFILE_ENV] = str(Path(hostfile).expanduser().resolve())
    return init(backend, hosts, timeout)


def start_local(
    argv: Sequence[str], size: int, backend: str = "ring", timeout: float = INIT_TIMEOUT_S, env: dict | None = None
) -> DistGroup:
    """This process becomes rank 0 of `size` local ranks; ranks 1..size-1 run `argv` (a command
    line, e.g. `[sys.executable, "-m", "some.module", ...]`) with MLX_RANK / MLX_HOSTFILE set.

    The children exit when this process does (PR_SET_PDEATHSIG on Linux; elsewhere they watch
    their parent's pid, see `exit_with_parent`). Returns once the group is formed.
    """
    if size < 2:
        raise DistError(f"a local group needs at least 2 ranks, not {size}")
    if backend != "ring":
        raise DistError(f"local ranks are started for the ring backend only, not {backend!r}")
    folder = Path(tempfile.mkdtemp(prefix="base-dist-"))
    children = []
    with reserve_ports(size) as reserved:  # NOTE: held until every rank has bound its port (init returned)
        hosts = [f"127.0.0.1:{p}" for p in reserved.ports]
        hostfile = write_hostfile(folder, hosts)
        try:
            for rank in range(1, size):
                child_env = {**os.environ, **(env or {}), RANK_ENV: str(rank), HOSTFILE_ENV: str(hostfile)}
                children.append(_start_rank(argv, child_env))
            os.environ[RANK_ENV], os.environ[HOSTFILE_ENV] = "0", str(hostfile)
            group = init(backend, hosts, timeout, children)
        except BaseException:
            DistGroup(None, backend, hosts, children, folder).stop(timeout=1.0)
            raise
    group.folder = folder  # NOTE: removed on stop, not here: a rank's MLX may still read it after rank 0 is joined
    return group


def form(argv: Sequence[str], size: int, backend: str = "ring", timeout: float = INIT_TIMEOUT_S) -> DistGroup:
    """The group of an entry point that runs on every rank: rank 0 (started by a person) starts
    the others with `argv`; a rank started that way joins. A started rank exits with its parent."""
    if os.environ.get(PARENT_ENV) and os.environ.get(RANK_ENV):
        exit_with_parent()
        return init(backend, read_hostfile(os.environ[HOSTFILE_ENV]), timeout)
    return start_local(argv, size, backend, timeout)


def _start_rank(argv: Sequence[str], env: dict[str, str]) -> subprocess.Popen:
    """One started rank, with a pipe on which it says it is ready (`_say_ready`)."""
    read_fd, write_fd = os.pipe()
    env = {**env, PARENT_ENV: str(os.getpid()), READY_ENV: str(write_fd)}
    try:
        child = subprocess.Popen(list(argv), env=env, pass_fds=(write_fd,), preexec_fn=_die_with_parent)
    except OSError as e:
        os.close(read_fd)
        raise DistError(f"cannot start a rank with {argv[0]}: {e.strerror or e}") from e
    finally:
        os.close(write_fd)
    child.ready_pipe = read_fd  # type: ignore[attr-defined]
    return child


def _die_with_parent() -> None:
    """In a started child before exec: the kernel sends SIGTERM when the parent exits (Linux)."""
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def exit_with_parent() -> None:
    """In a started rank: exits when the process that started it is gone (for systems without
    PR_SET_PDEATHSIG). Checks every half second on a daemon thread."""
    parent = os.environ.get(PARENT_ENV)
    if not parent:
        return

    def watch() -> None:
        while True:
            if os.getppid() != int(parent):
                os._exit(1)
            threading.Event().wait(0.5)

    threading.Thread(target=watch, name="dist-parent", daemon=True).start()


def lost_peer(error: BaseException) -> bool:
    """Whether an exception from a collective means a peer is gone (MLX's ring: "connection to a
    peer was lost")."""
    return isinstance(error, RuntimeError) and "peer" in str(error)
