"""LoRA training (`lora:`): only the adapters train and hold optimizer state; final/ is a PEFT adapter that
peft loads with our logits, plus final/merged/ for transformers; DPO's reference is the base with the
adapters off (no second copy, the loss of the two-model computation); kill + resume is bitwise; DDP and
FSDP on 2 gloo processes equal 1 process with the doubled batch."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

sys.path.insert(0, os.path.dirname(__file__))
import train_script as ts  # noqa: E402
from test_run import _opts, datasets  # noqa: E402,F401  (the module's preprocessed sft/dpo data)

from astrai.model import CausalContext, load_model  # noqa: E402
from astrai.model.adapter_files import load_checkpoint, read_adapter  # noqa: E402
from astrai.model.lora import BaseView, lora_layers  # noqa: E402
from astrai.train import resume  # noqa: E402
from astrai.train.run import TrainConfigError, run_train  # noqa: E402
from astrai.train.strategies import Env, make_strategy  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(__file__), "train_script.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
EXACT = 1e-9  # float64 runs: equal up to summation order (see test_fsdp.py)


def _logits(model, ids):
    with torch.no_grad():
        return model.logits(model(ids, torch.arange(len(ids)), CausalContext()))


def test_sft_trains_only_adapters_and_final_loads_in_peft_and_transformers(datasets, base_dir, tmp_path):  # noqa: F811
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    before = {k: v.clone() for k, v in load_model(base_dir).state_dict().items()}
    res = run_train(_opts(datasets["sft"], tmp_path / "run", model=str(base_dir), max_steps=3, lr=2e-2, save_every=2,
                          lora={"rank": 4, "alpha": 16, "target_modules": ["q_proj", "v_proj", "down_proj"]}))
    final = Path(res["final"])
    for f in ("adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "merged/config.json",
              "merged/model.safetensors", "merged/tokenizer.json"):
        assert (final / f).exists(), f
    assert not (final / "model.safetensors").exists()  # the base is not copied
    cfg = json.loads((final / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(base_dir.resolve()) and cfg["r"] == 4 and cfg["lora_alpha"] == 16
    # checkpoints: adapters + optimizer state of the adapters only (2 layers x 3 targets x A, B)
    ckpt = resume.latest(tmp_path / "run" / "checkpoints")
    assert not (ckpt / "model.safetensors").exists() and (ckpt / "adapter_model.safetensors").exists()
    opt = json.loads((ckpt / "optimizer.json").read_text())
    names = [n for g in opt["param_groups"] for n in g["params"]]
    assert len(names) == 12 and all(".lora_" in n for n in names)  # keyed by name: the trainable ones
    with safe_open(str(ckpt / "optimizer.safetensors"), framework="pt") as f:
        assert {k.rpartition("/")[0] for k in f.keys()} == set(names)
    tensors, _ = read_adapter(final)
    assert len(tensors) == 12 and all(t.dtype == torch.float32 for t in tensors.values())
    assert any(float(t.abs().max()) > 0 for k, t in tensors.items() if "lora_B" in k)  # B moved from 0
    assert all(torch.equal(v, before[k]) for k, v in load_model(base_dir).state_dict().items())  # base untouched

    ours = load_checkpoint(final)  # the adapter merged into the base it names
    ids = torch.randint(0, 448, (13,))
    pm = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base_dir), final).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(final / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(_logits(ours, ids), pm(input_ids=ids[None]).logits[0], atol=1e-4, rtol=0)
        torch.testing.assert_close(merged(input_ids=ids[None]).logits[0], pm(input_ids=ids[None]).logits[0],
                                   atol=1e-4, rtol=0)
        assert float((_logits(ours, ids) - _logits(load_model(base_dir), ids)).abs().max()) > 1e-3


def test_lora_needs_a_checkpoint_and_no_merge_writes_adapters_only(datasets, base_dir, tmp_path):  # noqa: F811
    with pytest.raises(TrainConfigError, match="'tiny' is not a checkpoint directory"):
        run_train(_opts(datasets["sft"], tmp_path / "a", lora={}))
    res = run_train(_opts(datasets["sft"], tmp_path / "b", model=str(base_dir), max_steps=1,
                          lora={"merge": False}))
    final = Path(res["final"])
    assert (final / "adapter_model.safetensors").exists() and not (final / "merged").exists()
    assert len(read_adapter(final)[0]) == 2 * 7 * 2  # the default targets: every projection
    with pytest.raises(TrainConfigError, match="is a LoRA adapter directory; new adapters need a full checkpoint"):
        run_train(_opts(datasets["sft"], tmp_path / "c", model=str(final), lora={}))
    # a bfloat16 base: adapters (and their AdamW state) stay float32
    res = run_train(_opts(datasets["sft"], tmp_path / "bf16", model=str(base_dir), max_steps=2, dtype="bfloat16",
                          lora={"merge": False}))
    assert res["loss"] == res["loss"] and all(t.dtype == torch.float32 for t in read_adapter(res["final"])[0].values())


def test_dpo_reference_is_the_base_with_adapters_off(datasets, base_dir, tmp_path):  # noqa: F811
    # through run_train: the first step's policy equals its reference (B = 0), so the loss is log 2
    res = run_train(_opts(datasets["dpo"], tmp_path / "dpo", model=str(base_dir), strategy="dpo", max_steps=1,
                          lora={}))
    assert res["loss"] == pytest.approx(0.6931471805599453, abs=1e-6)

    # the loss with the view equals the two-model computation (a separate plain copy of the base as
    # reference), for adapters that moved; and the view adds no parameter
    from astrai.data.load import ShardDataset

    policy = ts.model(lora=True)
    view = BaseView(policy)
    separate = ts.model()  # the same base weights, no adapters
    rows = [ShardDataset(datasets["dpo"])[i] for i in range(2)]
    # into the small model's vocabulary (ids and their labels alike; -100 stays)
    rows = [{k: ([i % ts.CFG.vocab_size if i >= 0 else i for i in v] if k.endswith(("input_ids", "labels")) else v)
             for k, v in r.items()} for r in rows]
    losses = []
    for ref in (view, separate):
        strategy = make_strategy("dpo", ref, beta=0.1)
        batch = strategy.collate(rows)
        strategy.prepare(policy, [batch], [[0, 1]], Env())
        loss, _, _ = strategy.loss(policy, batch, Env())
        losses.append(float(loss.detach()))
    assert losses[0] == pytest.approx(losses[1], abs=1e-6) and abs(losses[0] - 2 * 0.6931) > 1e-4
    params = {id(p) for p in policy.parameters()}
    assert all(id(p) in params for p in view.lm_head.parameters())
    assert sum(p.numel() for p in policy.parameters()) == ts.model().num_parameters() + sum(
        p.numel() for layer in lora_layers(policy).values() for p in (layer.lora_A.weight, layer.lora_B.weight))


def _run(out, *args, procs=1, check=True):
    launcher = [sys.executable] if procs == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                   "--nproc_per_node", str(procs)]
    r = subprocess.run(launcher + [SCRIPT, str(out), "--lora", *args], capture_output=True, text=True, timeout=300,
                       env=ENV)
    if check:
        assert r.returncode == 0, r.stderr[-3000:]
    return r


def _by_step(out, key):
    return {r["step"]: r[key] for r in map(json.loads, Path(out, "metrics.jsonl").read_text().splitlines()) if key in r}


@pytest.mark.slow
def test_lora_resume_after_kill_is_bitwise(tmp_path):
    _run(tmp_path / "full")
    r = _run(tmp_path / "killed", "--kill-at", "5", check=False)
    assert r.returncode == -signal.SIGKILL
    assert resume.latest(tmp_path / "killed" / "checkpoints").name == "step-00000004"
    _run(tmp_path / "killed")
    ref = _by_step(tmp_path / "full", "loss")
    assert len(ref) == 12 and _by_step(tmp_path / "killed", "loss") == ref  # float equality, every step
    a, _ = read_adapter(resume.latest(tmp_path / "full" / "checkpoints"))
    b, _ = read_adapter(resume.latest(tmp_path / "killed" / "checkpoints"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["fsdp", "ddp"])
def test_two_processes_with_lora_equal_one_with_the_doubled_batch(tmp_path, parallel):
    common = ("--tied", "--val", "5", "--opt", 'dtype="float64"')
    _run(tmp_path / "one", *common, "--batch", "4")
    _run(tmp_path / "two", *common, "--batch", "2", "--parallel", parallel, procs=2)
    for key in ("loss", "grad_norm", "val_loss"):
        one, two = _by_step(tmp_path / "one", key), _by_step(tmp_path / "two", key)
        assert sorted(one) == sorted(two) and one, key
        for s in one:
            assert abs(one[s] - two[s]) < EXACT, (key, one, two)
    a, _ = read_adapter(resume.latest(tmp_path / "one" / "checkpoints"))
    b, _ = read_adapter(resume.latest(tmp_path / "two" / "checkpoints"))
    assert sorted(a) == sorted(b) and len(a) == 28
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=EXACT, rtol=0)
    if parallel == "fsdp":  # each rank holds half of everything, and AdamW state only for the adapters
        counts = ts.rank_counts(tmp_path / "two")
        adapters = sum(t.numel() for t in a.values())
        assert len(counts) == 2 and all(c["adam"] == adapters and c["local_adam"] == adapters // 2 for c in counts)
