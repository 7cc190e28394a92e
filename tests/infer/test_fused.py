"""The engine's fused forward (astrai.infer.fused) against the reference path (the model's own forward) and
transformers: same logits on ragged prefill / decode steps, the same greedy tokens, after weights change in
place too, and the reference path for what it does not implement."""

import random

import pytest
import torch
import torch.nn as nn

from astrai.infer import fused as fused_mod
from astrai.infer.engine import Engine, EngineOptions
from astrai.infer.request import SamplingParams
from astrai.model import CausalLM, ModelConfig, load_model, save_model

VOCAB = 512


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    torch.manual_seed(3)
    cfg = ModelConfig.preset("tiny", initializer_range=0.2, eos_token_id=None, bos_token_id=None,
                             max_position_embeddings=512)
    path = tmp_path_factory.mktemp("tiny_fused")
    save_model(CausalLM(cfg), path)
    return path


def prompts(seed, n=5):
    rng = random.Random(seed)
    shared = [rng.randrange(VOCAB) for _ in range(20)]
    return [(shared if i % 2 else []) + [rng.randrange(VOCAB) for _ in range(rng.choice([1, 3, 9, 30]))]
            for i in range(n)]


def step_logits(engine, batch, fused: bool):
    """Logits of every computed position of a scheduled batch, through the fused or the model's forward."""
    ids, pos, ctx, _ = engine.runner.prepare(batch)
    with torch.inference_mode():
        hidden = engine.runner.fused(ids, pos, ctx) if fused else engine.model(ids, pos, ctx)
        return engine.model.logits(hidden)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("own_rows", [(0, -1), fused_mod.OWN_ROWS, (1, 1 << 30)], ids=["input-major", "default", "own"])
def test_fused_step_logits_equal_the_model_forward(tiny_path, page_size, own_rows):
    """Ragged prefill with a cached prefix, chunked prefill mixed with decode, then pure decode steps;
    every step on the input-major copies, on the model's own weights, or as the row count chooses."""
    engine = Engine(load_model(tiny_path), options=EngineOptions(device="cpu", page_size=page_size, max_step_tokens=24,
                                                                 max_running=8))
    assert engine.runner.fused is not None, engine.runner.reference_reason
    engine.runner.fused.own_rows = own_rows
    engine.generate(prompts(0)[:1], SamplingParams(max_tokens=1, temperature=0.0))  # a prefix in the radix cache
    for p in prompts(1):
        engine.add_request(p, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    kinds = set()
    while engine.has_work():
        batch = engine.scheduler.schedule()
        kinds.add("decode" if all(n == 1 for n in batch.q_lens) else "mixed")
        ref = step_logits(engine, batch, fused=False)  # writes the step's K/V; the fused pass rewrites it
        ours = step_logits(engine, batch, fused=True)
        torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-5)
        last = torch.tensor(batch.q_lens).cumsum(0) - 1
        picks = [(r, last[i]) for i, r in enumerate(batch.reqs) if batch.samples(i)]
        engine.scheduler.advance(batch)
        for req, row in picks:
            engine._accept(req, int(ref[row].argmax()), None)
    assert kinds == {"decode", "mixed"}


def hf_greedy(path, prompt_ids, new):
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(path).eval()
    return [hf.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False, min_new_tokens=new)[0, len(p):].tolist()
            for p in prompt_ids]


def test_weights_changed_in_place_or_replaced_are_seen(tiny_path, tmp_path):
    """The engine's model changes under it (an optimizer step, load_state_dict, param.data = ...): the next
    step uses the new weights, equal to transformers on a checkpoint of them."""
    model = load_model(tiny_path)
    engine = Engine(model, options=EngineOptions(device="cpu", page_size=4))
    params = SamplingParams(max_tokens=8, temperature=0.0)
    ps = prompts(2, n=3)
    engine.generate(ps, params)
    builds = engine.runner.fused.builds
    torch.manual_seed(11)
    other = CausalLM(model.config)
    with torch.no_grad():
        model.load_state_dict(other.state_dict())  # in place: copy_ into every parameter
        model.model.layers[1].mlp.up_proj.weight.data = other.model.layers[1].mlp.up_proj.weight.data * 1.5  # replaced
        model.model.layers[0].self_attn.q_proj.weight.mul_(0.5)  # an in-place update after the load
    save_model(model, tmp_path / "changed")
    outs = engine.generate(ps, params)
    assert engine.runner.fused.builds == builds + 1
    assert [o.token_ids for o in outs] == hf_greedy(tmp_path / "changed", ps, 8)
    engine.generate(ps, params)
    assert engine.runner.fused.builds == builds + 1  # unchanged weights: no rebuild


