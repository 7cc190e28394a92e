"""What a checkpoint's counters must satisfy before a run resumes from them.

trainer_state.json says where training stands: global_step (optimizer steps taken), epoch and
step_in_epoch (the sampler's position: drawn batches), consumed_rows, saved_step,
skipped_nonfinite and world (the processes that saved it). Each is checked against what it
cannot contradict, and an impossible value stops the resume with one line naming the file and the
key (a CheckpointError), before anything is loaded:
- global_step and saved_step equal the step in the directory's name (step-00000040);
- skipped_nonfinite lies between 0 and global_step;
- world is the number of ranks whose generator files (rng-rank<R>.*) the directory holds;
- with the schedule the checkpoint was saved under (its options' batch_size, grad_accum and
  GRPO updates, its world size, the data's row count: `DataOrder`), global_step is `updates` times
  the drawn batches epoch * steps_per_epoch + step_in_epoch (step_in_epoch from 0 to
  steps_per_epoch: a checkpoint at an epoch's end is saved before the epoch counter moves on), and
  consumed_rows is exactly the rows those batches held (RankSampler pads each epoch to a multiple
  of the world size; the last batch of an epoch may be short).
A checkpoint saved by another number of processes resumes only when the global batch
(batch_size x grad_accum x processes) is the same, so the data order continues where it stopped;
the ranks it had no generator state for start from this run's seed, and the run says so.
The optimizer's and the scheduler's own values are checked by their readers (astrai.train.state_files).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from astrai.train.batches import RankSampler
from astrai.train.state_files import CheckpointError, rng_files

STATE = "trainer_state.json"
STEP_NAME = re.compile(r"\.?step-(\d{8})(\.replaced)?")
_RNG = re.compile(r"rng-rank(\d+)\.(safetensors|json)")


@dataclass(frozen=True)
class DataOrder:
    """How this run draws its data: rows of the data set, and this run's batch_size, grad_accum,
    world size and optimizer steps per drawn batch (GRPO's updates; 1 otherwise)."""
    rows: int
    batch_size: int
    grad_accum: int
    world: int
    updates: int = 1


def _refuse(path: Path, key: str, value, why: str, fix: str = ""):
    raise CheckpointError(f"{path / STATE}: {key} is {value!r}, but {why}; the file was edited or the checkpoint "
                          f"moved: delete {path} to resume from an earlier checkpoint{fix}")


def _saved_order(saved: dict, now: DataOrder) -> DataOrder:
    """The data order the checkpoint was saved under: its options and world size (this run's where an
    older checkpoint did not record them)."""
    opts = saved.get("options") if isinstance(saved.get("options"), dict) else {}

    def whole(v, default):
        return v if isinstance(v, int) and not isinstance(v, bool) and v >= 1 else default

    updates = whole(opts.get("grpo_updates"), 1) if opts.get("strategy") == "grpo" else 1 if opts else now.updates
    return DataOrder(now.rows, whole(opts.get("batch_size"), now.batch_size), whole(opts.get("grad_accum"),
                    now.grad_accum), saved["world"], updates)


def consumed(s: DataOrder, epoch: int, step_in_epoch: int) -> int:
    """The rows drawn over all ranks by `epoch` whole epochs and `step_in_epoch` batches of the next
    (each counted once per update, as the trainer counts them)."""
    sampler = RankSampler(s.rows, s.batch_size, s.grad_accum, 0, s.world)
    per_step, per_rank = s.batch_size * s.grad_accum, sampler.rows_per_rank
    per_epoch = min(sampler.steps_per_epoch * per_step, per_rank)
    return s.updates * s.world * (epoch * per_epoch + min(step_in_epoch * per_step, per_rank))


def check_counters(path: Path, saved: dict, world: int, now: Optional[DataOrder] = None, is_main: bool = True):
    """Raise CheckpointError at the first counter of `saved` (trainer_state.json of `path`) that
    cannot be; `world`: this run's number of processes; `now`: this run's data order (None: only the
    checks that need none)."""
    path = Path(path)
    g = saved["global_step"]
    m = STEP_NAME.fullmatch(path.name)
    if m is None or g != int(m.group(1)):
        _refuse(path, "global_step", g, f"the checkpoint's directory is {path.name}")
    if saved["saved_step"] != g:
        _refuse(path, "saved_step", saved["saved_step"], f"global_step is {g} (a checkpoint records its own step)")
    skipped = saved.get("skipped_nonfinite", 0)
    if not isinstance(skipped, int) or isinstance(skipped, bool) or not 0 <= skipped <= g:
        _refuse(path, "skipped_nonfinite", skipped, f"only 0 to {g} steps were taken")
    w = saved.get("world", 1)
    ranks = {int(r.group(1)) for p in path.iterdir() if (r := _RNG.fullmatch(p.name))}
    full = {r for r in ranks if all((path / n).is_file() for n in rng_files(r))}
    if not isinstance(w, int) or isinstance(w, bool) or w < 1 or ranks != set(range(w)) or full != ranks:
        _refuse(path, "world", w, f"the directory holds the generator state of rank(s) "
                                  f"{', '.join(map(str, sorted(ranks))) or 'none'}" + (" (some files missing)"
                                                                                       if full != ranks else ""))
    if now is None:
        return
    s = _saved_order(saved, now)
    steps = RankSampler(s.rows, s.batch_size, s.grad_accum, 0, s.world).steps_per_epoch
    shape = (f"{steps} optimizer step(s) per epoch of {s.rows} rows with batch_size {s.batch_size} x grad_accum "
             f"{s.grad_accum} x {s.world} process(es)" + (f", {s.updates} updates per batch" if s.updates > 1 else ""))
    fix = "; when the data changed since, start over (another output, or resume: never)"
    if steps == 0 or g % s.updates:
        _refuse(path, "global_step", g, f"that is no checkpoint of {shape}", fix)
    drawn, epoch, step_in_epoch = g // s.updates, saved["epoch"], saved["step_in_epoch"]
    fits = {(drawn // steps, drawn % steps)} | ({(drawn // steps - 1, steps)} if drawn and not drawn % steps else set())
    if (epoch, step_in_epoch) not in fits:
        key, value = ("step_in_epoch", step_in_epoch) if epoch in {e for e, _ in fits} else ("epoch", epoch)
        want = " or ".join(f"epoch {e}, step_in_epoch {i}" for e, i in sorted(fits))
        _refuse(path, key, value, f"global_step {g} is {want} with {shape}", fix)
    rows = consumed(s, epoch, step_in_epoch)
    if saved["consumed_rows"] != rows:
        _refuse(path, "consumed_rows", saved["consumed_rows"], f"global_step {g} drew {rows} rows with {shape}", fix)
    if w != world:
        _other_world(path, s, now, is_main)


def _other_world(path: Path, saved: DataOrder, now: DataOrder, is_main: bool):
    was, nowb = saved.batch_size * saved.grad_accum * saved.world, now.batch_size * now.grad_accum * now.world
    if was != nowb:
        _refuse(path, "world", saved.world, f"this run has {now.world} process(es): the global batch would change "
                                            f"from {was} to {nowb} rows and the data order would not continue where it "
                                            f"stopped", "; or set batch_size x grad_accum x processes to "
                                                        f"{was} again")
    if is_main:
        fresh = ", ".join(str(r) for r in range(saved.world, now.world))
        print(f"astrai train: {path} was saved by {saved.world} process(es), this run has {now.world}: the data "
              f"order continues (global batch {was} rows)"
              + (f"; rank(s) {fresh} have no saved generator state and start from this run's seed" if fresh else ""),
              file=sys.stderr, flush=True)
