"""report_to: TensorBoard event files hold exactly what metrics.jsonl holds; W&B runs offline with the
same tags; a reporter whose package is missing is refused before any work with the pip command."""

import json
import sys
import types

import pytest

sys.path.insert(0, __import__("os").path.dirname(__file__))
import train_script as ts  # noqa: E402

from astrai.train.report import check_reporters, tags  # noqa: E402
from astrai.train.strategies import make_strategy  # noqa: E402
from astrai.train.trainer import Trainer  # noqa: E402


def _records(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_tags_name_train_and_eval_metrics():
    assert tags({"step": 3, "epoch": 0, "loss": 1.5, "lr": 1e-3, "grad_norm": None, "tokens": 40}) == {
        "train/loss": 1.5, "train/lr": 1e-3, "train/tokens": 40.0}
    assert tags({"step": 3, "val_loss": 2.0, "val_reward_accuracy": 0.75, "x": float("nan")}) == {
        "eval/loss": 2.0, "eval/reward_accuracy": 0.75}


def test_tensorboard_events_equal_the_metrics_file(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    opts = ts.options(tmp_path, epochs=1, max_steps=4, report_to="tensorboard", val_data="unused", eval_every=2)
    Trainer(ts.model(), make_strategy("sft"), ts.synthetic_rows(24), opts, val_dataset=ts.synthetic_rows(4, 1)).fit()
    acc = EventAccumulator(str(tmp_path / "runs"))
    acc.Reload()
    recs = _records(tmp_path)
    loss = [(r["step"], r["loss"]) for r in recs if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in recs if "val_loss" in r]
    assert [(e.step, pytest.approx(e.value, rel=1e-6)) for e in acc.Scalars("train/loss")] == loss
    assert [(e.step, pytest.approx(e.value, rel=1e-6)) for e in acc.Scalars("eval/loss")] == val
    assert [e.step for e in acc.Scalars("train/lr")] == [1, 2, 3, 4] and [s for s, _ in val] == [0, 2, 4]


def test_wandb_runs_offline_with_the_same_tags(tmp_path, monkeypatch):
    calls = {"log": []}

    class Run:
        def log(self, data, step):
            calls["log"].append((step, data))

        def finish(self):
            calls["finished"] = True

    def init(**kw):
        calls["init"] = kw
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    opts = ts.options(tmp_path, epochs=1, max_steps=2, report_to=["wandb"])
    Trainer(ts.model(), make_strategy("sft"), ts.synthetic_rows(24), opts).fit()
    assert calls["init"]["mode"] == "offline" and calls["init"]["dir"] == str(tmp_path)
    assert calls["init"]["config"]["max_steps"] == 2 and calls["finished"]
    assert [(s, d["train/loss"]) for s, d in calls["log"]] == [(r["step"], r["loss"]) for r in _records(tmp_path)]


def test_a_missing_reporter_is_refused_before_work(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    assert check_reporters(["tensorboard"]) == []
    (problem,) = check_reporters(["tensorboard", "wandb"])
    assert "report_to: wandb needs the wandb package: pip install 'astrai[wandb]'" in problem

    from astrai.train.run import TrainConfigError, run_train

    with pytest.raises(TrainConfigError, match=r"pip install 'astrai\[wandb\]'"):
        run_train(ts.options(tmp_path / "out", report_to="wandb"))
    assert not (tmp_path / "out").exists()


def test_report_to_accepts_none_one_or_a_list(tmp_path):
    from pydantic import ValidationError

    assert ts.options(tmp_path).reporters == []
    assert ts.options(tmp_path, report_to="tensorboard").reporters == ["tensorboard"]
    assert ts.options(tmp_path, report_to=["wandb", "tensorboard", "wandb"]).reporters == ["wandb", "tensorboard"]
    with pytest.raises(ValidationError):
        ts.options(tmp_path, report_to="mlflow")


def test_metrics_records_leave_out_only_a_last_line_cut_by_a_kill(tmp_path):
    from astrai.errors import InputError
    from astrai.train.summary import read_records

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "val_loss": 1.5}\n')
    assert read_records(path) == [{"step": 1}, {"step": 2, "val_loss": 1.5}]
    path.write_text('{"step": 1}\n{"step": 2, "val_lo')  # a record's single write, cut
    assert read_records(path) == [{"step": 1}]
    path.write_text('{"step": 1}\n{"step": 2, "val_lo\n{"step": 3}\n')  # inside the file: not ours to drop
    with pytest.raises(InputError) as e:  # one line naming the file and the line
        read_records(path)
    assert str(e.value).startswith(f"{path}:2: not a JSON record") and "\n" not in str(e.value)
    path.write_text('{"step": 1}\n[1, 2]\n')
    with pytest.raises(InputError, match=r"metrics.jsonl:2: not a metrics record"):
        read_records(path)


def test_a_resumed_run_appends_after_whole_records_only(tmp_path):
    from astrai.train.callbacks import drop_cut_line
    from astrai.train.summary import read_records

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "lo')
    drop_cut_line(path)
    with open(path, "a") as fh:  # what the resumed run appends next
        fh.write('{"step": 2, "loss": 1.0}\n')
    assert read_records(path) == [{"step": 1}, {"step": 2, "loss": 1.0}]
    drop_cut_line(path)  # whole records are left alone
    assert path.read_text() == '{"step": 1}\n{"step": 2, "loss": 1.0}\n'
