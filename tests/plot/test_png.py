"""The fallback loss-curve PNG (no matplotlib), decoded by a small independent PNG reader written here (no PIL needed)."""

import struct
import zlib

from astrai.plot.png import COLORS, nice_ticks, tick_label, write_loss_png


def read_png(data: bytes):
    """(width, height, rows of RGB tuples). Checks signature, chunk CRCs and the 8-bit RGB format."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, []
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        tag, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        (crc,) = struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])
        assert zlib.crc32(tag + body) & 0xFFFFFFFF == crc, tag
        chunks.append((tag, body))
        pos += 12 + n
    assert [t for t, _ in chunks][0] == b"IHDR" and chunks[-1][0] == b"IEND"
    w, h, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (depth, color, interlace) == (8, 2, 0)
    raw = zlib.decompress(b"".join(b for t, b in chunks if t == b"IDAT"))
    assert len(raw) == h * (1 + 3 * w)
    rows = []
    for y in range(h):
        line = raw[y * (1 + 3 * w):(y + 1) * (1 + 3 * w)]
        assert line[0] == 0  # filter type None on every row
        rows.append([tuple(line[1 + 3 * x:4 + 3 * x]) for x in range(w)])
    return w, h, rows


def _pixels(rows, color):
    return [(x, y) for y, row in enumerate(rows) for x, px in enumerate(row) if px == color]


def test_png_has_both_curves_where_the_losses_put_them(tmp_path):
    train = [[s, 4.0 - 3.0 * s / 100] for s in range(0, 101, 5)]  # falls from 4 to 1
    val = [[0, 4.2], [50, 2.6], [100, 1.2]]
    path = write_loss_png(tmp_path / "loss.png", {"train": train, "val": val})
    w, h, rows = read_png(path.read_bytes())
    assert (w, h) == (640, 400)
    blue, orange = _pixels(rows, COLORS["train"]), _pixels(rows, COLORS["val"])
    assert len(blue) > 300 and len(orange) > 200  # lines, not stray pixels
    curve = [(x, y) for x, y in blue if y > 40]  # the legend swatch sits at the top right
    left = [y for x, y in curve if x < 150]
    right = [y for x, y in curve if x > 500]
    assert left and right and sum(left) / len(left) < sum(right) / len(right)  # falling loss: up-left to down-right
    # the first train point (step 0, highest loss) is at the left edge near the top of the box
    first_x = min(x for x, _ in curve)
    assert first_x <= 58 and min(y for x, y in curve if x == first_x) < 60
    # axes: a black horizontal line along the bottom of the plot box
    assert sum(1 for px in rows[400 - 40] if px == (0, 0, 0)) > 500


def test_same_curves_same_bytes_and_degenerate_input(tmp_path):
    curves = {"train": [[1, 2.0], [2, 1.5]], "val": [[2, 1.7]]}
    a = write_loss_png(tmp_path / "a.png", curves).read_bytes()
    b = write_loss_png(tmp_path / "b.png", curves).read_bytes()
    assert a == b
    # one point, a flat curve, no points, a NaN: still a valid image
    for curves in ({"train": [[0, 1.0]]}, {"train": [[0, 1.0], [5, 1.0]]}, {}, {"train": [[0, float("nan")], [1, 2.0]]}):
        w, h, _ = read_png(write_loss_png(tmp_path / "c.png", curves).read_bytes())
        assert (w, h) == (640, 400)


def test_nice_ticks():
    assert nice_ticks(0, 1) == [0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert nice_ticks(0, 300) == [0, 100, 200, 300]
    assert nice_ticks(1.03, 4.27) == [2.0, 3.0, 4.0]  # range 3.24 / 5 = 0.648 -> step 1
    assert [tick_label(v) for v in (0, 2.0, 0.25, 1500)] == ["0", "2", "0.25", "1500"]
