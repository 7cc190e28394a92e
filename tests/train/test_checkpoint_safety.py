"""Checkpoints as untrusted input and as the only copy of the work: a planted pickle is never opened
(no code runs, one clear line), our older pickle format converts and then resumes exactly, a re-saved
step is never missing from disk, and the files hold no pickle at all."""

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import train_script as ts  # noqa: E402

from astrai.model.hf_checkpoint import read_tensors  # noqa: E402
from astrai.train import legacy, resume  # noqa: E402
from astrai.train.state_files import CheckpointError  # noqa: E402
from astrai.train.strategies import make_strategy  # noqa: E402
from astrai.train.trainer import Trainer  # noqa: E402


class _Evil:
    """Unpickling this creates `marker`: proof that a file was unpickled."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def _trainer(out, **kw):
    # constant lr: a run stopped at step 4 follows the 6-step run's schedule exactly
    return Trainer(ts.model(), make_strategy("sft"), ts.synthetic_rows(8), ts.options(out, scheduler="constant", **kw))


def _losses(state):
    return [r["loss"] for r in state.history if "loss" in r]


@pytest.fixture
def trained(tmp_path):
    """A finished 4-step run (checkpoints at 2 and 4) and the losses of a 6-step run of the same data."""
    _trainer(tmp_path / "run", epochs=3, max_steps=4).fit()
    return tmp_path / "run"


@pytest.mark.parametrize("name", ["optimizer.pt", "scheduler.pt", "rng.pt", "extra.pkl", "pytorch_model.bin"])
def test_a_planted_pickle_is_never_opened(trained, tmp_path, name):
    latest = resume.latest(trained / "checkpoints")
    marker = tmp_path / "PWNED"
    (latest / name).write_bytes(pickle.dumps(_Evil(marker)))
    t = _trainer(trained, epochs=3, max_steps=6)
    with pytest.raises(CheckpointError) as e:
        t.fit()
    assert not marker.exists()
    msg = str(e.value)
    assert name in msg and "never opens" in msg and "remove it" in msg and "\n" not in msg


def test_our_older_pickle_checkpoint_is_refused_with_the_conversion_then_resumes_exactly(tmp_path):
    ref = _trainer(tmp_path / "ref", epochs=3, max_steps=6).fit()
    # the same run stopped at step 4, its checkpoint rewritten as an older astrai wrote it (torch.save)
    _trainer(tmp_path / "old", epochs=3, max_steps=4).fit()
    ckpt = resume.latest(tmp_path / "old" / "checkpoints")
    t = _trainer(tmp_path / "scratch", epochs=3, max_steps=4)
    resume.load(ckpt, t.raw_model, t.optimizer, t.scheduler)  # live objects holding the step-4 state
    torch.save(t.optimizer.state_dict(), ckpt / "optimizer.pt")  # index-keyed, as before
    torch.save(t.scheduler.state_dict(), ckpt / "scheduler.pt")
    import random

    import numpy as np
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
               ckpt / "rng.pt")
    for f in ("optimizer.safetensors", "optimizer.json", "scheduler.json", "rng-rank0.safetensors",
              "rng-rank0.json"):
        (ckpt / f).unlink()
    with pytest.raises(CheckpointError, match=r"older astrai .*python -m astrai\.train\.legacy"):
        _trainer(tmp_path / "old", epochs=3, max_steps=6).fit()

    r = subprocess.run([sys.executable, "-m", "astrai.train.legacy", str(ckpt)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert not list(ckpt.glob("*.pt"))
    state = _trainer(tmp_path / "old", epochs=3, max_steps=6).fit()
    assert _losses(state) == _losses(ref)[4:]  # steps 5 and 6, bitwise
    a, b = read_tensors(resume.latest(tmp_path / "ref" / "checkpoints")), read_tensors(
        resume.latest(tmp_path / "old" / "checkpoints"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_converter_refuses_a_malicious_pickle(trained, tmp_path):
    ckpt = resume.latest(trained / "checkpoints")
    marker = tmp_path / "PWNED"
    for n in resume.LEGACY:
        (ckpt / n).write_bytes(pickle.dumps(_Evil(marker)))
    assert legacy.main([str(ckpt)]) == 1
    assert not marker.exists()
    assert all((ckpt / n).exists() for n in resume.LEGACY)  # nothing converted, nothing removed


def test_checkpoint_files_hold_no_pickle(trained):
    ckpt = resume.latest(trained / "checkpoints")
    for f in ckpt.iterdir():
        head = f.read_bytes()[:2]
        assert head != b"\x80\x02" and not f.name.endswith(".pt"), f  # pickle protocol header
        if f.suffix == ".json":
            json.loads(f.read_text())
    opt = json.loads((ckpt / "optimizer.json").read_text())
    names = [n for g in opt["param_groups"] for n in g["params"]]
    assert "model.embed_tokens.weight" in names and all(isinstance(n, str) for n in names)


@pytest.mark.parametrize("edit", ["truncate_tensors", "bad_json", "foreign_names", "rng_size"])
def test_damaged_state_files_give_one_line(trained, edit):
    ckpt = resume.latest(trained / "checkpoints")
    if edit == "truncate_tensors":
        p = ckpt / "optimizer.safetensors"
        p.write_bytes(p.read_bytes()[:100])
    elif edit == "bad_json":
        (ckpt / "scheduler.json").write_text("{")
    elif edit == "foreign_names":
        meta = json.loads((ckpt / "optimizer.json").read_text())
        meta["param_groups"][0]["params"][0] = "model.layers.99.mlp.up_proj.weight"
        (ckpt / "optimizer.json").write_text(json.dumps(meta))
    else:
        meta = json.loads((ckpt / "rng-rank0.json").read_text())
        meta["python"]["state"] = meta["python"]["state"][:10]
        (ckpt / "rng-rank0.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError) as e:
        _trainer(trained, epochs=3, max_steps=6).fit()
    assert str(ckpt) in str(e.value) and "\n" not in str(e.value)


def test_resaving_a_step_never_leaves_it_missing(trained, monkeypatch):
    root = trained / "checkpoints"
    first = resume.latest(root)
    step = int(first.name.split("-")[1])
    before = read_tensors(first)
    t = _trainer(trained, epochs=3, max_steps=4)
    t.resume()
    real = os.replace

    def crash_on_rename_in(src, dst):  # the old directory is moved aside, then the new one's rename "crashes"
        if Path(src).name == f".{first.name}.tmp":
            raise KeyboardInterrupt
        return real(src, dst)

    monkeypatch.setattr(resume.os, "replace", crash_on_rename_in)
    with pytest.raises(KeyboardInterrupt):
        t.save_checkpoint()
    monkeypatch.setattr(resume.os, "replace", real)
    assert not first.exists()  # moved aside, and still found
    found = resume.latest(root)
    assert found is not None and found.name == f".{first.name}.replaced"
    assert all(torch.equal(before[k], v) for k, v in read_tensors(found).items())
    t.save_checkpoint()  # recovers the aside directory, then replaces it properly
    assert resume.latest(root) == first and not list(root.glob(".step-*"))
    assert int(json.loads((first / "trainer_state.json").read_text())["global_step"]) == step


SCRIPT = os.path.join(os.path.dirname(__file__), "train_script.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _torchrun(out, *args, procs=2):
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                           str(procs), SCRIPT, str(out), *args], capture_output=True, text=True, timeout=300, env=ENV)


@pytest.mark.slow
def test_every_rank_resumes_its_own_generators(tmp_path):
    """DDP, 2 ranks whose generators differ: killed after the checkpoint of step 4, each rank resumes
    with the generator state it had at step 4 (not rank 0's)."""
    r = _torchrun(tmp_path / "run", "--kill-at", "4", "--rng-log")
    assert r.returncode != 0
    before = ts.rank_rng(tmp_path / "run", "step")
    assert before[(0, 4)] != before[(1, 4)]
    ckpt = resume.latest(tmp_path / "run" / "checkpoints")
    assert ckpt.name == "step-00000004"
    assert {f.name for f in ckpt.glob("rng-rank*")} == {"rng-rank0.json", "rng-rank0.safetensors",
                                                          "rng-rank1.json", "rng-rank1.safetensors"}
    r = _torchrun(tmp_path / "run", "--rng-log")
    assert r.returncode == 0, r.stderr[-3000:]
    after = {k: v for k, v in ts.rank_rng(tmp_path / "run", "begin").items() if k[1]}  # not the first run's
    assert after == {(0, 4): before[(0, 4)], (1, 4): before[(1, 4)]}


@pytest.mark.slow
def test_a_nan_on_one_ddp_rank_stops_both_at_the_same_step(tmp_path):
    r = _torchrun(tmp_path / "run", "--nan-at", "3")
    assert r.returncode != 0
    assert r.stderr.count("NonFiniteError: step 3: non-finite loss nan") == 2, r.stderr[-3000:]
    assert resume.latest(tmp_path / "run" / "checkpoints").name == "step-00000002"


def test_a_fifo_named_like_a_state_file_is_refused_without_blocking(trained):
    ckpt = resume.latest(trained / "checkpoints")
    (ckpt / "scheduler.json").unlink()
    os.mkfifo(ckpt / "scheduler.json")
    with pytest.raises(CheckpointError, match="not a regular file"):
        _trainer(trained, epochs=3, max_steps=6).fit()


def test_a_resume_with_changed_options_says_which(trained, capsys):
    capsys.readouterr()
    _trainer(trained, epochs=3, max_steps=5).fit()  # only the length grew: a plain continuation
    assert "changed" not in capsys.readouterr().err
    _trainer(trained, epochs=3, max_steps=6, lr=1e-4).fit()
    err = capsys.readouterr().err
    assert "step-00000005" in err and "(step 5)" in err and "lr 0.01 -> 0.0001" in err, err
    assert "max_steps" not in err and "resume: never" in err


def test_starting_over_refuses_an_output_holding_another_runs_checkpoints(trained):
    # its step-4 would outrank this run's step-2 in keep_last and in the next resume: refused before any step
    with pytest.raises(CheckpointError) as e:
        _trainer(trained, epochs=3, max_steps=2, resume="never").fit()
    assert "step-00000004" in str(e.value) and "another output" in str(e.value) and "\n" not in str(e.value)
    assert resume.latest(trained / "checkpoints").name == "step-00000004"


def test_a_checkpoint_saved_without_the_fused_kernel_resumes_with_it(trained):
    # FSDP saves fused None (no fused AdamW for sharded tensors); one plain process runs fused: how each
    # runs is its own choice, while a real hyperparameter of the wrong kind is still refused
    ckpt = resume.latest(trained / "checkpoints")
    meta = json.loads((ckpt / "optimizer.json").read_text())
    assert [g["fused"] for g in meta["param_groups"]] == [True, True]
    for g in meta["param_groups"]:
        g["fused"] = None
    (ckpt / "optimizer.json").write_text(json.dumps(meta))
    t = _trainer(trained, epochs=3, max_steps=5)
    t.fit()
    assert all(g["fused"] is True for g in t.optimizer.param_groups)
    ckpt = resume.latest(trained / "checkpoints")
    assert ckpt.name == "step-00000005"
    meta = json.loads((ckpt / "optimizer.json").read_text())
    meta["param_groups"][0]["weight_decay"] = "0.1"
    (ckpt / "optimizer.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="weight_decay"):
        _trainer(trained, epochs=3, max_steps=6).fit()
