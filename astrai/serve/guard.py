"""The ASGI layer in front of the routes: what every request must pass before a handler sees it.

- Host: the Host header must name this server (HostRule): the bound address, localhost,
  127.0.0.1, [::1], any port, plus `--allowed-hosts`; others get 421. A web page that rebinds its
  own domain name to 127.0.0.1 (DNS rebinding) sends its domain as Host, so it is refused. Bound to
  every interface (0.0.0.0, ::), any IP address is accepted too (whatever address reached the socket
  is this machine's), and the machine's own host names; a domain name still has to be listed.
- POST bodies must say `Content-Type: application/json` (415 otherwise): text/plain and form bodies
  are what a web page may send to any origin without a CORS preflight, so a page open in a browser
  on this machine could otherwise start generations on a keyless local server.
- The body: refused with 413 on its Content-Length, or while it streams in, past `max_body`; it
  must arrive within `read_timeout` seconds of the headers (408, and the connection is closed). After
  any other refusal the connection stays open and the rest of the body is read and dropped (within
  `read_timeout`, connections.py), so the client reads the answer: closing a socket with unread data
  resets it, and the client would see a broken connection instead of the 413.
- A client that disconnects before its body is complete ends its request silently: nobody is
  there to answer, and it is not a fault of the server.
- Any other exception of a handler is answered 500 in OpenAI's error shape and its traceback written
  once (Starlette's own handling would write it twice and re-raise it into uvicorn).

Every refusal has OpenAI's error shape ({"error": {"message", "type", "param", "code"}}).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import socket
import sys
import time
import traceback
from typing import Optional

from astrai.serve.protocol import APIError

LOCAL_NAMES = ("localhost", "127.0.0.1", "[::1]")


def host_name(value: str) -> str:
    """A Host header's name without its port, lower case, IPv6 addresses in brackets: `[::1]:8000` -> `[::1]`,
    `LocalHost.:80` -> `localhost`, `::1` (an allow-list entry) -> `[::1]`."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[:value.find("]") + 1] if "]" in value else value
    if value.count(":") > 1:  # a bare IPv6 address (as --host or --allowed-hosts give it)
        return f"[{value}]"
    return value.split(":", 1)[0].rstrip(".")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name.strip("[]"))
        return True
    except ValueError:
        return False


class HostRule:
    """Which Host header values this server answers (see the module docstring)."""

    def __init__(self, bound: str, extra: list[str] = ()):
        self.any = "*" in extra
        self.wildcard = bound in ("0.0.0.0", "::", "")
        names = {host_name(n) for n in (bound, *LOCAL_NAMES, *extra) if n != "*"}
        if self.wildcard:
            names |= {host_name(socket.gethostname()), host_name(socket.getfqdn())}
        self.names = frozenset(names)

    def allows(self, host: Optional[str]) -> bool:
        if self.any:
            return True
        if not host:
            return False
        name = host_name(host)
        return name in self.names or (self.wildcard and _is_ip(name))

    def refusal(self, host: Optional[str]) -> APIError:
        shown = ", ".join(sorted(self.names))
        return APIError(421, f"this server does not answer for Host {host!r} (it answers for {shown}); start it "
                             f"with --allowed-hosts NAME to add a name, or --allowed-hosts '*'",
                        code="misdirected_request")


class ClientGone(Exception):
    """The client disconnected before its request body was complete."""


class BodyRefused(Exception):
    """The body is too large or too slow: answered by the Guard (the connection closes)."""

    def __init__(self, error: APIError):
        super().__init__(error.message)
        self.error = error


def _header(scope, name: bytes) -> Optional[str]:
    for k, v in scope["headers"]:
        if k == name:
            return v.decode("latin-1")
    return None


async def answer(send, err: APIError, close: bool = False) -> None:
    body = json.dumps(err.body(), allow_nan=False).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class Guard:
    """ASGI middleware (see the module docstring); sits between Starlette's error middleware and its routes."""

    def __init__(self, app, hosts: HostRule, max_body: int, read_timeout: float):
        self.app, self.hosts, self.max_body, self.read_timeout = app, hosts, max_body, read_timeout

    def refusal(self, scope) -> Optional[APIError]:
        host = _header(scope, b"host")
        if not self.hosts.allows(host):
            return self.hosts.refusal(host)
        if scope["method"] != "POST":
            return None
        ctype = _header(scope, b"content-type")
        if (ctype or "").split(";", 1)[0].strip().lower() != "application/json":
            return APIError(415, f"the body must be JSON sent with 'Content-Type: application/json' (got "
                                 f"{ctype or 'no Content-Type'}); with curl: -H 'Content-Type: application/json'",
                            code="unsupported_media_type")
        length = _header(scope, b"content-length")
        if length is not None and length.strip().isdigit() and int(length) > self.max_body:
            return self.too_large()
        return None

    def too_large(self) -> APIError:
        size = f"{self.max_body / 2 ** 20:g} MiB" if self.max_body >= 2 ** 20 else f"{self.max_body / 1024:g} KiB"
        return APIError(413, f"the body is larger than {size} (--max-body-mb)", code="request_too_large")

    def bounded(self, receive):
        """`receive` that counts the body's bytes and bounds its time; a disconnect before its end is ClientGone."""
        size, deadline, complete = 0, None, False

        async def receive_bounded():
            nonlocal size, deadline, complete
            if complete:
                return await receive()
            deadline = deadline or time.monotonic() + self.read_timeout
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.0))
            except asyncio.TimeoutError:
                raise BodyRefused(APIError(408, f"the body did not arrive within {self.read_timeout:g} s "
                                                f"(--read-timeout)", code="request_timeout")) from None
            if message["type"] == "http.disconnect":
                raise ClientGone()
            size += len(message.get("body", b""))
            if size > self.max_body:
                raise BodyRefused(self.too_large())
            complete = not message.get("more_body", False)
            return message

        return receive_bounded

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refused = self.refusal(scope)
        if refused is not None:
            return await answer(send, refused)
        started = False

        async def send_tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, self.bounded(receive), send_tracked)
        except ClientGone:
            return
        except BodyRefused as e:
            if not started:
                await answer(send, e.error, close=e.error.status == 408)
        except Exception as e:  # a bug: say so to the client, once to the log, and keep serving
            traceback.print_exception(e, file=sys.stderr)
            if not started:
                await answer(send, APIError(500, f"internal error: {type(e).__name__}: {e}"))
