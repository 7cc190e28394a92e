"""`astrai generate`: the verb of the generate stage; options, flags and behaviour live in astrai.infer.generate."""

from __future__ import annotations

from astrai.config.stages import STAGES
from astrai.infer.generate import add_arguments, run  # noqa: F401  (the verb protocol: add_arguments, run)


def help_for(verb: str) -> str:
    return STAGES[verb].help
