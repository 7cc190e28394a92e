"""Online GRPO on a tiny chat checkpoint: the engine samples the trainer's current weights, rollouts are
seeded, a group shares its prompt's pages, temperature 0 is `astrai generate`, and a killed run resumes
with the same completions and rewards."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from astrai.config.train import RolloutOptions
from astrai.model import CausalContext
from astrai.model.adapter_files import load_checkpoint
from astrai.rl.rollout import Rollout
from astrai.text.tokenizer import load_tokenizer

QUESTIONS = ["hello how are you today", "the quick brown fox jumps over the lazy dog please answer",
             "what number is one two three", "good day"]

REWARDS = '''
def score(completion, sample):
    if len(completion) % 7 == 3:
        raise ValueError("a failing reward")
    return completion.count("e") / (1 + len(completion)) + (sample["answer"] in completion)
'''


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_tokenizer, make_chat_checkpoint):
    root = tmp_path_factory.mktemp("online")
    ckpt = make_chat_checkpoint(root / "ckpt", tiny_tokenizer)
    with open(root / "prompts.jsonl", "w") as fh:
        for i, q in enumerate(QUESTIONS * 2):
            fh.write(json.dumps({"messages": [{"role": "user", "content": q}], "answer": ["yes", "no"][i % 2]}) + "\n")
    (root / "pipe.yaml").write_text(
        f"version: 1\ntokenizer: {ckpt}\nchat_template: tokenizer\ninput:\n  sections:\n"
        "    - {field: messages, action: mask, template: true, add_generation_prompt: true}\n"
        "    - {field: answer, action: value, value_type: string}\n")
    r = subprocess.run([sys.executable, "-m", "astrai.cli", "preprocess", str(root / "pipe.yaml"), "-i",
                        str(root / "prompts.jsonl"), "-o", str(root / "data"), "--workers", "1"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    (root / "my_rewards.py").write_text(REWARDS)
    return root, Path(ckpt)


def prompt_ids(root, n=None):
    from astrai.train.data import TrainData

    ds = TrainData(root / "data").dataset
    return [ds[i]["input_ids"].tolist() for i in range(len(ds) if n is None else n)]


def greedy_by_hand(model, ids, n, stop):
    """The slow obvious decode: the model's own forward over the whole sequence for each new token."""
    ids, out = list(ids), []
    with torch.no_grad():
        for _ in range(n):
            h = model(torch.tensor(ids), torch.arange(len(ids)), CausalContext())
            t = int(model.logits(h[-1:]).argmax(-1))
            out.append(t)
            ids.append(t)
            if t in stop:
                break
    return out


def test_the_engine_samples_the_trainers_current_weights(setup):
    root, ckpt = setup
    tok = load_tokenizer(str(ckpt))
    model = load_checkpoint(ckpt).train()
    ro = RolloutOptions(group_size=2, max_tokens=8, temperature=0.0)
    rollout = Rollout(model, tok, ro, seed=0, device="cpu")
    prompts = prompt_ids(root, 2)
    stop = {tok.tok.token_to_id("<|im_end|>"), tok.eos_id}
    first, _ = rollout.generate(prompts, 0)
    for p, group in zip(prompts, first):
        assert group[0]["token_ids"] == group[1]["token_ids"] == greedy_by_hand(model, p, 8, stop)
    with torch.no_grad():  # what an optimizer step does: the trainer's weights change in place
        model.model.layers[0].mlp.down_proj.weight.mul_(-3.0)
        model.lm_head.weight.add_(0.2 * torch.randn_like(model.lm_head.weight))
    rollout.sync(model)
    second, _ = rollout.generate(prompts, 0)
    assert [g[0]["token_ids"] for g in second] != [g[0]["token_ids"] for g in first]
    for p, group in zip(prompts, second):
        assert group[0]["token_ids"] == greedy_by_hand(model, p, 8, stop)
    assert model.training  # the trainer's model is left as it was


