"""Greedy output token-identical to transformers' generate; the engine's prefill logits equal the training
forward for every family."""

import random

import pytest
import torch

from astrai.infer.engine import Engine, EngineOptions
from astrai.infer.request import SamplingParams
from astrai.infer.scheduler import Batch
from astrai.model import CausalContext, load_model

VOCAB = 512
NEW = 20


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    """A random-weight Llama written by transformers itself (HF's checkpoint format)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      eos_token_id=None, bos_token_id=None, pad_token_id=None, initializer_range=0.2)
    model = LlamaForCausalLM(cfg).eval()  # a large init spreads the logits: no near-ties in argmax
    path = tmp_path_factory.mktemp("hf_llama")
    model.save_pretrained(path, safe_serialization=True)
    return path, model


@pytest.fixture(scope="module")
def ours_checkpoint(tmp_path_factory):
    """A random-weight model written by astrai's save_model, read back by transformers."""
    from transformers import LlamaForCausalLM

    from astrai.model import CausalLM, ModelConfig, save_model

    torch.manual_seed(1)
    cfg = ModelConfig.preset("tiny", initializer_range=0.2, eos_token_id=None, bos_token_id=None,
                             max_position_embeddings=512)
    path = tmp_path_factory.mktemp("our_llama")
    save_model(CausalLM(cfg), path)
    return path, LlamaForCausalLM.from_pretrained(path).eval()


def prompts_with_shared_prefixes(seed, n=6):
    rng = random.Random(seed)
    system = [rng.randrange(VOCAB) for _ in range(21)]
    out = []
    for i in range(n):
        own = [rng.randrange(VOCAB) for _ in range(rng.choice([1, 5, 17, 40]))]
        out.append(system + own if i % 2 == 0 else own)
    return out


def hf_greedy(model, prompts):
    ref = []
    for p in prompts:  # one at a time: no padding, the plainest reference
        out = model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW)
        ref.append(out[0, len(p):].tolist())
    return ref


CONFIGS = {
    "page1-radix": dict(page_size=1),
    "page16-radix": dict(page_size=16),
    "page16-noradix": dict(page_size=16, prefix_cache=False),
    "page1-noradix-chunked": dict(page_size=1, prefix_cache=False, max_step_tokens=16, max_running=8),
    "page16-preempt": dict(page_size=16, kv_cache_tokens=96, max_running=6),
    "page1-preempt-radix": dict(page_size=1, kv_cache_tokens=90, max_running=6),
}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("which", ["hf_checkpoint", "ours_checkpoint"])
def test_greedy_matches_transformers(name, which, request):
    path, hf = request.getfixturevalue(which)
    prompts = prompts_with_shared_prefixes(list(CONFIGS).index(name) + 10 * (which == "hf_checkpoint"))
    ref = hf_greedy(hf, prompts)
    engine = Engine(load_model(path), options=EngineOptions(device="cpu", dtype="float32", **CONFIGS[name]))
    params = SamplingParams(max_tokens=NEW, temperature=0.0)
    for _ in range(2):  # the second round finds the first round's prompts in the radix cache
        outs = engine.generate(prompts, params)
        assert [o.token_ids for o in outs] == ref
        assert all(o.finish_reason == "length" for o in outs)
    stats = engine.engine_stats()
    if "preempt" in name:
        assert stats["preemptions"] > 0
    if CONFIGS[name].get("prefix_cache", True):
        assert stats["prefix_cache_hit_rate"] > 0.3
    else:
        assert stats["prefix_cache_hit_rate"] == 0
    engine.pool.check([])
    if engine.pool.radix is not None:
        engine.pool.radix.clear()
    assert engine.pool.alloc.num_free == engine.pool.num_pages


def _family_checkpoint(name, tmp_path):
    from families import CASES, hf_model

    hf = hf_model(name, seed=40 + list(CASES).index(name))
    hf.save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize("name", ["hf_llama", "llama", "mistral", "qwen2", "qwen3", "gemma3_text", "mixtral",
                                  "qwen3_moe"])
def test_prefill_logits_equal_training_forward(name, hf_checkpoint, tmp_path):
    """The engine's forward on a ragged prefill step (a radix-cached prefix, prompts past the sliding window of
    8) against astrai's training forward on each whole prompt alone (1e-4, float32), every family."""
    path = hf_checkpoint[0] if name == "hf_llama" else _family_checkpoint(name, tmp_path)
    model = load_model(path)
    vocab = model.config.vocab_size
    engine = Engine(load_model(path), options=EngineOptions(device="cpu", dtype="float32", page_size=4))
    prompts = [[t % vocab for t in p] for p in prompts_with_shared_prefixes(7)]
    engine.generate(prompts[:1], SamplingParams(max_tokens=1, temperature=0.0))  # caches prompt 0's prefix
    reqs = [engine.add_request(p, SamplingParams(max_tokens=1)) for p in prompts]
    batch = engine.scheduler.schedule()
    assert len(batch.reqs) == len(prompts) and batch.reqs[2].kv_len > 0  # ragged, with a cached prefix
    ids, pos, ctx, _ = engine.runner.prepare(batch)
    with torch.inference_mode():
        logits = engine.runner.logits(engine.runner.fused(ids, pos, ctx))
        start = 0
        for req, n in zip(batch.reqs, batch.q_lens):
            full = torch.tensor(req.tokens)
            ref = model.logits(model(full, torch.arange(len(full)), CausalContext()))
            torch.testing.assert_close(logits[start:start + n], ref[req.kv_len:req.kv_len + n], atol=1e-4, rtol=0)
            start += n
    assert all(r in reqs for r in batch.reqs)
