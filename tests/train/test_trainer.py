"""Trainer: accumulation normalised by the step's trained tokens, hook order, exact resume after a
kill, SIGTERM checkpoint, atomic checkpoints."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import train_script as ts  # noqa: E402

from astrai.model.hf_checkpoint import read_tensors  # noqa: E402
from astrai.train import resume  # noqa: E402
from astrai.train.callbacks import Callback  # noqa: E402
from astrai.train.strategies import make_strategy  # noqa: E402
from astrai.train.trainer import Trainer  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(__file__), "train_script.py")


class GradCapture(Callback):
    def __init__(self):
        self.grads, self.losses = [], []

    def on_optimizer_step(self, trainer):
        self.grads.append({k: p.grad.clone() for k, p in trainer.raw_model.named_parameters()})


def _one_step_grads(tmp_path, batch, accum):
    cap = GradCapture()
    t = Trainer(ts.model(), make_strategy("sft"), ts.synthetic_rows(8), ts.options(
        tmp_path / f"b{batch}a{accum}", batch_size=batch, grad_accum=accum, shuffle=False, max_steps=1,
        max_grad_norm=None), callbacks=(cap,))
    state = t.fit()
    return cap.grads[0], state.history[0]["loss"]


def test_four_micro_batches_equal_the_concatenated_batch(tmp_path):
    g4, loss4 = _one_step_grads(tmp_path, batch=1, accum=4)
    g1, loss1 = _one_step_grads(tmp_path, batch=4, accum=1)
    assert abs(loss4 - loss1) < 1e-6
    for k in g1:
        torch.testing.assert_close(g4[k], g1[k], atol=1e-6, rtol=1e-5, msg=k)

    # the seed's normalisation (each micro-batch's mean / 4) gives a visibly different gradient here
    m = ts.model()
    strat = make_strategy("sft")
    from astrai.train.strategies import Env
    for row in ts.synthetic_rows(8)[:4]:
        b = strat.collate([row])
        s, _, _ = strat.loss(m, b, Env())
        (s / max(strat.units(b), 1) / 4).backward()
    naive = {k: p.grad for k, p in m.named_parameters()}
    assert max(float((naive[k] - g1[k]).abs().max()) for k in g1) > 1e-4


class Recorder(Callback):
    def __init__(self):
        self.events = []

    def __getattribute__(self, name):
        if name.startswith("on_"):
            return lambda trainer, *a: object.__getattribute__(self, "events").append(name)
        return object.__getattribute__(self, name)


def test_hook_order(tmp_path):
    rec = Recorder()
    Trainer(ts.model(), make_strategy("sft"), ts.synthetic_rows(8), ts.options(
        tmp_path, batch_size=2, grad_accum=2, epochs=1), callbacks=(rec,)).fit()
    step = ["on_batch_begin", "on_batch_end", "on_batch_begin", "on_optimizer_step", "on_batch_end"]
    assert rec.events == ["on_train_begin", "on_epoch_begin", *step, *step, "on_epoch_end", "on_train_end"]


def test_on_error_then_on_train_end(tmp_path):
    rec = Recorder()

    class Boom(Callback):
        def on_optimizer_step(self, trainer):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        Trainer(ts.model(), make_strategy("sft"), ts.synthetic_rows(8), ts.options(tmp_path, epochs=1),
                callbacks=(Boom(), rec)).fit()
    assert rec.events[-2:] == ["on_error", "on_train_end"]


def _losses(out):
    by_step = {}
    for line in Path(out, "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "loss" in r:
            by_step[r["step"]] = r["loss"]  # a resumed run rewrites the steps after its checkpoint
    return [by_step[k] for k in sorted(by_step)]


def test_resume_after_kill_is_bitwise_exact(tmp_path):
    full = tmp_path / "full"
    r = subprocess.run([sys.executable, SCRIPT, str(full)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    killed = tmp_path / "killed"
    r = subprocess.run([sys.executable, SCRIPT, str(killed), "--kill-at", "5"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == -signal.SIGKILL
    assert resume.latest(killed / "checkpoints").name == "step-00000004"
    r = subprocess.run([sys.executable, SCRIPT, str(killed)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    ref = _losses(full)
    assert len(ref) == 12  # 24 rows / (2 x 2) = 6 steps x 2 epochs
    assert _losses(killed) == ref  # bitwise: float equality of every step's loss
    a = read_tensors(resume.latest(full / "checkpoints"))
    b = read_tensors(resume.latest(killed / "checkpoints"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_sigterm_writes_a_checkpoint(tmp_path):
    out = tmp_path / "sig"
    p = subprocess.Popen([sys.executable, SCRIPT, str(out), "--sleep", "0.3"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (out / "metrics.jsonl").exists() and time.time() < deadline:
        time.sleep(0.1)
    p.send_signal(signal.SIGTERM)
    stdout, stderr = p.communicate(timeout=120)
    assert p.returncode == 0, stderr
    assert "STOPPED SIGTERM" in stdout
    step = int(stdout.split("STEP")[1])
    assert 0 < step < 12
    latest = resume.latest(out / "checkpoints")
    assert json.loads((latest / "trainer_state.json").read_text())["global_step"] == step


def test_incomplete_checkpoints_are_ignored(tmp_path):
    root = tmp_path / "checkpoints"
    t = Trainer(ts.model(), make_strategy("sft"), ts.synthetic_rows(8), ts.options(tmp_path, epochs=1))
    t.fit()
    good = resume.latest(root)
    # what a kill mid-save leaves: a hidden temporary directory, or a directory without trainer_state.json
    (root / ".step-00000009.tmp-1234").mkdir()
    (root / ".step-00000009.tmp-1234" / "model.safetensors").write_bytes(b"partial")
    (root / "step-00000010").mkdir()
    assert resume.latest(root) == good
    for f in ("config.json", "model.safetensors", "optimizer.safetensors", "optimizer.json", "scheduler.json",
              "rng-rank0.safetensors", "rng-rank0.json", "trainer_state.json"):
        assert (good / f).exists(), f
    assert not list(good.glob("*.pt"))


def test_moe_aux_loss_logged_apart_and_weighted(tmp_path):
    from astrai.model import CausalLM, ModelConfig

    torch.manual_seed(0)
    m = CausalLM(ModelConfig.preset("tiny-moe", vocab_size=128, router_aux_loss_coef=0.02))
    state = Trainer(m, make_strategy("sft"), ts.synthetic_rows(8), ts.options(tmp_path, max_steps=2)).fit()
    rec = state.history[0]
    assert rec["aux_loss"] >= 1.0  # E * sum f * P is 1 for perfectly balanced routing, more otherwise
    assert rec["aux_loss_weighted"] == pytest.approx(0.02 * rec["aux_loss"])
    assert rec["loss"] > 3.0  # the task loss alone (ln 128 = 4.85 at init), not task + aux


def test_validation_reads_the_validation_rows(tmp_path):
    """evaluate() is the token-weighted loss of the validation rows (not of the training rows at the
    same indices), computed here directly from the strategy on the val rows alone."""
    from astrai.train.strategies import Env

    train, val = ts.synthetic_rows(8, seed=0), ts.synthetic_rows(5, seed=7)
    t = Trainer(ts.model(), make_strategy("sft"), train, ts.options(tmp_path, val_data="unused", eval_every=1,
                                                                       batch_size=2),
                val_dataset=val)
    strat, model = make_strategy("sft"), ts.model()
    with torch.no_grad():
        total = units = 0.0
        for row in val:
            b = strat.collate([row])
            total += float(strat.loss(model, b, Env())[0])
            units += strat.units(b)
        on_train = sum(float(strat.loss(model, strat.collate([r]), Env())[0]) for r in train[:5])
    got = t.evaluate()["val_loss"]
    assert got == pytest.approx(total / units, rel=1e-5)
    assert abs(got - on_train / sum(strat.units(strat.collate([r])) for r in train[:5])) > 1e-3
