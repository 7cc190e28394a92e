"""`astrai train CONFIG.yaml [--set key=value]`: the verb of the train stage (astrai.train.cli)."""

from __future__ import annotations

from astrai.config.stages import STAGES


def help_for(verb: str) -> str:
    return STAGES[verb].help


def add_arguments(p):
    p.add_argument("config", help="train YAML (TrainOptions keys; paths relative to the file)")


def run(args) -> int:
    from astrai.train.cli import main

    argv = [args.config]
    for expr in args.overrides:
        argv += ["--set", expr]
    return main(argv)
