"""`astrai chat CHECKPOINT`: talk to a model in the terminal, on the same engine as `astrai serve`.

Each line you type is a user message; the whole conversation so far (history kept, an optional
`--system` message first) is rendered with the checkpoint's chat template (or `--chat-template`) and
the answer streams as it is generated. The answer goes to stdout, everything else (the prompt, notes
on why an answer stopped) to stderr, so `astrai chat CKPT < questions.txt > answers.txt` works too.
Commands: /reset forgets the history, /exit (or Ctrl-D) quits; Ctrl-C stops the answer being
generated (what was said so far stays in the history) and Ctrl-C at the prompt quits.
Turns share their prefix with the previous one, so the radix cache computes each turn's new text only.
Sampling: the flags over the checkpoint's generation_config.json over the defaults, as `astrai
generate` and `astrai serve` resolve it (astrai.config.infer.with_checkpoint_defaults).
"""

from __future__ import annotations

import sys

from astrai.config.infer import checkpoint_sampling_note, with_checkpoint_defaults
from astrai.config.serve import ChatOptions

HELP = "astrai chat: type a message and Enter; /reset forgets the history, /exit or Ctrl-D quits"


def _read(inp, err, interactive: bool):
    if interactive:
        try:
            return input("> ")
        except EOFError:
            return None
    line = inp.readline()
    return None if not line else line.rstrip("\n")


def chat_main(options: ChatOptions, inp=None, out=None, err=None) -> int:
    from astrai.infer.engine import Engine

    inp, out, err = inp or sys.stdin, out or sys.stdout, err or sys.stderr
    engine = Engine.from_checkpoint(options.checkpoint, options.engine, options.base)
    if engine.template is None:
        print("error: this checkpoint has no chat template (tokenizer_config.json or chat_template.jinja); "
              "give one with --chat-template chatml (or a .jinja path)", file=err)
        return 1
    sampling = with_checkpoint_defaults(options.sampling, engine.generation_defaults)
    interactive = inp is sys.stdin and sys.stdin.isatty() and out is sys.stdout and sys.stdout.isatty()
    if interactive:
        import readline  # noqa: F401  (line editing and history for input())
    opening = [{"role": "system", "content": options.system}] if options.system else []
    history = list(opening)
    print(f"{engine.device.type}, {engine.dtype_reason}", file=err)
    print(HELP, file=err, flush=True)
    note = checkpoint_sampling_note(engine.generation_defaults)
    if note:
        print(f"[{note}]", file=err, flush=True)
    while True:
        try:
            line = _read(inp, err, interactive)
        except KeyboardInterrupt:
            print(file=err)
            break
        if line is None or line.strip() in ("/exit", "/quit"):
            break
        if line.strip() == "/reset":
            history = list(opening)
            print("[history cleared]", file=err, flush=True)
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        answer = _answer(engine, history, sampling, out, err)
        history.append({"role": "assistant", "content": answer})
    return 0


def _answer(engine, history: list[dict], sampling, out, err) -> str:
    parts, done = [], None
    try:
        for ev in engine.stream([history], sampling):
            out.write(ev.text)
            out.flush()
            parts.append(ev.text)
            done = ev.completion or done
    except KeyboardInterrupt:  # the stream's own cleanup aborts the request and frees its pages
        print("\n[stopped]", file=err, flush=True)
    out.write("\n")
    out.flush()
    if done is not None and done.finish_reason == "length":
        print(f"[the answer reached max_tokens ({sampling.max_tokens}); --max-tokens gives more]",
              file=err, flush=True)
    return "".join(parts)
