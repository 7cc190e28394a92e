"""Structured output on SmolLM2-135M-Instruct: how many sampled json_schema answers are valid, and what the
grammar mask costs in tokens/s.

    python bench/structured.py [--answers 50] [--repeats 2] [--smollm2 DIR]

Validity: --answers chat requests (10 prompts asking for a small JSON record, seeds 0..N-1) sampled at
temperature 1 with the schema below as the grammar, all batched in one engine; an answer counts as
valid when it parses and jsonschema validates it (an answer cut by max_tokens counts as invalid).

Cost: the same requests, unconstrained, each with max_tokens = the length of its constrained answer
and EOS ignored, so both runs generate the same tokens per request and their batches have the same
shape at every step; the figure is generated tokens / engine seconds, the two runs interleaved
--repeats times (the machine is shared), and the ratio constrained / unconstrained of the best of each.
Also the grammar's own work per constrained token (the mask in the sampler, the matcher's advance),
timed around those two calls in the constrained runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city", "hobbies"],
          "properties": {"name": {"type": "string", "maxLength": 40},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"type": "string", "maxLength": 40},
                         "hobbies": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 30}}}}
TOPICS = ["a retired teacher", "a young painter", "a football player", "a chef from Lyon", "a software engineer",
          "a farmer", "a pilot", "a student in Tokyo", "a doctor", "a musician"]


def prompts(n: int) -> list:
    return [[{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} as JSON with name, age, city and "
                                         f"hobbies."}] for i in range(n)]


def run(engine, convs, params, grammar=None):
    t0 = time.perf_counter()
    outs = engine.generate(convs, params, grammar=grammar)
    return outs, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--answers", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--smollm2", default=None, help="SmolLM2 checkpoint directory (default: the converted package)")
    args = ap.parse_args()

    import jsonschema
    import torch

    from astrai.config.infer import EngineOptions, SamplingParams
    from astrai.infer.engine import Engine
    from astrai.infer.grammar import json_grammar

    torch.set_num_threads(max(os.cpu_count() - 1, 1))
    if args.smollm2:
        ckpt = args.smollm2
    else:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
        from conftest import smollm2_dir
        ckpt = smollm2_dir()
    engine = Engine.from_checkpoint(ckpt, EngineOptions(device="cpu", kv_cache_tokens=32768))
    grammar = json_grammar(SCHEMA)
    convs = prompts(args.answers)
    sampled = [SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=s) for s in range(args.answers)]
    engine.generate(convs[:2], sampled[:2], grammar=grammar)  # warm-up: llguidance's vocabulary, first steps

    outs, _ = run(engine, convs, sampled, grammar)
    ok = 0
    for c in outs:
        try:
            jsonschema.validate(json.loads(c.text), SCHEMA)
            ok += 1
        except (ValueError, jsonschema.ValidationError):
            print(f"invalid ({c.finish_reason}): {c.text!r}")
    lens = [len(c.token_ids) for c in outs]
    print(f"valid: {ok}/{len(outs)} ({ok / len(outs):.0%}); answer tokens mean {sum(lens) / len(lens):.1f}, "
          f"max {max(lens)}; finish reasons {sorted({c.finish_reason for c in outs})}")
    print("example:", outs[0].text)

    same_len = [SamplingParams(max_tokens=n, temperature=1.0, seed=s, ignore_eos=True) for s, n in enumerate(lens)]
    import astrai.infer.sampling as sampling
    from astrai.infer.grammar import Matcher

    spent = [0.0]

    def timed(fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[0] += time.perf_counter() - t
        return wrapper

    sampling.apply_grammar = timed(sampling.apply_grammar)
    Matcher.advance = timed(Matcher.advance)
    rates = {"constrained": [], "unconstrained": []}
    for _ in range(args.repeats):
        for kind in ("unconstrained", "constrained"):
            params = sampled if kind == "constrained" else same_len
            o, dt = run(engine, convs, params, grammar if kind == "constrained" else None)
            rates[kind].append(sum(len(c.token_ids) for c in o) / dt)
    for kind, r in rates.items():
        print(f"{kind:13s} tokens/s: " + ", ".join(f"{x:.1f}" for x in r))
    print(f"constrained / unconstrained (best of each): {max(rates['constrained']) / max(rates['unconstrained']):.3f}")
    print(f"grammar work per constrained token (mask + advance): {spent[0] / (args.repeats * sum(lens)) * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
