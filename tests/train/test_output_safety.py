"""The train output as something to protect (astrai.train.output): a directory of the user's is refused
before any write, a planted link is never written through (at start or mid-run), and a checkpoint or
final/ is deleted or replaced only when all it holds is astrai's."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from astrai.config import load_pipeline
from astrai.config.train import TrainOptions
from astrai.data.preprocess import run_preprocess
from astrai.errors import InputError
from astrai.runtime import LinkRefused, claim_output
from astrai.train import resume
from astrai.train.callbacks import Callback
from astrai.train.output import TRAIN_MARKER, WRITTEN, foreign
from astrai.train.run import run_train

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def data(tmp_path_factory, tiny_tokenizer):
    tmp = tmp_path_factory.mktemp("sft")
    chats = [{"messages": [{"role": "user", "content": f"how are you today number {i}"},
                           {"role": "assistant", "content": "fine thanks " * (1 + i % 4)}]} for i in range(24)]
    src = tmp / "chat.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in chats))
    run_preprocess(load_pipeline(ROOT / "pipelines" / "chatml_sft.yaml"), [str(src)], str(tmp / "data"),
                   tokenizer=str(tiny_tokenizer), workers=1, log=lambda s: None)
    return tmp / "data"


def _opts(data, out, **kw):
    return TrainOptions(**{"data": str(data), "output": str(out), "model": "tiny", "batch_size": 1, "max_steps": 2,
                           "epochs": 20, "progress": False, "lr": 1e-3, "save_every": 1, **kw})


def _tree(root: Path) -> dict:
    """Every entry under root with its bytes (files) or link target: what must stay as it was."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        out[rel] = ("link", os.readlink(p)) if p.is_symlink() else ("dir",) if p.is_dir() else p.read_bytes()
    return out


def _users_dir(tmp_path) -> Path:
    """The issue's case: a directory of the user's with files named like the ones astrai writes."""
    out = tmp_path / "mine"
    (out / "final").mkdir(parents=True)
    (out / "final" / "p.txt").write_text("mine")
    (out / "metrics.jsonl").write_text("my notes, not JSON\n")
    (out / "checkpoints" / "step-00000001").mkdir(parents=True)
    (out / "checkpoints" / "step-00000001" / "mine.txt").write_text("mine too")
    return out


def test_a_users_directory_is_refused_before_any_write(data, tmp_path):
    out = _users_dir(tmp_path)
    before = _tree(out)
    with pytest.raises(InputError) as e:
        run_train(_opts(data, out))
    msg = str(e.value)
    assert msg.startswith(f"output {out} is not empty") and TRAIN_MARKER in msg and "\n" not in msg
    assert _tree(out) == before  # nothing added, changed or deleted


def test_a_malformed_metrics_line_is_refused_before_any_step(data, tmp_path):
    out = tmp_path / "out"
    run_train(_opts(data, out))
    with open(out / "metrics.jsonl", "a") as fh:
        fh.write("{oops\n")
    before = _tree(out)
    with pytest.raises(InputError) as e:
        run_train(_opts(data, out, max_steps=3))
    assert str(e.value).startswith(f"{out / 'metrics.jsonl'}:3: not a JSON record") and "\n" not in str(e.value)
    assert _tree(out) == before  # no step trained, nothing appended


def test_a_preprocess_output_is_not_a_train_output(data, tmp_path):
    copy = tmp_path / "data"
    shutil.copytree(data, copy)
    before = _tree(copy)
    with pytest.raises(InputError, match="it is a preprocess output"):
        run_train(_opts(copy, copy))
    assert _tree(copy) == before


