"""`astrai serve CHECKPOINT`: load the engine, bind the socket, run uvicorn until Ctrl-C or SIGTERM.

The socket is bound here, before the model loads, so a port in use is one clear line (exit 1) in a
second and `--port 0` can print the port it got. The ready line goes to stdout once the model is loaded:

    astrai serve: NAME on http://127.0.0.1:8000/v1 (OpenAI API; /health, /metrics)

uvicorn runs with astrai's h11 protocol (connections.py: `--max-connections`, a `--read-timeout` for
headers) and the Guard middleware (guard.py: Host allow-list, JSON bodies, body size and time);
keep-alive connections close after KEEP_ALIVE_S idle seconds, longer than the 5 s after which httpx
(the openai client's transport) stops reusing one, so a client never sends on a connection the server
is closing. Repeated log lines (accept() out of file descriptors, malformed requests) are written once
per 10 s.

Stopping: the first Ctrl-C or SIGTERM stops accepting connections; running requests get
`--shutdown-timeout` seconds to finish, then are cancelled; the engine thread is stopped and the
process exits 0: the signal handlers are uvicorn's, without its re-raise of the signal after a graceful
stop (that would end the process as "killed by signal").
"""

from __future__ import annotations

import contextlib
import gc
import ipaddress
import os
import signal
import socket
import sys
from pathlib import Path

from astrai.config.infer import checkpoint_sampling_note
from astrai.config.serve import ServeOptions

KEEP_ALIVE_S = 30
MAX_HEADER_BYTES = 16 * 1024  # request line + headers (h11's bound; uvicorn's default, stated)
INSTALL_HINT = "astrai serve needs the serve extra: pip install 'astrai[serve]' (uvicorn, starlette, prometheus_client)"


def _missing_extra() -> str | None:
    try:
        import prometheus_client  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        return f"{INSTALL_HINT}; {e}"
    return None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind(host: str, port: int, backlog: int = 2048) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e} (is another server running there? "
                         f"pick another --port)") from None
    sock.listen(backlog)  # connections made before uvicorn runs wait in the backlog instead of being refused
    sock.set_inheritable(True)
    return sock


def _set_threads(threads: int | None) -> None:
    """The engine thread steps the model while the event loop streams tokens: torch's CPU thread pool gets the
    cores but one, so the HTTP side always has a core (an OpenMP team waiting on a descheduled member spins,
    and a busy event loop would deschedule one; bench/RESULTS.md has the measurement)."""
    import torch

    torch.set_num_threads(threads or max(1, (os.cpu_count() or 2) - 1))


def serve_main(options: ServeOptions, out=None) -> int:
    out = out or sys.stdout
    missing = _missing_extra()
    if missing:
        print(f"error: {missing}", file=sys.stderr)
        return 1
    import uvicorn

    from astrai.infer.engine import Engine
    from astrai.serve.app import ServeConfig, build_app
    from astrai.serve.connections import backlog_for, fd_budget, protocol_class, quiet_repeats
    from astrai.serve.guard import HostRule

    max_connections, note = fd_budget(options.max_connections, "max_connections" in options.model_fields_set)
    backlog = backlog_for(max_connections)
    sock = bind(options.host, options.port, backlog)  # before loading: a busy port fails in a second, not a minute
    if note:
        print(f"astrai serve: {note}", file=out, flush=True)
    _set_threads(options.threads)
    engine = Engine.from_checkpoint(options.checkpoint, options.engine, options.base, options.adapters())
    print(f"astrai serve: {engine.device.type}, {engine.dtype_reason}", file=out, flush=True)
    name = options.served_model_name or options.checkpoint
    if name in engine.adapter_names:
        raise ValueError(f"--lora {name}: the base is served under that name; give the adapter another one")
    aliases = frozenset({options.checkpoint, str(Path(options.checkpoint).resolve()),
                         Path(options.checkpoint).resolve().name}) - {name}
    api_key = options.api_key if options.api_key is not None else os.environ.get("ASTRAI_API_KEY") or None
    app = build_app(engine, ServeConfig(name, aliases, api_key, options.max_queue, options.stall_timeout,
                                        HostRule(options.host, options.allowed_hosts),
                                        int(options.max_body_mb * 2 ** 20), options.read_timeout,
                                        options.max_prompt_chars))
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                            http=protocol_class(max_connections, options.read_timeout),
                            timeout_graceful_shutdown=options.shutdown_timeout, timeout_keep_alive=KEEP_ALIVE_S,
                            # no limit_concurrency: uvicorn answers 503 to every request once that many connections
                            # are open, whatever they do, so idle ones would lock clients out; the protocol's cap
                            # closes the longest idle connection instead
                            h11_max_incomplete_event_size=MAX_HEADER_BYTES, backlog=backlog)
    quiet_repeats()
    server = _server_class()(config)
    for sig in (signal.SIGINT, signal.SIGTERM):  # from the ready line on, a signal stops the server cleanly
        signal.signal(sig, server.handle_exit)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    if not _is_loopback(options.host):
        print(f"astrai serve: listening on {options.host}: reachable from the network"
              + ("" if api_key else " by anyone (no --api-key given)"), file=out, flush=True)
    note = checkpoint_sampling_note(engine.generation_defaults)
    if note:
        print(f"astrai serve: {note}", file=out, flush=True)
    print(f"astrai serve: {name} on http://{shown}:{port}/v1 (OpenAI API; /health, /metrics)", file=out, flush=True)
    # Everything loaded so far (torch, the model, the tokenizer) lives as long as the process: keep it out of
    # the collector's full passes, which otherwise walk it all during serving and again at exit (seconds).
    gc.freeze()
    try:
        server.run(sockets=[sock])
    finally:
        app.state.server.loop.stop()
        sock.close()
    print("astrai serve: stopped", file=out, flush=True)
    return 0


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            originals = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, handler in originals.items():
                    signal.signal(s, handler)

    return Server
