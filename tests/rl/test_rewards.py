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


def test_reward_files_are_read_next_to_the_config(tmp_path):
    opts = TrainOptions(output="o", strategy="grpo", rollout={}, reward={"function": "r.py:f"},
                        rewards=[{"function": "pkg.mod:g"}, {"function": "/abs/x.py:h"}, {"name": "numeric_match"}])
    fixed = opts.with_reward_files_under(tmp_path)
    assert fixed.reward.function == f"{tmp_path}/r.py:f"
    assert [r.function for r in fixed.rewards] == ["pkg.mod:g", "/abs/x.py:h", None]