def test_an_empty_directory_is_claimed_then_resumed(data, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    assert run_train(_opts(data, out))["steps"] == 2
    assert json.loads((out / TRAIN_MARKER).read_text()) == {"kind": "train", "written_by": "astrai"}
    assert run_train(_opts(data, out, max_steps=3))["steps"] == 3  # ours: resumed from step 2
    steps = [json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    # everything train wrote into final/ and a checkpoint is named in WRITTEN (what it may delete)
    assert foreign(out / "final") == [] and foreign(out / "checkpoints" / "step-00000003") == []


def test_a_run_refused_before_any_step_leaves_no_trace(data, tmp_path):
    out = tmp_path / "new"
    with pytest.raises(Exception):
        run_train(_opts(data, out, model="no-such-model"))
    assert not out.exists()


@pytest.fixture
def trained(data, tmp_path):
    out = tmp_path / "out"
    run_train(_opts(data, out))
    return out


@pytest.mark.parametrize("where,said", [("final/notes.txt", "final holds notes.txt"),
                                        ("final/merged/notes.txt", "final holds merged/notes.txt"),
                                        ("checkpoints/step-00000002/notes.txt", "step-00000002 holds notes.txt")])
def test_a_users_file_in_final_or_a_checkpoint_is_never_deleted(data, trained, where, said):
    (trained / where).parent.mkdir(exist_ok=True)
    (trained / where).write_text("mine")
    before = _tree(trained)
    with pytest.raises(InputError) as e:  # refused before the first step: nothing replaced or pruned
        run_train(_opts(data, trained, max_steps=4, keep_last=1))
    assert said in str(e.value) and "did not write" in str(e.value)
    assert _tree(trained) == before


def test_pruning_keeps_higher_steps_and_directories_holding_user_files(tmp_path, capsys):
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3, 5):
        d = root / f"step-{step:08d}"
        d.mkdir(parents=True)
        (d / "trainer_state.json").write_text("{}")
        (d / "model.safetensors").write_text("x")
    (root / "step-00000002" / "notes.txt").write_text("mine")
    (root / "step-00000009").symlink_to(tmp_path)  # a link named like a checkpoint: never one
    resume.prune(root, keep=1, step=3)
    left = sorted(p.name for p in root.iterdir())
    assert left == ["step-00000002", "step-00000003", "step-00000005", "step-00000009"]
    assert (root / "step-00000002" / "notes.txt").read_text() == "mine" and "notes.txt" in capsys.readouterr().err
    assert resume.latest(root).name == "step-00000005"


# ---- planted links -------------------------------------------------------------------------------


@pytest.fixture
def ours(tmp_path):
    """An output astrai claimed (its marker), and a file of the user's outside it."""
    out = tmp_path / "out"
    out.mkdir()
    claim_output(out, {"kind": "train"}, TRAIN_MARKER)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("the user's file")
    return out, outside


@pytest.mark.parametrize("name,is_dir", [("metrics.jsonl", False), ("loss.png", False), ("checkpoints", True),
                                         ("final", True), ("runs", True), ("completions.jsonl", False),
                                         ("checkpoints/step-00000001", True), (".final.tmp", True),
                                         ("checkpoints/.step-00000001.tmp", True),
                                         ("checkpoints/.step-00000002.replaced", True)])
def test_a_link_planted_where_train_writes_is_refused_naming_it(data, ours, name, is_dir):
    out, outside = ours
    target = outside if is_dir else outside / "keep.txt"
    (out / name).parent.mkdir(exist_ok=True)
    (out / name).symlink_to(target)
    before = _tree(outside)
    with pytest.raises(InputError) as e:  # before any step, every rank alike: one line naming the link
        run_train(_opts(data, out))
    assert str(e.value).startswith(f"{out / name}: is a symbolic link") and "\n" not in str(e.value)
    assert _tree(outside) == before and (out / name).is_symlink()
    assert not (out / "metrics.jsonl").exists() or name == "metrics.jsonl"  # refused before the first step


@pytest.mark.parametrize("name", [".final.tmp", "checkpoints/.step-00000002.tmp"])
def test_a_link_planted_mid_run_at_a_temporary_name_is_removed_not_followed(data, ours, name):
    out, outside = ours
    (out / "checkpoints").mkdir()
    before = _tree(outside)
    assert run_train(_opts(data, out), callbacks=[PlantAt(out, name, outside)])["steps"] == 2
    assert _tree(outside) == before and not (out / name).is_symlink()
    assert (out / "final" / "model.safetensors").is_file()


class PlantAt(Callback):
    """Plants a link at `name` after step 1, as another process could mid-run."""

    def __init__(self, out, name, target):
        self.out, self.name, self.target = out, name, target

    def on_batch_end(self, trainer):
        if trainer.state.at_boundary and trainer.state.global_step == 1 and not (self.out / self.name).is_symlink():
            (self.out / self.name).unlink(missing_ok=True)
            (self.out / self.name).symlink_to(self.target)


def test_a_link_planted_mid_run_is_refused_by_the_open_itself(data, ours):
    out, outside = ours
    target = outside / "keep.txt"
    with pytest.raises(LinkRefused) as e:
        run_train(_opts(data, out), callbacks=[PlantAt(out, "metrics.jsonl", target)])
    assert e.value.filename == str(out / "metrics.jsonl")
    assert target.read_text() == "the user's file"


def test_the_cli_says_one_line_naming_the_link(data, ours, tmp_path):
    out, outside = ours
    (out / "metrics.jsonl").symlink_to(outside / "keep.txt")
    cfg = tmp_path / "train.yaml"
    cfg.write_text(json.dumps({"data": str(data), "output": str(out), "model": "tiny", "batch_size": 1,
                               "max_steps": 2, "progress": False}))
    r = subprocess.run([sys.executable, "-m", "astrai.cli", "train", str(cfg)], capture_output=True, text=True,
                       timeout=300, env=ENV)
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [r.stderr.strip()], r.stderr[-2000:]
    assert r.stderr.startswith(f"error: {out / 'metrics.jsonl'}: is a symbolic link")
    assert (outside / "keep.txt").read_text() == "the user's file"


def test_written_names_cover_every_writer():
    for name in ("config.json", "model.safetensors", "adapter_model.safetensors", "chat_template.jinja",
                 "rng-rank3.safetensors", "optimizer.json", ".model.safetensors.tmp-123"):
        assert WRITTEN.fullmatch(name), name
    for name in ("notes.txt", "model.safetensors.bak", "p.txt", "rng-rankX.json"):
        assert not WRITTEN.fullmatch(name), name
