"""What a finished training run says: its figures from metrics.jsonl, and the lines `astrai train` prints.

`figures(records)`: `loss_start`/`loss` (first and last logged training loss) and, for every
validation figure (val_loss, val_reward_accuracy, val_policy_reward, ...), `<key>_start` and
`<key>` (first and last); a step logged twice (a resumed run repeats the steps after its last
checkpoint) counts with its latest record. `lines(result)` is the short report `astrai train`
ends with: steps and time, loss first -> last, the held-out figures, where final/ and the plot
are, and the commands to try the model.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from astrai.errors import InputError, read_text_regular

# what the report shows of the validation figures, in this order, with a label
SHOWN = (("val_loss", "val loss"), ("val_reward_accuracy", "held-out reward accuracy"),
         ("val_reward_margin", "held-out reward margin"), ("val_policy_reward", "held-out policy-weighted reward"),
         ("val_policy_accuracy", "held-out choice accuracy"))
# online GRPO's held-out figures are of completions sampled from the current weights (astrai.rl.online)
ONLINE_SHOWN = (("val_reward_mean", "held-out mean reward"), ("val_truncated_share", "held-out share cut at max_tokens"),
                ("val_completion_length", "held-out completion tokens"))


def read_records(path) -> list[dict]:
    """metrics.jsonl's records. Each is written as one line ending in a newline, so a last line without
    one that does not parse was cut by a kill: it is left out (the resumed run logs that step again).
    Any other line that is not a JSON object is an InputError naming the file and the line."""
    path = Path(path)
    if not path.exists():
        return []
    *whole, tail = read_text_regular(path, "metrics file").split("\n")
    records = [_record(line, path, i) for i, line in enumerate(whole, 1) if line.strip()]
    try:
        return records + ([_record(tail, path, len(whole) + 1)] if tail.strip() else [])
    except InputError:
        return records


def _record(line: str, path: Path, number: int) -> dict:
    try:
        rec = json.loads(line)
    except (ValueError, RecursionError) as e:
        raise InputError(f"{path}:{number}: not a JSON record ({e}); the file was edited: remove that line") from None
    if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
        raise InputError(f"{path}:{number}: not a metrics record (an object with an integer 'step'); the file was "
                         f"edited: remove that line")
    return rec


def _series(records: list[dict], key: str) -> list[float]:
    by_step = {r["step"]: r[key] for r in records if isinstance(r.get(key), (int, float))}
    return [by_step[s] for s in sorted(by_step)]


def figures(records: list[dict]) -> dict:
    out = {}
    keys = ["loss"] + sorted({k for r in records for k in r if k.startswith("val_")})
    for key in keys:
        values = _series(records, key)
        if values:
            out[f"{key}_start"], out[key] = values[0], values[-1]
    return out


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) and math.isfinite(v) else str(v)


def _seconds(s: float) -> str:
    return f"{s:.1f}s" if s < 60 else f"{int(s // 60)}m{s % 60:04.1f}s"


def lines(result: dict) -> list[str]:
    f = result.get("figures") or {}
    head = f"trained {result['steps']} steps in {_seconds(result.get('seconds') or 0.0)}"
    if result.get("precision"):
        head += f" ({result['precision']})"
    if "loss" in f:
        head += f": loss {_fmt(f['loss_start'])} -> {_fmt(f['loss'])}"
    out = [head]
    for key, label in ONLINE_SHOWN if result.get("online") else SHOWN:
        if key in f:
            out.append(f"  {label} {_fmt(f[key + '_start'])} -> {_fmt(f[key])}")
    if result.get("stopped"):
        out.append(f"stopped by {result['stopped']} after a checkpoint: run the same command again to resume")
        return out
    out.append(f"  final model: {result['final']}")
    if result.get("plot"):
        out.append(f"  curves: {result['plot']}  (every logged step: {Path(result['output']) / 'metrics.jsonl'})")
    if result.get("tensorboard"):
        out.append(f"  tensorboard --logdir {result['tensorboard']}")
    out.append(f"next: astrai generate {result['final']} --prompt 'Hello' --max-tokens 32   (or --chat FILE.jsonl)")
    if result.get("val_data") and not result.get("online"):  # a prompt set has no answers to score by eval
        ref = ""
        if result.get("strategy") == "dpo":  # the reward figures compare with the model DPO started from
            ref = f" --ref-model {result['ref_model']}" if result.get("ref_model") else " --ref-model REFERENCE"
        out.append(f"      astrai eval {result['final']} --data {result['val_data']}{ref}")
    return out
