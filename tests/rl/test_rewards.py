"""Reward functions: built-ins against hand-written cases, user functions, failures counted not raised."""

import math

import pytest

from astrai.config.train import RewardSpec, TrainOptions
from astrai.errors import InputError
from astrai.rl.rewards import Scorer, final_answer


def sample(**kw):
    return {"prompt": "p", "completion_tokens": 5, "truncated": False, **kw}


def test_final_answer_extraction():
    assert final_answer("so 12 + 30 = 42.", "last_number") == "42"
    assert final_answer("it is -1,250.5 dollars", "last_number") == "-1,250.5"
    assert final_answer("no digits", "last_number") is None
    assert final_answer("x <answer> 7 </answer> y <answer>8</answer>", "answer_tag") == "8"
    assert final_answer("a\nb \n\n", "last_line") == "b"


def test_builtins():
    s = Scorer([RewardSpec(name="numeric_match", column="answer")], 16)
    assert s.score("12 + 30 = 42", sample(answer="42"))[0] == 1.0
    assert s.score("12 + 30 = 42.0000001", sample(answer=" 42 "))[0] == 1.0
    assert s.score("12 + 30 = 43", sample(answer="42"))[0] == 0.0
    assert s.score("I do not know", sample(answer="42"))[0] == 0.0
    e = Scorer([RewardSpec(name="exact_match", column="answer", extract="whole")], 16)
    assert e.score(" Paris ", sample(answer="Paris"))[0] == 1.0 and e.score("paris", sample(answer="Paris"))[0] == 0
    f = Scorer([RewardSpec(name="format", pattern=r"\d+", fullmatch=True)], 16)
    assert f.score(" 42\n", sample())[0] == 1.0 and f.score("it is 42", sample())[0] == 0.0
    g = Scorer([RewardSpec(name="format", pattern=r"\d+")], 16)
    assert g.score("it is 42", sample())[0] == 1.0


def test_length_penalty_is_dapos_soft_overlong_punishment():
    s = Scorer([RewardSpec(name="length_penalty", buffer=4)], 16)  # L_max 16 (max_tokens), L_cache 4
    assert s.score("x", sample(completion_tokens=12))[0] == 0.0
    assert s.score("x", sample(completion_tokens=14))[0] == pytest.approx((16 - 4 - 14) / 4)
    assert s.score("x", sample(completion_tokens=16, truncated=True))[0] == -1.0


def test_weighted_sum_and_per_function_values():
    s = Scorer([RewardSpec(name="numeric_match"), RewardSpec(name="format", pattern=r"^\d+$", weight=0.5,
                                                             label="digits_only")], 16)
    total, per, err = s.score("42", sample(answer="42"))
    assert (total, per, err) == (1.5, {"numeric_match": 1.0, "digits_only": 1.0}, None)
    total, per, _ = s.score("x 42", sample(answer="42"))
    assert total == 1.0 and per["digits_only"] == 0.0


def test_user_function_from_a_file_and_its_failures(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "import math\n"
        "def score(completion, sample):\n"
        "    if completion == 'boom': raise RuntimeError('bad completion')\n"
        "    if completion == 'nan': return math.nan\n"
        "    if completion == 'text': return 'high'\n"
        "    return len(completion) + (sample['answer'] == '1')\n")
    monkeypatch.chdir(tmp_path)
    for spec in ("my_rewards.py:score", "my_rewards:score"):
        s = Scorer([RewardSpec(function=spec)], 16)
        assert s.score("abc", sample(answer="1")) == (4.0, {"score": 4.0}, None)
        for bad, why in (("boom", "RuntimeError: bad completion"), ("nan", "returned nan"), ("text", "not a number")):
            total, _, err = s.score(bad, sample(answer="1"))
            assert total is None and why in err
    with pytest.raises(InputError, match="has no function 'nope'"):
        Scorer([RewardSpec(function="my_rewards.py:nope")], 16)
    with pytest.raises(InputError, match="no file"):
        Scorer([RewardSpec(function="missing.py:score")], 16)
    with pytest.raises(InputError, match="importing 'no_such_module' failed"):
        Scorer([RewardSpec(function="no_such_module:score")], 16)


def test_a_missing_reference_column_fails_the_completion_with_the_columns_named():
    s = Scorer([RewardSpec(name="numeric_match", column="solution")], 16)
    total, _, err = s.score("42", sample(answer="42"))
    assert total is None and "no column 'solution'" in err and "answer" in err


def test_options_are_checked():
    with pytest.raises(ValueError, match="exactly one of name"):
        RewardSpec(name="format", function="a:b", pattern="x")
    with pytest.raises(ValueError, match="needs pattern"):
        RewardSpec(name="format")
    with pytest.raises(ValueError, match="not a regular expression"):
        RewardSpec(name="format", pattern="(")
    with pytest.raises(ValueError, match="needs reward functions"):
        TrainOptions(output="o", strategy="grpo", rollout={})
    with pytest.raises(ValueError, match="not sft"):
        TrainOptions(output="o", rollout={}, rewards=[{"name": "numeric_match"}])
    with pytest.raises(ValueError, match="add a rollout block"):
        TrainOptions(output="o", strategy="grpo", rewards=[{"name": "numeric_match"}])
    assert not math.isnan(TrainOptions(output="o", strategy="grpo", rollout={"group_size": 4},
                                       reward={"function": "m:f"}).rollout.temperature)
    with pytest.raises(ValueError, match="online, log-probs use rollout.temperature"):
        TrainOptions(output="o", strategy="grpo", rollout={}, rewards=[{"name": "numeric_match"}], grpo_temperature=0.7)
    with pytest.raises(ValueError, match="overlong_buffer 20 is more than max_tokens 16"):
        TrainOptions(output="o", strategy="grpo", rollout={"max_tokens": 16, "overlong_buffer": 20},
                     rewards=[{"name": "numeric_match"}])
    opts = TrainOptions(output="o", strategy="grpo", rollout={}, rewards=[{"name": "numeric_match"}])
    assert (opts.reward_timeout, opts.reward_error_share, opts.rollout.sleep) == (30.0, 0.5, False)


