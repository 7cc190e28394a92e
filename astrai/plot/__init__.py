"""Training curves as one PNG: loss, learning rate and reward panels, with titles and axes.

`curves(records)` turns metrics.jsonl records into panels, `{panel: {series: [[step, value], ...]}}`:
- "loss": the training loss per logged step and the validation loss (`val`);
- "learning rate";
- "DPO rewards": the implicit rewards beta * (policy - reference) of chosen and rejected answers
  and their margin, on training batches and on held-out pairs; "DPO reward accuracy": the share
  of pairs whose chosen answer has the higher reward (0.5 is chance);
- "GRPO reward": the data's mean reward per step and the policy-weighted reward of the candidates
  (astrai.model.scores), on training batches and held-out groups, and the held-out mean (online:
  of completions sampled from the current weights); "GRPO choice accuracy".
A panel appears when its metrics were logged. A step logged twice (a resumed run repeats the steps
after its last checkpoint) keeps its latest value.

`write_plot(path, panels, title)` draws them with matplotlib side by side: the plot is a feature of
the `plot` extra (`pip install 'astrai[plot]'`, also in `sample`), imported here only. Without it no
file is written (None is returned; metrics.jsonl holds every figure). The file is written under a
temporary name and renamed, never through a link planted at the name (astrai.runtime.atomic_write_bytes).
"""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Optional

from astrai.runtime import atomic_write_bytes

# panel title -> (y label, [(metric key, series label), ...])
PANELS = {
    "loss": ("loss", [("loss", "train"), ("val_loss", "val")]),
    "learning rate": ("lr", [("lr", "lr")]),
    "DPO rewards": ("beta * log-ratio", [("reward_chosen", "chosen"), ("reward_rejected", "rejected"),
                                         ("reward_margin", "margin"), ("val_reward_margin", "val margin")]),
    "DPO reward accuracy": ("share of pairs", [("reward_accuracy", "train"), ("val_reward_accuracy", "val")]),
    "GRPO reward": ("reward", [("reward_mean", "data mean"), ("policy_reward", "policy-weighted"),
                               ("val_policy_reward", "val policy-weighted"), ("val_reward_mean", "val mean")]),
    "GRPO choice accuracy": ("share of groups", [("policy_accuracy", "train"), ("val_policy_accuracy", "val")]),
}


def curves(records: list[dict]) -> dict:
    """{panel: {series: [[step, value], ...]}} for the panels with data (see the module docstring)."""
    out = {}
    for panel, (_, keys) in PANELS.items():
        series = {}
        for key, label in keys:
            by_step = {r["step"]: float(r[key]) for r in records
                       if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])}
            if by_step:
                series[label] = [[s, by_step[s]] for s in sorted(by_step)]
        if series:
            out[panel] = series
    return out


def _as_panels(curves_or_loss: dict) -> dict:
    """Accept the older loss-only form {"train": points, "val": points} too."""
    if curves_or_loss and all(isinstance(v, list) for v in curves_or_loss.values()):
        return {"loss": curves_or_loss}
    return curves_or_loss


def write_plot(path, panels: dict, title: str = "") -> Optional[Path]:
    """The PNG at `path`, or None where matplotlib (the `plot` extra) is not installed."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    _matplotlib(Figure, buf, _as_panels(panels), title)
    atomic_write_bytes(path, buf.getvalue())
    return path


def _matplotlib(Figure, path, panels: dict, title: str):
    # a bare Figure, not pyplot: no backend or global state of the caller's process is touched
    names = list(panels) or ["loss"]
    cols = len(names) if len(names) <= 2 else 2
    rows = -(-len(names) // cols)
    fig = Figure(figsize=(5.6 * cols, 4.0 * rows))
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax in axes[len(names):]:
        ax.set_visible(False)
    for ax, name in zip(axes, names):
        for label, pts in panels.get(name, {}).items():
            steps, values = [p[0] for p in pts], [p[1] for p in pts]
            sparse = label.startswith("val") or len(pts) < 3
            ax.plot(steps, values, label=label, marker="o" if sparse else None, markersize=4, linewidth=1.5)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.set_ylabel(PANELS.get(name, (name,))[0])
        ax.grid(True, alpha=0.3)
        if name == "learning rate":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        elif ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100, format="png")
