"""The verb of a registered stage that has not landed yet: says so and exits 2."""

from __future__ import annotations

import argparse
import sys

from astrai.config.stages import STAGES, not_landed_message


def help_for(verb: str) -> str:
    return f"({not_landed_message(STAGES[verb])})"


def add_arguments(p):
    p.add_argument("args", nargs="*", help=argparse.SUPPRESS)


def run(args) -> int:
    print(f"astrai {args.verb}: {not_landed_message(STAGES[args.verb])} in this version.", file=sys.stderr)
    return 2
