"""`astrai serve` as a command: start-up lines, stopping cleanly, and the mistakes a user makes; `astrai chat`."""

import io
import signal
import socket
import sys
import threading
import time

import pytest
from serving import ServerProcess

from astrai.cli import main

openai = pytest.importorskip("openai")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_during_a_stream_stops_cleanly_with_exit_0(serve_checkpoint, sig):
    s = ServerProcess(serve_checkpoint, "--shutdown-timeout", "2")
    client = openai.OpenAI(base_url=s.base, api_key="x", max_retries=0)
    got = []

    def read():
        try:
            for chunk in client.completions.create(model=str(serve_checkpoint), prompt="hello", max_tokens=1900,
                                                   stream=True, extra_body={"ignore_eos": True}):
                got.append(chunk)
        except Exception as e:  # the connection is closed under it once the grace period is over
            got.append(e)

    reader = threading.Thread(target=read)
    reader.start()
    while len(got) < 3:
        time.sleep(0.05)
    t0 = time.monotonic()
    assert s.stop(sig) == 0, "".join(s.stderr)[-2000:]
    assert time.monotonic() - t0 < 30  # 2 s of grace, then the running request is cancelled
    reader.join(30)
    assert "astrai serve: stopped\n" in s.lines
    assert "Traceback" not in "".join(s.stderr)


def test_all_interfaces_says_so(serve_checkpoint):
    s = ServerProcess(serve_checkpoint, "--host", "0.0.0.0")
    try:
        port = s.url.rsplit(":", 1)[1]
        assert any("listening on 0.0.0.0: reachable from the network by anyone (no --api-key given)" in line
                   for line in s.lines), s.lines
        with socket.create_connection(("127.0.0.1", int(port)), timeout=10):
            pass
    finally:
        assert s.stop() == 0


def test_busy_port_and_missing_extra_are_one_line_errors(serve_checkpoint, capsys, monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", str(serve_checkpoint), "--port", str(port), "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot listen on 127.0.0.1:{port}") and "--port" in err and err.count("\n") == 1
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # as if astrai[serve] were not installed
    assert main(["serve", str(serve_checkpoint)]) == 1
    assert "pip install 'astrai[serve]'" in capsys.readouterr().err
    assert main(["serve", str(serve_checkpoint), "--port", "70000"]) == 1
    assert "port" in capsys.readouterr().err


def test_chat_keeps_the_history_and_applies_the_template(serve_checkpoint, monkeypatch, capsys):
    from astrai.infer.engine import Engine, EngineOptions
    from astrai.infer.request import SamplingParams

    monkeypatch.setattr(sys, "stdin", io.StringIO("hello how are you\n\nthe quick brown fox\n/reset\nhello how are you\n"))
    rc = main(["chat", str(serve_checkpoint), "--max-tokens", "7", "--temperature", "0", "--system", "be brief",
               "--device", "cpu"])
    out, err = capsys.readouterr()
    assert rc == 0 and "/reset" in err and "[history cleared]" in err
    answers = out.split("\n")
    engine = Engine.from_checkpoint(serve_checkpoint, EngineOptions(device="cpu", dtype="float32"))
    params = SamplingParams(max_tokens=7, temperature=0)
    sys_msg = {"role": "system", "content": "be brief"}
    first = engine.generate([[sys_msg, {"role": "user", "content": "hello how are you"}]], params)[0].text
    second = engine.generate([[sys_msg, {"role": "user", "content": "hello how are you"},
                               {"role": "assistant", "content": first},
                               {"role": "user", "content": "the quick brown fox"}]], params)[0].text
    assert answers[:4] == [first, second, first, ""]  # after /reset the first answer again


def test_chat_without_a_template_says_how_to_give_one(tmp_path, serve_checkpoint, monkeypatch, capsys):
    import json
    import shutil

    plain = tmp_path / "plain"
    shutil.copytree(serve_checkpoint, plain)
    cfg = json.loads((plain / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (plain / "tokenizer_config.json").write_text(json.dumps(cfg))
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n"))
    assert main(["chat", str(plain), "--device", "cpu"]) == 1
    assert "--chat-template chatml" in capsys.readouterr().err
    assert main(["chat", str(plain), "--device", "cpu", "--chat-template", "chatml", "--max-tokens", "2"]) == 0
