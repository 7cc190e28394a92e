"""precision: fp32 | bf16-mixed | auto (astrai.train.precision, the probe astrai.runtime.hardware).

bf16-mixed is checked by what it must do, not by its code: float32 master weights, gradients and
AdamW state; the step's matrix products in bf16 (every linear's output, seen by forward hooks); the
loss on float32 logits; the reference/old-policy log-probs in the same precision as the loss; exact
resume. Its loss curve is compared with fp32's within a tolerance derived from bf16's format:

bf16 keeps 8 significant bits, so one rounding is off by at most u = 2^-9 (relative). Under
autocast a product rounds both operands and its result: at most 3u per product, and the errors of a
K-term dot product with random signs grow like sqrt(K) while the sum grows like sqrt(K) too, so
each product stays within a few u in relative terms. The loss of this tiny model sits behind two
decoder layers of five products in sequence each (q/k/v, scores, values, o, gate/up, down: the
rounding of a softmax and norm in between adds none, they run in float32) and the head: 11
products, at most 33u of first-order relative error in the logits in the worst case, about
sqrt(11) * 3u ~ 10u typically. We allow 8u = 2^-6 of relative difference per step of the loss
curve over 12 steps (lr 1e-2: the weights move apart too): the bound is 1.6% of the loss; a run
that did all its arithmetic in fp32 would match bitwise, so the curves must also differ somewhere.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import train_script as ts  # noqa: E402

from astrai.config.train import TrainOptions  # noqa: E402
from astrai.model.hf_checkpoint import read_tensors  # noqa: E402
from astrai.runtime import hardware  # noqa: E402
from astrai.train import precision as precision_mod, resume  # noqa: E402
from astrai.train.callbacks import Callback  # noqa: E402
from astrai.train.lm_loss import cross_entropy_sum  # noqa: E402
from astrai.train.strategies import make_strategy  # noqa: E402
from astrai.train.trainer import Trainer  # noqa: E402

U = 2.0 ** -9  # bf16's unit roundoff: 8 significant bits
TOLERANCE = 8 * U  # relative, per step of the loss curve (module docstring)
SCRIPT = os.path.join(os.path.dirname(__file__), "train_script.py")


class Capture(Callback):
    """Per optimizer step: every parameter's gradient dtype; at the end: the optimizer state dtypes."""

    def __init__(self):
        self.grad_dtypes, self.state_dtypes = set(), set()

    def on_optimizer_step(self, trainer):
        self.grad_dtypes |= {p.grad.dtype for p in trainer.raw_model.parameters() if p.grad is not None}

    def on_train_end(self, trainer):
        self.state_dtypes = {v.dtype for s in trainer.optimizer.state.values() for k, v in s.items() if k != "step"}


def _fit(tmp_path, name, model=None, callbacks=(), strategy="sft", rows=None, **kw):
    t = Trainer(model or ts.model(), make_strategy(strategy), rows or ts.synthetic_rows(24),
                ts.options(tmp_path / name, **{"save_every": 100, **kw}), callbacks=callbacks)
    return t, t.fit()


def _curve(state):
    return [r["loss"] for r in state.history if "loss" in r]


def test_bf16_mixed_keeps_float32_weights_gradients_and_adam_state(tmp_path):
    cap = Capture()
    before = {k: v.clone() for k, v in ts.model().state_dict().items()}
    t, _ = _fit(tmp_path, "mixed", callbacks=(cap,), precision="bf16-mixed", max_steps=3)
    assert t.precision.name == "bf16-mixed"
    assert {p.dtype for p in t.raw_model.parameters()} == {torch.float32}
    assert cap.grad_dtypes == {torch.float32} and cap.state_dtypes == {torch.float32}
    # the master weights moved by updates smaller than bf16 could hold: not every value is a bf16 number
    after = t.raw_model.state_dict()
    assert any(not torch.equal(after[k], before[k]) for k in before)
    w = after["model.layers.0.mlp.down_proj.weight"]
    assert not torch.equal(w, w.to(torch.bfloat16).float())


