"""Non-finite training never costs the good model: training stops at the first NaN/inf loss or gradient
norm naming the step (or skips up to skip_nonfinite_steps of them), no checkpoint or final model with
non-finite weights is written, and keep_last never prunes a finite checkpoint for a bad one. Also:
validation runs once at the end whenever there is validation data."""

import json
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import train_script as ts  # noqa: E402

from astrai.model.hf_checkpoint import read_tensors  # noqa: E402
from astrai.train import resume  # noqa: E402
from astrai.train.callbacks import Callback  # noqa: E402
from astrai.train.strategies import make_strategy  # noqa: E402
from astrai.train.trainer import NonFiniteError, Trainer  # noqa: E402


def _trainer(out, callbacks=(), val=None, **kw):
    base = dict(epochs=3, save_every=1, keep_last=1)
    return Trainer(ts.model(), make_strategy("sft"), ts.synthetic_rows(8), ts.options(out, **{**base, **kw}),
                   callbacks=tuple(callbacks), val_dataset=val)


def _finite(path):
    return all(bool(torch.isfinite(t).all()) for t in read_tensors(path).values())


def _checkpoints(out):
    return sorted(p.name for p in (out / "checkpoints").iterdir())


def test_lr_1e6_stops_at_the_first_nonfinite_step_and_keeps_the_last_good_checkpoint(tmp_path):
    with pytest.raises(NonFiniteError) as e:
        _trainer(tmp_path, lr=1e6).fit()
    msg = str(e.value)
    step = int(msg.split()[1].rstrip(":"))
    assert msg.startswith(f"step {step}: non-finite") and "lower lr" in msg and "\n" not in msg
    assert step >= 2
    last = resume.latest(tmp_path / "checkpoints")
    assert last.name == f"step-{step - 1:08d}" and _checkpoints(tmp_path) == [last.name]  # keep_last 1
    assert _finite(last)


def test_a_nan_loss_stops_before_the_optimizer_step(tmp_path):
    with pytest.raises(NonFiniteError, match=r"^step 3: non-finite loss nan; .*last checkpoint: step 2"):
        _trainer(tmp_path, callbacks=[ts.NaNLossAt([3])]).fit()
    assert _checkpoints(tmp_path) == ["step-00000002"] and _finite(tmp_path / "checkpoints" / "step-00000002")
    assert not (tmp_path / "final").exists()


class PoisonGrads(Callback):
    """After clipping measured a finite norm, a gradient turns NaN: the optimizer step makes the weights
    non-finite, which the checkpoint check must catch."""

    def __init__(self, step):
        self.step = step

    def on_optimizer_step(self, trainer):
        if trainer.state.global_step + 1 == self.step:
            next(trainer.raw_model.parameters()).grad.fill_(float("nan"))


def test_nonfinite_weights_are_never_saved_nor_pruned_for(tmp_path):
    with pytest.raises(NonFiniteError, match=r"^step 3: the weights hold NaN.*checkpoint of step 3 was not written"):
        _trainer(tmp_path, callbacks=[PoisonGrads(3)]).fit()
    assert _checkpoints(tmp_path) == ["step-00000002"] and _finite(tmp_path / "checkpoints" / "step-00000002")


def test_skip_nonfinite_steps_skips_counts_and_then_stops(tmp_path):
    state = _trainer(tmp_path / "skip", callbacks=[ts.NaNLossAt([3, 5])], skip_nonfinite_steps=2, keep_last=10).fit()
    assert state.global_step == 6 and state.skipped_nonfinite == 2
    recs = [json.loads(line) for line in (tmp_path / "skip" / "metrics.jsonl").read_text().splitlines()]
    skipped = [(r["step"], r["skipped_nonfinite"]) for r in recs if r.get("skipped")]
    assert skipped == [(3, 1), (5, 2)] and all(math.isnan(r["loss"]) for r in recs if r.get("skipped"))
    ck = tmp_path / "skip" / "checkpoints"
    w2, w3 = read_tensors(ck / "step-00000002"), read_tensors(ck / "step-00000003")
    assert all(torch.equal(w2[k], w3[k]) for k in w2)  # the skipped step moved nothing
    s2, s3 = (json.loads((ck / f"step-0000000{i}" / "scheduler.json").read_text())["state"] for i in (2, 3))
    assert s2["last_epoch"] == s3["last_epoch"]  # nor the schedule
    assert json.loads((ck / "step-00000006" / "trainer_state.json").read_text())["skipped_nonfinite"] == 2
    assert _finite(ck / "step-00000006")

    with pytest.raises(NonFiniteError, match=r"^step 5: non-finite loss nan after skipping 2 such step"):
        _trainer(tmp_path / "stop", callbacks=[ts.NaNLossAt([3, 4, 5])], skip_nonfinite_steps=2).fit()


@pytest.mark.parametrize("eval_every,expected", [(None, [0, 6]), (3, [0, 3, 6]), (4, [0, 4, 6])])
def test_validation_runs_once_at_the_end(tmp_path, eval_every, expected):
    """Before the first step (step 0), every eval_every steps, and at the end unless just measured."""
    kw = {"val_data": "unused", "eval_every": eval_every} if eval_every else {}
    state = _trainer(tmp_path, val=ts.synthetic_rows(4, seed=1), **kw).fit()
    assert [r["step"] for r in state.history if "val_loss" in r] == expected
