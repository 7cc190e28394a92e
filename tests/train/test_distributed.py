"""torchrun with 2 CPU processes (gloo DDP) gives the losses of 1 process with the doubled batch,
through the same trainer; ranks see disjoint rows; only rank 0 writes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from astrai.train.batches import RankSampler

SCRIPT = os.path.join(os.path.dirname(__file__), "train_script.py")


def test_ranks_see_disjoint_rows_and_the_union_of_one_step():
    one = RankSampler(24, batch_size=4, grad_accum=2, seed=5)
    ranks = [RankSampler(24, batch_size=2, grad_accum=2, rank=r, world=2, seed=5) for r in range(2)]
    assert set(ranks[0].order(1)).isdisjoint(ranks[1].order(1))
    assert one.steps_per_epoch == ranks[0].steps_per_epoch == 3
    for (_, w1), (_, wa), (_, wb) in zip(one.windows(1), ranks[0].windows(1), ranks[1].windows(1)):
        assert sorted(i for mb in w1 for i in mb) == sorted(i for mb in wa + wb for i in mb)


def _losses(out):
    return [json.loads(line)["loss"] for line in Path(out, "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_two_processes_equal_one_with_the_doubled_batch(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, SCRIPT, str(tmp_path / "one"), "--batch", "4", "--epochs", "1", "--opt", 'dtype="float64"'],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        SCRIPT, str(tmp_path / "two"), "--batch", "2", "--epochs", "1", "--opt", 'dtype="float64"'],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    one, two = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert len(one) == len(two) == 3
    for a, b in zip(one, two):
        assert abs(a - b) < 1e-9, (one, two)  # float64: equal up to summation order
    assert len(list((tmp_path / "two").glob("checkpoints/step-*"))) >= 1
