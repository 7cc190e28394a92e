"""The default callbacks a user sees: the progress bar counts the optimizer steps that will run; in a
log (standard error not a terminal) progress is plain lines, never a bar's carriage returns."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import train_script as ts  # noqa: E402

from astrai.train.callbacks import Callback, ProgressBar  # noqa: E402
from astrai.train.strategies import make_strategy  # noqa: E402
from astrai.train.trainer import Trainer  # noqa: E402


class BarSeen(Callback):
    def __init__(self):
        self.total = self.n = None

    def on_batch_end(self, trainer):  # user callbacks run after the defaults: the bar is updated
        bar = next(c for c in trainer.callbacks if isinstance(c, ProgressBar)).bar
        self.total, self.n = bar.total, bar.n


class Terminal:
    """Standard error as a terminal: what tqdm writes goes nowhere."""

    def isatty(self):
        return True

    def write(self, text):
        return len(text)

    def flush(self):
        pass


def _run(tmp_path, **kw):
    seen = BarSeen()
    t = Trainer(ts.model(), make_strategy("sft"), ts.synthetic_rows(24), ts.options(tmp_path, progress=True, **kw),
                callbacks=(seen,))
    t.fit()
    return seen


def test_the_bar_counts_max_steps_not_an_epoch(tmp_path, monkeypatch):
    # 24 rows / (2 x 2) = 6 steps per epoch, 5 epochs = 30 steps; max_steps 4 is what runs
    monkeypatch.setattr(sys, "stderr", Terminal())
    seen = _run(tmp_path / "a", epochs=5, max_steps=4)
    assert (seen.total, seen.n) == (4, 4)


def test_the_bar_counts_every_epoch(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "stderr", Terminal())
    seen = _run(tmp_path / "b", epochs=2)
    assert (seen.total, seen.n) == (12, 12)


def test_callbacks_import_nothing_from_the_trainer():
    """The dependency runs one way: the trainer imports its callbacks, never the reverse (at any level)."""
    import ast

    import astrai.train.callbacks as cb

    tree = ast.parse(open(cb.__file__).read())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | \
        {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert "astrai.train.trainer" not in imported
    from astrai.train.trainer import NonFiniteError
    assert NonFiniteError is cb.NonFiniteError


def test_a_log_gets_lines_not_a_bar(tmp_path, capsys):
    t = Trainer(ts.model(), make_strategy("sft"), ts.synthetic_rows(24),
                ts.options(tmp_path, progress=True, epochs=5, max_steps=4))
    t.fit()
    err = capsys.readouterr().err
    assert "\r" not in err and "progress: 4/4 steps" in err
