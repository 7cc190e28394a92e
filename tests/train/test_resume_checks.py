"""A resume trusts no counter of the checkpoint it continues (astrai.train.resume_checks, state_files):
each impossible value is one line naming the file and the key, before anything is loaded or pruned;
the learning rate follows the options; a divergence right after a resume names the checkpoint."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(__file__))
import train_script as ts  # noqa: E402

from astrai.train import resume  # noqa: E402
from astrai.train.resume_checks import DataOrder, consumed  # noqa: E402
from astrai.train.state_files import CheckpointError  # noqa: E402
from astrai.train.strategies import make_strategy  # noqa: E402
from astrai.train.trainer import NonFiniteError, Trainer  # noqa: E402

ROWS = 8  # batch_size 2 x grad_accum 2: 2 optimizer steps per epoch


def _trainer(out, callbacks=(), **kw):
    return Trainer(ts.model(), make_strategy("sft"), ts.synthetic_rows(ROWS),
                   ts.options(out, **{"scheduler": "constant", **kw}), callbacks=callbacks)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 4-step run (checkpoints at 2 and 4), kept pristine: each test edits a copy."""
    out = tmp_path_factory.mktemp("resume") / "run"
    _trainer(out, epochs=3, max_steps=4).fit()
    return out


@pytest.fixture
def run(finished, tmp_path):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(finished, out)
    return out


def _edit_json(path: Path, **changes):
    data = json.loads(path.read_text())
    for dotted, value in changes.items():
        *keys, last = dotted.split(".")
        target = data
        for k in keys:
            target = target[int(k)] if isinstance(target, list) else target[k]
        target[int(last) if isinstance(target, list) else last] = value
    path.write_text(json.dumps(data))


def test_the_saved_counters_are_what_the_schedule_says(finished):
    """The reference for the checks below, by hand: 8 rows, batch 2 x accum 2, one process: 2 steps per
    epoch, 4 rows each; step 4 is the end of epoch 1 (saved before the epoch counter moves on)."""
    state = json.loads((finished / "checkpoints" / "step-00000004" / "trainer_state.json").read_text())
    assert (state["global_step"], state["epoch"], state["step_in_epoch"], state["consumed_rows"]) == (4, 1, 2, 16)
    assert consumed(DataOrder(ROWS, 2, 2, 1), 1, 2) == 16
    assert consumed(DataOrder(10, 4, 1, 1), 0, 3) == 10  # 3 steps of 4, 4 and the last 2 rows
    assert consumed(DataOrder(10, 2, 1, 2, updates=2), 1, 1) == 2 * 2 * (5 + 2)  # each rank 5 rows an epoch


STATE_EDITS = {  # trainer_state.json key -> (tampered value, what the line must say)
    "global_step": (1000000, "global_step is 1000000, but the checkpoint's directory is step-00000004"),
    "epoch": (999, "epoch is 999, but global_step 4 is epoch 1, step_in_epoch 2 or epoch 2, step_in_epoch 0"),
    "step_in_epoch": (7, "step_in_epoch is 7"),
    "consumed_rows": (10 ** 9, "consumed_rows is 1000000000, but global_step 4 drew 16 rows"),
    "saved_step": (3, "saved_step is 3"),
    "skipped_nonfinite": (9, "skipped_nonfinite is 9, but only 0 to 4 steps were taken"),
    "world": (2, "world is 2, but the directory holds the generator state of rank(s) 0"),
}


def _refused(run, match: str, file: str):
    ckpt = run / "checkpoints" / "step-00000004"
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    metrics = (run / "metrics.jsonl").read_text()
    with pytest.raises(CheckpointError) as e:
        _trainer(run, epochs=3, max_steps=6, keep_last=1).fit()
    msg = str(e.value)
    assert msg.startswith(f"{ckpt / file}: ") and match in msg and "\n" not in msg, msg
    # nothing trained, saved or pruned: the genuine checkpoints are as they were
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000002", "step-00000004"]
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before
    assert (run / "metrics.jsonl").read_text() == metrics


@pytest.mark.parametrize("key", list(STATE_EDITS))
def test_an_impossible_counter_is_refused_naming_file_and_key(run, key):
    value, match = STATE_EDITS[key]
    _edit_json(run / "checkpoints" / "step-00000004" / "trainer_state.json", **{key: value})
    _refused(run, match, "trainer_state.json")


def _edit_tensor(path: Path, key_end: str, fn):
    tensors = load_file(str(path))
    key = sorted(k for k in tensors if k.endswith(key_end))[0]
    tensors[key] = fn(tensors[key].clone())
    save_file(tensors, str(path), metadata={"format": "astrai-optimizer"})
    return key


@pytest.mark.parametrize("field,fn,match", [
    ("/exp_avg", lambda t: t.view(-1).index_fill_(0, torch.tensor([0]), math.nan).view(t.shape), "holds NaN"),
    ("/exp_avg_sq", lambda t: t - 1.0, "holds negative values"),
    ("/step", lambda t: torch.full_like(t, 1e9), "not a whole number of optimizer steps from 0 to 4")])
def test_an_impossible_optimizer_tensor_is_refused(run, field, fn, match):
    key = _edit_tensor(run / "checkpoints" / "step-00000004" / "optimizer.safetensors", field, fn)
    _refused(run, f"'{key}' " + ("is [1000000000.0], " if field == "/step" else "") + match, "optimizer.safetensors")


