"""The end-of-run table: one line per stage with its status, time and key figures."""

from __future__ import annotations

HEADERS = ("stage", "kind", "status", "time", "key figures")


def format_value(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def figures_text(metrics: dict, keys) -> str:
    return "  ".join(f"{k} {format_value(metrics[k])}" for k in keys if metrics.get(k) is not None)


def format_seconds(seconds) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    return f"{int(seconds // 60)}m{seconds % 60:04.1f}s"


def render_table(rows: list[dict]) -> str:
    """rows: dicts with name, kind, status, seconds, figures (text)."""
    cells = [HEADERS] + [(r["name"], r["kind"], r["status"], format_seconds(r.get("seconds")), r.get("figures", ""))
                         for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(HEADERS) - 1)]
    lines = []
    for i, row in enumerate(cells):
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1])
        if i == 0:
            lines.append("  ".join("-" * w for w in widths) + "  " + "-" * len(HEADERS[-1]))
    return "\n".join(line.rstrip() for line in lines)