@pytest.mark.parametrize("precision,expected", [("bf16-mixed", torch.bfloat16), ("fp32", torch.float32)])
def test_the_step_multiplies_in_bf16_and_takes_the_loss_in_float32(tmp_path, monkeypatch, precision, expected):
    seen, ce_inputs = set(), set()
    model = ts.model()
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_hook(lambda mod, args, out: seen.add(out.dtype))
    real_ce = torch.nn.functional.cross_entropy

    def spy(z, *a, **kw):
        ce_inputs.add(z.dtype)
        return real_ce(z, *a, **kw)

    monkeypatch.setattr(torch.nn.functional, "cross_entropy", spy)
    _fit(tmp_path, precision, model=model, precision=precision, max_steps=1, lm_loss="full")
    assert seen == {expected}
    assert ce_inputs == {torch.float32}


@pytest.mark.parametrize("mode", ["full", "fused", "chunked"])
def test_lm_head_under_autocast_equals_the_obvious_bf16_head(mode):
    """Under autocast every LM-head mode takes bf16 products (the fused one's custom function too) and a
    float32 loss: the sum equals F.cross_entropy on the float32 widening of the bf16 product, and the
    gradients equal autograd's through that formula."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(40, 16, generator=g, requires_grad=True)
    w = torch.randn(50, 16, generator=g, requires_grad=True)
    y = torch.randint(0, 50, (40,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = cross_entropy_sum(h, w, y, mode, chunk=16)
    got.backward()
    assert got.dtype == torch.float32
    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    z = (h2.to(torch.bfloat16) @ w2.to(torch.bfloat16).t()).float()
    ref = torch.nn.functional.cross_entropy(z, y, reduction="sum")
    ref.backward()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)
    # backward products in bf16 (autocast's, or the fused function's half-precision path)
    torch.testing.assert_close(h.grad, h2.grad, rtol=4 * U, atol=4 * U * float(h2.grad.abs().max()))
    torch.testing.assert_close(w.grad, w2.grad, rtol=4 * U, atol=4 * U * float(w2.grad.abs().max()))
    # and it is not the float32 head: the fp32 loss differs by more than float32 rounding
    assert abs(float(cross_entropy_sum(h.detach(), w.detach(), y, mode, chunk=16)) - float(ref.detach())) > 1e-4


@pytest.mark.parametrize("kw", [{"gradient_checkpointing": True}, {"attention": "loop", "lm_loss": "chunked",
                                                                    "loss_chunk_tokens": 8}])
def test_bf16_mixed_with_checkpointing_and_other_loss_modes(tmp_path, kw):
    """Recomputed layers (gradient checkpointing) and the chunked head keep bf16 products and the curve."""
    seen = set()
    model = ts.model()
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_hook(lambda mod, args, out: seen.add(out.dtype))
    _, ref = _fit(tmp_path, "fp32", precision="fp32", max_steps=4, **kw)
    _, mixed = _fit(tmp_path, "mixed", model=model, precision="bf16-mixed", max_steps=4, **kw)
    assert seen == {torch.bfloat16}
    a, b = _curve(ref), _curve(mixed)
    assert max(abs(x - y) / abs(x) for x, y in zip(a, b)) <= TOLERANCE and a != b


def test_a_resume_where_auto_resolves_otherwise_says_so(tmp_path, monkeypatch, capfd):
    monkeypatch.setattr(precision_mod, "bf16_matmul_fast", lambda device: (True, "probe: fast"))
    _fit(tmp_path, "run", precision="auto", max_steps=2, save_every=2)
    monkeypatch.setattr(precision_mod, "bf16_matmul_fast", lambda device: (False, "probe: slow"))
    capfd.readouterr()
    t = Trainer(ts.model(), make_strategy("sft"), ts.synthetic_rows(24),
                ts.options(tmp_path / "run", save_every=2, precision="auto", max_steps=4))
    t.fit()
    err = capfd.readouterr().err
    assert "precision in effect bf16-mixed -> fp32" in err and "precision fp32 (auto: probe: slow)" in err


def test_loss_curve_stays_within_the_bf16_tolerance_of_fp32(tmp_path):
    _, ref = _fit(tmp_path, "fp32", precision="fp32", epochs=2)
    _, mixed = _fit(tmp_path, "mixed", precision="bf16-mixed", epochs=2)
    a, b = _curve(ref), _curve(mixed)
    assert len(a) == len(b) == 12
    worst = max(abs(x - y) / abs(x) for x, y in zip(a, b))
    assert worst <= TOLERANCE, (worst, a, b)
    assert a != b  # bf16 really ran


def test_lora_under_bf16_mixed(tmp_path):
    """Adapters (float32) train, the base stays as it was; with a bfloat16 base the adapters stay float32
    too; both curves within the tolerance of fp32's."""
    curves = {}
    for name, dtype, prec in [("fp32", "float32", "fp32"), ("mixed", "float32", "bf16-mixed"),
                              ("bf16base", "bfloat16", "bf16-mixed")]:
        model = ts.model(lora=True)
        base = {k: v.clone() for k, v in model.state_dict().items() if "lora_" not in k}
        cap = Capture()
        t, st = _fit(tmp_path, name, model=model, callbacks=(cap,), precision=prec, dtype=dtype, lora={},
                     max_steps=6)
        adapters = {p.dtype for n, p in t.raw_model.named_parameters() if "lora_" in n}
        assert adapters == {torch.float32} and cap.grad_dtypes == {torch.float32} and cap.state_dtypes == {torch.float32}
        after = t.raw_model.state_dict()
        assert all(torch.equal(after[k], v.to(after[k].dtype)) for k, v in base.items())
        curves[name] = _curve(st)
    for name in ("mixed", "bf16base"):
        worst = max(abs(x - y) / abs(x) for x, y in zip(curves["fp32"], curves[name]))
        assert worst <= TOLERANCE, (name, worst)
    assert curves["mixed"] != curves["fp32"]