class Wrapped(nn.Module):
    """What an adapter library puts in place of a Linear (the fused forward must not read past it)."""

    def __init__(self, base):
        super().__init__()
        self.base_layer = base

    def forward(self, x):
        return self.base_layer(x) * 2


def test_what_the_fused_forward_does_not_implement_takes_the_reference_path(tiny_path, monkeypatch):
    moe = CausalLM(ModelConfig.preset("tiny-moe"))
    assert "mixture of experts" in fused_mod.unsupported(moe)
    model = load_model(tiny_path)
    model.model.layers[1].self_attn.v_proj = Wrapped(model.model.layers[1].self_attn.v_proj)
    assert "v_proj is a Wrapped" in fused_mod.unsupported(model)
    engine = Engine(model, options=EngineOptions(device="cpu"))
    assert engine.runner.fused is None and "Wrapped" in engine.runner.reference_reason
    ref = model.model.layers[1].self_attn.v_proj
    with torch.no_grad():  # the wrapper's computation is the one that runs
        out = engine.generate(prompts(3, 2), SamplingParams(max_tokens=4, temperature=0.0))
        model.model.layers[1].self_attn.v_proj = ref.base_layer
        plain = Engine(model, options=EngineOptions(device="cpu")).generate(prompts(3, 2),
                                                                              SamplingParams(max_tokens=4, temperature=0.0))
    assert [o.token_ids for o in out] != [o.token_ids for o in plain]
    scaled = load_model(tiny_path).config.replace(rope_scaling={"rope_type": "linear", "factor": 2.0})
    monkeypatch.setattr(fused_mod, "IMPLEMENTED", fused_mod.IMPLEMENTED - {"rope_scaling"})
    assert "rope_scaling" in fused_mod.unsupported(CausalLM(scaled))  # a field it does not know: reference path


def test_smollm2_chats_fused_equal_transformers_also_after_an_in_place_update(smollm2):
    """The real model, several chats at once (continuous batching, greedy, EOS honoured) against transformers
    one chat at a time; then the same in-place weight update on both sides, and again."""
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(smollm2)
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    engine = Engine.from_checkpoint(smollm2, EngineOptions(device="cpu", kv_cache_tokens=4096))
    assert engine.runner.fused is not None, engine.runner.reference_reason
    chats = [[{"role": "user", "content": q}] for q in
             ("What is the capital of France?", "Can you explain the fourth dimension to a second grader?",
              "What are some social media ideas I could use?", "Which hero is the best in Heroes of Might and Magic 3?")]
    params = SamplingParams(max_tokens=20, temperature=0.0)

    def hf_out():
        out = []
        for chat in chats:
            enc = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
            ids = hf.generate(**enc, max_new_tokens=20, do_sample=False)[0, enc["input_ids"].shape[1]:].tolist()
            out.append(ids[:ids.index(tok.eos_token_id) + 1] if tok.eos_token_id in ids else ids)
        return out

    assert [o.token_ids for o in engine.generate(chats, params)] == hf_out()
    with torch.no_grad():
        for m in (engine.model, hf):
            for layer in m.model.layers[::3]:
                layer.mlp.gate_proj.weight.mul_(1.05)
                layer.self_attn.k_proj.weight.mul_(0.9)
    builds = engine.runner.fused.builds
    assert [o.token_ids for o in engine.generate(chats, params)] == hf_out()
    assert engine.runner.fused.builds == builds + 1
