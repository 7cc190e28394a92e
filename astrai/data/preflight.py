"""Checks made before any record is read, so a mistake costs seconds, not a whole run of rejects.

`check_template_markers`: the special markers a chat template writes around messages (`<|im_start|>`,
`<|eot_id|>`, `<start_of_turn>`, `</s>`, ...) must each be ONE token of the tokenizer. When they are
not (chatml with a tokenizer that lacks them, and no `added_tokens:`), every conversation fails
with `boundary_straddle` as a marker's pieces merge with message text; found here instead, with the fix.
Markers are found in what the template renders around probe messages (never in message text),
by their shape: `<|...|>` or `<name>` / `</name>` (lower-case names, so Llama-2's `<<SYS>>` and
`[INST]`, plain text by design, are not taken for markers).

`check_model_template`: a tokenizer that is a model checkpoint's (config.json beside it) carries the
template the model serves with; data rendered with another one is refused before any work unless
the pipeline allows it (astrai.text.drift).

`check_reject_share`: a run that keeps nothing, or rejects more than `max_reject_share` of what it
read, fails with the reasons instead of exiting 0.
"""

from __future__ import annotations

import re

from astrai.errors import InputError
from astrai.text.template import TemplateLimit

MARKER = re.compile(r"<\|[^<>|\s]{1,40}\|>|(?<!<)</?[a-z][a-z0-9_]{0,30}>(?!>)")
_PROBES = ("QSYSPROBEQ", "QUSERPROBEQ", "QASSISTANTPROBEQ")


def template_markers(template, special_tokens: dict, template_kwargs: dict) -> list[str]:
    """The marker strings the template writes outside message content, in order of first use."""
    convs = ([{"role": "system", "content": _PROBES[0]}, {"role": "user", "content": _PROBES[1]},
              {"role": "assistant", "content": _PROBES[2]}],
             [{"role": "user", "content": _PROBES[1]}, {"role": "assistant", "content": _PROBES[2]}])
    for conv in convs:  # some templates refuse a system message
        try:
            text = template.render(conv, add_generation_prompt=False, special_tokens=special_tokens, **template_kwargs)
        except TemplateLimit:  # past its size or time bounds: the template is at fault, stop before any work
            raise
        except Exception:  # raise_exception or a template bug: the records will report it with its location
            continue
        for probe in _PROBES:
            text = text.replace(probe, "\0")
        return list(dict.fromkeys(MARKER.findall(text)))
    return []


def check_template_markers(processor) -> None:
    if processor.template is None:
        return
    hf = processor.tok.tok
    markers = template_markers(processor.template, processor.special, processor.kwargs)
    split = [m for m in markers if len(hf.encode(m, add_special_tokens=False).ids) != 1]
    if split:
        listed = ", ".join(repr(m) for m in split)
        verb = "is not a single token" if len(split) == 1 else "are not single tokens"
        raise InputError(f"chat template {processor.template.name}: {listed} {verb} of tokenizer "
                         f"{processor.tok.path}, so every message boundary would be rejected (boundary_straddle); add `added_tokens: [{', '.join(split)}]` to the pipeline, "
                         f"or use a tokenizer (or template) that has them")


def check_model_template(pipeline, tokenizer, template) -> None:
    """Refuse (InputError) a template that renders unlike the one of the checkpoint the tokenizer
    comes from, unless `chat_template_mismatch: allow`."""
    from pathlib import Path

    from astrai.text.drift import MISMATCH_FIX, template_difference
    from astrai.text.template import resolve_template

    if template is None or pipeline.chat_template_mismatch == "allow" or not tokenizer.chat_template \
            or not (Path(tokenizer.path) / "config.json").is_file():
        return
    diff = template_difference(template, resolve_template("tokenizer", tokenizer), tokenizer.special_tokens_map,
                               dict(pipeline.input.template_kwargs))
    if diff:
        raise InputError(f"{diff}; {MISMATCH_FIX}")


def check_reject_share(stats: dict, max_share: float, rejects_path: str) -> None:
    read, kept, rejected = stats["records_read"], stats["records_kept"], stats["records_rejected"]
    if read == 0:
        return  # an empty input is warned about, not failed
    if kept > 0 and rejected <= max_share * read:
        return
    reasons = ", ".join(f"{r}: {n}" for r, n in sorted(stats["rejected_by_reason"].items(), key=lambda kv: -kv[1]))
    filtered = ", ".join(f"{r}: {n}" for r, n in sorted(stats["filtered_by_reason"].items(), key=lambda kv: -kv[1]))
    what = "no record was kept" if kept == 0 else f"{rejected} of {read} records were rejected " \
                                                  f"(more than max_reject_share {max_share:g})"
    raise InputError(f"{what}: rejected by reason {{{reasons or 'none'}}}, filtered {{{filtered or 'none'}}}; see "
                     f"{rejects_path} and fix the data or pipeline (or raise preprocessing.max_reject_share); nothing "
                     f"was marked done, so a rerun checks again")