def test_grpo_and_dpo_score_old_and_reference_policies_in_the_loss_precision(tmp_path, monkeypatch):
    """The first GRPO update's ratio pi / pi_old is exactly 1 and the first DPO step's margin against a
    copy of the policy exactly 0: prepare() runs under the same autocast as the loss."""
    import copy

    import test_grpo
    from astrai.train import grpo_loss

    pairs = []
    real = grpo_loss.per_token_terms

    def spy(logp, old, *a, **kw):
        pairs.append((logp.detach().clone(), old.clone()))
        return real(logp, old, *a, **kw)

    monkeypatch.setattr(grpo_loss, "per_token_terms", spy)
    opts = ts.options(tmp_path / "grpo", strategy="grpo", grpo_updates=2, max_steps=2, batch_size=2, grad_accum=1,
                      epochs=1, precision="bf16-mixed", save_every=2)
    Trainer(ts.model(), make_strategy("grpo", None, kl_coef=0.0, updates=2), test_grpo.grpo_rows(4), opts).fit()
    assert torch.equal(pairs[0][0], pairs[0][1])  # first update: the policy is pi_old, in the same precision
    assert not torch.equal(pairs[1][0], pairs[1][1])  # second: it moved

    policy = ts.model()
    rows = [{"chosen_input_ids": r["input_ids"].tolist(), "chosen_labels": r["labels"].tolist(),
             "rejected_input_ids": r["input_ids"].flip(0).tolist(), "rejected_labels": r["labels"].flip(0).tolist()}
            for r in ts.synthetic_rows(8)]
    t = Trainer(policy, make_strategy("dpo", copy.deepcopy(policy)), rows,
                ts.options(tmp_path / "dpo", strategy="dpo", max_steps=1, precision="bf16-mixed", save_every=2))
    st = t.fit()
    assert st.history[0]["loss"] == pytest.approx(float(torch.log(torch.tensor(2.0))), abs=1e-7)
    assert st.history[0]["reward_margin"] == 0.0


