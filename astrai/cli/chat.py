"""`astrai chat CHECKPOINT`: a terminal chat loop on the engine (astrai.serve.chat)."""

from __future__ import annotations

import sys

from astrai.config.serve import ChatOptions


def help_for(verb: str) -> str:
    return "talk to a checkpoint in the terminal (history kept, chat template applied, streamed)"


def add_arguments(parser) -> None:
    from astrai.infer.flags import add_flags

    parser.add_argument("checkpoint", help=ChatOptions.model_fields["checkpoint"].description)
    add_flags(parser, ChatOptions, skip=("checkpoint",))


def run(args) -> int:
    from astrai.infer.flags import build
    from astrai.serve.chat import chat_main

    try:
        return chat_main(build(ChatOptions, args, getattr(args, "overrides", [])))
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
