"""What every request passes before a handler: the Host allow-list, JSON-only POST bodies, the body's size and
time bounds, and a client that leaves mid-body (no traceback). Requests are sent as a browser, curl or an
attacker would send them (raw sockets, http.client), and each answer is read as an OpenAI client reads it."""

import http.client
import json
import socket
import time

import pytest
from serving import ServerProcess, assert_error, strict_json

from astrai.serve.guard import HostRule, host_name

httpx = pytest.importorskip("httpx")

BODY = json.dumps({"prompt": "hello", "max_tokens": 1}).encode()


@pytest.mark.parametrize("header,name", [
    ("127.0.0.1:8000", "127.0.0.1"), ("LocalHost.:80", "localhost"), ("[::1]:8000", "[::1]"), ("[::1]", "[::1]"),
    ("::1", "[::1]"), ("example.com", "example.com"), ("", ""),
])
def test_host_name(header, name):
    assert host_name(header) == name


def test_host_rule():
    rule = HostRule("127.0.0.1")
    for ok in ("127.0.0.1:8000", "localhost", "LOCALHOST:1", "[::1]:8000", "[::1]", "localhost."):
        assert rule.allows(ok), ok
    for bad in ("evil.example", "127.0.0.1.nip.io", "localhost.evil.example:8000", "192.168.1.5", "", None):
        assert not rule.allows(bad), bad
    assert HostRule("127.0.0.1", ["my.box"]).allows("My.Box:8000")
    assert not HostRule("127.0.0.1", ["my.box"]).allows("other.box")
    assert HostRule("127.0.0.1", ["*"]).allows("anything.example")
    every = HostRule("0.0.0.0")  # bound to every interface: whatever address reached it is this machine's
    assert every.allows("192.168.1.5:8000") and every.allows("[fe80::1]:8000") and every.allows("localhost")
    assert not every.allows("evil.example")  # a domain name is what DNS rebinding sends
    assert HostRule("::1").allows("[::1]:9") and not HostRule("::1").allows("10.0.0.1")


def raw(server, data: bytes, read_timeout: float = 30) -> bytes:
    """Send bytes on a fresh connection; everything the server answers until it closes or goes quiet."""
    with socket.create_connection(server.address, timeout=read_timeout) as s:
        s.sendall(data)
        out = b""
        try:
            while b"\r\n\r\n" not in out or len(out.split(b"\r\n\r\n", 1)[1]) < _length(out):
                chunk = s.recv(65536)
                if not chunk:
                    break
                out += chunk
        except socket.timeout:
            pass
        return out


def _length(response: bytes) -> int:
    for line in response.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"content-length":
            return int(v)
    return 1 << 30


def status_and_error(response: bytes) -> tuple[int, dict]:
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split()[1]), strict_json(body)


def test_wrong_host_is_421_in_openai_shape(server):
    for host in ("evil.example", "evil.example:8000", "127.0.0.1.evil.example"):
        r = httpx.post(server.base + "/completions", content=BODY, headers={"host": host,
                                                                          "content-type": "application/json"})
        assert_error(r.status_code, strict_json(r.content), 421, None, "does not answer for Host")
        assert "--allowed-hosts" in r.json()["error"]["message"]
        assert httpx.get(server.url + "/health", headers={"host": host}).status_code == 421
    port = server.address[1]
    for host in ("localhost", f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}"):
        assert httpx.get(server.url + "/health", headers={"host": host}).status_code == 200, host


@pytest.mark.parametrize("ctype", ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                                   "multipart/form-data; boundary=x", None])
def test_post_bodies_that_are_not_json_are_415(server, ctype):
    """The content types a web page may send cross-origin without a CORS preflight, and none at all."""
    headers = f"content-type: {ctype}\r\n" if ctype else ""
    got = raw(server, b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n%scontent-length: %d\r\n\r\n%s"
              % (headers.encode(), len(BODY), BODY))
    status, err = status_and_error(got)
    assert_error(status, err, 415, None, "Content-Type: application/json")
    assert err["error"]["code"] == "unsupported_media_type"


