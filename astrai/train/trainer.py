"""The training loop: epoch -> optimizer step -> micro-batch, with exact accumulation and resume.

One optimizer step draws `grad_accum` micro-batches per rank (RankSampler). Before any backward,
the step's normaliser is known: the trained units (tokens, or pairs for DPO) of all its
micro-batches on all ranks, one all-reduce. Each micro-batch then backpropagates
    task_sum / step_units * world   (+ coef * aux * micro_units / step_units * world for MoE)
so the accumulated, DDP-averaged gradient is exactly the gradient of the step's token-weighted
mean: 4 micro-batches give the gradient of their concatenation (tested). Gradients are
reduced only on the last micro-batch (DDP no_sync, FSDP2 set_requires_gradient_sync(False) on the
others: astrai.train.distributed); the optimizer and the scheduler step only there. GRPO runs `updates` optimizer steps on each drawn batch. A strategy
with a `draw(model, window, global_step)` method makes the step's micro-batches itself from the
drawn row indices (online GRPO samples them: astrai.rl), and its `step_metrics` join the step's
metrics line.

Counting: `max_steps`, `log_every` and `eval_every` count optimizer steps exactly, also between
the updates of one GRPO batch (a run with max_steps 3 and 2 updates per batch stops after 3).
Checkpoints are taken only after a drawn batch's last update, where a resume can start, so the
options require save_every to be a multiple of grpo_updates; a run that max_steps ends between two
updates writes final/ but no checkpoint for that step.

Resume: the state (global step, epoch, next step in the epoch) is saved with the weights,
optimizer, scheduler and RNG at step boundaries only; the data order is a function of
(seed, epoch), so a resumed run replays exactly the steps an uninterrupted run would (bitwise
on CPU, tested). Every counter of the checkpoint is checked against that order first
(astrai.train.resume_checks), and the hyperparameters then follow this run's options
(resume.follow_options). SIGTERM/SIGINT set a flag; the step in progress finishes, a checkpoint is
written, and `fit` returns with `state.stopped` set. In one process a second one raises Aborted at
once, wherever the run is (a reward call or a rollout that blocks included): nothing more is
written, and the checkpoints on disk stay as they are (each is renamed into place whole). Hook order:
astrai.train.callbacks.

Precision (astrai.train.precision): under bf16-mixed every forward (prepare's log-probs, the loss,
validation) runs under torch.autocast to bf16 while weights, gradients and optimizer state stay
float32; the choice is printed once when fit begins and saved with each checkpoint.

Non-finite training: before each optimizer step the step's loss (summed over ranks) and gradient
norm are checked, on every rank alike. A non-finite one stops training with NonFiniteError naming
the step, before the optimizer moves, so no weight ever becomes NaN; `skip_nonfinite_steps: N`
instead skips up to N such steps over the run (gradients dropped, optimizer and scheduler not
stepped, the batch consumed; counted in metrics.jsonl as `skipped_nonfinite`), and stops at the
next one. Until a resumed run writes a checkpoint of its own, the error names the checkpoint it
resumed from as the first suspect. Every checkpoint and the final model are checked finite before
they are written.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from astrai.model.lora import cast, has_adapters
from astrai.train import resume
from astrai.train.batches import RankSampler
from astrai.train.callbacks import (Callback, Checkpoint, GradientCheckpointing, GradientClipping, Metrics,
                                    Aborted, NonFiniteError, ProgressBar)
from astrai.train.distributed import (Dist, all_sum, full_model_state, gradient_sync, is_sharded, named_optimizer_state,
                                     reshard, wrap)
from astrai.train.host_memory import return_freed_memory
from astrai.train.step_metrics import add_metrics, reduce_metrics
from astrai.train.optim import Schedule, build_optimizer, build_scheduler
from astrai.train.precision import resolve as resolve_precision
from astrai.train.report import open_reporters
from astrai.train.resume_checks import DataOrder
from astrai.train.strategies import Env, Strategy


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


_SAVED = ("global_step", "epoch", "step_in_epoch", "consumed_rows", "saved_step", "skipped_nonfinite")


@dataclass
class TrainState:
    global_step: int = 0          # optimizer steps taken
    epoch: int = 0
    step_in_epoch: int = 0        # the next drawn step of this epoch (the sampler's position)
    consumed_rows: int = 0        # rows seen over all ranks (with repeats of the padding)
    saved_step: int = 0
    skipped_nonfinite: int = 0    # optimizer steps skipped for a non-finite loss or gradient norm
    stopped: Optional[str] = None  # the signal that stopped training early
    completed: bool = field(default=False, repr=False)    # the loop ran to its end (no signal, no error)
    # per step, not saved:
    synced: bool = field(default=False, repr=False)       # this micro-batch ended an optimizer step
    at_boundary: bool = field(default=True, repr=False)   # a resumable point (drawn batch finished)
    grad_norm: Optional[float] = field(default=None, repr=False)
    step_metrics: dict = field(default_factory=dict, repr=False)
    history: list = field(default_factory=list, repr=False)

    def saved(self) -> dict:
        return {k: v for k, v in asdict(self).items()
                if k in _SAVED}


class Trainer:
    def __init__(self, model, strategy: Strategy, dataset, options, out_dir=None, val_dataset=None,
                 callbacks: tuple[Callback, ...] = (), dist: Optional[Dist] = None,
                 write_tokenizer: Optional[Callable[[Path], None]] = None):
        o = self.opts = options
        self.dist = dist or Dist()
        self.out = Path(out_dir or o.output)
        if o.return_freed_memory and self.dist.device.type == "cpu":
            return_freed_memory()  # process-wide, before the first step's tensors (astrai.train.host_memory)
        self.raw_model = cast(model, self.dist.device, _DTYPES[o.dtype])  # LoRA adapters stay float32
        if o.compile:
            # each layer's attention holds its own layer_idx, an int dynamo would specialise on: one graph
            # per layer, and past dynamo's recompile_limit the remaining layers would run eager.
            # Unspecialised, every layer of the same shapes shares one graph.
            torch._dynamo.config.allow_unspec_int_on_nn_module = True
            for layer in self.raw_model.model.layers:
                layer.compile()
        self.model = wrap(self.raw_model, self.dist, o.parallel)
        self.sharded = is_sharded(self.raw_model)  # fsdp under torchrun: saving and validating are collective
        self.strategy, self.dataset, self.val_dataset = strategy, dataset, val_dataset
        self.env = Env(self.dist.device, _DTYPES[o.dtype], o.attention, o.lm_loss, o.loss_chunk_tokens)
        self.precision = resolve_precision(o.precision, o.dtype, self.dist.device, o.lora is not None)
        self.sampler = RankSampler(len(dataset), o.batch_size, o.grad_accum, self.dist.rank, self.dist.world,
                                   o.seed, o.shuffle)
        if self.sampler.steps_per_epoch == 0:
            raise ValueError(f"{len(dataset)} rows make no full optimizer step of batch_size {o.batch_size} x "
                             f"grad_accum {o.grad_accum} x {self.dist.world} rank(s); lower them")
        self.total_steps = self.sampler.steps_per_epoch * o.epochs * strategy.updates
        if o.max_steps:
            self.total_steps = min(self.total_steps, o.max_steps)
        self.optimizer = build_optimizer(self.raw_model, o.lr, o.weight_decay, o.betas, o.adam_eps)
        self.scheduler = build_scheduler(self.optimizer, Schedule(
            o.scheduler, self.total_steps, o.warmup_steps, o.min_lr_ratio, o.sgdr_cycle_steps, o.sgdr_cycle_mult,
            o.wsd_decay_ratio))
        coef = o.moe_aux_loss_coef
        self.aux_coef = self.raw_model.config.router_aux_loss_coef if coef is None else coef
        self.callbacks = [GradientCheckpointing(o.gradient_checkpointing), Checkpoint(o.save_every),
                          Metrics(self.out / "metrics.jsonl", o.log_every, o.eval_every, sinks=open_reporters(
                              o.reporters, self.out, o.model_dump(mode="json")) if self.dist.is_main else ()),
                          ProgressBar(o.progress),
                          GradientClipping(o.max_grad_norm), *callbacks]
        self.write_tokenizer = write_tokenizer
        self.state = TrainState()
        self.stop_signal: Optional[int] = None
        self.resumed: Optional[tuple[Path, int]] = None  # the checkpoint this run continues, and its step

    # ---- hooks, checkpoints, signals --------------------------------------------------------------

    def fire(self, hook: str, *args):
        for cb in self.callbacks:
            getattr(cb, hook)(self, *args)

    @property
    def checkpoint_dir(self) -> Path:
        return self.out / "checkpoints"

    def save_checkpoint(self):
        """Every rank calls this (the full state is gathered when sharded, each rank writes its own
        generators, weights are checked finite on all ranks); no rank returns before the checkpoint
        is on disk."""
        st = self.state
        model_sd = full_model_state(self.raw_model, trainable_only=has_adapters(self.raw_model)) if self.sharded \
            else None
        optim_sd = named_optimizer_state(self.raw_model, self.optimizer) if self.sharded or self.dist.is_main else None
        self.check_finite_weights(f"the checkpoint of step {st.global_step}")
        st.saved_step = st.global_step
        resume.save(self.checkpoint_dir, st.global_step, self.raw_model, optim_sd, self.scheduler,
                    {**st.saved(), "options": self.opts.model_dump(mode="json"), "precision": self.precision.name},
                    self.dist, self.write_tokenizer,
                    model_sd, keep=self.opts.keep_last)

    def check_finite_weights(self, what: str):
        """Raise NonFiniteError (on every rank alike) when any weight is NaN or infinite."""
        bad = 0.0
        with torch.no_grad():
            for p in self.raw_model.parameters():
                local = p.to_local() if hasattr(p, "to_local") else p
                if local.is_floating_point() and not bool(torch.isfinite(local).all()):
                    bad = 1.0
                    break
        if all_sum([bad], self.dist)[0] > 0:
            raise NonFiniteError(f"step {self.state.global_step}: the weights hold NaN or infinite values; "
                                 f"{what} was not written (the last checkpoint is step {self.state.saved_step})")

    def resume(self) -> Optional[Path]:
        path = resume.latest(self.checkpoint_dir)
        if path is None:
            return None
        o = self.opts
        order = DataOrder(len(self.dataset), o.batch_size, o.grad_accum, self.dist.world, self.strategy.updates)
        saved = resume.load(path, self.raw_model, self.optimizer, self.scheduler, self.dist, order)
        self.resumed = (path, saved["global_step"])
        for k in _SAVED:
            setattr(self.state, k, saved.get(k, 0))
        changed = resume.changed_options(saved, self.opts.model_dump(mode="json"))
        if saved.get("precision", self.precision.name) != self.precision.name:  # auto resolved otherwise here
            changed.append(f"precision in effect {saved['precision']} -> {self.precision.name}")
        if changed and self.dist.is_main:  # continuing is allowed (a lower lr after a spike), never silent
            print(f"astrai train: resuming {path} (step {self.state.global_step}) with options changed since it was "
                  f"written: {'; '.join(changed)}; to start over instead, use another output or resume: never",
                  file=sys.stderr, flush=True)
        return path

    def _on_signal(self, signum, frame):
        name = signal.Signals(signum).name
        # under torchrun a terminal's Ctrl-C reaches each rank twice (its own, and torchrun's SIGTERM): there
        # the ranks stop together at a step boundary, as agreed in _optimizer_step
        if self.stop_signal is not None and self.dist.world == 1:
            raise Aborted(f"{name} a second time: stopped at once (last checkpoint: step {self.state.saved_step})")
        self.stop_signal = signum
        # os.write: a print here could land inside another write to stderr (the progress bar's)
        if self.dist.world == 1:
            os.write(2, f"\nastrai train: {name}: stopping after this step, with a checkpoint; {name} again stops at "
                        f"once\n".encode())

    def _install_signals(self):
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}

    # ---- the loop ----------------------------------------------------------------------------------

    def _done(self) -> bool:
        return self.state.global_step >= self.total_steps or self.state.stopped is not None

    def fit(self) -> TrainState:
        if self.opts.resume == "auto":
            self.resume()
        elif (earlier := resume.latest(self.checkpoint_dir)) is not None:
            # its checkpoints would interleave with this run's (keep_last keeps the higher steps: the old ones)
            raise resume.CheckpointError(f"{self.out}: holds checkpoints of an earlier run (latest {earlier.name}); "
                                         f"resume: never starts over only in an output without them: use another "
                                         f"output, or delete {self.checkpoint_dir}")
        previous = self._install_signals()
        if self.dist.is_main and self.precision.worth_saying:
            print(f"astrai train: {self.precision.line()}", file=sys.stderr, flush=True)
        self.raw_model.train()
        self.fire("on_train_begin")
        try:
            while self.state.epoch < self.opts.epochs and not self._done():
                self.fire("on_epoch_begin")
                for _, window in self.sampler.windows(self.state.epoch, self.state.step_in_epoch):
                    self._train_window(window)
                    if self._done():
                        break
                self.fire("on_epoch_end")
                if self.state.step_in_epoch >= self.sampler.steps_per_epoch:
                    self.state.epoch += 1
                    self.state.step_in_epoch = 0
            self.state.completed = self.state.stopped is None
        except BaseException as e:
            self.fire("on_error", e)
            raise
        finally:
            self.fire("on_train_end")
            for s, h in previous.items():
                signal.signal(s, h)
        return self.state

    def _batches(self, window: list[list[int]], dataset=None) -> list[dict]:
        draw = getattr(self.strategy, "draw", None)
        if draw is not None and dataset is None:  # a strategy that makes its batches from the rows (online GRPO samples them)
            out = draw(self.raw_model, window, self.state.global_step)
            return [{k: v.to(self.dist.device) if torch.is_tensor(v) else v for k, v in b.items()} for b in out]
        dataset = self.dataset if dataset is None else dataset
        out = []
        for idx in window:
            b = self.strategy.collate([dataset[i] for i in idx])
            out.append({k: v.to(self.dist.device) if torch.is_tensor(v) else v for k, v in b.items()})
        return out

    def _train_window(self, window: list[list[int]]):
        st, d = self.state, self.dist
        batches = self._batches(window)
        with self.precision.autocast():  # old-policy / reference log-probs in the precision of the loss
            self.strategy.prepare(self.raw_model, batches, window, self.env)
        reshard(self.raw_model)
        units = [self.strategy.units(b) for b in batches]
        step_units = max(all_sum([float(sum(units))], d)[0], 1.0)
        for update in range(self.strategy.updates):
            sums: dict[str, float] = {"loss": 0.0, "aux_loss": 0.0, "forwards": 0.0, "tokens": 0.0}
            counts: dict[str, float] = {}
            for i, (b, n) in enumerate(zip(batches, units)):
                last = i == len(batches) - 1
                st.synced, st.at_boundary = False, False
                self.fire("on_batch_begin")
                with gradient_sync(self.model, d, sync=last):
                    with self.precision.autocast():  # the forward only: backward follows the dtypes it recorded
                        task, aux, metrics = self.strategy.loss(self.model, b, self.env)
                    loss = task * (d.world / step_units)
                    if aux is not None:
                        loss = loss + (self.aux_coef * n * d.world / step_units) * aux
                        sums["aux_loss"] += float(aux.detach())
                        sums["forwards"] += 1
                    loss.backward()
                sums["loss"] += float(task.detach())
                sums["tokens"] += b["input_ids"].numel()
                add_metrics(sums, counts, metrics)
                st.consumed_rows += len(window[i]) * d.world
                if last:
                    self._optimizer_step(sums, counts, step_units, update == self.strategy.updates - 1)
                self.fire("on_batch_end")
            if self._done():  # max_steps may fall between two updates of one drawn batch (GRPO)
                return

    def _optimizer_step(self, sums: dict, counts: dict, step_units: float, window_done: bool):
        st = self.state
        st.synced = True
        self.fire("on_optimizer_step")  # gradient clipping measures st.grad_norm
        # one collective per step: the metric sums and counts, and whether any rank was asked to stop;
        # before the optimizer moves, so every rank sees the same loss and decides alike on a non-finite one
        raw = ("tokens", "aux_loss", "forwards")
        totals, stop = reduce_metrics(sums, counts, step_units, self.dist, float(self.stop_signal is not None), raw)
        loss = totals.pop("loss")
        finite = math.isfinite(loss) and (st.grad_norm is None or math.isfinite(st.grad_norm))
        if finite:
            self.optimizer.step()
            self.scheduler.step()
        else:
            self._nonfinite(loss)
        self.optimizer.zero_grad(set_to_none=True)
        st.global_step += 1
        m = {"loss": loss, "tokens": int(totals.pop("tokens")), "units": int(step_units)}
        aux, forwards = totals.pop("aux_loss"), totals.pop("forwards")
        if forwards:
            m["aux_loss"] = aux / forwards
            m["aux_loss_weighted"] = self.aux_coef * m["aux_loss"]
        m |= totals
        m.update(getattr(self.strategy, "step_metrics", None) or {})  # what the strategy measured drawing the step
        if not finite:
            m.update(skipped=True, skipped_nonfinite=st.skipped_nonfinite)
        st.step_metrics = m
        if window_done:
            st.step_in_epoch += 1
            st.at_boundary = True
            if stop:
                self.stop_signal = self.stop_signal or signal.SIGTERM
                st.stopped = signal.Signals(self.stop_signal).name

    def _nonfinite(self, loss: float):
        """Count a skipped step, or stop: the optimizer has not moved, so the weights stay finite."""
        st, allowed = self.state, self.opts.skip_nonfinite_steps
        what = f"loss {loss}" if not math.isfinite(loss) else f"gradient norm {st.grad_norm} (loss {loss:.4g})"
        if st.skipped_nonfinite >= allowed:
            skipped = f" after skipping {allowed} such step(s)" if allowed else ""
            # no checkpoint written since the resume: the state it loaded is the first suspect
            suspect = (f"this run resumed from {self.resumed[0]}: its saved state may be damaged (delete it to "
                       f"resume from an earlier checkpoint), or " if self.resumed and st.saved_step == self.resumed[1]
                       else "")
            raise NonFiniteError(
                f"step {st.global_step + 1}: non-finite {what}{skipped}; training stopped before the optimizer "
                f"step, the weights were not changed (last checkpoint: step {st.saved_step}); {suspect}lower lr "
                f"(now {self.opts.lr:g}), check the data, or allow skips with skip_nonfinite_steps")
        st.skipped_nonfinite += 1

    # ---- validation ---------------------------------------------------------------------------------

    @torch.no_grad()
    def validate(self) -> float:
        return self.evaluate().get("val_loss", float("nan"))

    @torch.no_grad()
    def evaluate(self) -> dict:
        """On the validation data: {"val_loss", "val_<metric>" for each of the strategy's figures}
        (for DPO the held-out reward accuracy and margin); every rank calls it (it sums across ranks)."""
        if self.val_dataset is None:
            return {"val_loss": float("nan")}
        held_out = getattr(self.strategy, "held_out_figures", None)
        if held_out is not None:  # a strategy that samples its own (online GRPO: held-out rewards)
            return held_out(self.raw_model, self.val_dataset, self.state.global_step)
        self.raw_model.eval()
        d, bs = self.dist, self.opts.batch_size
        mine = list(range(d.rank, len(self.val_dataset), d.world))
        # sharded, every forward is collective: every rank runs rank 0's number of batches (rank 0
        # has the most rows), the ranks with fewer rows a discarded one (row 0) for each missing batch
        most = len(range(0, len(self.val_dataset), d.world)) if self.sharded else len(mine)
        n_batches = -(-most // bs)
        sums, counts, units = {"loss": 0.0}, {}, 0.0
        for s in range(0, n_batches * bs, bs):
            idx = mine[s:s + bs]
            (b,) = self._batches([idx or [0]], self.val_dataset)
            with self.precision.autocast():
                self.strategy.prepare(self.raw_model, [b], [[-1 - i for i in idx or [0]]], self.env)
                task, _, metrics = self.strategy.loss(self.raw_model, b, self.env)
            if idx:
                sums["loss"] += float(task)
                add_metrics(sums, counts, metrics)
                units += self.strategy.units(b)
        reshard(self.raw_model)
        self.raw_model.train()
        totals, _ = reduce_metrics(sums, counts, max(all_sum([units], d)[0], 1.0), d)
        return {f"val_{k}": v for k, v in totals.items()}