@pytest.mark.parametrize("key,value,match", [
    ("param_groups.0.lr", 1e30, "param_groups[0].lr is 1e+30"),
    ("param_groups.0.lr", -0.01, "param_groups[0].lr is -0.01"),
    ("param_groups.1.betas", [1.5, 0.999], "param_groups[1].betas[0] is 1.5"),
    ("param_groups.0.eps", 0.0, "param_groups[0].eps is 0.0"),
    ("param_groups.0.weight_decay", math.inf, "param_groups[0].weight_decay is inf")])
def test_an_impossible_hyperparameter_is_refused(run, key, value, match):
    _edit_json(run / "checkpoints" / "step-00000004" / "optimizer.json", **{key: value})
    _refused(run, match, "optimizer.json")


@pytest.mark.parametrize("key,value,match", [
    ("state.last_epoch", -50, "last_epoch is -50"),
    ("state.last_epoch", 3, "last_epoch is 3, but the checkpoint records 4 optimizer steps"),
    ("state._step_count", 1, "_step_count is 1"),
    ("state.base_lrs", [math.nan, 0.01], "base_lrs[0] is nan"),
    ("state.base_lrs", [1e30, 0.01], "base_lrs[0] is 1e+30, but optimizer.json's param_groups[0].initial_lr is 0.01")])
def test_an_impossible_scheduler_state_is_refused(run, key, value, match):
    _edit_json(run / "checkpoints" / "step-00000004" / "scheduler.json", **{key: value})
    _refused(run, match, "scheduler.json")


def test_a_lowered_lr_is_followed_on_resume(run):
    t = _trainer(run, epochs=3, max_steps=6, lr=1e-3)  # the run was trained at 1e-2
    state = t.fit()
    assert [r["lr"] for r in state.history if "loss" in r] == [1e-3, 1e-3]  # not the saved 1e-2
    assert t.scheduler.base_lrs == [1e-3, 1e-3]


class StopAt(ts.Callback):
    def __init__(self, step):
        self.step = step

    def on_batch_end(self, trainer):
        if trainer.state.at_boundary and trainer.state.global_step == self.step:
            raise KeyboardInterrupt  # Checkpoint.on_error saves this step first (one process)


def test_an_unchanged_resume_restores_the_saved_lr_exactly(tmp_path):
    """cosine after warmup: resumed at step 3 (mid-decay), the lr and loss of steps 4-6 are the
    uninterrupted run's, bitwise."""
    straight = _trainer(tmp_path / "a", epochs=3, max_steps=6, scheduler="cosine").fit()
    with pytest.raises(KeyboardInterrupt):
        _trainer(tmp_path / "b", callbacks=[StopAt(3)], epochs=3, max_steps=6, scheduler="cosine").fit()
    assert resume.latest(tmp_path / "b" / "checkpoints").name == "step-00000003"
    resumed = _trainer(tmp_path / "b", epochs=3, max_steps=6, scheduler="cosine").fit()
    want = {r["step"]: (r["lr"], r["loss"]) for r in straight.history if "loss" in r and r["step"] > 3}
    assert {r["step"]: (r["lr"], r["loss"]) for r in resumed.history if "loss" in r} == want
    assert len(set(lr for lr, _ in want.values())) == 3  # the lr does move over these steps


def test_a_divergence_right_after_a_resume_names_the_checkpoint(run):
    ckpt = run / "checkpoints" / "step-00000004"
    with pytest.raises(NonFiniteError) as e:
        _trainer(run, callbacks=[ts.NaNLossAt([5])], epochs=3, max_steps=6).fit()
    msg = str(e.value)
    assert msg.startswith("step 5: non-finite loss nan") and f"this run resumed from {ckpt}" in msg
    assert "delete it to resume from an earlier checkpoint" in msg
    with pytest.raises(NonFiniteError) as e:  # a fresh run: the data and lr are the suspects
        _trainer(run.parent / "fresh", callbacks=[ts.NaNLossAt([1])], epochs=3, max_steps=2).fit()
    assert "resumed" not in str(e.value) and "lower lr" in str(e.value)


def test_the_cli_refuses_a_tampered_counter_in_one_line(tmp_path, data_dir):
    """`astrai train` on real preprocessed data, resumed after global_step was raised: one error line."""
    from astrai.config.train import TrainOptions
    from astrai.train.run import run_train

    out = tmp_path / "out"
    opts = {"data": str(data_dir), "output": str(out), "model": "tiny", "batch_size": 1, "max_steps": 2,
            "epochs": 20, "progress": False, "save_every": 1}
    run_train(TrainOptions(**opts))
    ckpt = out / "checkpoints" / "step-00000002"
    _edit_json(ckpt / "trainer_state.json", global_step=1000000)
    cfg = tmp_path / "train.yaml"
    cfg.write_text(json.dumps({**opts, "max_steps": 4}))
    r = subprocess.run([sys.executable, "-m", "astrai.cli", "train", str(cfg)], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr[-2000:]
    assert r.stderr.startswith(f"error: {ckpt / 'trainer_state.json'}: global_step is 1000000")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000001", "step-00000002"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, tiny_tokenizer):
    from astrai.config import load_pipeline
    from astrai.data.preprocess import run_preprocess

    tmp = tmp_path_factory.mktemp("sft")
    chats = [{"messages": [{"role": "user", "content": f"how are you today number {i}"},
                           {"role": "assistant", "content": "fine thanks " * (1 + i % 4)}]} for i in range(12)]
    (tmp / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chats))
    root = Path(__file__).resolve().parents[2]
    run_preprocess(load_pipeline(root / "pipelines" / "chatml_sft.yaml"), [str(tmp / "chat.jsonl")], str(tmp / "data"),
                   tokenizer=str(tiny_tokenizer), workers=1, log=lambda s: None)
    return tmp / "data"
