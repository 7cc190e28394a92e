"""`astrai inspect` (placeholder until issue 5 lands)."""

import sys


def add_arguments(p):
    p.add_argument("target", nargs="?", help="pipeline/recipe YAML or a preprocessed output directory")


def run(args) -> int:
    print("astrai inspect: not available yet in this version.", file=sys.stderr)
    return 2