def test_seeded_rollouts_are_reproducible_and_groups_share_prompt_pages(setup):
    root, ckpt = setup
    tok = load_tokenizer(str(ckpt))
    model = load_checkpoint(ckpt)
    ro = RolloutOptions(group_size=4, max_tokens=6, temperature=1.0, page_size=4)
    prompts = prompt_ids(root, 3)
    a, stats = Rollout(model, tok, ro, seed=5, device="cpu").generate(prompts, 7)
    b, _ = Rollout(model, tok, ro, seed=5, device="cpu").generate(prompts, 7)
    c, _ = Rollout(model, tok, ro, seed=5, device="cpu").generate(prompts, 8)
    ids = lambda groups: [[x["token_ids"] for x in g] for g in groups]  # noqa: E731
    assert ids(a) == ids(b)
    assert ids(a) != ids(c)  # another step draws other completions
    assert any(len({tuple(x) for x in g}) > 1 for g in ids(a))  # G samples of a prompt differ
    # the first completion of each prompt computes it; the other G-1 attach its full pages (the last prompt
    # token is always computed: its logits sample the first token)
    shared = sum((4 - 1) * ((len(p) - 1) // 4) * 4 for p in prompts)
    assert stats["prefix_cached_tokens"] == shared > 0
    assert [x["cached_tokens"] for x in a[0]] == [0] + [(len(prompts[0]) - 1) // 4 * 4] * 3


def test_temperature_zero_rollouts_equal_astrai_generate(setup, tmp_path):
    root, ckpt = setup
    tok = load_tokenizer(str(ckpt))
    with open(tmp_path / "chat.jsonl", "w") as fh:
        for q in QUESTIONS:
            fh.write(json.dumps({"messages": [{"role": "user", "content": q}]}) + "\n")
    r = subprocess.run([sys.executable, "-m", "astrai.cli", "generate", str(ckpt), "--chat", str(tmp_path / "chat.jsonl"),
                        "--temperature", "0", "--max-tokens", "12", "--device", "cpu", "--output",
                        str(tmp_path / "out.jsonl")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    expected = [json.loads(line)["text"] for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    ro = RolloutOptions(group_size=2, max_tokens=12, temperature=0.0)
    # the prompts as the pipeline rendered them for training (the dataset's rows), not re-encoded here
    groups, _ = Rollout(load_checkpoint(ckpt), tok, ro, seed=0, device="cpu").generate(prompt_ids(root, 4), 0)
    assert [g[0]["text"] for g in groups] == expected


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
                    rollout=dict(group_size=3, max_tokens=6, temperature=1.0, prompts_per_step=2{rollout}),
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
            mean = sum(rs) / len(rs)
            std = (sum((x - mean) ** 2 for x in rs) / (len(rs) - 1)) ** 0.5
            assert advs == pytest.approx([(x - mean) / (std + 1e-4) for x in rs], abs=1e-5)
    start = load_checkpoint(ckpt).state_dict()
    end = load_checkpoint(root / "a" / "final").state_dict()
    assert any(not torch.equal(start[k], end[k]) for k in start)
    # killed (SIGKILL) after step 2's checkpoint, then rerun: the same completions and rewards as run a
    r = train(root, ckpt, root / "b", 3, kill_at=2)
    assert r.returncode != 0 and (root / "b" / "checkpoints").exists()
    r = train(root, ckpt, root / "b", 3)
    assert r.returncode == 0, r.stderr
    assert (root / "b" / "completions.jsonl").read_text() == (root / "a" / "completions.jsonl").read_text()


def test_with_lora_the_engine_samples_base_plus_adapters_and_keeps_no_pool(setup):
    import gc

    from astrai.infer.engine import Engine
    from astrai.model.lora import LoraSpec, apply_lora, lora_layers

    root, ckpt = setup
    tok = load_tokenizer(str(ckpt))
    model = load_checkpoint(ckpt)
    apply_lora(model, LoraSpec(rank=4, alpha=8))
    torch.manual_seed(1)
    with torch.no_grad():  # a trained adapter: B no longer zero
        for layer in lora_layers(model).values():
            layer.lora_B.weight.normal_(0, 0.5)
    ro = RolloutOptions(group_size=2, max_tokens=8, temperature=0.0)
    prompts = prompt_ids(root, 2)
    stop = {tok.tok.token_to_id("<|im_end|>"), tok.eos_id}
    groups, stats = Rollout(model, tok, ro, seed=0, device="cpu").generate(prompts, 0)
    base = load_checkpoint(ckpt)
    for p, group in zip(prompts, groups):
        assert group[0]["token_ids"] == greedy_by_hand(model, p, 8, stop)  # the LoRA-wrapped forward
    assert [g[0]["token_ids"] for g in groups] != [greedy_by_hand(base, p, 8, stop) for p in prompts]
    gc.collect()
    assert not [o for o in gc.get_objects() if type(o) is Engine]  # the KV pool went with the engine
    assert stats["kv_pool_mb"] > 0


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
