"""Connections: how many the server holds, how long a client may take to send its headers, and what the
log says when the process runs short of file descriptors.

Each open connection holds a file descriptor. uvicorn bounds neither how many stay open nor how long
a client may take to send its request line and headers (its keep-alive timeout starts only after a
response), so idle, half-sent connections pile up until accept() fails with "Too many open files"
and nobody is served. Here (`protocol_class`, uvicorn's h11 protocol with two additions):

- headers must be complete within `header_timeout` seconds of the connection opening, or of the
  first byte of a later request on a kept-alive connection; otherwise the connection is closed;
- at most `max_connections` are open: beyond the cap, the connections idle longest (between requests,
  or still sending their headers) are closed to make room, once idle for GRACE_S (a burst of new
  connections is accepted in one go before any of them is read: without the grace, a burst larger
  than the cap would close its own first members, a client's request among them, unread); past
  the cap plus the backlog (what the file budget holds) without waiting for the grace. When
  every connection has a request in progress, a new one is answered 503 and closed. A flood of
  idle connections therefore never locks out a client that sends its request at once (/health
  keeps answering);
- the listen backlog is as large as the cap (up to 4096): a burst of new connections waits in it
  rather than being dropped by the kernel (a dropped SYN costs its client a second); `fd_budget`
  raises the process's open-file limit (ulimit -n) towards what the cap and such bursts need;
- `OncePerInterval`, a logging filter, lets a repeated warning or error through once per interval
  with the count of those held back, an OSError as one line without its traceback (accept() failing
  for want of descriptors: asyncio logs it with a traceback at every retry; h11's "Invalid HTTP
  request received." for each malformed request).
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from typing import Optional

GRACE_S = 1.0  # a new connection is not closed to make room before it had this long to send its request
FD_RESERVE = 128  # descriptors beyond those open at start: the model files, closed connections not yet released
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

    idle: OrderedDict = OrderedDict()  # connection -> since when idle (no request in progress), longest idle first
    open_count = [0]  # connections open and not dropped
    trim_at = [None]  # the pending call of make_room, if any
    hard_cap = max_connections + backlog_for(max_connections)  # what fd_budget provided for

    def make_room(loop) -> None:
        """Close connections idle for GRACE_S or more, longest idle first, until at most max_connections are open
        (younger ones too while more than hard_cap are); look again when the longest idle is GRACE_S old."""
        if trim_at[0] is not None:
            trim_at[0].cancel()
            trim_at[0] = None
        now = time.monotonic()
        while open_count[0] > max_connections and idle:
            oldest, since = next(iter(idle.items()))
            if now - since < GRACE_S and open_count[0] <= hard_cap:
                trim_at[0] = loop.call_later(since + GRACE_S - now, make_room, loop)
                return
            oldest.drop()

    class CappedH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.dropped, self.header_timer = False, None
            open_count[0] += 1
            if open_count[0] > max_connections and not idle:  # every connection has a request in progress
                transport.write(_busy_response(max_connections))
                self.drop()
                return
            idle[self] = time.monotonic()
            self._arm()
            if open_count[0] > max_connections and (trim_at[0] is None or open_count[0] > hard_cap):
                make_room(self.loop)

        def drop(self) -> None:
            if not self.dropped:
                self.dropped = True
                open_count[0] -= 1
                idle.pop(self, None)
                self._disarm()
                self.transport.close()

        def busy(self) -> bool:
            """A request is in progress (its headers are in); otherwise between requests or still sending headers."""
            return self.cycle is not None and not self.cycle.response_complete

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.dropped:
                return
            if self.busy():
                idle.pop(self, None)
                self._disarm()
            else:
                self._arm()  # a later request's first bytes: its headers get the same time

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.dropped and not self.transport.is_closing():
                idle[self] = time.monotonic()  # the newest idle one
                idle.move_to_end(self)

        def connection_lost(self, exc: Optional[Exception]) -> None:
            if not self.dropped:
                self.dropped = True
                open_count[0] -= 1
            idle.pop(self, None)
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
            if not self.busy():
                self.drop()

    return CappedH11Protocol


def backlog_for(max_connections: int) -> int:
    """The listen backlog: room for a burst as large as the cap (within Linux's default somaxconn of 4096)."""
    return min(max_connections, 4096)


def fd_budget(max_connections: int, given: bool) -> tuple[int, Optional[str]]:
    """Raise the soft open-file limit (never above the hard one) to what `max_connections` needs: the open
    connections, up to a backlog more while new ones get their grace, and up to two backlogs accepted but
    not yet seen by the protocol (the event loop accepts a whole backlog per wake-up, and reaches the new
    connections one wake-up later). Returns the cap to use and a line to print: when the limit falls short,
    a cap the user gave is an error (ValueError), the default is lowered to fit."""
    try:
        import resource
    except ImportError:  # not a POSIX system: nothing to adjust
        return max_connections, None
    in_use = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 64
    need = max_connections + 3 * backlog_for(max_connections) + in_use + FD_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return max_connections, None
    target = need if hard == resource.RLIM_INFINITY else min(need, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if target >= need:
        return max_connections, None
    fits = max((target - in_use - FD_RESERVE) // 4, 1)
    if given:
        raise ValueError(f"--max-connections {max_connections} needs about {need} open files (three times as many "
                         f"again for bursts of new connections, and what is open now) but this process may open "
                         f"{target} "
                         f"(ulimit -n): lower --max-connections to {fits} or raise ulimit -n")
    return fits, f"at most {fits} connections (ulimit -n {target} allows no more; raise it for more)"


class OncePerInterval(logging.Filter):
    """Lets a warning or error through once per `interval` seconds per message; the next one let through
    says how many were held back. An OSError's traceback is dropped (the message and the error say it all:
    accept() out of file descriptors, a connection reset); any other keeps its traceback."""

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
        held = self.held.pop(key, 0)
        exc = record.exc_info[1] if record.exc_info else None
        if not held and not isinstance(exc, OSError):
            return True  # the first of its kind, as it was logged (a bug keeps its traceback)
        message = record.getMessage() + (f": {exc}" if isinstance(exc, OSError) else "")
        if held:
            message += f" ({held} more like it since the last one shown)"
        record.msg, record.args = message, None
        if isinstance(exc, OSError):  # out of descriptors, a reset connection: the line says it all
            record.exc_info, record.exc_text = None, None
        return True


def quiet_repeats(interval: float = 10.0) -> None:
    """Install OncePerInterval on the loggers a flood of bad connections writes to."""
    f = OncePerInterval(interval)
    for name in ("asyncio", "uvicorn.error"):
        logging.getLogger(name).addFilter(f)
