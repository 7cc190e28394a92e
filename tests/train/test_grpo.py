"""GRPO against numbers computed by hand: the clipped surrogate and which side it clips, k3, the
reward and choice figures, and the trainer's exact step counting with several updates per batch.

The stub model is test_strategies.py's: p(.|0) = [1/8, 2/8, 5/8] over tokens 0, 1, 2.
"""

import json
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import train_script as ts  # noqa: E402
from test_strategies import LOG, policy, uniform  # noqa: E402

from astrai.train import resume  # noqa: E402
from astrai.train.grpo_loss import per_token_terms  # noqa: E402
from astrai.train.strategies import Env, GRPOStrategy, make_strategy  # noqa: E402
from astrai.train.step_metrics import add_metrics, reduce_metrics  # noqa: E402
from astrai.train.trainer import Trainer  # noqa: E402
from astrai.train.distributed import Dist  # noqa: E402


def clipped_surrogate(logp, old, adv, eps_low, eps_high=None):
    t = per_token_terms(logp, old, adv, eps_low, eps_low if eps_high is None else eps_high)
    return t["loss"], t["clip_low"], t["clip_high"]


def k3(logp, ref):
    return per_token_terms(logp, logp.detach(), torch.zeros_like(logp), 0.2, 0.2, ref, 1.0)["kl"]


def test_clip_counts_only_the_side_that_removes_the_gradient():
    a = 1.0
    logp = torch.zeros(4, requires_grad=True)
    old = -torch.log(torch.tensor([1.5, 0.5, 0.5, 1.5]))  # ratios 1.5, 0.5, 0.5, 1.5
    adv = torch.tensor([a, -a, a, -a])
    loss, low, high = clipped_surrogate(logp, old, adv, 0.2)
    # +A, 1.5: min(1.5, 1.2) = 1.2 (clipped high); -A, 0.5: min(-0.5, -0.8) = -0.8 (clipped low);
    # +A, 0.5: min(0.5, 0.8) = 0.5 (not clipped); -A, 1.5: min(-1.5, -1.2) = -1.5 (not clipped)
    torch.testing.assert_close(loss, torch.tensor([-1.2, 0.8, -0.5, 1.5]))
    assert low.tolist() == [False, True, False, False] and high.tolist() == [True, False, False, False]
    grad = torch.autograd.grad(loss.sum(), logp)[0]  # d(-rho A)/d logp = -rho A where not clipped
    torch.testing.assert_close(grad, torch.tensor([0.0, 0.0, -0.5, 1.5]))
    assert ((grad == 0) == (low | high)).all()  # counted exactly where the clip removes the gradient
    # asymmetric: eps_high 0.6 lets ratio 1.5 through on the high side
    _, low, high = clipped_surrogate(logp.detach(), old, adv, 0.2, 0.6)
    assert low.tolist() == [False, True, False, False] and not high.any()


def test_k3_by_hand():
    torch.testing.assert_close(k3(torch.tensor([0.0, 0.0]), torch.tensor([LOG(2), 0.0])),
                               torch.tensor([2 - LOG(2) - 1, 0.0]))


def test_grpo_loss_and_figures_by_hand():
    rows = [{"prompt_input_ids": [0], "completion_input_ids": [[2], [1], [0], [1]],
             "completion_labels": [[2], [1], [0], [1]], "rewards": [1.0, 0.0, 1.0, 0.0]}]
    st = GRPOStrategy(uniform(), clip_eps=0.2, kl_coef=0.1, updates=2)
    b = st.collate(rows)
    a = 0.5 / (math.sqrt(1 / 3) + 1e-4)  # (r - 0.5) / (Bessel std + eps)
    torch.testing.assert_close(b["advantages"], torch.tensor([a, -a, a, -a]))
    # documents [0, c]: the trained token is at positions 0, 2, 4, 6, p(c|0) = 5/8, 2/8, 1/8, 2/8
    lp = [LOG(5 / 8), LOG(2 / 8), LOG(1 / 8), LOG(2 / 8)]
    old, ref = torch.zeros(8), torch.zeros(8)
    for i, (x, r) in enumerate(zip(lp, [1.5, 0.5, 0.5, 1.5])):
        old[2 * i], ref[2 * i] = x - LOG(r), x
    ref[0] = lp[0] + LOG(2)  # k3 = 1 - ln 2 on the first token, 0 elsewhere
    b["old_logps"], b["ref_logps"] = old, ref
    s, _, m = st.loss(policy(), b, Env())
    assert st.units(b) == 4
    assert float(s.detach()) == pytest.approx((-1.2 + 0.8 - 0.5 + 1.5) * a + 0.1 * (1 - LOG(2)), abs=1e-5)
    assert m["clip_low_fraction"] == 1.0 and m["clip_high_fraction"] == 1.0  # the two unclipped-by-sign tokens are not counted
    assert m["kl"] == pytest.approx(1 - LOG(2), abs=1e-6)
    # the data's rewards; the policy's choice among the four: softmax of [5, 2, 1, 2] / 8 = [.5, .2, .1, .2]
    assert m["reward_mean"] == (2.0, 4.0) and m["reward_std"][0] == pytest.approx(math.sqrt(1 / 3))
    assert m["policy_reward"][0] == pytest.approx(0.5 + 0.1) and m["policy_reward"][1] == 1.0
    assert m["policy_accuracy"] == (1.0, 1.0)  # the most probable completion (5/8) has the best reward


