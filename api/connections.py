"""What HTTP clients may hold of the server: a deadline for a request's headers, and a budget for
the request bodies being read at once.

uvicorn closes a connection that is idle between requests (its keep-alive timeout), but one that
has sent part of a request line or part of its headers is held for ever, so a client that
trickles bytes (slowloris) keeps a socket, and a place under `--max-connections`, as long as it
likes. `DeadlineProtocol` gives every request `read_timeout` seconds, from the connection's start
or the previous response's end, to complete its headers, then answers 408 and closes. The body's
own deadline is the route's (`serving.read_json`), since only the app reads it.

Each connection may send a body of up to `--max-body`, and up to `--max-connections` may do so at
once: 512 bodies of 8 MiB, buffered whole, are 4 GiB. `BodyBudget` caps the bytes of all bodies
being read and parsed at one time; a body that would pass it gets a 503 before it is read.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

DEFAULT_READ_TIMEOUT = 30.0  # seconds for a request's headers, and again for its body
MIN_BODY_BUDGET = 64 * 2**20  # bytes of request bodies read at once, at least; 4 bodies of the largest size beyond


class BodyBudget:
    """Bytes of request bodies being read at once, against a limit; used from the event loop only."""

    def __init__(self, max_body_bytes: int) -> None:
        self.limit = max(MIN_BODY_BUDGET, 4 * max_body_bytes)
        self.num_bytes = 0

    def take(self, num_bytes: int) -> bool:
        """Takes `num_bytes` if they fit under the limit; False (nothing taken) if not."""
        if self.num_bytes + num_bytes > self.limit:
            return False
        self.num_bytes += num_bytes
        return True

    def give_back(self, num_bytes: int) -> None:
        self.num_bytes -= num_bytes


class DeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's headers."""

    def __init__(self, *args: Any, read_timeout: float = DEFAULT_READ_TIMEOUT, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.read_timeout = read_timeout
        self.header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's headers are complete: its body is the route's to time
            self._disarm()

    def on_response_complete(self) -> None:
        if not self.transport.is_closing():
            self._arm()  # the next request on this connection gets its own deadline
        super().on_response_complete()

    def _arm(self) -> None:
        self._disarm()
        self.header_deadline = self.loop.call_later(self.read_timeout, self._headers_too_slow)

    def _disarm(self) -> None:
        if self.header_deadline is not None:
            self.header_deadline.cancel()
            self.header_deadline = None

    def _headers_too_slow(self) -> None:
        """408 to a request whose headers did not arrive in time; a connection idle between requests
        (nothing of a next request sent) is only closed, as keep-alive's timeout would."""
        self.header_deadline = None
        if self.transport.is_closing():
            return
        if self.conn.our_state is h11.IDLE and self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:
            self._send_408()
        self.transport.close()

    def _send_408(self) -> None:
        body = f"the request's headers did not arrive within {self.read_timeout:g} seconds\n".encode()
        headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"connection", b"close")]
        try:
            self.transport.write(
                self.conn.send(h11.Response(status_code=408, headers=headers, reason=b"Request Timeout"))
            )
            self.transport.write(self.conn.send(h11.Data(data=body)) or b"")
            self.transport.write(self.conn.send(h11.EndOfMessage()) or b"")
        except h11.LocalProtocolError:
            pass  # h11 is past a state where a response can be sent: closing is all that is left
