"""`astrai serve` under load: the same N chat requests one at a time, then from C concurrent clients, one server.

    python bench/serve.py [--models tiny,smollm2] [--requests 64] [--concurrency 16] [--max-prompt 256]

Requests are real first user turns (ShareGPT, else chitchat; mixed lengths, cut at --max-prompt
tokens) with max_tokens drawn from 16..128, EOS ignored so each produces exactly its max_tokens.
Each phase tags its prompts ("[seq]" / "[conc]" before the user text) so the second phase finds none
of the first phase's prompts in the prefix cache (the chat template's system prompt stays shared, in
both). The client is a small asyncio HTTP/1.1 reader of the SSE stream (it costs the 2-core machine
little, so the figures are the server's), one connection per request.

Printed per phase: output tokens/s (wall), the server's CPU seconds, p50/p99 time to first token
(request sent -> first content chunk) and inter-token latency (between content chunks); then the
ratio concurrent / one-at-a-time of tokens/s. Targets at C=16: >= 4x on tiny, >= 2x on SmolLM2.
Models: tiny = the tiny preset (random weights) with SmolLM2's tokenizer and chat template;
smollm2 = SmolLM2-135M-Instruct (tests/conftest.py smollm2_dir, or --smollm2 DIR).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from data import chats  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def smollm2_dir(given: str | None) -> Path:
    if given:
        return Path(given)
    spec = importlib.util.spec_from_file_location("astrai_tests_conftest", ROOT / "tests" / "conftest.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.smollm2_dir()


def tiny_checkpoint(smol: Path, out: Path) -> Path:
    import torch

    from astrai.model import CausalLM, ModelConfig, save_model

    torch.manual_seed(0)
    vocab = json.loads((smol / "config.json").read_text())["vocab_size"]
    save_model(CausalLM(ModelConfig.preset("tiny", vocab_size=vocab, initializer_range=0.1, eos_token_id=2)), out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (smol / name).exists():
            shutil.copy(smol / name, out / name)
    return out


def requests(smol: Path, n: int, max_prompt: int, seed: int = 0) -> list[tuple[str, int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(smol / "tokenizer.json"))
    _, records = chats(4 * n)
    users = [r["messages"][0]["content"] for r in records if r["messages"][0]["role"] == "user"]
    rng = random.Random(seed)
    out = []
    for text in users[:n]:
        ids = tok.encode(text, add_special_tokens=False).ids[:max_prompt]
        out.append((tok.decode(ids), rng.randint(16, 128)))
    return out


class Server:
    def __init__(self, checkpoint: Path, *args: str):
        cmd = [sys.executable, "-m", "astrai.cli", "serve", str(checkpoint), "--port", "0", "--device", "cpu", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT)
        for line in self.proc.stdout:
            m = re.search(r"http://([^:/]+):(\d+)/v1", line)
            if m:
                self.host, self.port = m.group(1), int(m.group(2))
                return
        raise RuntimeError("the server did not start")

    def cpu_seconds(self) -> float:
        import psutil

        t = psutil.Process(self.proc.pid).cpu_times()
        return t.user + t.system

    def stop(self) -> int:
        self.proc.terminate()
        return self.proc.wait(60)


async def one(host: str, port: int, body: dict) -> dict:
    """Send one streamed chat request; times of the first and of every content chunk, and the usage."""
    payload = json.dumps(body).encode()
    t0 = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n"
                 b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (host.encode(), len(payload), payload))
    head = await reader.readuntil(b"\r\n\r\n")
    if b" 200 " not in head.split(b"\r\n")[0]:
        raise RuntimeError(head.decode() + (await reader.read()).decode())
    times, usage, buf = [], None, b""
    while True:  # chunked transfer encoding, SSE events inside
        size = int((await reader.readuntil(b"\r\n")).strip(), 16)
        if size == 0:
            break
        data = await reader.readexactly(size + 2)
        now = time.perf_counter()
        buf += data[:-2]
        *events, buf = buf.split(b"\n\n")
        for ev in events:
            if ev == b"data: [DONE]":
                continue
            d = json.loads(ev[6:])
            if d.get("usage"):
                usage = d["usage"]
            elif d["choices"] and d["choices"][0]["delta"].get("content"):
                times.append(now)
    writer.close()
    return {"ttft": times[0] - t0 if times else None, "itl": [b - a for a, b in zip(times, times[1:])],
            "tokens": usage["completion_tokens"], "end": time.perf_counter()}


async def phase(server: Server, reqs, tag: str, concurrency: int) -> dict:
    bodies = [{"messages": [{"role": "user", "content": f"[{tag}] {text}"}], "max_tokens": mt, "temperature": 0,
               "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}} for text, mt in reqs]
    queue = list(reversed(bodies))
    results = []

    async def worker():
        while queue:
            results.append(await one(server.host, server.port, queue.pop()))

    cpu0, t0 = server.cpu_seconds(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall, cpu = time.perf_counter() - t0, server.cpu_seconds() - cpu0
    ttft = sorted(r["ttft"] for r in results if r["ttft"] is not None)
    itl = sorted(x for r in results for x in r["itl"])
    tokens = sum(r["tokens"] for r in results)

    def pct(xs, q):
        return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000 if xs else float("nan")

    return {"tokens": tokens, "wall": wall, "server_cpu": cpu, "tok_s": tokens / wall,
            "ttft_p50": pct(ttft, 0.5), "ttft_p99": pct(ttft, 0.99), "itl_p50": pct(itl, 0.5), "itl_p99": pct(itl, 0.99),
            "itl_mean": statistics.fmean(itl) * 1000 if itl else float("nan")}


def show(name: str, r: dict) -> None:
    print(f"  {name:<14} {r['tokens']:>6} tok in {r['wall']:6.1f}s = {r['tok_s']:7.1f} tok/s  "
          f"(server CPU {r['server_cpu']:5.1f}s)  TTFT p50/p99 {r['ttft_p50']:6.0f}/{r['ttft_p99']:6.0f} ms  "
          f"ITL p50/p99 {r['itl_p50']:5.1f}/{r['itl_p99']:6.1f} ms", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="tiny,smollm2")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument("--smollm2", default=None, help="SmolLM2-135M-Instruct directory (default: tests' converted copy)")
    ap.add_argument("--server-args", default="", help="extra `astrai serve` flags, e.g. '--max-running 32'")
    args = ap.parse_args()
    smol = smollm2_dir(args.smollm2)
    reqs = requests(smol, args.requests, args.max_prompt)
    print(f"{len(reqs)} requests, prompts {min(len(t) for t, _ in reqs)}..{max(len(t) for t, _ in reqs)} chars, "
          f"max_tokens 16..128 ({sum(m for _, m in reqs)} output tokens); load average before "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} cores", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="astrai-bench-serve-"))
    ratios = {}
    try:
        for model in args.models.split(","):
            ckpt = tiny_checkpoint(smol, tmp / "tiny") if model == "tiny" else smol
            server = Server(ckpt, *args.server_args.split())
            try:
                asyncio.run(phase(server, reqs[:4], "warm", 4))
                seq = asyncio.run(phase(server, reqs, "seq", 1))
                conc = asyncio.run(phase(server, reqs, "conc", args.concurrency))
            finally:
                rc = server.stop()
            print(f"{model}: (server exit {rc})")
            show("one at a time", seq)
            show(f"{args.concurrency} clients", conc)
            ratios[model] = conc["tok_s"] / seq["tok_s"]
            print(f"  concurrent / one-at-a-time: {ratios[model]:.2f}x tokens/s "
                  f"(target >= {4 if model == 'tiny' else 2}x)", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"load average after {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
