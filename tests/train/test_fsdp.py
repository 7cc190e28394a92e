"""FSDP2 (`parallel: fsdp`) on CPU with gloo: 2 sharded processes give the losses, gradient norms and
validation loss of 1 process with the doubled batch (tied embeddings, so the head shares the
embedding's shard); the gathered checkpoint equals the 1-process one and loads in transformers; a
run killed after a checkpoint resumes into the shards with the same losses; a sharded checkpoint
resumes in one plain process and the other way round (optimizer state keyed by name vs index);
MoE under fsdp equals MoE under DDP; gradient checkpointing under fsdp changes no loss; each rank
holds half the weights and AdamW state; SIGTERM to one rank stops both at one step with a checkpoint."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

sys.path.insert(0, os.path.dirname(__file__))
import train_script as ts  # noqa: E402

from astrai.model.hf_checkpoint import read_tensors  # noqa: E402
from astrai.train import resume  # noqa: E402
from astrai.train.distributed import Dist, _rekey_by_name, is_sharded, load_full_state, wrap  # noqa: E402
from astrai.train.optim import build_optimizer  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(__file__), "train_script.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
# The runs compared for equality train in float64: equal up to summation order then means equal to
# ~1e-12 even after AdamW, whose first steps turn the rounding of a gradient near 0 into a visible
# weight change (float32 differed by 1.2e-5 on one CPU, 4e-6 on another).
F64 = ("--opt", 'dtype="float64"')
EXACT = 1e-9


def test_parallel_option_is_validated():
    assert ts.options("out").parallel == "ddp"
    assert ts.options("out", parallel="fsdp").parallel == "fsdp"
    with pytest.raises(ValidationError, match="parallel"):
        ts.options("out", parallel="zero3")


def test_one_process_fsdp_is_the_plain_model_and_a_bad_mode_is_refused():
    m = ts.model()
    assert wrap(m, Dist(), "fsdp") is m and not is_sharded(m)
    with pytest.raises(ValueError, match="choose one of ddp, fsdp"):
        wrap(m, Dist(), "zero")


def _stepped_optimizer(model):
    opt = build_optimizer(model, 1e-2, 0.1, (0.9, 0.95), 1e-8)
    for seed in range(2):
        torch.manual_seed(seed)
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
    return opt


def test_an_index_keyed_optimizer_state_loads_by_name():
    """What an fsdp run does with a checkpoint written without fsdp: re-key by parameter name, load
    through torch.distributed.checkpoint; the result equals the plain load_state_dict."""
    src = ts.model(tied=True)
    saved = _stepped_optimizer(src).state_dict()
    plain, named = ts.model(tied=True), ts.model(tied=True)
    opt_plain, opt_named = (build_optimizer(m, 1e-2, 0.1, (0.9, 0.95), 1e-8) for m in (plain, named))
    by_name = _rekey_by_name(named, opt_named, saved)
    assert "model.embed_tokens.weight" in by_name["state"] and len(by_name["state"]) == len(saved["state"])
    opt_plain.load_state_dict(saved)
    load_full_state(named, opt_named, src.state_dict(), by_name)
    a, b = opt_plain.state_dict(), opt_named.state_dict()
    # torch.distributed.checkpoint hands the betas back as a list: the same numbers for AdamW
    assert a["param_groups"] == [{**g, "betas": tuple(g["betas"])} for g in b["param_groups"]]
    for i in a["state"]:
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(a["state"][i][k], b["state"][i][k]), (i, k)
    assert all(torch.equal(p, q) for p, q in zip(src.parameters(), named.parameters()))


def _run(out, *args, procs=1, check=True):
    launcher = [sys.executable] if procs == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                   "--nproc_per_node", str(procs)]
    r = subprocess.run(launcher + [SCRIPT, str(out), "--tied", "--val", "5", *F64, *args], capture_output=True,
                       text=True, timeout=300, env=ENV)
    if check:
        assert r.returncode == 0, r.stderr[-3000:]
    return r


def _records(out):
    return [json.loads(line) for line in Path(out, "metrics.jsonl").read_text().splitlines()]


def _by_step(out, key):
    return {r["step"]: r[key] for r in _records(out) if key in r}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process with batch 4, and 2 fsdp processes with batch 2 each: 6 steps, validation at 0, 3 and 6
    over 5 rows (so rank 0 validates 3 rows and rank 1 two)."""
    root = tmp_path_factory.mktemp("fsdp")
    _run(root / "one", "--batch", "4")
    _run(root / "two", "--batch", "2", "--parallel", "fsdp", procs=2)
    return root


@pytest.mark.slow
def test_two_fsdp_processes_equal_one_with_the_doubled_batch(runs):
    for key in ("loss", "grad_norm", "val_loss"):
        one, two = _by_step(runs / "one", key), _by_step(runs / "two", key)
        assert sorted(one) == sorted(two) == ([0, 3, 6] if key == "val_loss" else [1, 2, 3, 4, 5, 6]), key
        for s in one:
            assert abs(one[s] - two[s]) < EXACT, (key, one, two)
    # the model moved (a no-op sync would still agree at step 1, not later)
    assert _by_step(runs / "two", "loss")[6] < _by_step(runs / "two", "loss")[1] - 0.1
    # no reduce-scatter on the first micro-batch of each step (train_script.UnsyncedGrads), on both ranks
    counts = ts.rank_counts(runs / "two")
    assert len(counts) == 2 and all(c["reduced_early"] == 0 and c["checked"] == 6 for c in counts)


