"""`astrai serve CHECKPOINT`: an OpenAI-compatible HTTP server on the engine (astrai.serve.server)."""

from __future__ import annotations

import sys

from astrai.config.serve import ServeOptions


def help_for(verb: str) -> str:
    return "serve a checkpoint over the OpenAI API (chat and text completions, streaming; needs astrai[serve])"


def add_arguments(parser) -> None:
    from astrai.infer.flags import add_flags

    parser.add_argument("checkpoint", help=ServeOptions.model_fields["checkpoint"].description)
    add_flags(parser, ServeOptions, skip=("checkpoint",))


def run(args) -> int:
    from astrai.infer.flags import build
    from astrai.serve.server import serve_main

    try:
        return serve_main(build(ServeOptions, args, getattr(args, "overrides", [])))
    except (ValueError, FileNotFoundError) as e:  # bad options, a busy port, a checkpoint that does not load
        print(f"error: {e}", file=sys.stderr)
        return 1
