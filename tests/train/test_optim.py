"""Schedules against values worked out by hand; weight decay only on matrices."""

import math

import pytest
import torch

from astrai.model import CausalLM, ModelConfig
from astrai.train.optim import Schedule, build_optimizer, build_scheduler


def test_warmup_then_cosine():
    s = Schedule("cosine", total=12, warmup=2, min_ratio=0.0)
    assert [s(0), s(1)] == [0.5, 1.0]
    assert s(2) == 1.0 and s(7) == pytest.approx(0.5) and s(12) == pytest.approx(0.0)  # 10 steps of cosine


def test_sgdr_restarts():
    s = Schedule("sgdr", total=100, cycle=4, mult=2.0, min_ratio=0.0)
    assert s(0) == 1.0 and s(2) == pytest.approx(0.5) and s(4) == 1.0  # restart after 4
    assert s(8) == pytest.approx(0.5)  # second cycle is 8 long: 4 steps in = halfway
    assert s(12) == 1.0


def test_wsd():
    s = Schedule("wsd", total=10, warmup=1, decay_ratio=0.2, min_ratio=0.0)
    assert [s(0), s(5), s(7), s(8), s(9), s(10)] == [1.0, 1.0, 1.0, 1.0, 0.5, 0.0]


def test_scheduler_drives_optimizer_and_decay_groups():
    m = CausalLM(ModelConfig.preset("tiny"))
    opt = build_optimizer(m, 1e-3, 0.1, (0.9, 0.95), 1e-8)
    assert all(p.ndim >= 2 for p in opt.param_groups[0]["params"])
    assert all(p.ndim == 1 for p in opt.param_groups[1]["params"]) and opt.param_groups[1]["weight_decay"] == 0
    sch = build_scheduler(opt, Schedule("cosine", total=4, warmup=0, min_ratio=0.0))
    lrs = []
    for _ in range(4):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sch.step()
    assert lrs == pytest.approx([1e-3 * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(4)])
