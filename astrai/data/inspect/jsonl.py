"""`--format json`: one JSON object per line, for scripts.

Lines come in this order: stats (dataset mode: stats.json as is), note, then one record | bin |
row object per entry, or with --compare one compare object per record holding both sides (a, b).
An entry has its status (+ reason, detail), counts, seq_lens, values and notes, and per token
{id, text, trained, position_id, doc, special} (+ msg, role for records; + diff: "label",
"only_here" or null with --compare). A single output puts its tokens on the entry; multi-output
entries list seqs, one per source (and list item).
"""

from __future__ import annotations

import json

from astrai.data.inspect.views import Entry, Report


def entry_json(e: Entry) -> dict:
    d: dict = {"kind": e.kind, "index": e.index, "where": e.where, "status": e.status}
    if e.reason:
        d.update(reason=e.reason, detail=e.detail)
    for key in ("seq_lens", "values", "notes"):
        if getattr(e, key):
            d[key] = getattr(e, key)
    d["counts"] = {"tokens": sum(len(v.ids) for v in e.seqs), "trained": sum(int(v.trained.sum()) for v in e.seqs),
                   "truncated": sum(v.truncated for v in e.seqs)}
    seqs = []
    for v in e.seqs:
        marks = e.marks.get(v.label)
        toks = []
        for k in range(len(v.ids)):
            t = {"id": int(v.ids[k]), "text": v.texts[k], "trained": bool(v.trained[k]),
                 "position_id": None if v.positions is None else int(v.positions[k]), "doc": int(v.docs[k]),
                 "special": bool(v.special[k])}
            if v.msg is not None:
                t.update(msg=int(v.msg[k]), role=v.role(k))
            if marks is not None:
                t["diff"] = {"^": "label", "+": "only_here"}.get(str(marks[k]))
            toks.append(t)
        seqs.append({"source": v.source, "item": v.item, "counts": {"tokens": len(v.ids),
                     "trained": int(v.trained.sum()), "truncated": v.truncated}, "tokens": toks})
    # one output (SFT, pretraining, bins): the tokens right here; multi-output: one entry per sequence
    if len(seqs) == 1 and not seqs[0]["source"]:
        d["tokens"] = seqs[0]["tokens"]
    elif seqs:
        d["seqs"] = seqs
    return d


def render_json(report: Report) -> str:
    lines: list[dict] = [{"kind": "stats", "stats": report.stats}] if report.is_dataset and report.stats else []
    lines += [{"kind": "note", "text": n} for n in report.notes]
    if report.other is None:
        lines += [entry_json(e) for e in report.entries]
    else:
        lines += [{"kind": "compare", "index": a.index, "where": a.where, "a": entry_json(a), "b": entry_json(b)}
                  for a, b in zip(report.entries, report.other.entries)]
    return "".join(json.dumps(x, ensure_ascii=False, default=str) + "\n" for x in lines)
