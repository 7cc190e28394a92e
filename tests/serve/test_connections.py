"""Connections: idle, half-sent ones neither lock clients out nor exhaust file descriptors nor flood the log."""

import io
import logging
import socket
import time

import pytest
from serving import ServerProcess

from astrai.cli import main
from astrai.serve.connections import OncePerInterval

httpx = pytest.importorskip("httpx")

HALF_SENT = b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\nx-slow: "


def test_half_sent_connections_beyond_the_cap_and_the_fd_limit(serve_checkpoint):
    """300 idle connections that never finish their headers: far more than twice --max-connections 16, and more
    than the 256 files the process may open. /health answers within a second while they are held; the
    server closes them (the longest idle beyond the cap, the rest after --read-timeout); stderr stays quiet."""
    s = ServerProcess(serve_checkpoint, "--max-connections", "16", "--read-timeout", "4", nofile=256)
    try:
        socks = []
        for _ in range(300):
            c = socket.create_connection(s.address, timeout=30)
            c.sendall(HALF_SENT)
            socks.append(c)
        slowest = 0.0
        for _ in range(10):
            t0 = time.monotonic()
            assert httpx.get(s.url + "/health", timeout=30).status_code == 200
            slowest = max(slowest, time.monotonic() - t0)
            time.sleep(0.1)
        assert slowest < 1.0, slowest
        time.sleep(5)  # --read-timeout: the rest are closed too
        for c in socks:
            assert c.recv(10) == b""  # closed by the server, without an answer
            c.close()
        assert httpx.get(s.url + "/health", timeout=30).status_code == 200
    finally:
        assert s.stop() == 0
    err = "".join(s.stderr)
    assert len(err) < 1000 and "Traceback" not in err, err[-2000:]


def test_a_cap_the_fd_limit_cannot_hold_is_one_line(serve_checkpoint, tmp_path):
    import subprocess
    import sys

    def limit():
        import resource
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))

    r = subprocess.run([sys.executable, "-m", "astrai.cli", "serve", str(serve_checkpoint), "--port", "0",
                        "--max-connections", "1000"], capture_output=True, text=True, preexec_fn=limit, timeout=120)
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("error: --max-connections 1000 needs about") and "ulimit -n" in r.stderr
    assert main(["serve", str(serve_checkpoint), "--max-connections", "0"]) == 1


def test_repeated_log_lines_are_written_once_per_interval():
    """asyncio logs accept() failing for want of descriptors with a traceback, at every retry."""
    out = io.StringIO()
    log = logging.getLogger("test-once-per-interval")
    log.propagate = False
    log.setLevel(logging.INFO)
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(handler)
    log.addFilter(OncePerInterval(0.3))

    def emfile():
        try:
            raise OSError(24, "Too many open files")
        except OSError as e:
            log.error("socket.accept() out of system resource", exc_info=e)

    for _ in range(1000):
        emfile()
    assert out.getvalue() == "socket.accept() out of system resource: [Errno 24] Too many open files\n"
    time.sleep(0.35)
    emfile()
    assert out.getvalue().splitlines()[1] == ("socket.accept() out of system resource: [Errno 24] Too many open "
                                              "files (999 more like it since the last one shown)")
    try:  # another message, not an OSError: written, with its traceback
        raise KeyError("bug")
    except KeyError as e:
        log.error("Task exception was never retrieved", exc_info=e)
    assert "Traceback" in out.getvalue() and "KeyError: 'bug'" in out.getvalue()
    log.info("quiet")  # below WARNING: untouched
    assert out.getvalue().endswith("quiet\n")
