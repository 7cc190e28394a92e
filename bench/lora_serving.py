"""Many LoRA adapters on one base against one merged model: the engine's multi-adapter steps.

    python bench/lora_serving.py --checkpoint ~/.cache/astrai/checkpoints/smollm2-135m-instruct \
        [--adapters 4] [--rank 16] [--threads 2] [--repeats 3]

Workload: the 16 short real chat questions of bench/generate_checkpoint.py, rendered with the
checkpoint's chat template, greedy, --max-tokens new tokens (EOS ignored, so both sides generate the
same number of tokens). --adapters random LoRA adapters (rank --rank, every linear layer but the
head, B drawn at 0.02: as after some training) are saved in PEFT's format in a temporary directory.

  merged    one Engine on the base with adapter 0 merged in (what serving a single fine-tune costs),
            the 16 requests at once
  bank      one Engine on the base with every adapter loaded side by side (astrai.infer.lora_bank),
            the 16 requests at once, request i on adapter i mod --adapters

tokens/s = tokens generated / wall seconds, best of --repeats interleaved rounds; printed with the
ratio bank / merged, torch's threads and the CPU flags. The greedy tokens of the bank's adapter-0
requests are compared with the merged engine's for the same prompts.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from generate_checkpoint import questions  # noqa: E402

from astrai.config.infer import EngineOptions, SamplingParams  # noqa: E402
from astrai.infer.engine import Engine  # noqa: E402
from astrai.model import load_model  # noqa: E402
from astrai.model.adapter_files import load_checkpoint, save_adapter  # noqa: E402
from astrai.model.lora import LoraSpec, apply_lora, lora_layers  # noqa: E402
from astrai.runtime.hardware import cpu_flags_line  # noqa: E402


def make_adapters(base: str, n: int, rank: int, root: str) -> dict[str, str]:
    out = {}
    for i in range(n):
        model = load_model(base)
        torch.manual_seed(i)
        apply_lora(model, LoraSpec(rank, 2.0 * rank), base=base)
        with torch.no_grad():
            for layer in lora_layers(model).values():
                layer.lora_B.weight.normal_(0, 0.02)
        path = os.path.join(root, f"adapter{i}")
        save_adapter(model, path)
        out[f"adapter{i}"] = path
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    opts = EngineOptions(device="cpu", dtype="float32", max_running=16, kv_cache_tokens=16 * 1024)
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as root:
        adapters = make_adapters(args.checkpoint, args.adapters, args.rank, root)
        bank = Engine.from_checkpoint(args.checkpoint, opts, adapters=adapters)
        merged = Engine(load_checkpoint(adapters["adapter0"]), bank.tokenizer, opts)
        convs = questions(bank.tokenizer)
        names = [f"adapter{i % args.adapters}" for i in range(len(convs))]
        greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {cpu_flags_line()}")
        print(f"{args.checkpoint}: {len(convs)} chats, {args.adapters} adapters of rank {args.rank}, "
              f"{args.max_tokens} new tokens each, greedy, wall clock")
        rates = {"merged": [], "bank": []}
        outs = {}
        for r in range(args.repeats):
            for name, run in (("merged", lambda: merged.generate(convs, greedy)),
                              ("bank", lambda: bank.generate(convs, greedy, adapters=names))):
                for e in (merged, bank):
                    e.pool.reset_prefix_cache()
                t = time.perf_counter()
                res = run()
                dt = time.perf_counter() - t
                outs[name] = [c.token_ids for c in res]
                rates[name].append(sum(map(len, outs[name])) / dt)
            print(f"round {r + 1}: merged {rates['merged'][-1]:.1f}, bank {rates['bank'][-1]:.1f} tokens/s", flush=True)
        m, b = max(rates["merged"]), max(rates["bank"])
        print(f"16 chats on one merged model: {m:.1f} tokens/s (range {min(rates['merged']):.1f}-{m:.1f})")
        print(f"16 chats over {args.adapters} adapters: {b:.1f} tokens/s (range {min(rates['bank']):.1f}-{b:.1f})")
        print(f"bank / merged: {b / m:.2f}x")
        same = [outs["bank"][i] == outs["merged"][i] for i in range(len(convs)) if names[i] == "adapter0"]
        print(f"adapter0 requests with the merged engine's greedy tokens: {sum(same)}/{len(same)}")


if __name__ == "__main__":
    main()
