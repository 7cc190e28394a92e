"""Online GRPO on a tiny chat checkpoint: training logs every completion and resumes after a kill with the
same completions and rewards, held-out prompts are sampled and scored, advantages by hand, the overlong
penalty, a failing reward stopping the run, and a second signal stopping it at once."""

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from astrai.config.train import RolloutOptions
from astrai.model.adapter_files import load_checkpoint
from astrai.rl.rollout import Rollout
from astrai.text.tokenizer import load_tokenizer


def train(root, ckpt, out, max_steps, kill_at=None, extra="", rollout=""):
    code = f"""
import sys
from astrai.config.train import TrainOptions
from astrai.rl.online import run_online_grpo
sys.path.insert(0, {str(Path(__file__).parents[1] / 'train')!r})
from train_script import KillAt
opts = TrainOptions(data={str(root / 'data')!r}, model={str(ckpt)!r}, output={str(out)!r}, strategy="grpo",
                    max_steps={max_steps}, lr=0.05, scheduler="constant", grpo_updates=1, grpo_kl_coef=0.05,
                    save_every=1, progress=False, seed=3, loss_type="grpo",
                    rollout=dict(group_size=3, max_tokens=6, temperature=1.0, prompts_per_step=2, overlong_buffer=2
                                 {rollout}),
                    rewards=[dict(function="my_rewards.py:score"), dict(name="format", pattern="e", weight=0.5)]{extra})
result = run_online_grpo(opts, callbacks=[KillAt({kill_at})] if {kill_at!r} else [])
from astrai.train.summary import lines
print("\\n".join(lines(result)))
"""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root)