def test_json_with_a_charset_is_accepted(server):
    r = httpx.post(server.base + "/completions", content=BODY,
                   headers={"content-type": "Application/JSON; charset=utf-8"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1


TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
            "{% if m['content'] | length > 100 %}{{ m['content'] * 1000000 }}{% else %}{{ m['content'] }}{% endif %}"
            "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def edge_server(serve_checkpoint, tmp_path_factory):
    """Small bounds: 10 KiB bodies, 2 s to send headers and body; a template that repeats a message over 100
    characters a million times (past the template sandbox's size bound); my.box as an extra Host name."""
    template = tmp_path_factory.mktemp("tpl") / "repeat.jinja"
    template.write_text(TEMPLATE)
    s = ServerProcess(serve_checkpoint, "--max-body-mb", str(10 / 1024), "--read-timeout", "2",
                      "--chat-template", str(template), "--allowed-hosts", "my.box")
    yield s
    assert s.stop() == 0, "".join(s.stderr)[-3000:]


def test_allowed_hosts_extends_the_list(edge_server):
    assert httpx.get(edge_server.url + "/health", headers={"host": "my.box:8000"}).status_code == 200
    assert httpx.get(edge_server.url + "/health", headers={"host": "other.box"}).status_code == 421


def test_a_body_over_the_cap_is_413_read_by_the_client(edge_server):
    big = json.dumps({"prompt": "x" * 200_000}).encode()
    conn = http.client.HTTPConnection(*edge_server.address, timeout=30)
    conn.request("POST", "/v1/completions", body=big, headers={"content-type": "application/json"})
    r = conn.getresponse()  # the whole body was sent first: the answer is still read, not a reset connection
    assert_error(r.status, strict_json(r.read()), 413, None, "larger than 10 KiB")
    conn.request("GET", "/health")  # and the connection still serves
    assert conn.getresponse().status == 200
    conn.close()

    def chunks():  # no Content-Length: refused while it streams in
        for _ in range(30):
            yield b" " * 1000
    conn = http.client.HTTPConnection(*edge_server.address, timeout=30)
    conn.request("POST", "/v1/completions", body=chunks(), headers={"content-type": "application/json"},
                 encode_chunked=True)
    r = conn.getresponse()
    assert_error(r.status, strict_json(r.read()), 413, None, "--max-body-mb")
    conn.close()


def test_a_body_that_does_not_arrive_is_408(edge_server):
    t0 = time.monotonic()
    got = raw(edge_server, b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                           b"content-length: 100\r\n\r\n{\"prompt\": ")
    status, err = status_and_error(got)
    assert_error(status, err, 408, None, "within 2 s")
    assert 1.5 < time.monotonic() - t0 < 10


def test_headers_that_do_not_arrive_close_the_connection(edge_server):
    with socket.create_connection(edge_server.address, timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\nx-slow: ")
        t0 = time.monotonic()
        assert s.recv(100) == b""  # closed
        assert 1.5 < time.monotonic() - t0 < 10


def test_clients_that_leave_mid_body_leave_no_traceback(edge_server):
    before = len("".join(edge_server.stderr))
    for _ in range(10):
        with socket.create_connection(edge_server.address) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                      b"content-length: 5000\r\n\r\n{\"messages\": [")
            time.sleep(0.05)
    assert httpx.get(edge_server.url + "/health").status_code == 200
    time.sleep(0.5)
    assert "".join(edge_server.stderr)[before:] == ""


def test_a_message_past_the_templates_bounds_is_400(edge_server):
    status, err = edge_server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "y" * 200}]})
    assert_error(status, err, 400, "messages", "cannot render this conversation")
    assert "16,777,216" in err["error"]["message"]  # the sandbox's own words: its bound
    status, ok = edge_server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                           "max_tokens": 1})
    assert status == 200
