"""Trainer callbacks: the hooks, and the default callbacks registered in this order.

Hooks, in the order they fire (a test records it):
  on_train_begin
    on_epoch_begin
      on_batch_begin            every micro-batch, before its forward
      on_optimizer_step         on the last micro-batch of a step, after backward, BEFORE
                                optimizer.step() (clipping sees the accumulated gradients)
      on_batch_end              every micro-batch; on the last one AFTER the optimizer step, so a
                                checkpoint written here holds a finished step
    on_epoch_end
  on_error                      an exception escaped the loop (then re-raised)
  on_train_end                  always, once on_train_begin has run (finally)

Defaults: gradient_checkpointing, checkpoint (rank 0), metrics (JSONL + validation, rank 0),
progress_bar (tqdm over the run's optimizer steps, rank 0), gradient_clipping; user callbacks run
after them. A callback receives the trainer; this module imports nothing from astrai.train.trainer
(which imports it), and NonFiniteError, which the trainer raises and Checkpoint tests for, lives here.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from astrai.errors import InputError
from astrai.runtime import open_nofollow


class NonFiniteError(InputError):
    """Training stopped at a non-finite loss or gradient norm (or weights); the message names the step."""


class Aborted(KeyboardInterrupt):
    """A second stop signal: training ends at once, where it is; no checkpoint is written."""


class Callback:
    def on_train_begin(self, trainer): ...
    def on_epoch_begin(self, trainer): ...
    def on_batch_begin(self, trainer): ...
    def on_optimizer_step(self, trainer): ...
    def on_batch_end(self, trainer): ...
    def on_epoch_end(self, trainer): ...
    def on_error(self, trainer, error: BaseException): ...
    def on_train_end(self, trainer): ...


class GradientCheckpointing(Callback):
    def __init__(self, enabled: bool):
        self.enabled = enabled

    def on_train_begin(self, trainer):
        trainer.raw_model.gradient_checkpointing = self.enabled

    def on_train_end(self, trainer):
        trainer.raw_model.gradient_checkpointing = False


class GradientClipping(Callback):
    """Clips to max_norm (None: only measures) and records the pre-clip norm for the metrics."""

    def __init__(self, max_norm):
        self.max_norm = max_norm

    def on_optimizer_step(self, trainer):
        params = [p for p in trainer.raw_model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, self.max_norm if self.max_norm else math.inf)
        trainer.state.grad_norm = float(norm)


class Checkpoint(Callback):
    """Every `every` optimizer steps, at the end, on a stop signal, and on an error raised at a step
    boundary in one process (mid-step state is never saved: it could not resume exactly; nor with
    several ranks, where a save is collective and the failing rank's peers may never join it; nor
    after non-finite weights; nor on a second stop signal, which asks to stop at once)."""

    def __init__(self, every: int):
        self.every = every

    def on_batch_end(self, trainer):
        s = trainer.state
        # `stopped`, not the raw signal flag: it is agreed by all ranks at the same step, so every
        # rank saves together (a sharded save is collective)
        if s.at_boundary and (s.global_step % self.every == 0 or s.stopped is not None):
            trainer.save_checkpoint()

    def on_error(self, trainer, error):
        if trainer.dist.active or isinstance(error, (NonFiniteError, Aborted)):
            return
        if trainer.state.at_boundary and trainer.state.global_step > trainer.state.saved_step:
            trainer.save_checkpoint()

    def on_train_end(self, trainer):
        s = trainer.state
        if s.completed and s.at_boundary and s.global_step > s.saved_step:
            trainer.save_checkpoint()


class Metrics(Callback):
    """One JSON line per `log_every` optimizer steps (loss, the strategy's figures, aux losses, lr,
    grad norm, seconds), and whenever there is validation data, the validation figures (val_loss,
    val_<figure>) before the first step (step 0, so a run can say how training moved them), every
    `eval_every` steps and once at the end of a completed run (not twice when eval_every divides
    the last step); rank 0 writes, all ranks compute. Every record also goes to the `sinks`
    (TensorBoard, W&B: astrai.train.report)."""

    def __init__(self, path: Path, log_every: int, eval_every, sinks=()):
        self.path, self.log_every, self.eval_every, self.sinks = Path(path), log_every, eval_every, list(sinks)
        self._t = 0.0
        self._validated_at = None

    def _write(self, trainer, rec: dict):
        trainer.state.history.append(rec)
        if trainer.dist.is_main:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open_nofollow(self.path, "a") as fh:  # a link planted at its name is refused, not followed
                fh.write(json.dumps(rec) + "\n")
            for sink in self.sinks:
                sink.write(rec)

    def on_train_begin(self, trainer):
        step = trainer.state.global_step
        if trainer.dist.is_main and self.path.exists():
            drop_cut_line(self.path)
        if trainer.val_dataset is not None and step == 0:  # resumed: measured by then
            self._validate(trainer)
        elif trainer.val_dataset is not None and self._logged_validation(step, trainer):
            self._validated_at = step  # a finished run resumed: its last figures are not measured again
        self._t = time.perf_counter()

    def _logged_validation(self, step: int, trainer) -> bool:
        """Whether the file holds validation figures of `step` (rank 0 reads, every rank learns)."""
        from astrai.train.distributed import all_sum
        from astrai.train.summary import read_records

        found = trainer.dist.is_main and any(r.get("step") == step and any(k.startswith("val_") for k in r)
                                             for r in read_records(self.path))
        return all_sum([float(found)], trainer.dist)[0] > 0

    def on_batch_end(self, trainer):
        s = trainer.state
        if not s.synced:  # every optimizer step counts, also between a GRPO batch's updates
            return
        if s.global_step % self.log_every == 0:
            now = time.perf_counter()
            rec = {"step": s.global_step, "epoch": s.epoch, **s.step_metrics,
                   "lr": trainer.optimizer.param_groups[0]["lr"], "grad_norm": s.grad_norm,
                   "seconds": round(now - self._t, 4)}
            self._t = now
            self._write(trainer, rec)
        if self.eval_every and s.global_step % self.eval_every == 0:
            self._validate(trainer)

    def _validate(self, trainer):
        self._validated_at = trainer.state.global_step
        # every rank: evaluate sums across ranks
        self._write(trainer, {"step": trainer.state.global_step, **trainer.evaluate()})

    def on_train_end(self, trainer):
        s = trainer.state
        try:
            if s.completed and trainer.val_dataset is not None and self._validated_at != s.global_step:
                self._validate(trainer)
        finally:
            for sink in self.sinks:
                sink.close()


class ProgressBar(Callback):
    """Progress over the optimizer steps that will run (max_steps or the epochs' steps, from the
    resumed step on), so its rate and ETA are the run's: on a terminal a tqdm bar whose postfix shows
    the epoch and the loss; in a log (not a terminal) plain lines every few seconds
    (astrai.runtime.Progress), never a bar's carriage returns."""

    def __init__(self, enabled: bool):
        self.enabled, self.bar, self.lines = enabled, None, None

    def on_train_begin(self, trainer):
        if not (self.enabled and trainer.dist.is_main):
            return
        import sys

        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=trainer.total_steps, initial=trainer.state.global_step, desc="train",
                            unit="step", leave=False, dynamic_ncols=True)
        else:
            from astrai.runtime import Progress

            self.lines = Progress(max(trainer.total_steps - trainer.state.global_step, 0), "steps")

    def on_batch_end(self, trainer):
        if not trainer.state.synced:
            return
        if self.bar is not None:
            self.bar.update(1)
            loss = trainer.state.step_metrics.get("loss", float("nan"))
            self.bar.set_postfix(epoch=trainer.state.epoch, loss=f"{loss:.4f}")
        elif self.lines is not None:
            self.lines.update(1)

    def on_train_end(self, trainer):
        for p in (self.bar, self.lines):
            if p is not None:
                p.close()
        self.bar = self.lines = None


def drop_cut_line(path: Path):
    """A record cut by a kill (the file does not end in a newline) is removed before more are appended
    after it, so every line of the file stays one whole record."""
    with open_nofollow(path, "r+b") as fh:
        data = fh.read()
        if data and not data.endswith(b"\n"):
            fh.truncate(data.rfind(b"\n") + 1)
