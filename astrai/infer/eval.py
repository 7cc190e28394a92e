"""Evaluation (`astrai eval CHECKPOINT --data DIR`, and a recipe's eval stage) -> eval.json.

On single-output data, perplexity (token-weighted, trained tokens only) of a held-out preprocessed
directory read back through astrai.data.load.ShardDataset (its shards verified against the
manifest), packed rows evaluated with document isolation (see perplexity.py). On DPO pairs, the
held-out reward accuracy and margin against the reference model (`ref_model`: the model DPO
started from); on scored groups (GRPO data), the reward the model would collect choosing among
each group's candidates (preference.py). Data made with another tokenizer than the checkpoint's
is refused (`tokenizer_problem`). Plus sample generations through the engine. eval.json holds
those figures, the counts, the samples and the generation statistics; a summary is printed.

Samples of DPO/GRPO data: the prompt of each of the first rows, the chosen (best-rewarded) answer as
the reference. Samples of single-output data: for `samples` held-out documents (whole documents first, not pieces that bfd_split cut
mid-text: perplexity.held_out_prompts), the prompt is the document up to its first trained token
(for SFT: the conversation up to the assistant header), the reference is the trained text that
followed; the engine generates from the prompt (greedy by default).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Optional
from pathlib import Path

from astrai.config.infer import EvalOptions
from astrai.errors import InputError
from astrai.runtime import atomic_write_text


def tokenizer_problem(manifest: dict, tokenizer, checkpoint, data) -> Optional[str]:
    """Why the held-out data cannot be scored by this checkpoint's tokenizer, or None. The manifest
    records the content digest of the tokenizer that made the data (astrai.text.tokenizer.
    content_digest); the checkpoint's tokenizer must have the same one: ids made by another
    tokenizer mean other tokens to the model, and their perplexity means nothing."""
    from astrai.text.tokenizer import content_digest

    recorded = (manifest.get("tokenizer") or {}).get("content")
    if not recorded:
        return f"{data}: its manifest records no tokenizer digest (made by an older astrai); run astrai preprocess again"
    if tokenizer is None:
        return (f"{checkpoint}: has no tokenizer files, so the data cannot be checked against the model's tokenizer; "
                f"copy the tokenizer the model was trained with into it")
    mine = content_digest(tokenizer)
    if mine != recorded:
        return (f"{data} was made with another tokenizer (digest {recorded[:12]}) than the checkpoint {checkpoint} "
                f"uses ({mine[:12]}); preprocess the held-out data with the checkpoint's tokenizer")
    return None


def _check_output(path: Path) -> None:
    """eval.json's place can be written: not a directory, a folder that exists (or can be made) and is writable."""
    if path.is_dir():
        raise InputError(f"eval output {path}: is a directory; give a file name, e.g. {path / 'eval.json'}")
    if path.exists() and not path.is_file():
        raise InputError(f"eval output {path}: not a regular file (a device, FIFO or socket); give a file path")
    parent = next((p for p in (path.parent, *path.parent.parents) if p.exists()), None)
    if parent is None or not parent.is_dir():
        raise InputError(f"eval output {path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InputError(f"eval output {path}: {parent} is not writable; choose another --output")


def run_eval(options: EvalOptions, out=None) -> dict:
    from astrai.data.load import ShardDataset
    from astrai.infer.engine import Engine
    from astrai.infer.perplexity import held_out_prompts, perplexity
    from astrai.infer.preference import preference_prompts
    from astrai.infer.request import SamplingParams

    out = out or sys.stdout
    if options.checkpoint is None or options.data is None:
        raise ValueError("eval needs a checkpoint and --data (a preprocessed held-out directory)")
    # the data and the output are checked before the model is loaded (minutes on a big checkpoint)
    dataset = ShardDataset(options.data)
    kind = data_kind(dataset)
    if kind == "dpo" and options.ref_model is None:
        raise ValueError(f"{options.data} holds DPO pairs: their reward figures need the reference model (the "
                         f"checkpoint DPO started from): give --ref-model DIR (in a recipe: ref_model: STAGE)")
    path = Path(options.output) if options.output else Path(options.checkpoint) / "eval.json"
    _check_output(path)
    engine = Engine.from_checkpoint(options.checkpoint, options.engine, options.base)
    problem = tokenizer_problem(dataset.manifest, engine.tokenizer, options.checkpoint, options.data)
    if problem:
        raise ValueError(problem)
    result = {"checkpoint": str(options.checkpoint), "data": str(options.data), "data_kind": kind,
              "dtype": str(engine.dtype).replace("torch.", ""),  # what the figures were computed in
              "quantize": engine.options.quantize, "quantize_head": engine.options.quantize_head}
    if kind == "single":
        result.update(perplexity(scorer(engine), dataset, options.max_rows, options.batch_tokens, engine.device))
        prompts = held_out_prompts(dataset, options.samples)
    else:
        result.update(preference_figures(engine, dataset, kind, options))
        prompts = preference_prompts(dataset, options.samples)
    stops = [engine.eot_id] if engine.eot_id is not None else []
    params = [SamplingParams(max_tokens=options.sample_max_tokens, temperature=options.temperature,
                             seed=options.seed + i, stop_token_ids=stops) for i in range(len(prompts))]
    completions = engine.generate([p for p, _ in prompts], params) if prompts else []
    decode = engine.tokenizer.decode if engine.tokenizer is not None else (lambda ids: "")
    result["samples"] = [{"prompt": decode(p), "reference": decode(ref), "completion": c.text,
                          "completion_token_ids": c.token_ids, "finish_reason": c.finish_reason}
                         for (p, ref), c in zip(prompts, completions)]
    result["generation"] = engine.engine_stats()
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    out.write(f"[eval] {summary_line(result)} -> {path}\n")
    for s in result["samples"]:  # eval.json has them whole
        out.write(f"[eval] prompt: {shorten(s['prompt'], keep='end')!r}\n"
                  f"       completion: {shorten(s['completion'])!r}\n")
    return result


def shorten(text: str, limit: int = 200, keep: str = "start") -> str:
    """`text` cut to `limit` characters for the terminal, keeping its start or its end; … marks the cut."""
    if len(text) <= limit:
        return text
    return text[:limit - 1] + "…" if keep == "start" else "…" + text[-(limit - 1):]


def data_kind(dataset) -> str:
    """single (input_ids/labels rows), dpo (pairs) or groups (GRPO data)."""
    if not dataset.multi:
        return "single"
    return "dpo" if "chosen_input_ids" in dataset.columns else "groups"


def scorer(engine):
    """The forward the figures are computed with: with quantized weights (EngineOptions.quantize) the engine's
    fused forward, so they are the quantized model's; else the model's own (the same numbers in float32)."""
    return engine.runner.fused if engine.options.quantize else engine.model


def preference_figures(engine, dataset, kind: str, options: EvalOptions) -> dict:
    from astrai.infer.preference import dpo_eval, groups_eval

    if kind == "groups":
        return groups_eval(scorer(engine), dataset, options.max_rows, options.batch_tokens, engine.device)
    from astrai.model.adapter_files import load_checkpoint

    # a checkpoint, or a LoRA adapter on its base (the reference of a LoRA DPO run is the base itself)
    ref = load_checkpoint(Path(options.ref_model), None).to(device=engine.device,
                                                            dtype=next(engine.model.parameters()).dtype)
    return dpo_eval(scorer(engine), ref.eval(), dataset, options.beta, options.max_rows, options.batch_tokens,
                    engine.device)


def summary_line(r: dict) -> str:
    if r["data_kind"] == "dpo":
        return (f"held-out reward accuracy {r['reward_accuracy']:.3f}, margin {r['reward_margin']:.4f} (chosen "
                f"{r['reward_chosen']:.4f}, rejected {r['reward_rejected']:.4f}) on {r['pairs']} pairs")
    if r["data_kind"] == "groups":
        acc = f", choice accuracy {r['policy_accuracy']:.3f}" if "policy_accuracy" in r else ""
        return (f"held-out policy-weighted reward {r['policy_reward']:.3f} (random choice {r['reward_mean']:.3f})"
                f"{acc} on {r['groups']} groups")
    return (f"perplexity {r['perplexity']:.3f} (loss {r['loss']:.4f}) on {r['trained_tokens']} trained tokens, "
            f"{r['documents']} documents")


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
