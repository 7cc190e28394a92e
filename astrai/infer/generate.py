"""`astrai generate CHECKPOINT`: continue text or answer conversations with a checkpoint directory.

    astrai generate runs/sft/model --prompt "Once upon a time" --max-tokens 64
    astrai generate runs/sft/model --chat chats.jsonl --temperature 0.7 --seed 1
    astrai generate runs/sft/model --input batch.jsonl --output out.jsonl

`--prompt` continues the raw text (tokenized as the tokenizer does by default); `--chat` renders
each conversation (a JSONL line: {"messages": [...]} or a bare list of messages) with the chat
template and the generation prompt; `--input` reads JSONL records holding "prompt" or "messages"
(optionally "sampling": per-record SamplingParams fields). One prompt streams to the terminal;
several are generated together (continuous batching) and written as JSONL, one record per prompt
in input order, to --output or stdout. Engine statistics go to stderr.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

from astrai.config.infer import GenerateOptions, SamplingParams


def read_jsonl_prompts(path: str, chat_only: bool) -> list[tuple[object, Optional[dict]]]:
    """(prompt or messages, per-record sampling overrides) per line; errors name file:line."""
    out = []
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: invalid JSON: {e.msg}") from None
            if isinstance(rec, list):
                rec = {"messages": rec}
            if not isinstance(rec, dict) or not ("messages" in rec or ("prompt" in rec and not chat_only)):
                want = "messages" if chat_only else "prompt or messages"
                raise ValueError(f"{path}:{n}: expected an object with {want} (or a list of messages)")
            prompt = rec["messages"] if "messages" in rec else rec["prompt"]
            if "messages" in rec and not (isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt)):
                raise ValueError(f"{path}:{n}: messages must be a non-empty list of {{role, content}} objects")
            out.append((prompt, rec.get("sampling")))
    if not out:
        raise ValueError(f"{path}: no records")
    return out


def completion_record(c, prompt) -> dict:
    rec = {"index": c.index, "prompt" if isinstance(prompt, str) else "messages": prompt, "text": c.text,
           "token_ids": c.token_ids, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
           "prompt_tokens": len(c.prompt_token_ids), "cached_tokens": c.cached_tokens,
           "preemptions": c.preemptions, "latency_s": round(c.latency, 4)}
    if c.logprobs is not None:
        rec["logprobs"] = [{"token_id": lp.token_id, "logprob": lp.logprob, "top": lp.top} for lp in c.logprobs]
    return rec


def _why(c, engine) -> str:
    if c.finish_reason == "length":
        return "max_tokens reached"
    if c.finish_reason == "stop" and isinstance(c.stop_reason, int):
        name = engine.tokenizer.tok.id_to_token(c.stop_reason) if engine.tokenizer is not None else None
        return f"stop token {c.stop_reason}" + (f" ({name})" if name else "") + "; --ignore-eos continues past it"
    if c.finish_reason == "stop":
        return f"stop string {c.stop_reason!r}"
    return c.finish_reason or "unknown"


def generate_main(options: GenerateOptions, out=None, err=None) -> int:
    from astrai.infer.engine import Engine

    out, err = out or sys.stdout, err or sys.stderr
    if options.prompt is not None:
        items = [(options.prompt, None)]
    else:
        items = read_jsonl_prompts(options.chat or options.input, chat_only=options.chat is not None)
    params = [options.sampling.model_copy(update=over) if over else options.sampling for _, over in items]
    params = [SamplingParams.model_validate(p.model_dump()) for p in params]  # overrides validated too
    engine = Engine.from_checkpoint(options.checkpoint, options.engine, options.base)
    prompts = [p for p, _ in items]
    if len(prompts) == 1 and options.output is None:
        done = None
        for ev in engine.stream(prompts, params):
            out.write(ev.text)
            out.flush()
            done = ev.completion or done
        out.write("\n")
        if done is not None:  # say why it stopped: an empty answer must not look like a failure
            err.write(f"[generate] finished after {len(done.token_ids)} token(s): {_why(done, engine)}\n")
    else:
        results: list[Optional[dict]] = [None] * len(prompts)
        for ev in engine.stream(prompts, params):
            if ev.completion is not None:
                results[ev.index] = completion_record(ev.completion, prompts[ev.index])
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in results)
        if options.output:
            Path(options.output).write_text(text, encoding="utf-8")
        else:
            out.write(text)
    s = engine.engine_stats()
    err.write(f"[generate] {s['requests']} request(s), {s['generated_tokens']} tokens in {s['seconds']:.2f}s "
              f"({s['tokens_per_second']:.1f} tok/s), prefix cache hit rate {s['prefix_cache_hit_rate']:.0%}, "
              f"{s['preemptions']} preemption(s)\n")
    return 0


def add_arguments(parser) -> None:
    from astrai.infer.flags import add_flags

    parser.add_argument("checkpoint", help=GenerateOptions.model_fields["checkpoint"].description)
    add_flags(parser, GenerateOptions, skip=("checkpoint",))


def run(args) -> int:
    from astrai.infer.flags import build

    try:
        return generate_main(build(GenerateOptions, args, getattr(args, "overrides", [])))
    except (ValueError, FileNotFoundError) as e:  # bad options, input lines, a request that cannot fit
        print(f"error: {e}", file=sys.stderr)
        return 1
