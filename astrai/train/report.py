"""Where training metrics go besides OUTPUT/metrics.jsonl: `report_to: tensorboard | wandb | [both]`.

Each record the Metrics callback writes (one per logged step, one per validation) is passed on:
- tensorboard: event files under OUTPUT/runs/ (`tensorboard --logdir OUTPUT/runs`), written by
  torch.utils.tensorboard; tags `train/<metric>` for step records, `eval/<metric>` for validation
  records (val_loss -> eval/loss), as transformers' Trainer names them;
- wandb: a Weights & Biases run in offline mode under OUTPUT/wandb/ (nothing leaves the machine;
  `wandb sync` uploads it), the train options as its config, the same tags.
Both are optional extras, imported only when asked for; `check_reporters` fails before any work
with the pip command when one is missing. Only rank 0 reports.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

EXTRAS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb")}  # name: (module, extra)
SKIP = ("step", "epoch")


def check_reporters(names: list[str]) -> list[str]:
    """A problem (with its fix) per requested reporter whose package is not installed."""
    return [f"report_to: {n} needs the {EXTRAS[n][0]} package: pip install 'astrai[{EXTRAS[n][1]}]' "
            f"(or remove {n} from report_to)" for n in names if importlib.util.find_spec(EXTRAS[n][0]) is None]


def tags(rec: dict) -> dict[str, float]:
    """{tag: value} of a metrics record's numbers: train/<key>, or eval/<key> for val_<key>."""
    out = {}
    for k, v in rec.items():
        if k in SKIP or isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            continue
        out[f"eval/{k[4:]}" if k.startswith("val_") else f"train/{k}"] = float(v)
    return out


class TensorBoard:
    def __init__(self, out: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(Path(out) / "runs"))

    def write(self, rec: dict):
        for tag, value in tags(rec).items():
            self.writer.add_scalar(tag, value, global_step=rec["step"])
        self.writer.flush()

    def close(self):
        self.writer.close()


class WandB:
    def __init__(self, out: Path, config: dict):
        import wandb

        Path(out).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project="astrai", name=Path(out).name, dir=str(out), mode="offline", config=config)

    def write(self, rec: dict):
        self.run.log(tags(rec), step=rec["step"])

    def close(self):
        self.run.finish()


def open_reporters(names: list[str], out: Path, config: dict) -> list:
    return [TensorBoard(out) if n == "tensorboard" else WandB(out, config) for n in names]
