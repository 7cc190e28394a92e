"""Rollouts through one engine for the whole run: the trainer's current weights (synced in place, LoRA
merged), seeded sampling, a group sharing its prompt's pages, temperature 0 = `astrai generate`, the
prefix cache started afresh by every call, the KV pool given back while asleep, the trainer's dtype."""

import json
import subprocess
import sys

import torch

from astrai.config.train import RolloutOptions
from astrai.model.adapter_files import load_checkpoint
from astrai.rl.rollout import Rollout
from astrai.text.tokenizer import load_tokenizer

from rollout_helpers import QUESTIONS, greedy_by_hand, prompt_ids


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
    engine, builds = rollout.engine, rollout.engine.runner.fused.builds
    where = [(f.qkv_t.data_ptr(), f.gate_up_t.data_ptr()) for f in engine.runner.fused.layers]
    with torch.no_grad():  # what an optimizer step does: the trainer's weights change in place
        model.model.layers[0].mlp.down_proj.weight.mul_(-3.0)
        model.lm_head.weight.add_(0.2 * torch.randn_like(model.lm_head.weight))
    rollout.sync(model)
    second, _ = rollout.generate(prompts, 0)
    # the same engine, its fused copies remade once from the synced weights
    assert rollout.engine is engine and rollout.engines_made == 1 and engine.runner.fused.builds == builds + 1
    assert [(f.qkv_t.data_ptr(), f.gate_up_t.data_ptr()) for f in engine.runner.fused.layers] == where  # in place
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


def test_with_lora_the_engine_samples_base_plus_adapters(setup):
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
    assert stats["kv_pool_mb"] > 0


def test_every_call_starts_from_an_empty_prefix_cache(setup):
    """A call's hits are its own groups' sharing only: the same call twice on the same weights hits the
    same tokens (the second does not reuse the first's pages), so a call samples what it would alone."""
    root, ckpt = setup
    tok = load_tokenizer(str(ckpt))
    ro = RolloutOptions(group_size=3, max_tokens=5, temperature=1.0, page_size=4)
    rollout = Rollout(load_checkpoint(ckpt), tok, ro, seed=1, device="cpu")
    prompts = prompt_ids(root, 2)
    a, sa = rollout.generate(prompts, 4)
    b, sb = rollout.generate(prompts, 4)
    shared = sum((3 - 1) * ((len(p) - 1) // 4) * 4 for p in prompts)
    assert sa["prefix_cached_tokens"] == sb["prefix_cached_tokens"] == shared
    assert sa["prefix_cache_hit_rate"] == sb["prefix_cache_hit_rate"] == shared / (3 * sum(len(p) for p in prompts))
    assert [[c["token_ids"] for c in g] for g in a] == [[c["token_ids"] for c in g] for g in b]
    assert rollout.engines_made == 1


def test_sleep_gives_the_pool_and_fused_copies_back_and_wakes_to_the_same_samples(setup):
    root, ckpt = setup
    tok = load_tokenizer(str(ckpt))
    model = load_checkpoint(ckpt)
    prompts = prompt_ids(root, 3)
    awake = Rollout(model, tok, RolloutOptions(group_size=2, max_tokens=6), seed=2, device="cpu")
    asleep = Rollout(model, tok, RolloutOptions(group_size=2, max_tokens=6, sleep=True), seed=2, device="cpu")
    for step in (0, 1):
        if step:
            with torch.no_grad():
                model.lm_head.weight.mul_(1.5)
            awake.sync(model)
            asleep.sync(model)
        x, _ = awake.generate(prompts, step)
        y, stats = asleep.generate(prompts, step)
        assert [[c["token_ids"] for c in g] for g in x] == [[c["token_ids"] for c in g] for g in y]
        engine = asleep.engine
        assert engine.asleep and all(t.numel() == 0 for t in (*engine.backend.k_cache, *engine.backend.v_cache))
        assert engine.runner.fused.layers == [] and engine.pool.available() == engine.pool.num_pages
        assert stats["kv_pool_mb"] > 0  # what it takes while awake
    assert not awake.engine.asleep and awake.engine.backend.k_cache[0].numel() > 0
    assert asleep.engines_made == 1


def test_the_policy_copy_and_the_kv_pool_are_in_the_trainers_dtype(setup):
    from astrai.model.lora import LoraSpec, apply_lora, cast

    root, ckpt = setup
    tok = load_tokenizer(str(ckpt))
    prompts = prompt_ids(root, 2)
    ro = RolloutOptions(group_size=2, max_tokens=4)
    sizes = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = load_checkpoint(ckpt)
        apply_lora(model, LoraSpec(rank=4, alpha=8))
        model = cast(model, "cpu", dtype)  # as the trainer casts it: the base in dtype, adapters float32
        rollout = Rollout(model, tok, ro, seed=0, device="cpu")
        groups, stats = rollout.generate(prompts, 0)
        assert {p.dtype for p in rollout.policy.parameters()} == {dtype}
        assert rollout.engine.backend.k_cache[0].dtype == dtype
        assert all(c["finish_reason"] in ("stop", "length") for g in groups for c in g)
        sizes[dtype] = stats["kv_pool_mb"]
    assert sizes[torch.bfloat16] == sizes[torch.float32] / 2
