"""`astrai validate FILE`: print OK, or every problem with its key path and line:column (exit 1)."""

from __future__ import annotations

from astrai.config import ConfigError, load_any


def help_for(verb: str) -> str:
    return "check a pipeline or recipe; print OK or every problem (exit 1)"


def add_arguments(p):
    p.add_argument("file", help="pipeline or recipe YAML")


def run(args) -> int:
    try:
        load_any(args.file, tuple(args.overrides))
    except ConfigError as e:
        for p in e.problems:
            print(f"{e.file}:{p}")
        print(f"{len(e.problems)} problem(s)")
        return 1
    print(f"{args.file}: OK")
    return 0
