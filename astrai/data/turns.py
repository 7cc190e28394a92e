"""Where a trained turn ends, for answers the template does not close itself.

- A plain-text answer to a chat prompt (a GRPO completion: a train section of a source without a
  template, in a pipeline whose prompt ends with the generation prompt) ends with the template's
  end-of-turn token, as a chat answer does, labelled by the end_of_turn policy: a policy never
  shown where to stop never learns to stop. The token is found once per pipeline: the first special
  token the template writes after an answer (whitespace before it allowed).
- A trained message with no text (blank content, no reasoning, no tool calls) would train its
  end-of-turn token alone, an answer that stops at once: `empty_messages` applies
  preprocessing.empty_message (filter the record, mask the message, or train it so).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from astrai.text.template import REASONING_FIELDS
from astrai.schema import IGNORE_INDEX


def end_of_turn_id(tok, after_answer: str) -> Optional[int]:
    """The special token that ends an assistant turn in `after_answer` (the template's text after an
    answer), or None if text comes before any special token."""
    if not after_answer:
        return None
    enc = tok.tok.encode(after_answer, add_special_tokens=False)
    for i, (s, e) in zip(enc.ids, enc.offsets):
        if i in tok.special_ids:
            return i
        if after_answer[s:e].strip():
            return None
    return None


def answer_sources(sources: dict, eot: Optional[int]) -> set:
    """Names of the sources that are plain-text answers to a chat prompt."""
    prompted = any(s.template and s.add_generation_prompt for secs, _ in sources.values() for s in secs)
    if not prompted or eot is None:
        return set()
    return {name for name, (secs, _) in sources.items()
            if name and not any(s.template for s in secs) and any(s.action == "train" for s in secs)}


def end_answer(seq, eot: int, policy: str):
    """The answer with the end-of-turn token at its end (appended unless the text has it), labelled
    by the end_of_turn policy like a chat answer's."""
    label = eot if policy == "train" else IGNORE_INDEX
    if len(seq) and seq.input_ids[-1] == eot:
        if seq.labels is not None:
            seq.labels[-1] = label
        return seq
    labels = None if seq.labels is None else np.append(seq.labels, np.int32(label)).astype(np.int32)
    return dataclasses.replace(seq, input_ids=np.append(seq.input_ids, np.int32(eot)).astype(np.int32),
                               labels=labels, token_msg=np.append(seq.token_msg, np.int32(-1)).astype(np.int32))


def is_empty(m: dict) -> bool:
    """No text at all: blank content, no reasoning, no tool calls."""
    texts = [m.get("content")] + [m.get(k) for k in REASONING_FIELDS]
    return not m.get("tool_calls") and not any(isinstance(t, str) and t.strip() for t in texts)


def empty_messages(msgs: list[dict], trained: list[bool], policy: str) -> Optional[str]:
    """Apply the empty_message policy to trained messages without text: 'mask' untrains them in
    `trained`; 'filter' returns why the record is dropped; 'train' keeps them as they are."""
    if policy == "train":
        return None
    for i, m in enumerate(msgs):
        if trained[i] and is_empty(m):
            if policy == "filter":
                return (f"message {i} ({m.get('role')}) is trained but has no text (set "
                        f"preprocessing.empty_message: mask or train to keep such records)")
            trained[i] = False
    return None
