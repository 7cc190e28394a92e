"""Connections: how many the server holds, how long a client may take to send its headers, and what the
log says when the process runs short of file descriptors.

Each open connection holds a file descriptor. uvicorn bounds neither how many stay open nor how long
a client may take to send its request line and headers (its keep-alive timeout starts only after a
response), so idle, half-sent connections pile up until accept() fails with "Too many open files"
and nobody is served. Here (`protocol_class`, uvicorn's h11 protocol with two additions):

- headers must be complete within `header_timeout` seconds of the connection opening, or of the
  first byte of a later request on a kept-alive connection; otherwise the connection is closed;
- at most `max_connections` are open: a new connection beyond the cap closes the one that has been
  idle longest (between requests, or still sending its headers); when every connection has a request
  in progress, the new one is answered 503 and closed. A flood of idle connections therefore never
  locks out a client that sends its request at once (/health keeps answering);
- `fd_budget` raises the process's open-file limit (ulimit -n) towards what the cap and the listen
  backlog (as large as the cap) need: both may be open at once, since the event loop accepts a whole
  backlog in one go before the protocol sees any of them;
- `OncePerInterval`, a logging filter, lets a repeated warning or error through once per interval
  with the count of those held back, and without a traceback (accept() failing for want of
  descriptors, h11's "Invalid HTTP request received.", uvicorn's concurrency-limit warning).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Optional

FD_RESERVE = 64  # descriptors beyond those open at start: the executor's, the engine's, stdio, a scrape
BUSY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
        b"content-length: %d\r\n\r\n%s")


def _busy_response(max_connections: int) -> bytes:
    body = (b'{"error": {"message": "the server holds its most connections (%d, --max-connections), each with a '
            b'request in progress; retry later", "type": "server_error", "param": null, "code": '
            b'"too_many_connections"}}' % max_connections)
    return BUSY % (len(body), body)


def protocol_class(max_connections: int, header_timeout: float):
    """uvicorn's h11 protocol with a header timeout and a connection cap (see the module docstring)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class CappedH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.idle_since = time.monotonic()
            self.dropped = False
            self.header_timer = None
            self._arm()
            open_ = [c for c in self.connections if not getattr(c, "dropped", False)]
            if len(open_) > max_connections:
                idle = [c for c in open_ if c is not self and c.idle()]
                if idle:
                    min(idle, key=lambda c: c.idle_since).drop()
                else:
                    self.transport.write(_busy_response(max_connections))
                    self.drop()

        def idle(self) -> bool:
            """Between requests, or still sending the request line and headers."""
            return self.cycle is None or self.cycle.response_complete

        def drop(self) -> None:
            self.dropped = True
            self._disarm()
            self.transport.close()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.idle():
                self._arm()  # a later request's first bytes: its headers get the same time
            else:
                self._disarm()

        def on_response_complete(self) -> None:
            self.idle_since = time.monotonic()
            super().on_response_complete()

        def connection_lost(self, exc: Optional[Exception]) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self.header_timer is None and not self.dropped:
                self.header_timer = self.loop.call_later(header_timeout, self._headers_late)

        def _disarm(self) -> None:
            if self.header_timer is not None:
                self.header_timer.cancel()
                self.header_timer = None

        def _headers_late(self) -> None:
            self.header_timer = None
            if self.idle() and not self.transport.is_closing():
                self.drop()

    return CappedH11Protocol


def fd_budget(max_connections: int, given: bool) -> tuple[int, Optional[str]]:
    """Raise the soft open-file limit (never above the hard one) to what `max_connections` open connections
    plus as many waiting in the listen backlog need. Returns the cap to use and a line to print: when the
    limit falls short, a cap the user gave is an error (ValueError), the default is lowered to fit."""
    try:
        import resource
    except ImportError:  # not a POSIX system: nothing to adjust
        return max_connections, None
    in_use = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 64
    need = 2 * max_connections + in_use + FD_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return max_connections, None
    target = need if hard == resource.RLIM_INFINITY else min(need, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if target >= need:
        return max_connections, None
    fits = max((target - in_use - FD_RESERVE) // 2, 1)
    if given:
        raise ValueError(f"--max-connections {max_connections} needs about {need} open files (as many again for "
                         f"the listen backlog, and what is open now) but this process may open {target} "
                         f"(ulimit -n): lower --max-connections to {fits} or raise ulimit -n")
    return fits, f"at most {fits} connections (ulimit -n {target} allows no more; raise it for more)"


class OncePerInterval(logging.Filter):
    """Lets a log record through once per `interval` seconds per message, as one line (no traceback);
    the next one let through says how many were held back."""

    def __init__(self, interval: float = 10.0):
        super().__init__()
        self.interval = interval
        self.last: dict[tuple, float] = {}
        self.held: dict[tuple, int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        key = (record.name, str(record.msg))
        now = time.monotonic()
        if now - self.last.get(key, -self.interval) < self.interval:
            self.held[key] = self.held.get(key, 0) + 1
            return False
        self.last[key] = now
        message = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            message += f": {record.exc_info[1]}"
        held = self.held.pop(key, 0)
        if held:
            message += f" ({held} more like it in the last {self.interval:g} s, not shown)"
        record.msg, record.args, record.exc_info, record.exc_text = message, None, None, None
        return True


def quiet_repeats(interval: float = 10.0) -> None:
    """Install OncePerInterval on the loggers a flood of bad connections writes to."""
    f = OncePerInterval(interval)
    for name in ("asyncio", "uvicorn.error"):
        logging.getLogger(name).addFilter(f)
