"""Helpers of the server tests: `astrai serve` started as a user starts it (a subprocess on a free loopback
port given by --port 0, read back from its ready line) and stopped with SIGTERM, which must exit 0."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
READY = re.compile(r"on (http://[^ ]+)/v1 ")


class ServerProcess:
    def __init__(self, checkpoint, *args, env=None, nofile=None):
        """nofile: the server's open-file limit (ulimit -n), soft and hard."""
        # float32 unless a test asks otherwise: the tests' references are float32 on every machine (dtype auto
        # would take bfloat16 on a CPU with bf16 dot products)
        dtype = [] if "--dtype" in args else ["--dtype", "float32"]
        cmd = [sys.executable, "-m", "astrai.cli", "serve", str(checkpoint), "--port", "0", "--device", "cpu", *dtype,
               *args]

        def limit():
            import resource
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                     env={**os.environ, **(env or {})}, preexec_fn=limit if nofile else None)
        self.lines: list[str] = []
        self.stderr: list[str] = []
        self.url = None
        ready = threading.Event()

        def read_stdout():
            for line in self.proc.stdout:
                self.lines.append(line)
                m = READY.search(line)
                if m and self.url is None:
                    self.url = m.group(1)
                    ready.set()
            ready.set()

        threading.Thread(target=read_stdout, daemon=True).start()
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True).start()
        if not ready.wait(180) or self.url is None:
            self.proc.kill()
            raise RuntimeError(f"server did not start: {''.join(self.lines)} {''.join(self.stderr)[-3000:]}")

    @property
    def base(self) -> str:
        return self.url + "/v1"

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            return json.loads(r.read())

    def text(self, path: str) -> str:
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            return r.read().decode()

    def post(self, path: str, body, headers=None) -> tuple[int, dict]:
        """The status and the JSON body, parsed strictly (NaN or Infinity is an error, as in strict clients)."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method="POST",
                                     headers={"content-type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, strict_json(r.read())
        except urllib.error.HTTPError as e:
            return e.code, strict_json(e.read())

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        return host, int(port)

    def idle_health(self, timeout: float = 10.0) -> dict:
        """/health once no request is in flight (a cancellation reaches the engine within a step)."""
        deadline = time.monotonic() + timeout
        while True:
            h = self.get("/health")
            if (h["running"], h["waiting"]) == (0, 0) and "stale" not in h or time.monotonic() > deadline:
                return h
            time.sleep(0.05)

    def stop(self, sig=signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


def _no_constant(name):
    raise ValueError(f"{name} is not JSON")


def strict_json(data):
    """json.loads that refuses NaN, Infinity and -Infinity (Python's accepts them; JSON has no such numbers)."""
    return json.loads(data, parse_constant=_no_constant)


def assert_error(status, body, want_status, param, words):
    """An error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""
    assert status == want_status, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["param"] == param, err
    assert words in err["message"], err