def test_reward_files_are_read_next_to_the_config(tmp_path):
    opts = TrainOptions(output="o", strategy="grpo", rollout={}, reward={"function": "r.py:f"},
                        rewards=[{"function": "pkg.mod:g"}, {"function": "/abs/x.py:h"}, {"name": "numeric_match"}])
    fixed = opts.with_reward_files_under(tmp_path)
    assert fixed.reward.function == f"{tmp_path}/r.py:f"
    assert [r.function for r in fixed.rewards] == ["pkg.mod:g", "/abs/x.py:h", None]


def test_numpy_and_0d_scalars_are_rewards_and_float32_overflow_is_refused_as_such(tmp_path, monkeypatch):
    (tmp_path / "np_rewards.py").write_text(
        "import numpy as np, torch\n"
        "VALUES = {'f32': np.float32(0.25), 'i64': np.int64(3), 'arr': np.array(1.5), 't': torch.tensor(2.0),\n"
        "          'big': 1e308, 'bool': np.bool_(True), 'list': [1.0], 'near': 3e38}\n"
        "def score(completion, sample):\n"
        "    return VALUES[completion]\n")
    monkeypatch.chdir(tmp_path)
    s = Scorer([RewardSpec(function="np_rewards.py:score")], 16)
    for text, value in (("f32", 0.25), ("i64", 3.0), ("arr", 1.5), ("t", 2.0), ("near", 3e38)):
        total, per, err = s.score(text, sample())
        assert err is None and total == pytest.approx(value) and type(total) is float, text
    total, _, err = s.score("big", sample())
    assert total is None and "returned 1e+308, beyond float32's range" in err
    assert f"{tmp_path / 'np_rewards.py'}:4: " in err  # the user's function, where it is defined
    for text in ("bool", "list"):
        total, _, err = s.score(text, sample())
        assert total is None and "not a number" in err, text
    # each value fits, their weighted sum does not
    w = Scorer([RewardSpec(function="np_rewards.py:score", weight=2.0)], 16)
    total, _, err = w.score("near", sample())
    assert total is None and "weighted sum" in err and "beyond float32's range" in err


def test_a_failure_names_the_line_of_the_users_code_that_raised(tmp_path, monkeypatch):
    (tmp_path / "deep.py").write_text(
        "def helper(x):\n"
        "    return 1 / x\n"
        "def score(completion, sample):\n"
        "    return helper(len(completion) - 3)\n")
    monkeypatch.chdir(tmp_path)
    total, _, err = Scorer([RewardSpec(function="deep.py:score")], 16).score("abc", sample())
    assert total is None and err == f"score: {tmp_path / 'deep.py'}:2: ZeroDivisionError: division by zero"


SLOW = '''
import os, time
def score(completion, sample):
    if completion == "hang":
        while True:
            pass
    if completion == "die":
        os._exit(3)
    if completion == "raise":
        raise ValueError("no " + completion)
    return float(len(completion))
'''


def test_a_call_past_the_timeout_fails_alone_and_the_worker_is_replaced(tmp_path, monkeypatch):
    (tmp_path / "slow.py").write_text(SLOW)
    monkeypatch.chdir(tmp_path)
    s = Scorer([RewardSpec(function="slow.py:score"), RewardSpec(name="format", pattern="a")], 16, timeout=1.0)
    try:
        out = s.score_all([(t, sample()) for t in ("ab", "hang", "abc", "die", "a")])
    finally:
        s.close()
    assert [o[0] for o in out] == [3.0, None, 4.0, None, 2.0]
    assert out[1][2] == "score: timed out after 1 s (reward_timeout)"
    assert out[1][1] == {"format": 1.0}  # the other function still scored it
    assert "worker process ended (exit status 3)" in out[3][2]
    with pytest.raises(InputError, match="has no function 'nope'"):  # load errors come back from the worker
        Scorer([RewardSpec(function="slow.py:nope")], 16, timeout=1.0)


def test_a_function_failing_on_more_than_the_share_stops_with_its_own_error(tmp_path, monkeypatch):
    from astrai.rl.rewards import RewardError

    (tmp_path / "slow.py").write_text(SLOW)
    monkeypatch.chdir(tmp_path)
    items = [(t, sample()) for t in ("raise", "ab", "raise", "abc")]
    s = Scorer([RewardSpec(function="slow.py:score")], 16, error_share=0.5)
    assert [o[0] for o in s.score_all(items, "step 1")] == [None, 2.0, None, 3.0]  # 2 of 4: not more than half
    assert s.last_failures == {"score": (2, f"score: {tmp_path / 'slow.py'}:10: ValueError: no raise")}
    with pytest.raises(RewardError) as e:
        s.score_all(items + [("raise", sample())], "step 2")  # 3 of 5
    assert str(e.value).startswith("step 2: reward function 'score' failed on more than reward_error_share 0.5")
    assert str(e.value).endswith(f"its first failure: score: {tmp_path / 'slow.py'}:10: ValueError: no raise")
    never = Scorer([RewardSpec(function="slow.py:score")], 16, error_share=1.0)
    assert all(o[0] is None for o in never.score_all([("raise", sample())] * 3, "step 1"))
