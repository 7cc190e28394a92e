"""`astrai inspect`: see exactly which tokens will be trained, before spending GPU hours.

    astrai inspect PIPELINE_OR_RECIPE [-i INPUT] [-n N | --record K ...] [--compare OTHER.yaml]
    astrai inspect OUTDIR [-n N | --record K ...]
        [--format text|json|html] [-o FILE] [--table] [--color auto|always|never]

The pipeline or recipe is resolved here (a recipe brings its inputs and tokenizer; `pipeline.KEY=...`
overrides go to its pipeline, as with `astrai run`); the views are built by astrai.data.inspect.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Optional

from astrai.config import load_any
from astrai.errors import InputError
from astrai.data.inspect import (
    add_compare_marks, dataset_report, records_report, render_html, render_json, render_text,
)


def help_for(verb: str) -> str:
    return "show exactly which tokens are trained, before training"


DEFAULT_N = 3


def add_arguments(p):
    p.add_argument("target", nargs="?", help="pipeline/recipe YAML, or a preprocessed output directory")
    p.add_argument("-i", "--input", dest="inputs", action="append", default=None, metavar="INPUT",
                   help="input file, glob or saved HF dataset dir (repeatable) [default: the recipe's inputs]")
    p.add_argument("-n", dest="n", type=int, default=None, metavar="N",
                   help=f"show the first N records (or dataset rows) [default: {DEFAULT_N}]")
    p.add_argument("--record", dest="records", type=int, action="append", default=None, metavar="K",
                   help="show record (or dataset row) K, counted from 0 in input order (repeatable; replaces -n)")
    p.add_argument("--format", choices=("text", "json", "html"), default="text",
                   help="text, json (one object per line) or html (one self-contained page) [default: text]")
    p.add_argument("-o", "--output", default=None, metavar="FILE",
                   help="write to FILE [default: stdout; html: OUTDIR/inspect.html, or PIPELINE.inspect.html]")
    p.add_argument("--compare", default=None, metavar="OTHER.yaml",
                   help="show each record under a second pipeline/recipe too, side by side, marking tokens whose "
                        "label differs (--set applies to the first one only)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="HF tokenizer directory [default: the pipeline's, or the one recorded in manifest.json]")
    p.add_argument("--table", action="store_true", help="text: one token per line (id, position, doc, message)")
    p.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                   help="text colour [default: auto: on a terminal unless NO_COLOR is set]")
    p.add_argument("--width", type=int, default=None, help="text width for --compare [default: the terminal's]")


def run(args) -> int:
    if not args.target:
        print("astrai inspect: give a pipeline/recipe YAML (with -i INPUT) or a preprocessed output directory",
              file=sys.stderr)
        return 2
    if (args.n is not None and args.n < 1) or (args.records and min(args.records) < 0):
        print("astrai inspect: -n must be at least 1 and --record counts from 0", file=sys.stderr)
        return 2
    wanted = sorted(set(args.records)) if args.records else list(range(args.n or DEFAULT_N))
    explicit = bool(args.records)
    target = Path(args.target)
    if target.is_file() and target.suffix.lower() in (".parquet", ".arrow"):
        target = _output_of_shard(target)
    if target.is_dir():
        if args.compare:
            raise InputError("--compare runs two pipelines on input records: give a pipeline or recipe, "
                             "not a dataset directory")
        report = dataset_report(target, wanted, args.tokenizer, explicit)
    else:
        overrides = list(getattr(args, "overrides", None) or [])
        report = _records(str(target), args.inputs, wanted, overrides, args.tokenizer, explicit)
        if args.compare:
            report.other = _records(args.compare, args.inputs or report.inputs, wanted, [], args.tokenizer)
            add_compare_marks(report, report.other)
    if args.format == "json":
        text = render_json(report)
    elif args.format == "html":
        text = render_html(report)
    else:
        tty = args.output is None and sys.stdout.isatty()
        color = args.color == "always" or (args.color == "auto" and tty and not os.environ.get("NO_COLOR")
                                           and os.environ.get("TERM") != "dumb")
        width = args.width or (shutil.get_terminal_size((160, 40)).columns if tty else 160)
        text = render_text(report, color, width, args.table)
    output = args.output or (_html_path(target) if args.format == "html" else None)
    if output:
        if Path(output).is_dir():
            raise InputError(f"-o {output} is a directory: give a file name, e.g. {Path(output) / 'inspect.html'}")
        Path(output).write_text(text, encoding="utf-8")
        print(f"wrote {output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0 if report.entries else 1


def _output_of_shard(shard: Path) -> Path:
    """A shard named on the command line: inspect the output it belongs to (data/ sits under it)."""
    out = shard.absolute().parent.parent
    if shard.parent.name == "data" and (out / "manifest.json").is_file():
        return out
    raise InputError(f"{shard} is a data file, not an astrai output: give the preprocessed output directory "
                     f"(the folder holding manifest.json), or a pipeline/recipe YAML with -i {shard}")


def _html_path(target: Path) -> Path:
    """HTML is a page, not a stream: by default it goes next to the data it shows (an output
    directory's inspect.html, or PIPELINE.inspect.html beside the YAML), never the working directory."""
    return target / "inspect.html" if target.is_dir() else target.with_name(target.stem + ".inspect.html")


def _records(path: str, inputs: Optional[list[str]], wanted: list[int], overrides: list[str],
             tokenizer: Optional[str], explicit: bool = False):
    if not Path(path).is_file():
        raise InputError(f"{path}: no such file (give a pipeline/recipe YAML or a preprocessed output directory)")
    if Path(path).suffix.lower() not in (".yaml", ".yml"):
        raise InputError(f"{path}: not a YAML file: give a pipeline/recipe YAML (and the data with -i {path}) or a "
                         f"preprocessed output directory")
    cfg = load_any(path, tuple(overrides))
    inputs = inputs or cfg.recipe_inputs
    if not inputs:
        raise InputError(f"{path} is a pipeline: give the records to inspect with -i INPUT (a recipe names its own)")
    spec = cfg.tokenizer(tokenizer)
    if not spec:
        raise InputError("no tokenizer: set `tokenizer:` in the pipeline, the recipe, or pass --tokenizer DIR")
    from astrai.recipe.checkpoint_stage import tokenizer_source

    spec = tokenizer_source(spec)  # a recipe's packaged checkpoint, converted on first use
    return records_report(path, cfg.pipeline, cfg.base_dir, spec, inputs, wanted, explicit)
