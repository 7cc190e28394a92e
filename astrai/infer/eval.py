"""Evaluation (`astrai eval CHECKPOINT --data DIR`, and a recipe's eval stage) -> eval.json.

Perplexity (token-weighted, trained tokens only) of a held-out preprocessed directory read back
through astrai.data.load.ShardDataset, packed rows evaluated with document isolation (see
perplexity.py), plus sample generations through the engine. eval.json holds loss, perplexity,
trained token / document / row counts, the samples and the generation statistics; a summary is
printed.

Samples: for `samples` held-out documents (whole documents first, not pieces that bfd_split cut
mid-text: perplexity.held_out_prompts), the prompt is the document up to its first trained token
(for SFT: the conversation up to the assistant header), the reference is the trained text that
followed; the engine generates from the prompt (greedy by default).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from astrai.config.infer import EvalOptions


def run_eval(options: EvalOptions, out=None) -> dict:
    from astrai.data.load import ShardDataset
    from astrai.infer.engine import Engine
    from astrai.infer.perplexity import held_out_prompts, perplexity
    from astrai.infer.request import SamplingParams

    out = out or sys.stdout
    if options.checkpoint is None or options.data is None:
        raise ValueError("eval needs a checkpoint and --data (a preprocessed held-out directory)")
    engine = Engine.from_checkpoint(options.checkpoint, options.engine, options.base)
    dataset = ShardDataset(options.data)
    if dataset.multi:
        raise ValueError(f"{options.data}: a multi-output (DPO/GRPO) dataset; perplexity needs input_ids/labels rows")
    result = {"checkpoint": str(options.checkpoint), "data": str(options.data)}
    result.update(perplexity(engine.model, dataset, options.max_rows, options.batch_tokens, engine.device))
    prompts = held_out_prompts(dataset, options.samples)
    stops = [engine.eot_id] if engine.eot_id is not None else []
    params = [SamplingParams(max_tokens=options.sample_max_tokens, temperature=options.temperature,
                             seed=options.seed + i, stop_token_ids=stops) for i in range(len(prompts))]
    completions = engine.generate([p for p, _ in prompts], params) if prompts else []
    decode = engine.tokenizer.decode if engine.tokenizer is not None else (lambda ids: "")
    result["samples"] = [{"prompt": decode(p), "reference": decode(ref), "completion": c.text,
                          "completion_token_ids": c.token_ids, "finish_reason": c.finish_reason}
                         for (p, ref), c in zip(prompts, completions)]
    result["generation"] = engine.engine_stats()
    path = Path(options.output) if options.output else Path(options.checkpoint) / "eval.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    tmp.replace(path)
    out.write(f"[eval] perplexity {result['perplexity']:.3f} (loss {result['loss']:.4f}) on "
              f"{result['trained_tokens']} trained tokens, {result['documents']} documents -> {path}\n")
    for s in result["samples"]:
        out.write(f"[eval] prompt: {s['prompt'][-200:]!r}\n       completion: {s['completion'][:200]!r}\n")
    return result


def add_arguments(parser) -> None:
    from astrai.infer.flags import add_flags

    parser.add_argument("checkpoint", help=EvalOptions.model_fields["checkpoint"].description)
    add_flags(parser, EvalOptions, skip=("checkpoint",))


def run(args) -> int:
    from astrai.infer.flags import build

    try:
        run_eval(build(EvalOptions, args, getattr(args, "overrides", [])))
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
