"""The fallback training plot when matplotlib is absent (astrai.plot): the loss curves only, as a
PNG drawn with zlib + struct, a pixel canvas and a 3x5 pixel font.

`write_loss_png(path, {"train": [[step, loss], ...], "val": [[step, loss], ...]})` draws each series
as a line (validation points also as small squares, since they are sparse) against step, with axes,
about five "nice" ticks per axis with their values, axis names and a legend. The PNG is 8-bit RGB,
one IDAT, filter 0 on every row: any reader decodes it. The same curves give the same bytes.
"""

from __future__ import annotations

import math
import os
import struct
import zlib
from pathlib import Path

from astrai.runtime import atomic_write_bytes

WIDTH, HEIGHT = 640, 400
LEFT, RIGHT, TOP, BOTTOM = 56, 16, 24, 40  # plot margins in pixels
WHITE, BLACK, GREY = (255, 255, 255), (0, 0, 0), (225, 225, 225)
COLORS = {"train": (31, 119, 180), "val": (255, 127, 14)}
EXTRA_COLORS = [(44, 160, 44), (214, 39, 40), (148, 103, 189)]

# 3x5 glyphs, rows top to bottom, '#' = ink: what tick values, axis names and legends need.
_FONT = {
    "0": ("###", "# #", "# #", "# #", "###"), "1": (" # ", "## ", " # ", " # ", "###"),
    "2": ("###", "  #", "###", "#  ", "###"), "3": ("###", "  #", "###", "  #", "###"),
    "4": ("# #", "# #", "###", "  #", "  #"), "5": ("###", "#  ", "###", "  #", "###"),
    "6": ("###", "#  ", "###", "# #", "###"), "7": ("###", "  #", "  #", "  #", "  #"),
    "8": ("###", "# #", "###", "# #", "###"), "9": ("###", "# #", "###", "  #", "###"),
    ".": ("   ", "   ", "   ", "   ", " # "), "-": ("   ", "   ", "###", "   ", "   "),
    "+": ("   ", " # ", "###", " # ", "   "),
    "a": (" # ", "# #", "###", "# #", "# #"), "e": ("###", "#  ", "## ", "#  ", "###"),
    "i": ("###", " # ", " # ", " # ", "###"), "l": ("#  ", "#  ", "#  ", "#  ", "###"),
    "n": ("###", "# #", "# #", "# #", "# #"), "o": ("###", "# #", "# #", "# #", "###"),
    "p": ("###", "# #", "###", "#  ", "#  "), "r": ("## ", "# #", "## ", "# #", "# #"),
    "s": (" ##", "#  ", " # ", "  #", "## "), "t": ("###", " # ", " # ", " # ", " # "),
    "v": ("# #", "# #", "# #", "# #", " # "), "x": ("# #", "# #", " # ", "# #", "# #"),
    "d": ("  #", "  #", "###", "# #", "###"), "w": ("# #", "# #", "# #", "###", "# #"),
}
_BLANK = ("   ",) * 5


def _glyph(ch: str) -> tuple:
    return _FONT.get(ch.lower(), _BLANK)


class Canvas:
    def __init__(self, width: int, height: int):
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(WHITE) * (width * height))

    def set(self, x: int, y: int, color) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            i = (y * self.width + x) * 3
            self.pixels[i:i + 3] = bytes(color)

    def get(self, x: int, y: int) -> tuple:
        i = (y * self.width + x) * 3
        return tuple(self.pixels[i:i + 3])

    def rect(self, x0: int, y0: int, x1: int, y1: int, color) -> None:
        for y in range(min(y0, y1), max(y0, y1) + 1):
            for x in range(min(x0, x1), max(x0, x1) + 1):
                self.set(x, y, color)

    def line(self, x0: int, y0: int, x1: int, y1: int, color, thick: int = 1) -> None:
        # Bresenham; a thick line is the same line stamped as a small square at every step.
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        while True:
            self.rect(x0, y0, x0 + thick - 1, y0 + thick - 1, color)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy

    def text(self, x: int, y: int, s: str, color=BLACK, scale: int = 1) -> int:
        """Draw s with its top-left at (x, y); return the width drawn."""
        for k, ch in enumerate(s):
            for r, row in enumerate(_glyph(ch)):
                for c, ink in enumerate(row):
                    if ink == "#":
                        self.rect(x + (k * 4 + c) * scale, y + r * scale,
                                  x + (k * 4 + c) * scale + scale - 1, y + r * scale + scale - 1, color)
        return len(s) * 4 * scale

    def png(self) -> bytes:
        raw = b"".join(b"\x00" + bytes(self.pixels[y * self.width * 3:(y + 1) * self.width * 3])
                       for y in range(self.height))

        def chunk(tag: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)  # 8-bit RGB
        return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")


