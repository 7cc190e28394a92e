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
    try:
        return args.verb_module.run(args)
    except KeyboardInterrupt:
        # finished units of work are kept (completion markers); what was half-written is redone
        print("interrupted; rerun to resume", file=sys.stderr)
        return 130
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Exception as e:
        from astrai.errors import InputError, RecordError
        from astrai.runtime_ray import ClusterError

        if isinstance(e, (InputError, RecordError, ClusterError)):
            print(f"error: {e}", file=sys.stderr)
            return 1
        raise
