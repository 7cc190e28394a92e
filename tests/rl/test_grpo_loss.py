"""GRPO's loss types against numbers computed by hand (astrai.train.grpo_loss's formulas), and every
loss type's value and gradient at several temperatures against a slow reference written out here.

The stub model of tests/train/test_strategies.py: hidden = one-hot of the token, so the logits after
token a are column a of W: p(.|0) = [1/8, 2/8, 5/8], p(.|1) = [3/5, 1/5, 1/5].
One group, prompt [0], completions [2] (reward 1) and [1, 0] (reward 0). The trained tokens are
p(2|0) in completion 1 and p(1|0), p(0|1) in completion 2; the old policy is set so that their
ratios are 1.5, 0.5 and 1.5.
"""

import math

import pytest
import torch

from astrai.schema import IGNORE_INDEX
from astrai.train.grpo_loss import clip_range, group_advantages
from astrai.train.strategies import Env, GRPOStrategy, grpo_options

LOG = math.log
ROWS = [{"prompt_input_ids": [0], "completion_input_ids": [[2], [1, 0]], "completion_labels": [[2], [1, 0]],
         "rewards": [1.0, 0.0]}]


class Stub(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lm_head = torch.nn.Linear(3, 3, bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(torch.tensor([[0.0, LOG(3), 0.0], [LOG(2), 0.0, 0.0], [LOG(5), 0.0, 0.0]]))

    def forward(self, ids, pos, ctx, return_aux=False):
        h = torch.nn.functional.one_hot(ids, 3).float()
        return (h, None) if return_aux else h


def run(loss_type, eps_low=None, eps_high=None, max_len=0, rows=ROWS):
    st = GRPOStrategy(None, clip_eps=0.2, kl_coef=0.0, loss_type=loss_type, clip_eps_low=eps_low,
                      clip_eps_high=eps_high, max_len=max_len)
    b = st.collate(rows)
    old = torch.zeros(5)  # positions: doc 1 = [0, 2] (0 trains p(2|0)), doc 2 = [0, 1, 0] (2: p(1|0), 3: p(0|1))
    old[0], old[2], old[3] = LOG(5 / 8) - LOG(1.5), LOG(2 / 8) - LOG(0.5), LOG(3 / 5) - LOG(1.5)
    b["old_logps"] = old
    s, _, m = st.loss(Stub(), b, Env())
    return st, b, float(s.detach()), m


A = 0.5 / (math.sqrt(0.5) + 1e-4)  # (r - mean) / (std + eps), std with Bessel's correction


def test_advantages_scaled_or_not():
    r = torch.tensor([1.0, 0.0, 0.5])
    std = math.sqrt((0.25 + 0.25 + 0) / 2)
    torch.testing.assert_close(group_advantages(r), torch.tensor([0.5, -0.5, 0.0]) / (std + 1e-4))
    torch.testing.assert_close(group_advantages(r, scale=False), torch.tensor([0.5, -0.5, 0.0]))
    assert group_advantages(torch.tensor([0.3, 0.3])).abs().max() == 0
    assert group_advantages(torch.tensor([0.3])).abs().max() == 0


# per token, eps 0.2: completion 1 (A = +a): ratio 1.5 -> -min(1.5a, 1.2a) = -1.2a (clipped: high)
# completion 2 (A = -a): ratio 0.5 -> -min(-0.5a, -0.8a) = 0.8a (clipped: low); ratio 1.5 -> -min(-1.5a, -1.2a) =
# 1.5a (not clipped: the gradient flows, so it is not counted)

def test_token_level():
    st, b, s, m = run("token")
    assert st.units(b) == 3
    assert s == pytest.approx((-1.2 + 0.8 + 1.5) * A, abs=1e-5)
    assert m["clip_low_fraction"] == 1 and m["clip_high_fraction"] == 1 and m["clip_fraction"] == 2


def test_grpo_per_sequence_mean_then_mean():
    st, b, s, m = run("grpo")
    assert st.units(b) == 2
    assert s == pytest.approx(-1.2 * A + (0.8 + 1.5) * A / 2, abs=1e-5)


def test_dr_grpo_unscaled_advantage_constant_normaliser():
    st, b, s, m = run("dr_grpo", max_len=4)
    torch.testing.assert_close(b["advantages"], torch.tensor([0.5, -0.5]))
    assert st.units(b) == 2 * 4  # G sequences x the rollout's max_tokens, whatever their lengths
    assert s == pytest.approx((-1.2 + 0.8 + 1.5) * 0.5, abs=1e-6)


def test_dapo_decoupled_clip():
    st, b, s, m = run("dapo", eps_low=0.2, eps_high=0.28)
    assert st.units(b) == 3
    # completion 1: -min(1.5a, 1.28a) = -1.28a; completion 2 as before
    assert s == pytest.approx((-1.28 + 0.8 + 1.5) * A, abs=1e-5)
    st, b, s, m = run("dapo", eps_low=0.2, eps_high=0.6)  # 1.5 < 1.6: the high side no longer clips
    assert s == pytest.approx((-1.5 + 0.8 + 1.5) * A, abs=1e-5)
    assert m["clip_high_fraction"] == 0 and m["clip_low_fraction"] == 1


def test_prepare_logs_clip_fractions_per_token_for_every_loss_type():
    for loss_type, units in (("token", 3), ("grpo", 2), ("dr_grpo", 8)):
        st = GRPOStrategy(None, clip_eps=0.2, kl_coef=0.0, loss_type=loss_type, max_len=4)
        b = st.collate(ROWS)
        st.prepare(Stub(), [b], [[0]], Env())
        b["old_logps"][0] -= LOG(1.5)  # ratio 1.5 on completion 1's token: clipped high
        s, _, m = st.loss(Stub(), b, Env())
        # the trainer divides metric sums by the step's units: the fraction is per completion token
        assert m["clip_high_fraction"] / units == pytest.approx(1 / 3)


def test_dapo_defaults_to_the_papers_decoupled_clip():
    st, b, s, m = run("dapo")  # neither eps given: eps_low 0.2, eps_high 0.28
    assert (st.eps_low, st.eps_high) == (0.2, 0.28)
    assert s == pytest.approx((-1.28 + 0.8 + 1.5) * A, abs=1e-5)
    st, b, s, m = run("token")  # the other types keep the symmetric clip
    assert s == pytest.approx((-1.2 + 0.8 + 1.5) * A, abs=1e-5)
    assert clip_range("dapo", 0.2, eps_low=0.1) == (0.1, 0.28)
    assert clip_range("dapo", 0.2, eps_high=0.4) == (0.2, 0.4)
    assert clip_range("grpo", 0.3) == (0.3, 0.3)


# completion 2 masked (overlong filtering, dynamic sampling): its tokens give no loss, but the
# normalisers that count sequences still count it
MASKED = [{**ROWS[0], "completion_labels": [[2], [IGNORE_INDEX, IGNORE_INDEX]]}]


def test_masked_rows_count_in_the_sequence_normalisers():
    st, b, s, m = run("dr_grpo", max_len=4, rows=MASKED)
    assert st.units(b) == 2 * 4  # G x L with the masked completion included
    assert s == pytest.approx(-1.2 * 0.5, abs=1e-6)
    st, b, s, m = run("grpo", rows=MASKED)
    assert st.units(b) == 2  # (1/G) sum_i: G = 2
    assert s == pytest.approx(-1.2 * A, abs=1e-5)
    st, b, s, m = run("token", rows=MASKED)
    assert st.units(b) == 1  # the trained tokens


def test_temperature_scales_the_logits_before_the_log_softmax():
    """At T, p_T(b|a) = p(b|a)^(1/T) / sum_v p(v|a)^(1/T): with p(.|0) = [1, 2, 5] / 8, p(.|1) = [3, 1, 1] / 5."""
    T = 0.7
    for temperature, expect in ((T, [5 ** (1 / T) / (1 + 2 ** (1 / T) + 5 ** (1 / T)),
                                     2 ** (1 / T) / (1 + 2 ** (1 / T) + 5 ** (1 / T)),
                                     3 ** (1 / T) / (3 ** (1 / T) + 2)]),
                                (1.0, [5 / 8, 2 / 8, 3 / 5])):
        st = GRPOStrategy(None, kl_coef=0.0, temperature=temperature)
        b = st.collate(ROWS)
        logp, _ = st._token_logps(Stub(), b, Env())
        torch.testing.assert_close(logp[[0, 2, 3]], torch.tensor([math.log(p) for p in expect]))
    assert GRPOStrategy(None, temperature=0.0).temperature == 1.0  # greedy rollouts: plain logits


def test_offline_options_give_dr_grpo_the_datas_longest_completion_and_the_temperature():
    import pyarrow as pa

    from astrai.config.train import TrainOptions

    data = type("Data", (), {"tables": [
        pa.table({"completion_input_ids": [[[1, 2], [3]], [[4, 5, 6, 7]]]}),
        pa.table({"completion_input_ids": [[[1, 2, 3]]]})]})()
    opts = TrainOptions(output="o", strategy="grpo", loss_type="dr_grpo", grpo_temperature=0.7)
    got = grpo_options(opts, data)
    assert got["max_len"] == 4 and got["temperature"] == 0.7
    assert grpo_options(TrainOptions(output="o", strategy="grpo"), data)["temperature"] == 1.0
    assert grpo_options(TrainOptions(output="o", strategy="sft"), data) == {}


# ---- every loss type against a slow reference, values and gradients, at several temperatures ----

V = 5  # vocabulary of the random stub


class RandomStub(torch.nn.Module):
    def __init__(self, w):
        super().__init__()
        self.lm_head = torch.nn.Linear(V, V, bias=False, dtype=torch.float64)
        with torch.no_grad():
            self.lm_head.weight.copy_(w)

    def forward(self, ids, pos, ctx, return_aux=False):
        h = torch.nn.functional.one_hot(ids, V).to(self.lm_head.weight.dtype)
        return (h, None) if return_aux else h


def random_rows(g):
    """Two groups: one with a masked completion and unequal rewards, one with all rewards equal."""
    comp = lambda n: torch.randint(0, V, (n,), generator=g).tolist()  # noqa: E731
    rows = []
    for rewards in ([1.0, 0.0, 0.5, 2.0], [0.3, 0.3, 0.3]):
        comps = [comp(int(torch.randint(1, 5, (1,), generator=g))) for _ in rewards]
        labels = [list(c) for c in comps]
        labels[1] = [IGNORE_INDEX] * len(comps[1]) if len(rewards) == 4 else labels[1]
        rows.append({"prompt_input_ids": comp(2), "completion_input_ids": comps, "completion_labels": labels,
                     "rewards": rewards})
    return rows


def slow_reference(w, w_old, w_ref, rows, T, loss_type, eps_low, eps_high, kl_coef, L, adv_eps=1e-4):
    """The papers' formulas token by token: log p = log_softmax(column prev of W / T)[target]."""
    def logp(weights, prev, target):
        z = weights[:, prev] / T
        return z[target] - torch.logsumexp(z, 0)

    total, n_tokens, n_seqs = 0.0, 0, 0
    for row in rows:
        r = row["rewards"]
        mean = sum(r) / len(r)
        std = math.sqrt(sum((x - mean) ** 2 for x in r) / (len(r) - 1))
        for comp, labels, ri in zip(row["completion_input_ids"], row["completion_labels"], r):
            a = ri - mean if loss_type == "dr_grpo" else (ri - mean) / (std + adv_eps)
            seq = row["prompt_input_ids"] + comp
            terms = []
            for t, (target, label) in enumerate(zip(comp, labels)):
                if label == IGNORE_INDEX:
                    continue
                prev = seq[len(row["prompt_input_ids"]) - 1 + t]
                lp = logp(w, prev, target)
                ratio = torch.exp(lp - logp(w_old, prev, target).detach())
                surrogate = torch.min(ratio * a, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * a)
                d = logp(w_ref, prev, target).detach() - lp
                terms.append(-surrogate + kl_coef * (torch.exp(d) - d - 1))
            n_seqs += 1
            n_tokens += len(terms)
            if loss_type == "grpo":
                total = total + (sum(terms) / len(terms) if terms else 0.0)
            else:
                total = total + sum(terms)
    return total / {"token": n_tokens, "dapo": n_tokens, "grpo": n_seqs, "dr_grpo": n_seqs * L}[loss_type]


@pytest.mark.parametrize("T", [0.7, 1.0, 1.3])
@pytest.mark.parametrize("loss_type", ["token", "grpo", "dr_grpo", "dapo"])
def test_loss_and_gradient_equal_the_slow_reference(loss_type, T):
    g = torch.Generator().manual_seed(7)
    w, w_old, w_ref = (torch.randn(V, V, generator=g, dtype=torch.float64) for _ in range(3))
    w_old = w + 0.3 * w_old  # an old policy near the current one: some ratios clip, some do not
    rows = random_rows(g)
    L = 6
    st = GRPOStrategy(RandomStub(w_ref), clip_eps=0.2, kl_coef=0.05, updates=2, loss_type=loss_type, max_len=L,
                      temperature=T)
    b = st.collate(rows)
    env = Env(dtype=torch.float64)
    st.prepare(RandomStub(w_old), [b], [[0, 1]], env)
    model = RandomStub(w)
    s, _, m = st.loss(model, b, env)
    (s / st.units(b)).backward()
    ww = w.clone().requires_grad_(True)
    eps_high = 0.28 if loss_type == "dapo" else 0.2
    ref = slow_reference(ww, w_old, w_ref, rows, T, loss_type, 0.2, eps_high, 0.05, L)
    ref.backward()
    # float64 throughout but the advantages, which the batch carries as float32 (as the rewards)
    assert float(s.detach() / st.units(b)) == pytest.approx(float(ref.detach()), rel=1e-5)
    torch.testing.assert_close(model.lm_head.weight.grad, ww.grad, rtol=1e-5, atol=1e-8)
    assert m["clip_low_fraction"] + m["clip_high_fraction"] > 0  # the clip is exercised