def nice_ticks(lo: float, hi: float, target: int = 5) -> list[float]:
    """Round tick values (1, 2, 5 x 10^k steps) covering [lo, hi]."""
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / max(1, target)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    return [round(first + i * step, 10) for i in range(int((hi - first) / step + 1e-9) + 1)]


def tick_label(v: float) -> str:
    if v == int(v) and abs(v) < 1e6:
        return str(int(v))
    text = f"{v:.3g}"
    return text.replace("e+0", "e").replace("e-0", "e-")


def render_loss(curves: dict, width: int = WIDTH, height: int = HEIGHT) -> Canvas:
    series = {name: [(float(s), float(v)) for s, v in pts if v is not None and math.isfinite(float(v))]
              for name, pts in curves.items()}
    points = [p for pts in series.values() for p in pts]
    canvas = Canvas(width, height)
    x0, x1, y0, y1 = LEFT, width - RIGHT, height - BOTTOM, TOP  # plot box (y grows downwards)
    if points:
        smin, smax = min(p[0] for p in points), max(p[0] for p in points)
        lmin, lmax = min(p[1] for p in points), max(p[1] for p in points)
    else:
        smin, smax, lmin, lmax = 0.0, 1.0, 0.0, 1.0
    if smax == smin:
        smax = smin + 1
    pad = (lmax - lmin) * 0.05 or max(abs(lmax) * 0.05, 0.05)
    lmin, lmax = lmin - pad, lmax + pad

    def px(step: float) -> int:
        return round(x0 + (step - smin) / (smax - smin) * (x1 - x0))

    def py(loss: float) -> int:
        return round(y0 - (loss - lmin) / (lmax - lmin) * (y0 - y1))

    for v in nice_ticks(lmin, lmax):  # horizontal grid + y tick labels
        y = py(v)
        canvas.line(x0 + 1, y, x1, y, GREY)
        canvas.line(x0 - 4, y, x0, y, BLACK)
        label = tick_label(v)
        canvas.text(x0 - 6 - len(label) * 8, y - 4, label, scale=2)
    for v in nice_ticks(smin, smax):
        x = px(v)
        canvas.line(x, y0, x, y0 + 4, BLACK)
        label = tick_label(v)
        canvas.text(x - len(label) * 4, y0 + 7, label, scale=2)
    canvas.line(x0, y0, x1, y0, BLACK)  # axes drawn over the grid
    canvas.line(x0, y0, x0, y1, BLACK)
    canvas.text((x0 + x1) // 2 - 16, height - 12, "step", scale=2)
    canvas.text(4, TOP - 14, "loss", scale=2)

    extra = iter(EXTRA_COLORS)
    legend_y = TOP + 6
    for name, pts in series.items():
        color = COLORS.get(name) or next(extra, BLACK)
        pts = sorted(pts)
        for (sa, la), (sb, lb) in zip(pts, pts[1:]):
            canvas.line(px(sa), py(la), px(sb), py(lb), color, thick=2)
        if name != "train" or len(pts) == 1:
            for s, v in pts:
                canvas.rect(px(s) - 2, py(v) - 2, px(s) + 2, py(v) + 2, color)
        canvas.rect(x1 - 90, legend_y, x1 - 74, legend_y + 3, color)
        canvas.text(x1 - 68, legend_y - 3, name.lower(), scale=2)
        legend_y += 16
    return canvas


def write_loss_png(path: str | os.PathLike, curves: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, render_loss(curves).png())
    return path
