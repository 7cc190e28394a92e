"""target_modules regexes (astrai.model.target_regex): re.fullmatch's answer, in bounded time.

References: Python's re itself on random patterns and names short enough for its backtracking, and
PEFT's own module selection on a transformers model of the same base."""

import json
import random
import re
import signal
import time

import pytest
import torch

from astrai.model import CausalLM, ModelConfig, save_model
from astrai.model.adapter_config import check_adapter_config
from astrai.model.target_regex import TargetPattern

NAMES = [f"model.layers.{i}.{m}" for i in range(12) for m in
         ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
          "mlp.up_proj", "mlp.down_proj")] + ["lm_head"]


@pytest.fixture(autouse=True)
def no_hang():
    signal.signal(signal.SIGALRM, lambda *a: (_ for _ in ()).throw(TimeoutError("took over 60 s")))
    signal.alarm(60)
    yield
    signal.alarm(0)


def _random_pattern(rng, depth=0):
    atoms = ["a", "b", ".", r"\.", r"\d", r"\w", "[ab]", "[^a]", "[0-9]", "_", r"\D", "[a-c_]", r"\s", r"\W"]
    r = rng.random()
    if depth > 3 or r < 0.3:
        return rng.choice(atoms)
    if r < 0.5:
        return _random_pattern(rng, depth + 1) + _random_pattern(rng, depth + 1)
    if r < 0.6:
        return f"({_random_pattern(rng, depth + 1)}|{_random_pattern(rng, depth + 1)})"
    if r < 0.8:
        return f"({_random_pattern(rng, depth + 1)})" + rng.choice(["*", "+", "?", "*?", "+?", "{2}", "{1,3}",
                                                                   "{0,2}", "{2,}", "??"])
    if r < 0.85:
        return rng.choice(["^", r"\A"]) + _random_pattern(rng, depth + 1)
    if r < 0.9:
        return _random_pattern(rng, depth + 1) + rng.choice(["$", r"\Z"])
    return rng.choice(["(?:", "(?s:", "(?a:", "("]) + _random_pattern(rng, depth + 1) + ")"


def test_random_patterns_agree_with_re_fullmatch():
    rng = random.Random(0)
    names = sorted({"".join(rng.choice("ab._1x ") for _ in range(rng.randint(0, 7))) for _ in range(200)})
    names += ["model.layers.0.q", "é1", "٣"]  # a non-ASCII letter and digit: \w and \d in str mode
    checked = 0
    for _ in range(400):
        p = _random_pattern(rng)
        tp = TargetPattern(p)
        assert tp.select(names) == [n for n in names if re.fullmatch(p, n)], p
        checked += 1
    assert checked == 400


@pytest.mark.parametrize("pattern", [r".*\.(q_proj|v_proj)", r"model\.layers\.([0-9]|1[01])\.mlp\..*",
                                     r"^.*(attn)\.[qk]_proj$", r"(?:model\.layers\.\d+\.self_attn\.)?o_proj",
                                     r".*\.(?P<which>up|down)_proj", r"lm_head|.*layers\.1\d?\.mlp\.gate_proj",
                                     r"(?a)model\.layers\.\d{1,2}\.\w+\.v_proj"])
def test_real_world_patterns_agree_with_re(pattern):
    assert TargetPattern(pattern).select(NAMES) == [n for n in NAMES if re.fullmatch(pattern, n)]


@pytest.mark.parametrize("pattern", [r"(.+)+x", r"(.*)*\.x_proj", r"(((.|[^a])){2,})?x", r"(\w|\d|_)+!",
                                     r"(a|a?)+$b", ".*" * 40 + "z"])
def test_catastrophic_patterns_take_bounded_time(pattern):
    # re.fullmatch needs exponential (or n**40) time on these names; none matches (no name ends in x, z, b or !)
    names = [n + ".lora_adapter_name_long_enough_to_hurt" for n in NAMES] * 4
    t0 = time.perf_counter()
    assert TargetPattern(pattern).select(names) == []
    assert time.perf_counter() - t0 < 10


def test_peft_selects_the_same_modules(tmp_path):
    """PEFT's own get_peft_model on transformers' model of the same base wraps what we select."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    save_model(CausalLM(ModelConfig.preset("tiny", vocab_size=64, num_hidden_layers=3)), tmp_path / "base")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    linear = sorted(n for n, m in hf.named_modules() if isinstance(m, torch.nn.Linear))
    cases = [dict(target_modules=r".*layers\.[02]\.(self_attn\.(q|v)|mlp\.down)_proj"),
             dict(target_modules=["q_proj", "mlp.up_proj"], exclude_modules=r".*\.1\..*"),
             dict(target_modules=r".*_proj", exclude_modules=["k_proj", "layers.2.mlp.gate_proj"])]
    for case in cases:
        wrapped = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base"),
                                      peft.LoraConfig(r=2, **case))
        want = sorted(n[len("base_model.model."):] for n, m in wrapped.named_modules() if hasattr(m, "lora_A")
                      and isinstance(getattr(m, "base_layer", None), torch.nn.Linear))
        ours = check_adapter_config(json.loads(json.dumps({"r": 2, **case})), tmp_path / "adapter_config.json")
        assert ours.selects(linear) == want, case
