"""`astrai validate FILE [-i INPUT] [--deep [N]]`: check what can be checked without running.

Config problems first (every one, with key path and line:column). Then, when the config is valid:
the tokenizer (directory or package) exists and loads, the chat template exists and compiles and
its markers are single tokens, and a recipe's input paths exist (a recipe of named stages is
checked by astrai.recipe: every stage, reference and input). `--deep N` processes the first N
input records as a run would (into a temporary directory that is removed) and reports rejects by
reason, the first few located in the user's file (file:line: key: what), and the trained share;
every reject is counted, also where the pipeline's on_error: raise would stop a run at the first.
`--rejects FILE` keeps all of them (rejects.jsonl lines). On a recipe, `--deep` reads its first
preprocess stage's inputs with its pipeline and tokenizer (a packaged checkpoint converted first).
Exit 1 on any problem, and with `--deep` when a run would fail on the records read (a reject
where the pipeline's on_error is raise, or more than max_reject_share rejected).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from astrai.config import ConfigError, is_staged, load_any, load_yaml

DEEP_DEFAULT = 100


def help_for(verb: str) -> str:
    return "check a pipeline or recipe (and its tokenizer, template, inputs); print OK or every problem (exit 1)"


def add_arguments(p):
    p.add_argument("file", help="pipeline or recipe YAML")
    p.add_argument("-i", "--input", dest="inputs", action="append", default=None, metavar="INPUT",
                   help="inputs to check (and to read with --deep) [default: the recipe's inputs]")
    p.add_argument("--tokenizer", default=None, metavar="DIR", help="HF tokenizer directory [default: the config's]")
    p.add_argument("--deep", nargs="?", type=int, const=DEEP_DEFAULT, default=None, metavar="N",
                   help=f"also process the first N records and report rejects and the trained share "
                        f"[default N: {DEEP_DEFAULT}]")
    p.add_argument("--rejects", default=None, metavar="FILE",
                   help="with --deep: write every rejected record there (JSONL: file, line, key, reason, detail, "
                        "record)")


def run(args) -> int:
    try:
        if is_staged(load_yaml(args.file)[0]):  # chained stages: every stage, reference and input checked
            from astrai.recipe.command import load_recipe_spec

            load_recipe_spec(args.file, tuple(args.overrides))
            if args.deep is None:
                print(f"{args.file}: OK")
                return 0
        cfg = load_any(args.file, tuple(args.overrides))
    except ConfigError as e:
        for p in e.problems:
            print(f"{e.file}:{p}")
        print(f"{len(e.problems)} problem(s)")
        return 1
    problems = _resources(cfg, args)
    for p in problems:
        print(f"{args.file}: {p}")
    if problems:
        print(f"{len(problems)} problem(s)")
        return 1
    if args.deep is not None:
        if args.deep < 1:
            print(f"{args.file}: --deep {args.deep}: give a number of records >= 1")
            return 1
        return _deep(cfg, args)
    print(f"{args.file}: OK")
    return 0


def _resources(cfg, args) -> list[str]:
    """The tokenizer, template and inputs the config names: each problem as one line with its fix."""
    from astrai.errors import InputError
    from astrai.data.preflight import check_model_template, check_template_markers
    from astrai.recipe.checkpoint_stage import tokenizer_source
    from astrai.data.process import Processor
    from astrai.data.read import expand_inputs
    from astrai.text.template import resolve_template
    from astrai.text.tokenizer import load_tokenizer

    problems = []
    inputs = args.inputs or cfg.recipe_inputs
    if inputs:  # a pipeline alone names none (give -i to check some)
        try:
            expand_inputs(inputs)
        except InputError as e:
            problems.append(str(e))
    spec = cfg.tokenizer(args.tokenizer)
    if not spec:
        if cfg.pipeline.template_spec:
            problems.append("no tokenizer: set `tokenizer:` or pass --tokenizer DIR (the template cannot be checked "
                            "without it)")
        return problems
    try:
        tok = load_tokenizer(tokenizer_source(spec), cfg.base_dir)
        template = (resolve_template(cfg.pipeline.template_spec, tok, cfg.base_dir)
                    if cfg.pipeline.template_spec else None)
        check_model_template(cfg.pipeline, tok, template)
        check_template_markers(Processor(cfg.pipeline, tok, cfg.base_dir, template))
    except InputError as e:
        problems.append(str(e))
    return problems


SHOWN_REJECTS = 5


def _deep(cfg, args) -> int:
    from astrai.data.preprocess import run_preprocess
    from astrai.errors import InputError
    from astrai.recipe.checkpoint_stage import tokenizer_source

    inputs = args.inputs or cfg.recipe_inputs
    if not inputs:
        print(f"{args.file}: --deep needs records: give -i INPUT (a recipe names its own)")
        return 1
    pp = cfg.pipeline.preprocessing.model_copy(update={"max_items": args.deep, "max_reject_share": 1.0,
                                                       "on_error": "skip"})
    pipe = cfg.pipeline.model_copy(update={"preprocessing": pp})
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "out"
        try:
            stats = run_preprocess(pipe, inputs, str(out), tokenizer=tokenizer_source(cfg.tokenizer(args.tokenizer)),
                                   workers=1, base_dir=cfg.base_dir, log=lambda s: None)
        except InputError:
            if not (out / "stats.json").exists():
                raise
            stats = json.loads((out / "stats.json").read_text())  # nothing kept: reported below, with the reasons
        rejects = out / "rejects.jsonl"
        lines = rejects.read_text(encoding="utf-8").splitlines() if rejects.exists() else []
        if args.rejects and lines:
            shutil.copyfile(rejects, args.rejects)
    read, rejected = stats["records_read"], stats["records_rejected"]
    share = stats["supervised_share"]
    print(f"{args.file}: first {read} records: {stats['records_kept']} kept, {stats['records_filtered']} filtered, "
          f"{rejected} rejected; trained share {share:.1%}" if share is not None else
          f"{args.file}: first {read} records: {stats['records_kept']} kept, {rejected} rejected")
    for reason, n in stats["rejected_by_reason"].items():
        print(f"  rejected {reason}: {n}")
    for line in lines[:SHOWN_REJECTS]:
        r = json.loads(line)
        print(f"  {r['file']}:{r['line']}: {r['key'] + ': ' if r.get('key') else ''}{r['detail']} ({r['reason']})")
    if len(lines) > SHOWN_REJECTS:
        print(f"  ... {len(lines) - SHOWN_REJECTS} more" + (f": all in {args.rejects}" if args.rejects else
                                                              " (--rejects FILE writes them all)"))
    elif args.rejects and lines:
        print(f"  rejects written to {args.rejects}")
    if read == 0 or stats["records_kept"] == 0 or rejected > cfg.pipeline.preprocessing.max_reject_share * read:
        print("problem: a run would fail (no record kept, or more rejected than preprocessing.max_reject_share)")
        return 1
    if rejected and cfg.pipeline.preprocessing.on_error == "raise":
        print("problem: a run stops at the first of these (on_error: raise); fix the records, or set "
              "preprocessing.on_error: skip to write them to rejects.jsonl and go on")
        return 1
    return 0