def test_resume_after_kill_is_bitwise_exact_under_bf16_mixed(tmp_path):
    opt = ["--opt", 'precision="bf16-mixed"']
    full, killed = tmp_path / "full", tmp_path / "killed"
    r = subprocess.run([sys.executable, SCRIPT, str(full), *opt], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("precision bf16-mixed") == 1  # printed once, at the start
    r = subprocess.run([sys.executable, SCRIPT, str(killed), "--kill-at", "5", *opt], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == -9
    r = subprocess.run([sys.executable, SCRIPT, str(killed), *opt], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr

    def losses(out):
        by_step = {}
        for line in (out / "metrics.jsonl").read_text().splitlines():
            rec = json.loads(line)
            by_step[rec["step"]] = rec["loss"]
        return [by_step[k] for k in sorted(by_step)]

    assert losses(killed) == losses(full) and len(losses(full)) == 12
    a, b = (read_tensors(resume.latest(p / "checkpoints")) for p in (full, killed))
    assert all(torch.equal(a[k], b[k]) for k in a)
    saved = json.loads((resume.latest(full / "checkpoints") / "trainer_state.json").read_text())
    assert saved["precision"] == "bf16-mixed"


@pytest.mark.parametrize("fast", [True, False])
def test_auto_follows_the_probe(monkeypatch, fast):
    monkeypatch.setattr(precision_mod, "bf16_matmul_fast", lambda device: (fast, "probe says so"))
    p = precision_mod.resolve("auto", "float32", "cpu")
    assert p.name == ("bf16-mixed" if fast else "fp32") and "probe says so" in p.line()
    assert precision_mod.resolve("auto", "float64", "cpu").name == "fp32"  # exactness runs stay exact
    assert precision_mod.resolve("auto", "bfloat16", "cpu").name == "fp32"  # bf16 weights: nothing to mix
    assert precision_mod.resolve("auto", "bfloat16", "cpu", lora=True).name == ("bf16-mixed" if fast else "fp32")
    assert precision_mod.resolve("fp32", "float32", "cpu").name == "fp32"
    assert precision_mod.resolve("bf16-mixed", "float32", "cpu").name == "bf16-mixed"


def test_auto_on_this_machine_follows_its_cpu_flags():
    with open("/proc/cpuinfo") as fh:
        flags = next(line.split(":", 1)[1].split() for line in fh if line.startswith("flags"))
    has = "avx512_bf16" in flags or "amx_bf16" in flags
    assert precision_mod.resolve("auto", "float32", "cpu").name == ("bf16-mixed" if has else "fp32")


def test_probe_reads_the_cpu_flags(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n\nprocessor\t: 1\nflags\t\t: fpu avx2\n")
    assert hardware.cpu_flags(str(info)) == frozenset({"fpu", "sse2", "avx", "avx2", "fma"})
    assert hardware.bf16_matmul_fast("cpu", flags=frozenset({"avx2", "avx512f"}))[0] is False
    fast, why = hardware.bf16_matmul_fast(torch.device("cpu"), flags=frozenset({"avx2", "avx512_bf16"}))
    assert fast and "avx512_bf16" in why
    assert hardware.bf16_matmul_fast("cpu", flags=frozenset({"amx_tile", "amx_bf16"}))[0] is True
    assert hardware.cpu_flags(str(tmp_path / "missing")) is None
    assert "avx2 yes" in hardware.cpu_flags_line(frozenset({"avx2"}))
    assert hardware.bf16_matmul_fast("mps")[0] is False


def test_bf16_mixed_with_bfloat16_weights_is_refused_naming_both_keys():
    with pytest.raises(ValueError) as e:
        TrainOptions(output="o", precision="bf16-mixed", dtype="bfloat16")
    msg = str(e.value)
    assert "bf16-mixed keeps float32 master weights" in msg and "dtype: bfloat16" in msg and "dtype: float32" in msg
    with pytest.raises(ValueError, match="dtype: float64"):
        TrainOptions(output="o", precision="bf16-mixed", dtype="float64")
    TrainOptions(output="o", precision="bf16-mixed", dtype="bfloat16", lora={})  # frozen bf16 base, fp32 adapters
    TrainOptions(output="o", precision="auto", dtype="bfloat16")  # auto resolves to fp32 there


def test_the_cli_refuses_it_in_one_line(tmp_path):
    cfg = tmp_path / "train.yaml"
    cfg.write_text("model: tiny\noutput: out\ndata: d\nprecision: bf16-mixed\ndtype: bfloat16\n")
    r = subprocess.run([sys.executable, "-m", "astrai.cli", "train", str(cfg)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and f"{cfg}:4:" in lines[0], r.stderr
    assert "precision: bf16-mixed keeps float32" in lines[0] and "dtype: bfloat16" in lines[0], r.stderr


def test_the_summary_names_the_precision():
    from astrai.train.summary import lines

    head = lines({"steps": 3, "seconds": 1.0, "precision": "bf16-mixed", "figures": {}, "final": "f",
                  "output": "o"})[0]
    assert head == "trained 3 steps in 1.0s (bf16-mixed)"
