"""Text layout: tokens become cells (text, style); cells become lines; lines print with colour or markers.

Colour (a terminal): trained tokens on a green background in alternating shades so token
boundaries show; masked tokens dim; special tokens bold magenta; --compare differences underlined
in red. Plain (a file, a pipe, NO_COLOR): ⟦ ⟧ around trained runs and « » around special tokens.
Widths are terminal columns (a wide character takes two, a combining mark none), and wrapping keeps
each token whole on a line where it fits.
"""

from __future__ import annotations

import unicodedata

from astrai.data.inspect.tokens import visible
from astrai.data.inspect.views import SeqView


TRAINED, SPECIAL, ALT, DIFF, ONLY, HEAD, MARK, LINE = (1 << k for k in range(8))


def _sgr(style: int) -> str:
    if style & MARK:
        return ""
    if style & HEAD:
        return "\x1b[36m"
    codes = ["30", "102" if style & ALT else "42"] if style & TRAINED else [] if style & SPECIAL else ["2"]
    if style & SPECIAL:
        codes += ["1", "35"]
    if style & (DIFF | ONLY):
        codes += ["4", "58;5;196"]  # underline, red where the terminal supports underline colour
    return "\x1b[" + ";".join(codes) + "m"


def token_groups(v: SeqView, marks=None) -> list[list[tuple[str, int]]]:
    """Per token, its cells: the header line that starts before it (if any), then its text."""
    groups = []
    for k in range(len(v.ids)):
        st = (TRAINED if v.trained[k] else 0) | (SPECIAL if v.special[k] else 0) | (ALT if k % 2 else 0)
        if marks is not None:
            st |= {"^": DIFF, "+": ONLY}.get(str(marks[k]), 0)
        cell = (visible(v.texts[k]), st)
        groups.append([(f"── {v.heads[k]} ──", HEAD | LINE), cell] if k in v.heads else [cell])
    return groups


def layout(cells: list[tuple[str, int]], plain: bool) -> list[list[tuple[str, int]]]:
    """Cells -> lines of (text, style); plain text gets ⟦ ⟧ around trained runs and « » around specials."""
    lines, cur, open_ = [], [], False

    def close():
        nonlocal open_
        if open_:
            cur.append(("⟧", MARK))
            open_ = False

    for text, st in cells:
        if st & LINE:
            if plain:
                close()
            if cur:
                lines.append(cur)
                cur = []
            lines.append([(text, st)])
            continue
        if plain:
            if st & TRAINED and not open_:
                cur.append(("⟦", MARK))
                open_ = True
            elif not st & TRAINED:
                close()
            if st & SPECIAL:
                text = f"«{text}»"
        for j, part in enumerate(text.split("\n")):
            if j:
                lines.append(cur)
                cur = []
            if part:
                cur.append((part, st))
    if plain:
        close()
    return lines + [cur] if cur else lines


def _cw(ch: str) -> int:
    return 0 if unicodedata.combining(ch) else 2 if unicodedata.east_asian_width(ch) in "WF" else 1


def text_width(s: str) -> int:
    return sum(_cw(c) for c in s)


def wrap(line: list[tuple[str, int]], width: int) -> list[list[tuple[str, int]]]:
    """Split a line at `width` columns, keeping each token whole where it fits on a line."""
    out, cur, w = [], [], 0
    for text, st in line:
        if cur and w + text_width(text) > width >= text_width(text):
            out.append(cur)
            cur, w = [], 0
        buf = ""
        for ch in text:
            if w + _cw(ch) > width and (cur or buf):
                out.append(cur + [(buf, st)] if buf else cur)
                cur, buf, w = [], "", 0
            buf += ch
            w += _cw(ch)
        if buf:
            cur.append((buf, st))
    return out + [cur]


def fmt(line: list[tuple[str, int]], color: bool) -> str:
    if not color:
        return "".join(t for t, _ in line)
    out, prev = [], ""
    for t, st in line:  # one escape sequence per run of the same style
        code = _sgr(st)
        if code != prev:
            out.append(("\x1b[0m" if prev else "") + code)
            prev = code
        out.append(t)
    return "".join(out) + ("\x1b[0m" if prev else "")


def gutter(line: list[tuple[str, int]]) -> str:
    return "".join(("^" if st & DIFF else "+" if st & ONLY else " ") * text_width(t) for t, st in line).rstrip()