@pytest.mark.slow
def test_fsdp_shards_weights_and_adam_state(runs):
    """Each rank holds about half of the weights and of the AdamW moments (dim 0 split in two), counted
    after the final validation: a forward without backward must not leave the root's weights gathered."""
    counts = ts.rank_counts(runs / "two")
    assert len(counts) == 2
    for c in counts:
        local, full, adam_local, adam_full = c["local_params"], c["params"], c["local_adam"], c["adam"]
        assert full == ts.model(tied=True).num_parameters() and adam_full == full
        assert abs(local - full / 2) <= 0.05 * full and abs(adam_local - full / 2) <= 0.05 * full
    assert sum(c["local_params"] for c in counts) == counts[0]["params"]


@pytest.mark.slow
def test_fsdp_with_gradient_checkpointing_equals_one_process(runs, tmp_path):
    _run(tmp_path / "gc", "--batch", "2", "--parallel", "fsdp", "--opt", "gradient_checkpointing=true", procs=2)
    one, gc = _by_step(runs / "one", "loss"), _by_step(tmp_path / "gc", "loss")
    assert sorted(one) == sorted(gc)
    for s in one:
        assert abs(one[s] - gc[s]) < EXACT, (one, gc)


@pytest.mark.slow
def test_fsdp_moe_equals_ddp_moe(tmp_path):
    """MoE: 2 ranks each compute their own load-balancing loss, so the reference is DDP on 2 ranks
    (same math, replicated), not 1 process. Every expert runs in training (even with no tokens), so
    all ranks reduce the same gradients."""
    _run(tmp_path / "ddp", "--batch", "2", "--moe", procs=2)
    _run(tmp_path / "fsdp", "--batch", "2", "--moe", "--parallel", "fsdp", procs=2)
    for key in ("loss", "aux_loss", "grad_norm", "val_loss"):
        ddp, fsdp = _by_step(tmp_path / "ddp", key), _by_step(tmp_path / "fsdp", key)
        assert sorted(ddp) == sorted(fsdp) and ddp, key
        for s in ddp:
            assert abs(ddp[s] - fsdp[s]) < EXACT, (key, ddp, fsdp)


@pytest.mark.slow
def test_the_fsdp_checkpoint_is_the_full_model_and_loads_in_transformers(runs, loads_in_transformers):
    one = resume.latest(runs / "one" / "checkpoints")
    two = resume.latest(runs / "two" / "checkpoints")
    assert one.name == two.name == "step-00000006"
    a, b = read_tensors(one), read_tensors(two)
    assert sorted(a) == sorted(b) and "lm_head.weight" not in b  # tied: stored once, as HF does
    for k in a:
        assert a[k].shape == b[k].shape, k  # full, not one rank's shard
        torch.testing.assert_close(a[k], b[k], atol=EXACT, rtol=0)
    loads_in_transformers(two)


@pytest.mark.slow
def test_fsdp_resumes_after_kill_with_the_same_losses(runs, tmp_path):
    killed = tmp_path / "killed"
    r = _run(killed, "--batch", "2", "--parallel", "fsdp", "--kill-at", "4", procs=2, check=False)
    assert r.returncode != 0
    assert resume.latest(killed / "checkpoints").name == "step-00000004"
    _run(killed, "--batch", "2", "--parallel", "fsdp", procs=2)
    steps = [rec["step"] for rec in _records(killed) if "loss" in rec]
    assert steps == [1, 2, 3, 4, 5, 6]  # resumed at 5: steps 1-4 are not trained again
    assert _by_step(killed, "loss") == _by_step(runs / "two", "loss")  # bitwise on CPU


@pytest.mark.slow
def test_checkpoints_move_between_fsdp_and_one_plain_process(runs, tmp_path):
    """An fsdp checkpoint (name-keyed optimizer state) resumes in one process; the 1-process
    checkpoint (index-keyed) resumes under fsdp; both continue the 1-process trajectory."""
    ref = _by_step(runs / "one", "loss")
    for src, dst, args, procs in ((runs / "two", "to_one", ("--batch", "4"), 1),
                                  (runs / "one", "to_two", ("--batch", "2", "--parallel", "fsdp"), 2)):
        out = tmp_path / dst
        shutil.copytree(src / "checkpoints" / "step-00000004", out / "checkpoints" / "step-00000004")
        _run(out, *args, procs=procs)
        got = _by_step(out, "loss")
        assert sorted(got) == [5, 6], got
        for s in got:
            assert abs(got[s] - ref[s]) < EXACT, (dst, got, ref)


@pytest.mark.slow
def test_sigterm_to_one_fsdp_rank_stops_both_with_a_checkpoint(tmp_path):
    """The ranks agree on the stop at one step (a sharded save needs all of them); SIGTERM reaches
    only rank 1 here."""
    import signal
    import time

    out = tmp_path / "sig"
    p = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          SCRIPT, str(out), "--batch", "2", "--parallel", "fsdp", "--sleep", "0.3"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    deadline = time.time() + 120
    while not (out / "metrics.jsonl").exists() and time.time() < deadline:
        time.sleep(0.1)
    workers = subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split()
    assert len(workers) == 2, workers
    ranks = {}
    for w in workers:  # torchrun sets RANK in each worker's environment
        env = Path(f"/proc/{w}/environ").read_bytes().split(b"\0")
        ranks[int(next(e for e in env if e.startswith(b"RANK=")).split(b"=")[1])] = int(w)
    os.kill(ranks[1], signal.SIGTERM)
    stdout, stderr = p.communicate(timeout=120)
    assert p.returncode == 0, stderr[-3000:]
    stops = [c["step"] for c in ts.rank_counts(out) if c["stopped"] == "SIGTERM"]
    steps = set(stops)
    assert len(stops) == 2 and len(steps) == 1 and 0 < next(iter(steps)) < 12, stdout
    latest = resume.latest(out / "checkpoints")
    assert json.loads((latest / "trainer_state.json").read_text())["global_step"] == next(iter(steps))
