"""`--format text`: the report for a terminal or a plain file.

Per entry: a heading with its status, info lines (why it is not trained, counts, values, notes),
then its tokens, with message turns or a bin's documents as header lines; --table prints one token
per line (id, position, doc, message, role). --compare prints the two pipelines in two columns,
one row per message turn, with a gutter line (^, +) under marked tokens. Dataset mode shows
stats.json's statistics first (stats_lines, which the html page shows too); records mode ends
with a one-line summary.
"""

from __future__ import annotations

from typing import Optional

from astrai.data.inspect.layout import SPECIAL, TRAINED, fmt, gutter, layout, text_width, token_groups, wrap
from astrai.data.inspect.tokens import visible
from astrai.data.inspect.views import Entry, Report, SeqView


def _paint(s: str, code: str, color: bool) -> str:
    return f"\x1b[{code}m{s}\x1b[0m" if color else s


def _pct(a, b) -> str:
    return f"{100 * a / b:.1f}%" if b else "n/a"


def _counts_line(e: Entry) -> str:
    n, t = sum(len(v.ids) for v in e.seqs), sum(int(v.trained.sum()) for v in e.seqs)
    if e.seq_lens is None:
        return f"{n} tokens · {t} trained ({_pct(t, n)}) · {sum(v.truncated for v in e.seqs)} truncated"
    fill = f" ({_pct(n, e.capacity)} of max_packed_len {e.capacity})" if e.capacity else ""
    return f"{len(e.seq_lens)} doc{'s' * (len(e.seq_lens) != 1)} · {n} tokens{fill} · {t} trained ({_pct(t, n)})"


def info_lines(e: Entry) -> list[str]:
    """The lines under an entry's heading: why it is not trained, its counts, values, notes."""
    out = [e.detail] if e.reason and e.detail else []
    out += [_counts_line(e)] if e.seqs else []
    out += ["values: " + ", ".join(f"{k}={v}" for k, v in e.values.items())] if e.values else []
    return out + [f"note: {n}" for n in e.notes]


def status_text(e: Entry) -> str:
    s = e.status.upper() if e.status in ("filtered", "rejected", "excluded") else e.status
    return s + (f": {e.reason}" if e.reason else "")


def render_text(report: Report, color: bool, width: int, table: bool = False) -> str:
    out = [f"astrai inspect {report.title}"]
    if report.other is not None:
        out += [f"  compared with {report.other.title}",
                "gutter: ^ label differs from the other pipeline's token there; + trained, no counterpart there"]
    legend = fmt([("trained", TRAINED), (" masked ", 0), ("«special»", SPECIAL)], True) if color else \
        "⟦trained⟧ masked «special»"
    out.append(f"legend: {legend}  ↵ newline  ⇥ tab  ◌ part of a character")
    out += report.notes
    if report.is_dataset and report.stats:
        out += [""] + stats_lines(report.stats, color)
    for k, e in enumerate(report.entries):
        out.append("")
        if report.other is not None:
            out += _compare_text(e, report.other.entries[k], report, color, width)
            continue
        bad = e.status in ("filtered", "rejected", "excluded")
        out.append(_paint(f"═══ {e.kind} {e.index} · {e.where} · {status_text(e)} ═══",
                          ("1;31" if e.status == "rejected" else "1;33") if bad else "1", color))
        out += ["    " + line for line in info_lines(e)]
        for v in e.seqs:
            if v.label:
                out.append(_paint(f"── {v.label} ──", "1;36", color))
            cells = [c for g in token_groups(v) for c in g]
            out += _table(v, color) if table else [fmt(line, color) for line in layout(cells, not color)]
    if report.entries and not report.is_dataset and report.other is None:
        s = report.stats
        out += ["", f"{len(report.entries)} record(s): {s['records_kept']} kept, {s['records_filtered']} filtered, "
                    f"{s['records_rejected']} rejected · {s['tokens']} tokens, {s['trained_tokens']} trained "
                    f"({_pct(s['trained_tokens'], s['tokens'])})"]
    return "\n".join(out) + "\n"


def _table(v: SeqView, color: bool) -> list[str]:
    out = [f"{'#':>6} {'id':>8} {'pos':>6} {'doc':>4} {'msg':>4} {'role':<10} T  text"]
    for k in range(len(v.ids)):
        if k in v.heads:
            out.append(_paint(f"── {v.heads[k]} ──", "36", color))
        st = (TRAINED if v.trained[k] else 0) | (SPECIAL if v.special[k] else 0)
        shown = visible(v.texts[k]).replace("\n", "")
        shown = f"«{shown}»" if v.special[k] and not color else shown
        pos = "-" if v.positions is None else int(v.positions[k])
        msg = "" if v.msg is None else int(v.msg[k])
        out.append(f"{k:>6} {int(v.ids[k]):>8} {pos:>6} {int(v.docs[k]):>4} {msg:>4} {v.role(k) or '':<10} "
                   f"{'✓' if v.trained[k] else '·'}  {fmt([(shown, st)], color)}")
    return out


