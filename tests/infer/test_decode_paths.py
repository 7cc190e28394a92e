"""The decode step's other paths against the eager forward, every family: torch.compile on the CPU, CUDA graphs
on a GPU (their host-side bucketing and padding are checked on the CPU)."""

import random

import pytest
import torch

from astrai.infer.cuda_graph import bucket_for, buckets, plan_inputs
from astrai.infer.engine import Engine, EngineOptions
from astrai.infer.request import Request, SamplingParams
from astrai.model import CausalLM, ModelConfig, load_model, save_model


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    torch.manual_seed(5)
    cfg = ModelConfig.preset("tiny", initializer_range=0.2, eos_token_id=None, bos_token_id=None,
                             max_position_embeddings=512)
    path = tmp_path_factory.mktemp("tiny_paths")
    save_model(CausalLM(cfg), path)
    return path


def prompts(seed, n):
    rng = random.Random(seed)
    shared = [rng.randrange(512) for _ in range(37)]
    return [shared[:rng.choice([0, 17, 37])] + [rng.randrange(512) for _ in range(rng.choice([1, 6, 21]))]
            for _ in range(n)]


def test_buckets_cover_every_batch_size():
    assert buckets(1) == [1]
    assert buckets(16) == [1, 2, 4, 8, 16]
    assert buckets(20) == [1, 2, 4, 8, 16, 20]
    assert buckets(64)[-3:] == [48, 56, 64]
    sizes = buckets(20)
    assert [bucket_for(n, sizes) for n in (1, 3, 5, 9, 17, 20)] == [1, 4, 8, 16, 20, 20]
    with pytest.raises(ValueError):
        bucket_for(21, sizes)


def test_plan_inputs_by_hand():
    """Real rows first (their token, position, write slot and pages), padding rows after: token 0 at
    position 0, one K/V position in the scratch page."""
    a = Request(0, [5, 6, 7, 8, 9], SamplingParams())
    a.pages, a.kv_len = [3, 1], 4  # computes token 9 at position 4: page 1, offset 0 (page size 4)
    b = Request(1, [1, 2], SamplingParams())
    b.pages, b.kv_len = [2], 1
    s = plan_inputs([a, b], 4, page_size=4, scratch_page=9)
    assert s.ids == [9, 2, 0, 0]
    assert s.positions == [4, 1, 0, 0]
    assert s.write_slots == [1 * 4 + 0, 2 * 4 + 1, 36, 36]
    assert s.kv_lens == [5, 2, 1, 1]
    assert s.kv_indptr == [0, 2, 3, 4, 5]
    assert s.page_indices == [3, 1, 2, 9, 9]


@pytest.mark.slow  # two compiles: about 1.5 min on an idle 2-core machine, ~9 min under load 15
def test_compiled_decode_equals_eager(tiny_path):
    """Greedy tokens of the compiled decode equal the eager fused path's, over batches of 1 and of several
    requests (with radix-shared prefixes and different lengths), and the logits agree closely."""
    eager = Engine(load_model(tiny_path), options=EngineOptions(device="cpu", dtype="float32", page_size=4, max_running=8))
    compiled = Engine(load_model(tiny_path), options=EngineOptions(device="cpu", dtype="float32", page_size=4, max_running=8,
                                                                   compile=True))
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=0)
    for ps in (prompts(1, 1), prompts(2, 6)):
        a, b = eager.generate(ps, params), compiled.generate(ps, params)
        assert [o.token_ids for o in a] == [o.token_ids for o in b]
        for x, y in zip(a, b):
            lp_a = torch.tensor([t.logprob for t in x.logprobs])
            lp_b = torch.tensor([t.logprob for t in y.logprobs])
            torch.testing.assert_close(lp_a, lp_b, atol=1e-4, rtol=0)


def _family_path(name, tmp_path):
    from families import CASES, hf_model

    hf_model(name, seed=60 + list(CASES).index(name)).save_pretrained(tmp_path)
    return tmp_path


def _family_prompts(seed):
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, 256, (9,), generator=g).tolist()
    return [shared + torch.randint(0, 256, (n,), generator=g).tolist() for n in (2, 8)] + [[7, 3, 5]]


