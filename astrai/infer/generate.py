"""`astrai generate CHECKPOINT`: continue text or answer conversations with a checkpoint directory.

    astrai generate runs/sft/model --prompt "Once upon a time" --max-tokens 64
    astrai generate runs/sft/model --chat chats.jsonl --temperature 0.7 --seed 1
    echo '[{"role": "user", "content": "Hi"}]' | astrai generate runs/sft/model --chat -
    astrai generate runs/sft/model --input batch.jsonl --output out.jsonl
    astrai generate runs/sft/model --chat chats.jsonl --json-schema answer.schema.json

`--prompt` continues the raw text (tokenized as the tokenizer does by default) and prints the
continuation; `--chat` renders each conversation (a JSONL line: {"messages": [...]} or a bare
list of messages) with the chat template and the generation prompt; `--input` reads JSONL records
holding "prompt" or "messages" (optionally "sampling": that record's own sampling keys). `-` reads
standard input. Several requests are generated together (continuous batching). `--json-schema FILE`
holds every answer to JSON valid against that schema (astrai.infer.grammar: the tokens the schema
cannot take next are masked while sampling); the schema is read and compiled before the model is
loaded, and checked against the tokenizer before the first token.

What is printed: on a terminal, --chat and --input show each conversation (or prompt) and its
answer as text, one request streamed as it is generated; with --output FILE, --json, or when
standard output is not a terminal, one JSONL record per request, written and flushed as each one
finishes ("index" is its position in the input), so an interrupted batch keeps what finished and
says so. Engine statistics go to standard error.

Everything a user gives is checked before the model is loaded, each problem one line naming the
file:line and key: the records, their sampling keys, the --output path. What only the model can
tell (token ids outside its vocabulary, too many logprobs, a conversation the chat template
refuses) is checked for every request before the first token is generated.

Sampling, highest first: a record's own "sampling", then flags and --set, then the checkpoint's
generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty; do_sample: false
means greedy), then astrai's defaults.
"""

from __future__ import annotations

import sys

from astrai.config.infer import GenerateOptions, SamplingParams, sampling_with, with_checkpoint_defaults
from astrai.errors import InputError, InvalidRequest
from astrai.infer.generate_io import Item, ResultWriter, TextWriter, completion_record, open_output, read_records
from astrai.text.template import resolve_template

__all__ = ["GenerateOptions", "generate_main", "completion_record", "read_records"]

MAX_SCHEMA_BYTES = 4 << 20  # a JSON Schema file (the largest real ones are tens of kB)
SAMPLING_ORDER = ("sampling, highest first: a record's own \"sampling\" (--input), then the flags and --set, then "
                  "the checkpoint's generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty; "
                  "do_sample: false = greedy), then the defaults shown")


def _why(c, engine) -> str:
    if c.finish_reason == "length":
        return "max_tokens reached"
    if c.finish_reason == "stop" and isinstance(c.stop_reason, int):
        name = engine.tokenizer.tok.id_to_token(c.stop_reason) if engine.tokenizer is not None else None
        return f"stop token {c.stop_reason}" + (f" ({name})" if name else "") + "; --ignore-eos continues past it"
    if c.finish_reason == "stop" and c.stop_reason is None:
        return "the answer is complete (--json-schema)"
    if c.finish_reason == "stop":
        return f"stop string {c.stop_reason!r}"
    return c.finish_reason or "unknown"


def _items(options: GenerateOptions, stdin) -> list[Item]:
    if options.prompt is not None:
        return [Item(options.prompt, None, "--prompt")]
    return read_records(options.chat or options.input, options.chat is not None, options.sampling, stdin)


def generate_main(options: GenerateOptions, out=None, err=None, stdin=None) -> int:
    from astrai.infer.engine import Engine

    out, err = out or sys.stdout, err or sys.stderr
    items = _items(options, stdin)
    spec = options.engine.chat_template
    if spec not in (None, "tokenizer"):  # found and compiled now (never rendered for text), not after the load
        resolve_template(spec)
    grammar = _schema_grammar(options.json_schema) if options.json_schema else None
    sink = open_output(options.output) if options.output else None  # before the model is loaded
    try:
        engine = Engine.from_checkpoint(options.checkpoint, options.engine, options.base)
        err.write(f"[generate] {engine.device.type}, {engine.dtype_reason}\n")
        if grammar is not None:
            try:
                engine.grammar.check(grammar)
            except InvalidRequest as e:
                raise InputError(f"--json-schema {options.json_schema}: {e}") from None
        base = with_checkpoint_defaults(options.sampling, engine.generation_defaults)
        params = [sampling_with(base, it.sampling, it.where) for it in items]
        text_view = not sink and not options.as_json and (options.prompt is not None or _is_terminal(out))
        writer = TextWriter(out, len(items), echo=options.prompt is None) if text_view else \
            ResultWriter(sink or out, options.output or "standard output", len(items), fresh=sink is not None)
        _run(engine, items, params, writer, err, grammar)
    finally:
        if sink is not None:
            sink.close()
    s = engine.engine_stats()
    err.write(f"[generate] {s['requests']} request(s), {s['generated_tokens']} tokens in {s['seconds']:.2f}s "
              f"({s['tokens_per_second']:.1f} tok/s), prefix cache hit rate {s['prefix_cache_hit_rate']:.0%}, "
              f"{s['preemptions']} preemption(s)\n")
    return 0


def _schema_grammar(path: str) -> str:
    """The grammar of the JSON Schema in file `path`; InputError naming the file when it is not one."""
    from astrai import json_bounded
    from astrai.infer.grammar import check_grammar, json_grammar

    schema = json_bounded.read_json(path, "--json-schema file", MAX_SCHEMA_BYTES)
    try:
        grammar = json_grammar(schema)
        check_grammar(grammar)  # without the tokenizer: before the model is loaded
        return grammar
    except InvalidRequest as e:
        raise InputError(f"--json-schema {path}: {e}") from None


def _run(engine, items: list[Item], params: list[SamplingParams], writer, err, grammar=None) -> None:
    writer.start(items)
    last = None
    try:
        for ev in engine.stream([it.prompt for it in items], params, grammar):
            writer.delta(ev.index, ev.text)
            if ev.completion is not None:
                writer.done(ev.completion, items[ev.index])
                last = ev.completion
    except InvalidRequest as e:  # found before the first token: say which record
        where = items[e.index].where if e.index is not None else ""
        raise InputError(f"{where}: {e}" if where and where != "--prompt" else str(e)) from None
    except KeyboardInterrupt:
        raise Interrupted(writer.kept()) from None
    if len(items) == 1 and last is not None:  # say why it stopped: an empty answer must not look like a failure
        err.write(f"[generate] finished after {len(last.token_ids)} token(s): {_why(last, engine)}\n")


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during generation, carrying what was kept (the CLI prints it, exit 130)."""


def _is_terminal(stream) -> bool:
    return bool(getattr(stream, "isatty", lambda: False)())


def add_arguments(parser) -> None:
    from astrai.infer.flags import add_flags

    parser.epilog = SAMPLING_ORDER
    parser.add_argument("checkpoint", help=GenerateOptions.model_fields["checkpoint"].description)
    add_flags(parser, GenerateOptions, skip=("checkpoint",))


def run(args) -> int:
    from astrai.infer.flags import build

    try:
        return generate_main(build(GenerateOptions, args, getattr(args, "overrides", [])))
    except Interrupted as e:
        print(f"interrupted: {e}", file=sys.stderr)
        return 130