def _compare_text(ea: Entry, eb: Entry, report: Report, color: bool, width: int) -> list[str]:
    col = max(20, (width - 3) // 2)
    out = [_paint(f"═══ record {ea.index} · {ea.where} ═══", "1", color)]
    info_a = [f"A: {report.name} · {status_text(ea)}"] + info_lines(ea)
    info_b = [f"B: {report.other.name} · {status_text(eb)}"] + info_lines(eb)
    out += _columns([wrap([(t, 0)], col) for t in info_a], [wrap([(t, 0)], col) for t in info_b], col, False)
    for label, va, vb in seq_pairs(ea, eb):
        if label:
            out.append(_paint(f"── {label} ──", "1;36", color))
        left = _segment_lines(va, ea.marks.get(label), col, color) if va else {}
        right = _segment_lines(vb, eb.marks.get(label), col, color) if vb else {}
        for m in sorted(set(left) | set(right), key=turn_order):
            out += _columns(left.get(m, []), right.get(m, []), col, color)
    return out


def seq_pairs(ea: Entry, eb: Entry) -> list[tuple[str, Optional[SeqView], Optional[SeqView]]]:
    """(label, A's sequence, B's sequence) for every sequence either side has."""
    a, b = {v.label: v for v in ea.seqs}, {v.label: v for v in eb.seqs}
    return [(label, a.get(label), b.get(label)) for label in list(a) + [x for x in b if x not in a]]


def turn_order(m: Optional[int]) -> int:
    return -1 if m is None else m


def _segment_lines(v: SeqView, marks, col: int, color: bool) -> dict:
    """Message index (None: a sequence without messages) -> its wrapped lines, so turns line up in rows."""
    groups = token_groups(v, marks)
    return {m: [wrap(line, col) for line in layout([c for g in groups[s:e] for c in g], not color)]
            for m, s, e in v.segments()}


def _columns(left: list, right: list, col: int, color: bool) -> list[str]:
    """Two columns of wrapped lines (lists of wrap() results), with a gutter row under marked lines."""
    lf = [ln for group in left for ln in group]
    rf = [ln for group in right for ln in group]
    out = []
    for k in range(max(len(lf), len(rf))):
        a, b = (lf[k] if k < len(lf) else []), (rf[k] if k < len(rf) else [])
        pad = " " * max(0, col - text_width("".join(t for t, _ in a)))
        out.append(f"{fmt(a, color)}{pad} │ {fmt(b, color)}".rstrip())
        ga, gb = gutter(a), gutter(b)
        if ga or gb:
            out.append(_paint(f"{ga:<{col}} │ {gb}".rstrip(), "31", color))
    return out


def stats_lines(s: dict, color: bool) -> list[str]:
    """stats.json (or the same figures for the records shown), for people."""
    out = [_paint("statistics", "1", color)]
    if s.get("records_read") is not None:
        out.append(f"  records: {s['records_read']} read, {s.get('records_kept')} kept, {s.get('records_filtered')} "
                   f"filtered, {s.get('records_rejected')} rejected")
    for kind in ("filtered", "rejected"):
        by = s.get(f"{kind}_by_reason") or {}
        if by:
            ranked = sorted(by.items(), key=lambda kv: -kv[1])
            out.append(f"  {kind} by reason: " + ", ".join(f"{k} {v}" for k, v in ranked))
    tokens, trained = s.get("tokens") or 0, s.get("trained_tokens") or 0
    out.append(f"  tokens: {tokens:,} · trained {trained:,} · supervised share {_pct(trained, tokens)}")
    per, tper = s.get("tokens_per_role") or {}, s.get("trained_tokens_per_role") or {}
    if per:
        ranked = sorted(per.items(), key=lambda kv: -kv[1])
        out.append("  tokens per role: " + " · ".join(f"{r} {n:,} ({tper.get(r, 0):,} trained)" for r, n in ranked))
    lost = s.get("truncated_tokens") or 0
    out.append(f"  truncation: {s.get('truncated_docs') or 0} docs cut by max_seq_len, {lost:,} tokens lost "
               f"({_pct(lost, tokens + lost)} of all)" + (f"; packing cut {s['pack_truncated_tokens']:,} tokens of "
                                                           f"{s.get('pack_truncated_docs')} docs"
                                                           if s.get("pack_truncated_tokens") else ""))
    if s.get("packing_strategy") is not None:
        eff = s.get("packing_efficiency")
        out.append(f"  packing: {s['packing_strategy']}, max_packed_len {s.get('max_packed_len')}, "
                   f"{s.get('bins', s.get('rows'))} rows, efficiency {'n/a' if eff is None else f'{100 * eff:.1f}%'}")
    if s.get("records_per_domain"):
        out.append("  domains: " + ", ".join(f"{k} {v}" for k, v in s["records_per_domain"].items()))
    hist = histogram(s.get("doc_length_histogram") or {})
    if hist:
        top = max(n for _, n in hist)
        out.append("  document lengths (tokens):")
        out += [f"    {label:>9} {n:>8,} {'█' * max(1, round(30 * n / top))}" for label, n in hist]
    return out


def histogram(h: dict) -> list[tuple[str, int]]:
    """Buckets in length order ('<=16', ..., '>131072'), whatever order the JSON kept."""
    return [(k, int(h[k])) for k in sorted(h, key=lambda b: (b[0] == ">", int(b.lstrip("<=>")))) if h[k]]
