"""`--format html`: one self-contained page.

No network: a Content-Security-Policy forbids every load, and text from the data is escaped (':'
too, so a URL in a message never reads as an address in the page source). Hovering a token shows
its id, text, position, document, message and label; the statistics and a document length
histogram come first; --compare puts the two pipelines in a two-column grid, one row per message
turn, so the same turn sits side by side.
"""

from __future__ import annotations

import html  # the standard library's (absolute import), not this module
from typing import Optional

from astrai.data.inspect.text import histogram, info_lines, seq_pairs, stats_lines, status_text, turn_order
from astrai.data.inspect.tokens import visible
from astrai.data.inspect.views import Entry, Report, SeqView


_CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:0;color:#1d2330;background:#f6f7f9}
header{position:sticky;top:0;background:#fff;border-bottom:1px solid #dde;padding:10px 18px;z-index:2}
h1{font-size:17px;margin:0 0 4px}h2{font-size:15px;margin:0 0 6px}.sub{color:#556;font-size:13px}
.legend{margin-top:6px;font-size:13px}.legend>span{margin-right:8px}
#info{margin-top:6px;font:12px ui-monospace,monospace;color:#334;min-height:1.4em}main{padding:12px 18px}
.card{background:#fff;border:1px solid #dde;border-radius:6px;padding:10px 14px;margin:0 0 14px}
.status{font-weight:600;padding:1px 6px;border-radius:4px;background:#e7f3ea;color:#17602b}
.status.filtered,.status.excluded{background:#fff3d6;color:#7a5300}.status.rejected{background:#fde2e2;color:#9b1c1c}
.meta{color:#556;font-size:13px;margin:2px 0}.note{color:#7a5300;font-size:13px}
.seq{font:13px/1.75 ui-monospace,Menlo,Consolas,"DejaVu Sans Mono",monospace;white-space:pre-wrap;word-break:break-all}
.t{color:#8a8f99;border-radius:2px}.t.tr{background:#b6efc1;color:#0c3b17}.t.tr.alt{background:#93e2a3}
.t.sp{color:#7b1fa2;font-weight:700;outline:1px solid #c9a2e0}.t.tr.sp{color:#4a0072}
.t.df{box-shadow:inset 0 -3px 0 #e0202a}.t.on{box-shadow:inset 0 -3px 0 #f08c00}.t:hover{outline:2px solid #1d2330}
.head{display:block;color:#0b6b8a;font:600 12px system-ui,sans-serif;border-top:1px dashed #c5d3dc;margin-top:6px}
.head.doc{color:#6b3fa0;border-top-color:#d2c4e6}.src{font-weight:600;margin-top:8px}
.cmp{display:grid;grid-template-columns:1fr 1fr;gap:0 18px}.cmp>div{min-width:0}
table.stats{border-collapse:collapse;font-size:13px}table.stats td{padding:2px 10px 2px 0;vertical-align:top}
.toc a{color:#0b6b8a;text-decoration:none;white-space:nowrap}.toc a:hover{text-decoration:underline}
section.card{scroll-margin-top:120px}.hist td.bar{width:320px}.hist .b{background:#4c8bf5;height:12px;border-radius:2px}
"""

_JS = """document.addEventListener('mouseover',function(e){var t=e.target.closest&&e.target.closest('.t');
if(t&&t.title){document.getElementById('info').textContent=t.title;}});"""


def _h(s) -> str:
    # ':' as an entity: text from the data (a URL in a message) never reads as an address in the page source
    return html.escape(str(s)).replace(":", "&#58;")


_MARKS = {"^": ("label differs from the other pipeline", " df"), "+": ("trained, no counterpart there", " on")}


def _token_html(v: SeqView, k: int, mark: str) -> str:
    parts = [f"id {int(v.ids[k])}", f"text {v.texts[k]!r}",
             f"position {'-' if v.positions is None else int(v.positions[k])}", f"doc {int(v.docs[k])}"]
    if v.msg is not None:
        parts.append(f"message {int(v.msg[k])} ({v.role(k)})" if v.role(k) else "template text")
    parts.append("trained" if v.trained[k] else "masked")
    cls = "t"
    if v.trained[k]:
        cls += " tr alt" if k % 2 else " tr"
    if v.special[k]:
        parts.append("special")
        cls += " sp"
    if mark:
        parts.append(_MARKS[mark][0])
        cls += _MARKS[mark][1]
    head = (f'<span class="head{"" if v.turns else " doc"}">{_h(v.heads[k])}</span>' if k in v.heads else "")
    return f'{head}<span class="{cls}" title="{_h(" · ".join(parts))}">{_h(visible(v.texts[k]))}</span>'


def _tokens_html(v: SeqView, marks, start: int = 0, end: Optional[int] = None) -> str:
    end = len(v.ids) if end is None else end
    return "".join(_token_html(v, k, "" if marks is None else str(marks[k])) for k in range(start, end))


def _entry_head_html(e: Entry) -> str:
    out = [f'<h2>{e.kind} {e.index} · {_h(e.where)} · <span class="status {e.status}">{_h(status_text(e).lower())}'
           f"</span></h2>"]
    return "".join(out + [f'<div class="{"note" if line.startswith("note:") else "meta"}">{_h(line)}</div>'
                          for line in info_lines(e)])


def _compare_html(ea: Entry, eb: Entry, a: Report, b: Report) -> str:
    """Two columns, one grid row per message turn, so the same turn sits side by side."""
    out = [f'<div class="cmp"><div><div class="src">A: {_h(a.name)}</div>{_entry_head_html(ea)}</div>'
           f'<div><div class="src">B: {_h(b.name)}</div>{_entry_head_html(eb)}</div>']
    for label, va, vb in seq_pairs(ea, eb):
        if label:
            out.append(f'<div class="src">{_h(label)}</div>' * 2)
        sa = {m: (s, e) for m, s, e in va.segments()} if va else {}
        sb = {m: (s, e) for m, s, e in vb.segments()} if vb else {}
        for m in sorted(set(sa) | set(sb), key=turn_order):
            for v, segs, e in ((va, sa, ea), (vb, sb, eb)):
                body = _tokens_html(v, e.marks.get(label), *segs[m]) if m in segs else ""
                out.append(f'<div class="seq">{body}</div>')
    return "".join(out) + "</div>"


def _stats_html(s: dict, title: str) -> str:
    rows = []
    for line in stats_lines(s, False)[1:]:
        if line.startswith("  ") and not line.startswith("    ") and not line.endswith("(tokens):"):
            key, _, val = line.strip().partition(": ")
            rows.append(f"<tr><td>{_h(key)}</td><td>{_h(val)}</td></tr>")
    hist = histogram(s.get("doc_length_histogram") or {})
    top = max((n for _, n in hist), default=1)
    bars = "".join(f'<tr><td>{_h(label)}</td><td>{n:,}</td><td class="bar"><div class="b" '
                   f'style="width:{100 * n / top:.1f}%"></div></td></tr>' for label, n in hist)
    return (f'<section class="card"><h2>{_h(title)}</h2><table class="stats">{"".join(rows)}</table>'
            + (f'<h2 style="margin-top:10px">document length histogram (tokens)</h2><table class="stats hist">'
               f"{bars}</table>" if bars else "") + "</section>")


def _toc_html(report: Report) -> str:
    """Jump links: the statistics, then every record or row with its status (a long report is one page)."""
    links = ['<a href="#stats">statistics</a>'] if report.stats else []
    links += [f'<a href="#e{k}">{e.kind} {e.index} <span class="status {e.status}">{_h(status_text(e).lower())}'
              f'</span></a>' for k, e in enumerate(report.entries)]
    return f'<nav class="card toc" id="contents"><h2>contents</h2>{" · ".join(links)}</nav>' if links else ""


def render_html(report: Report) -> str:
    other = report.other
    legend = ('<span class="t tr">trained</span><span class="t">masked</span><span class="t sp">&lt;special&gt;</span>'
              + ('<span class="t tr df">label differs</span><span class="t tr on">trained, only here</span>' if other
                 else "") + "<span>↵ newline · ⇥ tab · ◌ part of a character</span>")
    sub = _h(report.title) + (f"<br>compared with {_h(other.title)}" if other else "")
    body = [f'<header><h1>astrai inspect</h1><div class="sub">{sub}</div><div class="legend">{legend}</div>'
            f'<div id="info">hover a token for its id, position, document and label</div></header><main>']
    body += [f'<div class="card note">{_h(n)}</div>' for n in report.notes]
    body.append(_toc_html(report))
    if report.stats:
        title = "dataset statistics" if report.is_dataset else "statistics of the records shown" + " (A)" * bool(other)
        body.append(_stats_html(report.stats, title).replace("<section ", '<section id="stats" ', 1))
    for k, e in enumerate(report.entries):
        if other is not None:
            inner = _compare_html(e, other.entries[k], report, other)
        else:
            inner = _entry_head_html(e) + "".join(
                (f'<div class="src">{_h(v.label)}</div>' if v.label else "")
                + f'<div class="seq">{_tokens_html(v, None)}</div>' for v in e.seqs)
        body.append(f'<section class="card" id="e{k}">{inner}</section>')
    csp = "default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'"
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta http-equiv="Content-Security-Policy" content="{csp}">'
            f"<title>astrai inspect · {_h(report.name)}</title><style>{_CSS}</style></head><body>"
            + "".join(body) + f"</main><script>{_JS}</script></body></html>\n")
