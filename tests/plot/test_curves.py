"""Training plots: the panels come from the logged metrics (latest record of a repeated step wins),
matplotlib draws one titled panel each; without matplotlib (the plot extra) there is no plot, and
nothing else fails."""

import sys

import pytest

from astrai.plot import curves, write_plot

RECORDS = [
    {"step": 0, "val_loss": 0.69, "val_reward_accuracy": 0.0},
    {"step": 1, "loss": 0.70, "lr": 1e-3, "reward_accuracy": 0.5, "reward_chosen": 0.0, "reward_margin": 0.1},
    {"step": 2, "loss": 0.65, "lr": 9e-4, "reward_accuracy": 0.75, "reward_chosen": 0.2, "reward_margin": 0.3},
    {"step": 2, "loss": 0.60, "lr": 9e-4, "reward_accuracy": 1.0, "reward_chosen": 0.3, "reward_margin": 0.4},
    {"step": 2, "val_loss": 0.62, "val_reward_accuracy": 0.8, "val_reward_margin": 0.2},
]


def test_panels_from_records():
    c = curves(RECORDS)
    assert list(c) == ["loss", "learning rate", "DPO rewards", "DPO reward accuracy"]
    assert c["loss"] == {"train": [[1, 0.70], [2, 0.60]], "val": [[0, 0.69], [2, 0.62]]}  # the resumed step 2 wins
    assert c["DPO reward accuracy"] == {"train": [[1, 0.5], [2, 1.0]], "val": [[0, 0.0], [2, 0.8]]}
    assert c["DPO rewards"] == {"chosen": [[1, 0.0], [2, 0.3]], "margin": [[1, 0.1], [2, 0.4]],
                                "val margin": [[2, 0.2]]}
    assert "GRPO reward" in curves([{"step": 1, "loss": -0.1, "reward_mean": 0.4, "policy_reward": 0.5}])
    assert curves([{"step": 1, "loss": float("nan")}]) == {}


def test_matplotlib_draws_each_panel(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.image

    path = write_plot(tmp_path / "loss.png", curves(RECORDS), "dpo: test")
    img = matplotlib.image.imread(str(path))
    assert img.shape[0] == 800 and img.shape[1] == 1120  # 2 x 2 panels of 5.6 x 4 inches at 100 dpi
    assert (img[..., :3] < 0.5).any() and not list(tmp_path.glob(".*"))  # ink; no temporary file left


def test_without_matplotlib_there_is_no_plot_and_no_file(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import raises ImportError
    assert write_plot(tmp_path / "loss.png", curves(RECORDS)) is None
    assert not list(tmp_path.iterdir())


def test_the_older_loss_only_form_still_draws(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.image

    img = matplotlib.image.imread(str(write_plot(tmp_path / "old.png", {"train": [[1, 2.0], [2, 1.0]], "val": []})))
    assert img.shape[:2] == (400, 560)  # one panel of 5.6 x 4 inches at 100 dpi
