"""Online GRPO: rollout tokens/s through our engine against transformers.generate, and one step's time split.

    python bench/grpo.py [--checkpoint ~/.cache/astrai/checkpoints/smollm2-135m-instruct] [--prompts 4]
                         [--group 8] [--max-tokens 16] [--calls 4] [--no-hf] [--steps 3] [--lora]

Same weights (the checkpoint), same prompts (samples/arithmetic.jsonl rendered with the model's chat
template and the generation prompt), G sampled completions per prompt at temperature 1, both sides
stopping at the end-of-turn token: ours through astrai.rl.rollout (the engine, the G completions of
a prompt sharing its pages), transformers with `generate(num_return_sequences=G, do_sample=True)`
on the left-padded batch of prompts (its KV cache, no sharing). New tokens are what each completion
produced up to and including its stop token. Both are timed in wall seconds with the same torch
thread count, alternated `--repeats` times; the best of each is kept (a loaded machine only slows).

`--calls N` then times N rollouts in a row from one Rollout, the weights synced into it before each
(as a run does between optimizer steps): tokens/s over all of them, and the seconds of the first
call against the later ones (what making the engine costs per call when it is not kept).

Then a short online GRPO run (`--steps` optimizer steps, the bench's sizes, LoRA r=16, kl_coef 0) on
the same prompts splits a step's time into rollout, scoring and update (metrics.jsonl's
rollout_seconds, scoring_seconds, update_seconds), and reports the peak memory and the KV pool.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def prompts_for(checkpoint: str, n: int):
    from astrai.text.prompt import chat_template_for, encode_prompt
    from astrai.text.tokenizer import load_tokenizer

    tok = load_tokenizer(checkpoint)
    template = chat_template_for(tok)
    rows = [json.loads(x) for x in (ROOT / "samples" / "arithmetic.jsonl").read_text().splitlines()[:n]]
    return tok, [encode_prompt(r["messages"], tok, template) for r in rows]


def ours(model, tok, prompts, group, max_tokens, step):
    from astrai.config.train import RolloutOptions
    from astrai.rl.rollout import Rollout

    ro = RolloutOptions(group_size=group, max_tokens=max_tokens, temperature=1.0)
    r = Rollout(model, tok, ro, seed=0, device="cpu")
    t = time.perf_counter()
    groups, stats = r.generate(prompts, step)
    return time.perf_counter() - t, stats["rollout_tokens"], stats


def consecutive(model, tok, prompts, group, max_tokens, calls):
    """(seconds of each call, tokens of each call) for `calls` rollouts from one Rollout, synced before each."""
    from astrai.config.train import RolloutOptions
    from astrai.rl.rollout import Rollout

    r = Rollout(model, tok, RolloutOptions(group_size=group, max_tokens=max_tokens, temperature=1.0), seed=0,
                device="cpu")
    seconds, cpu, tokens = [], [], []
    for step in range(calls):
        t, c = time.perf_counter(), time.process_time()
        r.sync(model)  # a copy into the policy: the engine remakes its fused weights, as after an optimizer step
        _, stats = r.generate(prompts, step)
        seconds.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
        tokens.append(stats["rollout_tokens"])
    return seconds, cpu, tokens


def theirs(hf, tok, prompts, group, max_tokens, stop_ids):
    width = max(len(p) for p in prompts)
    pad = tok.eos_id if tok.eos_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    t = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                          max_new_tokens=max_tokens, num_return_sequences=group, eos_token_id=list(stop_ids),
                          pad_token_id=pad)
    seconds = time.perf_counter() - t
    new = 0
    for row in out[:, width:].tolist():
        for tkn in row:
            new += 1
            if tkn in stop_ids:
                break
    return seconds, new


def step_split(checkpoint, prompts, group, max_tokens, steps, lora, sleep=False):
    out = Path(tempfile.mkdtemp(prefix="bench-grpo-"))
    data = out / "data"
    subprocess.run([sys.executable, "-m", "astrai.cli", "preprocess", str(ROOT / "pipelines" / "grpo_prompts.yaml"),
                    "-i", str(ROOT / "samples" / "arithmetic.jsonl"), "-o", str(data), "--tokenizer", checkpoint,
                    "--workers", "1", "--set", "chat_template=tokenizer", "--set", "added_tokens=[]"],
                   check=True, capture_output=True)
    from astrai.config.train import TrainOptions
    from astrai.rl.online import run_online_grpo

    opts = TrainOptions(data=str(data), model=checkpoint, output=str(out / "run"), strategy="grpo",
                        max_steps=steps, lr=1e-4, grpo_updates=1, grpo_kl_coef=0.0, progress=False,
                        lora={} if lora else None,
                        rollout=dict(group_size=group, max_tokens=max_tokens, prompts_per_step=prompts,
                                     **({"sleep": True} if sleep else {})),
                        rewards=[dict(name="exact_match", column="answer", extract="whole")])
    run_online_grpo(opts)
    return [json.loads(x) for x in (out / "run" / "metrics.jsonl").read_text().splitlines()]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default=str(Path.home() / ".cache/astrai/checkpoints/smollm2-135m-instruct"))
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--calls", type=int, default=4, help="consecutive rollouts from one Rollout (0: skip)")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers.generate comparison")
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps of the step split (0: skip)")
    ap.add_argument("--lora", action=argparse.BooleanOptionalAction, default=True, help="the step split with LoRA")
    ap.add_argument("--sleep", action="store_true", help="the step split with rollout.sleep (the engine's memory "
                                                         "given back during the update)")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from astrai.model.adapter_files import load_checkpoint

    tok, prompts = prompts_for(a.checkpoint, a.prompts)
    model = load_checkpoint(Path(a.checkpoint))
    print(f"load average {os.getloadavg()[0]:.1f}; {a.prompts} prompts x G={a.group}, max_tokens {a.max_tokens}, "
          f"{a.threads} threads")
    if not a.no_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(a.checkpoint, dtype=torch.float32).eval()
        stop = {tok.eos_id, tok.tok.token_to_id("<|im_end|>")} - {None}
        best_ours = best_theirs = None
        for rep in range(a.repeats):
            s, n, stats = ours(model, tok, prompts, a.group, a.max_tokens, rep)
            best_ours = max(best_ours or (0, 0, {}), (n / s, n, stats), key=lambda x: x[0])
            s, n = theirs(hf, tok, prompts, a.group, a.max_tokens, stop)
            best_theirs = max(best_theirs or (0, 0), (n / s, n), key=lambda x: x[0])
        print(f"rollout tokens/s: astrai engine {best_ours[0]:.1f} ({best_ours[1]} tokens, prefix cache hit rate "
              f"{best_ours[2]['prefix_cache_hit_rate']:.2f}), transformers.generate {best_theirs[0]:.1f} "
              f"({best_theirs[1]} tokens): {best_ours[0] / best_theirs[0]:.2f}x")
        del hf
    if a.calls:
        seconds, cpu, tokens = consecutive(model, tok, prompts, a.group, a.max_tokens, a.calls)
        later = seconds[1:] or seconds
        print(f"{a.calls} consecutive rollouts, one Rollout: {sum(tokens) / sum(seconds):.1f} tokens/s overall "
              f"({sum(tokens)} tokens; {sum(tokens) / sum(cpu):.1f} per CPU second of the process); per call "
              f"{', '.join(f'{s:.2f}' for s in seconds)} s wall, {', '.join(f'{c:.2f}' for c in cpu)} s CPU (first "
              f"{seconds[0]:.2f} s, later mean {sum(later) / len(later):.2f} s)")
    for m in step_split(a.checkpoint, a.prompts, a.group, a.max_tokens, a.steps, a.lora, a.sleep) if a.steps else []:
        total = m["seconds"]
        print(f"step {m['step']}: {total:.1f} s = rollout {m['rollout_seconds']:.1f} s "
              f"({100 * m['rollout_seconds'] / total:.0f}%, {m['rollout_tokens_per_second']:.1f} tokens/s), scoring "
              f"{m['scoring_seconds']:.3f} s, update {m['update_seconds']:.1f} s "
              f"({100 * m['update_seconds'] / total:.0f}%); KV pool {m['kv_pool_mb']:.1f} MB, peak RSS "
              f"{m['peak_memory_mb']:.0f} MB, reward_mean {m['reward_mean']:.2f}")


if __name__ == "__main__":
    main()
