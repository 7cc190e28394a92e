"""The `astrai` command line: one module per verb, each with `add_arguments(parser)` and `run(args) -> int`.

    run.py         astrai run RECIPE: the recipe's stages, in the order written
    preprocess.py  astrai preprocess PIPELINE -i INPUT... -o OUT
    validate.py    astrai validate FILE
    inspect.py     astrai inspect PIPELINE_OR_RECIPE | OUTDIR
    export.py      astrai export OUT --to hf|jsonl|parquet DEST
    serve.py       astrai serve CHECKPOINT (OpenAI-compatible HTTP server); chat.py: astrai chat CHECKPOINT
    train.py, eval.py, generate.py   the stage verbs (from the stage registry)
The stage verbs come from the stage registry (astrai.config.stages): a stage that lands names its
verb module there and appears here with no change to this file. Options live in astrai.config
(one declaration each); paths (tokenizer, template, recipe-relative inputs) are resolved by
astrai.config.recipe.Loaded. Every verb takes `--set dotted.key=value` overrides (typed as YAML).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from astrai import __version__
from astrai.config import STAGES, ConfigError

# (verb, module) in help order; stage verbs are inserted after `run`, from the registry
_TOOL_VERBS = (("serve", "astrai.cli.serve"), ("chat", "astrai.cli.chat"), ("validate", "astrai.cli.validate"),
               ("inspect", "astrai.cli.inspect"), ("export", "astrai.cli.export"))


def verbs() -> list[tuple[str, str]]:
    # a stage without a verb module (tokenizer) runs only inside recipes
    stage_verbs = [(s.name, s.verb) for s in STAGES.values() if s.verb]
    return [("run", "astrai.cli.run"), *stage_verbs, *_TOOL_VERBS]


def add_set(p: argparse.ArgumentParser, verb: str = ""):
    # every example here must work as printed (tests/test_cli_set.py runs them)
    if verb == "run":
        example = ("--set preprocess.holdout=0.2 (STAGE.KEY; a pipeline key such as --set "
                   "preprocessing.max_seq_len=256 goes to the recipe's preprocess stages)")
    else:
        example = "--set preprocessing.max_seq_len=1024 (on a recipe, pipeline keys also as pipeline.KEY)"
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help=f"override a config key, e.g. {example}; repeatable, values are typed as YAML")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="astrai",
        description="Exact, packed, loss-masked LLM training data from a YAML pipeline.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action="version", version=f"astrai {__version__}")
    sub = ap.add_subparsers(dest="verb", metavar="VERB")
    for verb, module_name in verbs():
        module = importlib.import_module(module_name)
        p = sub.add_parser(verb, help=module.help_for(verb), formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        add_set(p, verb)
        p.set_defaults(verb_module=module)
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if not args.verb:
        ap.print_help()
        return 2
    if getattr(args, "workers", None) is not None and args.workers < 1:
        print(f"error: --workers {args.workers}: give 1 or more worker processes (or leave it out: one per core)",
              file=sys.stderr)
        return 2
    engine_memory(args.verb)
    try:
        return args.verb_module.run(args)
    except KeyboardInterrupt:
        # the verb says what an interruption keeps (finished units of work, or nothing)
        print(getattr(args.verb_module, "INTERRUPTED", "interrupted"), file=sys.stderr)
        return 130
    except Exception as e:
        return report(e, where=_output_of(args))


# the verbs whose time is the inference engine's decode (a stream of the weights per token)
ENGINE_VERBS = ("generate", "serve", "chat", "eval")
THP_ENV = "THP_MEM_ALLOC_ENABLE"


def engine_memory(verb: str) -> None:
    """For the engine's verbs, torch's CPU allocator puts large tensors in transparent huge pages (torch's own
    THP_MEM_ALLOC_ENABLE): a decode step streams every weight, and with 4 KiB pages a float32 SmolLM2 token took
    3% longer (bench/RESULTS.md). Set before torch is first imported (the allocator reads it once); a value in
    the environment, 0 included, is kept."""
    import os

    if verb in ENGINE_VERBS and "torch" not in sys.modules:
        os.environ.setdefault(THP_ENV, "1")


def _output_of(args) -> str:
    out = getattr(args, "output", None)
    return str(out) if isinstance(out, str) else ""


DEBUG_ENV = "ASTRAI_DEBUG"


def report(e: BaseException, stream=None, where: str = "") -> int:
    """Print an error as people read it and return the exit status (1).

    A problem with what the user gave (config, inputs, paths, the disk, memory) is one line, or the
    list of every problem of a config file. Anything else is a bug of astrai's: one line saying so,
    with the exception, so it can be reported. ASTRAI_DEBUG=1 adds the Python traceback to either."""
    import os
    import traceback

    stream = stream or sys.stderr
    if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
        traceback.print_exception(type(e), e, e.__traceback__, file=stream)
    line = user_error_line(e, where)
    if line is None:
        first = (str(e).strip().splitlines() or [""])[0]
        line = (f"internal error: {type(e).__name__}: {first} (a bug in astrai: please report it with the "
                f"command that caused it; {DEBUG_ENV}=1 prints the traceback)")
    print(line, file=stream)
    return 1


def user_error_line(e: BaseException, where: str = ""):
    """`error: ...` for an error caused by what the user gave or by the machine; None for a bug.
    `where`: the output the verb was writing, named when a full disk's error does not say."""
    from pydantic import ValidationError

    from astrai.errors import InputError, RecordError, no_space_left, os_error_line
    from astrai.recipe.rundir import RunDirError
    from astrai.runtime import OutputBusy, StageFailed
    from astrai.runtime_ray import ClusterError

    if isinstance(e, ConfigError):  # every problem of the file at once; a single one on one line
        if len(e.problems) != 1:
            return f"error: {e}"
        p = e.problems[0]
        return (f"error: {e.file}" + (f":{p.line}:{p.column}" if p.line is not None else "")
                + (f": {p.path}" if p.path else "") + f": {p.message}")
    if no_space_left(e):
        path = getattr(e, "filename", None) or where
        return (f"error: No space left on device" + (f" while writing {path}" if path else "")
                + f" ({_first_line(e)}); free space there or write elsewhere (what finished before is kept)")
    if isinstance(e, OSError) and not isinstance(e, (InputError, OutputBusy)):
        return f"error: {os_error_line(e)}"
    if isinstance(e, MemoryError) or _torch_out_of_memory(e):
        return ("error: out of memory" + (f": {_first_line(e)}" if str(e) else "")
                + " (ask for less: smaller batches, kv cache or model, or a machine with more memory)")
    text = str(e)
    if "not compiled with CUDA" in text or "no CUDA GPUs are available" in text or "Found no NVIDIA driver" in text:
        return f"error: a CUDA device was asked for, but {_first_line(e)}; use device cpu (or auto)"
    # model files as the libraries that read them report them (astrai.model names most problems itself)
    if type(e).__module__.split(".")[0] == "safetensors" or type(e).__name__ == "SafetensorError":
        return (f"error: cannot read the checkpoint's weights ({_first_line(e)}); the .safetensors file is damaged "
                f"or not one")
    if isinstance(e, RuntimeError) and str(e).startswith("Error(s) in loading state_dict"):
        detail = " ".join(str(e).split())
        return (f"error: the checkpoint's tensors do not fit its config.json ({detail[:300]}"
                + ("..." if len(detail) > 300 else "") + ")")
    if isinstance(e, ValidationError):  # options built in code from user values (flags, records)
        return "error: " + "; ".join(f"{'.'.join(map(str, err['loc'])) or 'options'}: {err['msg']}"
                                     for err in e.errors())
    if isinstance(e, (InputError, RecordError, ClusterError, OutputBusy, StageFailed, RunDirError, ValueError)):
        return f"error: {_first_line(e)}"
    return None


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def _torch_out_of_memory(e: BaseException) -> bool:
    text = str(e)
    return type(e).__name__ == "OutOfMemoryError" or (isinstance(e, RuntimeError) and (
        "can't allocate memory" in text or "out of memory" in text.lower()))