@pytest.mark.slow  # one compile per family: about 4 min each on a 2-core machine under load, less when idle
@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "qwen3", "gemma3_text", "mixtral", "qwen3_moe"])
def test_compiled_decode_equals_eager_for_every_family(name, tmp_path):
    """The compiled decode of every family (biases, q/k norms, Gemma's norms, GELU, scale and local RoPE, sliding
    windows past the window of 8, experts run eagerly between compiled halves) gives the eager forward's greedy
    tokens and logprobs (1e-4). Every decode step has two or more requests: only the graph of several requests compiles."""
    from astrai.infer.compiled import CompiledDecode
    from astrai.infer.runner import PagedContext

    path = _family_path(name, tmp_path)
    opts = dict(device="cpu", dtype="float32", page_size=4, max_running=4)
    eager = Engine(load_model(path), options=EngineOptions(**opts))
    compiled = Engine(load_model(path), options=EngineOptions(**opts))
    r = compiled.runner
    r.compiled = CompiledDecode(r.fused, r.backend, PagedContext, r.pool.num_pages, r.pool.page_size)
    calls = []
    layer = r.compiled.layer
    r.compiled.layer = lambda *a: calls.append(a[0].shape[0]) or layer(*a)
    ps = _family_prompts(list(name).count("a"))
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0)
    a, b = eager.generate(ps, params), compiled.generate(ps, params)
    assert calls and min(calls) >= 2  # the graph of several requests only (size 1 has its own)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    for x, y in zip(a, b):
        torch.testing.assert_close(torch.tensor([t.logprob for t in y.logprobs]),
                                   torch.tensor([t.logprob for t in x.logprobs]), atol=1e-4, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gemma3_text", "qwen2", "mixtral", "qwen3_moe"])
def test_cuda_graph_decode_of_every_family_equals_eager_on_gpu(name, tmp_path):
    """CUDA graphs on for the other families too (windows, Gemma's norms and local RoPE, experts gathered by
    index inside the graph): greedy tokens equal the eager forward's."""
    pytest.importorskip("cupy")
    path = _family_path(name, tmp_path)
    opts = dict(device="cuda", dtype="float32", page_size=4, max_running=4)
    graphs = Engine(load_model(path), options=EngineOptions(**opts))
    eager = Engine(load_model(path), options=EngineOptions(**opts, cuda_graphs=False))
    assert graphs.runner.graphs is not None
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ps = _family_prompts(3)
    assert [o.token_ids for o in graphs.generate(ps, params)] == [o.token_ids for o in eager.generate(ps, params)]
    assert graphs.runner.graphs.graphs


@pytest.mark.gpu
def test_cuda_graph_decode_equals_eager_on_gpu(tiny_path):
    """On a GPU with the cuda backend: replayed decode graphs give the eager path's greedy tokens, over batch
    sizes that hit several buckets (with padding rows), and after a weight change (graphs recaptured)."""
    pytest.importorskip("cupy")
    opts = dict(device="cuda", dtype="float32", page_size=16, max_running=12)
    model = load_model(tiny_path)
    graphs = Engine(model, options=EngineOptions(**opts))
    eager = Engine(load_model(tiny_path), options=EngineOptions(**opts, cuda_graphs=False))
    assert graphs.runner.graphs is not None and eager.runner.graphs is None
    params = SamplingParams(max_tokens=16, temperature=0.0)
    for n in (1, 3, 12):
        ps = prompts(n, n)
        assert [o.token_ids for o in graphs.generate(ps, params)] == [o.token_ids for o in eager.generate(ps, params)]
    assert set(graphs.runner.graphs.graphs) >= {1, 4, 12}
    with torch.no_grad():
        for m in (graphs.model, eager.model):
            m.model.layers[0].mlp.up_proj.weight.mul_(1.5)
    ps = prompts(9, 5)
    assert [o.token_ids for o in graphs.generate(ps, params)] == [o.token_ids for o in eager.generate(ps, params)]


@pytest.mark.slow  # one compile, about a minute on a 2-core machine
def test_compiled_bf16_decode_follows_eager_with_the_cpu_kernels(tiny_path):
    """bf16 weights on a CPU with astrai's kernels: the compiled decode multiplies with the same operator
    (astrai::gemv_bf16) inside its graph; its greedy tokens follow the eager bf16 engine's (inductor
    may round elementwise bf16 work once where eager rounds each operation, so only the first tokens of
    each request are held equal) and its log-probabilities stay within bf16's resolution of them."""
    from astrai.infer.native import RowsWeight, kernels

    if kernels() is None:
        pytest.skip("astrai's CPU kernels do not run here")
    opts = dict(device="cpu", dtype="bfloat16", page_size=4, max_running=8)
    eager = Engine(load_model(tiny_path), options=EngineOptions(**opts))
    compiled = Engine(load_model(tiny_path), options=EngineOptions(**opts, compile=True))
    assert isinstance(compiled.runner.fused.layers[0].qkv_t, RowsWeight) and compiled.runner.compiled is not None
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=0)
    for ps in (prompts(1, 1), prompts(2, 6)):
        a, b = eager.generate(ps, params), compiled.generate(ps, params)
        for x, y in zip(a, b):
            assert x.token_ids[:2] == y.token_ids[:2]
            assert abs(x.logprobs[0].logprob - y.logprobs[0].logprob) < 0.05