def test_grpo_prepare_records_the_old_policy():
    rows = [{"prompt_input_ids": [0], "completion_input_ids": [[2, 1]], "completion_labels": [[2, 1]],
             "rewards": [1.0]}]
    st = GRPOStrategy(None, kl_coef=0.0)
    b = st.collate(rows)
    st.prepare(policy(), [b], [[0]], Env())
    s, _, m = st.loss(policy(), b, Env())
    assert float(s.detach()) == 0.0 and m["clip_low_fraction"] == m["clip_high_fraction"] == 0.0  # ratio 1, advantage 0
    torch.testing.assert_close(b["old_logps"][:2], torch.tensor([LOG(5 / 8), LOG(1 / 3)]))


def test_metrics_means_over_their_own_counts():
    sums, counts = {"loss": 0.0}, {}
    add_metrics(sums, counts, {"kl": 3.0, "policy_reward": (1.5, 2.0), "policy_accuracy": (0.0, 0.0)})
    add_metrics(sums, counts, {"kl": 1.0, "policy_reward": (0.5, 2.0), "policy_accuracy": (1.0, 1.0)})
    out, stop = reduce_metrics(sums, counts, 8.0, Dist())
    assert out == {"loss": 0.0, "kl": 0.5, "policy_reward": 0.5, "policy_accuracy": 1.0} and not stop
    out, _ = reduce_metrics({"x": 1.0}, {"x": 0.0}, 8.0, Dist())
    assert out == {}  # nothing to average: left out, not 0/0


def grpo_rows(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_input_ids": torch.randint(0, 128, (5,), generator=g).tolist(),
             "completion_input_ids": [torch.randint(0, 128, (3,), generator=g).tolist() for _ in range(3)],
             "completion_labels": [torch.randint(0, 128, (3,), generator=g).tolist() for _ in range(3)],
             "rewards": [1.0, 0.5, 0.0]} for _ in range(n)]


@pytest.mark.parametrize("log_every,logged", [(1, [1, 2, 3]), (2, [2])])
def test_max_steps_and_log_every_are_exact_between_updates(tmp_path, log_every, logged):
    """2 updates per drawn batch, max_steps 3: exactly 3 optimizer steps (the second batch stops
    after its first update), a record at every log_every-th step and a validation at every step;
    checkpoints only after a batch's last update (step 2), none for step 3."""
    opts = ts.options(tmp_path, strategy="grpo", grpo_updates=2, max_steps=3, batch_size=2, grad_accum=1,
                      epochs=1, save_every=2, log_every=log_every, val_data="unused", eval_every=1)
    t = Trainer(ts.model(), make_strategy("grpo", None, kl_coef=0.0, updates=2), grpo_rows(8), opts,
                val_dataset=grpo_rows(2, seed=1))
    state = t.fit()
    assert state.global_step == 3 and t.total_steps == 3
    train = [r["step"] for r in state.history if "loss" in r]
    val = [r["step"] for r in state.history if "val_loss" in r]
    assert train == logged and val == [0, 1, 2, 3]  # step 0: before training
    assert all(set(r) >= {"clip_low_fraction", "clip_high_fraction", "reward_mean", "policy_reward"} for r in state.history
               if "loss" in r)
    assert all("val_policy_reward" in r for r in state.history if "val_loss" in r)
    assert [p.name for p in sorted((tmp_path / "checkpoints").glob("step-*"))] == ["step-00000002"]
    saved = json.loads((resume.latest(tmp_path / "checkpoints") / "trainer_state.json").read_text())
    assert saved["global_step"] == 2 and saved["step_in_epoch"] == 1
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "loss" in r] == logged


def test_save_every_must_be_a_multiple_of_the_updates(tmp_path):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="save_every 5 is not a multiple of grpo_updates 2.*use 4 or 6"):
        ts.options(tmp_path, strategy="grpo", grpo_updates=2, save_every=5)
    ts.options(tmp_path, strategy="sft", grpo_updates=2, save_every=5)  # only grpo steps more than once per batch