def test_online_training_logs_and_resumes_with_identical_rewards(setup):
    root, ckpt = setup
    r = train(root, ckpt, root / "a", 3)
    assert r.returncode == 0, r.stderr
    metrics = [json.loads(x) for x in (root / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        for key in ("reward_mean", "reward_std", "reward_score", "reward_format", "completion_length",
                    "zero_variance_share", "clip_low_fraction", "clip_high_fraction", "kl", "rollout_seconds",
                    "update_seconds", "prefix_cache_hit_rate", "reward_errors", "peak_memory_mb"):
            assert key in m, key
    done = [json.loads(x) for x in (root / "a" / "completions.jsonl").read_text().splitlines()]
    assert len(done) == 3 * 2 * 3 and [d["step"] for d in done[::6]] == [1, 2, 3]
    failed = [d for d in done if d["reward"] is None]
    assert sum(m["reward_errors"] for m in metrics) == len(failed) > 0  # counted, not raised
    assert all(d["advantage"] == 0.0 and "a failing reward" in d["reward_error"] for d in failed)
    for k in range(0, len(done), 3):  # advantages are each group's own (r - mean) / (std + eps), failures left out
        rs = [d["reward"] for d in done[k:k + 3] if d["reward"] is not None]
        advs = [d["advantage"] for d in done[k:k + 3] if d["reward"] is not None]
        if len(rs) > 1:
            mean, std = statistics.mean(rs), statistics.stdev(rs)
            assert advs == pytest.approx([(x - mean) / (std + 1e-4) for x in rs], abs=1e-5)
    for d in done:  # DAPO's soft overlong punishment, max_tokens 6, buffer 2: 0 up to 4 tokens, -0.5 at 5, -1 at 6
        if d["reward"] is not None:
            expect = -1.0 if d["finish_reason"] == "length" else {5: -0.5, 6: -1.0}.get(d["tokens"], 0.0)
            assert d["rewards"]["overlong"] == expect
            assert d["reward"] == pytest.approx(d["rewards"]["score"] + 0.5 * d["rewards"]["format"] + expect)
    assert -1.0 in {d["rewards"].get("overlong") for d in done}
    start = load_checkpoint(ckpt).state_dict()
    end = load_checkpoint(root / "a" / "final").state_dict()
    assert any(not torch.equal(start[k], end[k]) for k in start)
    # killed (SIGKILL) after step 2's checkpoint, then rerun: the same completions and rewards as run a
    r = train(root, ckpt, root / "b", 3, kill_at=2)
    assert r.returncode != 0 and (root / "b" / "checkpoints").exists()
    r = train(root, ckpt, root / "b", 3)
    assert r.returncode == 0, r.stderr
    assert (root / "b" / "completions.jsonl").read_text() == (root / "a" / "completions.jsonl").read_text()


VAL_QUESTIONS = ["what is two plus two", "name a colour", "say something kind"]


def test_held_out_prompts_are_sampled_and_scored_without_changing_training(setup):
    """val_data on a prompt set: G completions per held-out prompt from the current weights, seeded alike
    at every evaluation, scored as training is; training draws exactly what it draws without them."""
    from astrai.rl.online import VAL_STEP
    from astrai.train.data import TrainData

    root, ckpt = setup
    with open(root / "val.jsonl", "w") as fh:
        for i, q in enumerate(VAL_QUESTIONS):
            fh.write(json.dumps({"messages": [{"role": "user", "content": q}], "answer": ["yes", "no"][i % 2]}) + "\n")
    r = subprocess.run([sys.executable, "-m", "astrai.cli", "preprocess", str(root / "pipe.yaml"), "-i",
                        str(root / "val.jsonl"), "-o", str(root / "val"), "--workers", "1"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    # max_running 3 = one group: the held-out set is sampled a prompt at a time, seeded by its number in the set
    val = f", val_data={str(root / 'val')!r}, eval_every=2"
    r = train(root, ckpt, root / "v", 3, extra=val, rollout=", max_running=3")
    assert r.returncode == 0, r.stderr
    assert "held-out mean reward" in r.stdout and "astrai eval" not in r.stdout  # a prompt set has no answers
    out = root / "v"
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [m for m in records if "val_reward_mean" in m]
    assert [m["step"] for m in evals] == [0, 2, 3] and not any("val_loss" in m for m in evals)
    sampled = [json.loads(x) for x in (out / "val_completions.jsonl").read_text().splitlines()]
    for m in evals:  # each figure is the mean over that evaluation's logged completions, failures left out
        mine = [d for d in sampled if d["step"] == m["step"]]
        assert len(mine) == len(VAL_QUESTIONS) * 3 == m["val_completions"]
        ok = [d["reward"] for d in mine if d["reward"] is not None]
        assert m["val_reward_mean"] == pytest.approx(sum(ok) / len(ok))
        assert m["val_reward_errors"] == len(mine) - len(ok)
        assert m["val_completion_length"] == pytest.approx(sum(d["tokens"] for d in mine) / len(mine))
    # the finished run started again resumes at its end: its last evaluation is not measured (or logged) twice
    before = (out / "val_completions.jsonl").read_text()
    r = train(root, ckpt, out, 3, extra=val, rollout=", max_running=3")
    assert r.returncode == 0, r.stderr
    assert (out / "val_completions.jsonl").read_text() == before
    assert sum("val_reward_mean" in x for x in (out / "metrics.jsonl").read_text().splitlines()) == 3
    # step 0 is the checkpoint's own weights: one call over the whole set, seeded as the evaluations are
    tok = load_tokenizer(str(ckpt))
    ro = RolloutOptions(group_size=3, max_tokens=6, temperature=1.0)
    ds = TrainData(root / "val").dataset
    groups, _ = Rollout(load_checkpoint(ckpt), tok, ro, seed=3, device="cpu").generate(
        [ds[i]["input_ids"].tolist() for i in range(len(ds))], VAL_STEP)
    assert [d["completion"] for d in sampled if d["step"] == 0] == [c["text"] for g in groups for c in g]
    # training drew what a run without held-out prompts draws (the evaluations take nothing from its streams)
    r = train(root, ckpt, root / "nv", 3)
    assert r.returncode == 0, r.stderr
    assert (out / "completions.jsonl").read_text() == (root / "nv" / "completions.jsonl").read_text()
    # killed after step 2 (and its evaluation), then rerun: the same held-out completions, none twice
    r = train(root, ckpt, root / "vk", 3, kill_at=2, extra=val, rollout=", max_running=3")
    assert r.returncode != 0
    r = train(root, ckpt, root / "vk", 3, extra=val, rollout=", max_running=3")
    assert r.returncode == 0, r.stderr
    assert (root / "vk" / "val_completions.jsonl").read_text() == (out / "val_completions.jsonl").read_text()


def test_group_advantages_by_hand():
    """(r - mean) / (sample std + 1e-4) over a group's rewards that did not fail (None); 0 for a failed
    completion, for a group whose rewards are all equal, and for a group with one reward left."""
    from astrai.rl.online import advantages

    third = 0.5 / (0.5773502691896258 + 1e-4)  # rewards 1, 0, 0, 1: mean 0.5, std sqrt(1/3)
    half = 1 / (1.4142135623730951 + 1e-4)  # rewards 2, 0: mean 1, std sqrt(2)
    cases = [([1.0, 0.0, 0.0, 1.0], True, [third, -third, -third, third]),
             ([2.0, None, 0.0], True, [half, 0.0, -half]),
             ([0.7, 0.7, 0.7], True, [0.0, 0.0, 0.0]),
             ([3.0], True, [0.0]),
             ([None, 5.0, None], True, [0.0, 0.0, 0.0]),
             ([None, None], True, [0.0, 0.0]),
             ([1.0, 0.0, 0.0, 1.0], False, [0.5, -0.5, -0.5, 0.5]),  # dr_grpo: r - mean, no std
             ([2.0, None, 0.0], False, [1.0, 0.0, -1.0])]
    for rewards, scale, expect in cases:
        got = advantages(rewards, 1e-4, scale)
        assert got.dtype == torch.float32
        assert got.tolist() == pytest.approx(expect, abs=1e-6), (rewards, scale)
    # rewards at float32's edge: the variance is taken in float64 (in float32 it is inf, and A would be 0)
    big = advantages([3e38, -3e38], 1e-4, True).tolist()
    assert big == pytest.approx([0.7071067811865476, -0.7071067811865476], abs=1e-6)


def test_a_resumed_log_drops_later_steps_and_a_line_cut_by_a_kill(tmp_path):
    from astrai.errors import InputError
    from astrai.rl.online import trim_log

    log = tmp_path / "completions.jsonl"
    log.write_text('{"step": 1, "a": 1}\n{"step": 2, "a": 2}\n{"step": 3, "a": 3}\n{"step": 3, "a"')
    trim_log(log, 2)
    assert log.read_text() == '{"step": 1, "a": 1}\n{"step": 2, "a": 2}\n'
    assert not list(tmp_path.glob(".*tmp*"))  # written to a temporary name and renamed
    log.write_text('{"step": 1}\nnot json\n')
    with pytest.raises(InputError, match="completions.jsonl:2: not a completion record"):
        trim_log(log, 2)


def cli_config(root, ckpt, out, reward, **extra):
    """An `astrai train` YAML for online GRPO on the prompt set, with `reward` as its reward file."""
    (out.parent / "reward.py").write_text(reward)
    opts = {"data": str(root / "data"), "model": str(ckpt), "output": str(out), "strategy": "grpo",
            "max_steps": 3, "lr": 0.05, "grpo_updates": 1, "save_every": 1, "progress": False, "seed": 3,
            "rollout": {"group_size": 3, "max_tokens": 6, "prompts_per_step": 2},
            "reward": {"function": "reward.py:score"}, **extra}
    cfg = out.parent / "train.yaml"
    cfg.write_text(json.dumps(opts))  # JSON is YAML
    return cfg


def test_a_reward_failing_on_most_completions_stops_the_run_with_its_own_error(setup, tmp_path):
    root, ckpt = setup
    cfg = cli_config(root, ckpt, tmp_path / "out", "def score(completion, sample):\n"
                                                   "    return {}[completion]\n")
    r = subprocess.run([sys.executable, "-m", "astrai.cli", "train", str(cfg)], capture_output=True, text=True)
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: step 1: reward function 'score' failed on more than reward_error_share 0.5 of "
                           "the 6 completions")
    assert f"its first failure: score: {tmp_path / 'reward.py'}:2: KeyError: " in last
    assert not (tmp_path / "out" / "checkpoints").exists()  # no step was trained on the failed rewards


BLOCKING = """import os, time
def score(completion, sample):
    calls = os.path.join(os.path.dirname(__file__), "calls")
    with open(calls, "a") as fh:
        fh.write("x")
    if os.path.getsize(calls) > 6:  # step 2 (6 completions a step): block, as a hung reward would
        with open(os.path.join(os.path.dirname(__file__), "blocked"), "w") as fh:
            fh.write(str(os.getpid()))
        time.sleep(3600)
    return float(len(completion))
"""


def test_a_second_signal_stops_at_once_while_a_reward_blocks_and_keeps_the_checkpoint(setup, tmp_path):
    root, ckpt = setup
    cfg = cli_config(root, ckpt, tmp_path / "out", BLOCKING, reward_timeout=3600)
    proc = subprocess.Popen([sys.executable, "-m", "astrai.cli", "train", str(cfg)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    blocked = tmp_path / "blocked"
    try:
        deadline = time.monotonic() + 600
        while not blocked.exists() or not blocked.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        worker = int(blocked.read_text())
        proc.send_signal(signal.SIGTERM)
        time.sleep(2)
        assert proc.poll() is None  # the first waits for the step, whose reward blocks
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert time.monotonic() - t0 < 10
    assert proc.returncode == 130 and err.strip().endswith("interrupted; rerun to resume"), err
    assert "SIGTERM again stops at once" in err
    ckpts = sorted(p.name for p in (tmp_path / "out" / "checkpoints").iterdir())
    assert ckpts == ["step-00000001"]  # step 1's, whole; nothing of step 2
    state = json.loads((tmp_path / "out" / "checkpoints" / "step-00000001" / "trainer_state.json").read_text())
    assert state["global_step"] == 1
    load_checkpoint(tmp_path / "out" / "checkpoints" / "step-00000001")
    for _ in range(50):  # the reward worker went with the run
        try:
            os.kill(worker, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the reward worker {worker} outlived the run")
