"""The engine's one forward (astrai.infer.fused) against the model's own forward and transformers, for every
family: same logits on ragged prefill / decode steps, the same greedy tokens, after weights change in place
too; LoRA-wrapped projections served merged; what it cannot compute refused by name."""

import random

import pytest
import torch
import torch.nn as nn

from families import CASES, hf_model

from astrai.infer.engine import Engine, EngineOptions
from astrai.infer.packed import OWN_ROWS, UnservableModel
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
        if fused:
            return engine.runner.logits(engine.runner.fused(ids, pos, ctx))
        return engine.model.logits(engine.model(ids, pos, ctx))


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("own_rows,threads", [((0, -1), 1), (OWN_ROWS, 1), ((1, 1 << 30), 1), (OWN_ROWS, 2),
                                              (OWN_ROWS, 4)],
                         ids=["input-major", "default", "own", "split-2", "split-4"])
def test_fused_step_logits_equal_the_model_forward(tiny_path, page_size, own_rows, threads):
    """Ragged prefill with a cached prefix, chunked prefill mixed with decode, then pure decode steps;
    every step on the input-major copies, on the model's own weights, as the row count chooses, or with
    the products split into 2 or 4 pieces (inner dimension for 1-3 rows, output dimension above)."""
    engine = Engine(load_model(tiny_path), options=EngineOptions(device="cpu", dtype="float32", page_size=page_size, max_step_tokens=24,
                                                                 max_running=8))
    engine.runner.fused.own_rows = own_rows
    engine.runner.fused.threads = threads
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
    engine = Engine(model, options=EngineOptions(device="cpu", dtype="float32", page_size=4))
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
    """What another adapter library puts in place of a Linear: the engine must not compute past it."""

    def __init__(self, base):
        super().__init__()
        self.base_layer = base

    def forward(self, x):
        return self.base_layer(x) * 2


def test_a_projection_the_engine_cannot_compute_is_refused_by_name(tiny_path):
    model = load_model(tiny_path)
    model.model.layers[1].self_attn.v_proj = Wrapped(model.model.layers[1].self_attn.v_proj)
    with pytest.raises(UnservableModel, match=r"model.layers.1.self_attn.v_proj is a Wrapped"):
        Engine(model, options=EngineOptions(device="cpu", dtype="float32"))
    model = load_model(tiny_path)
    model.model.layers[0].mlp.extra = nn.Linear(2, 2)
    with pytest.raises(UnservableModel, match=r"model.layers.0.mlp: submodules \['extra'\]"):
        Engine(model, options=EngineOptions(device="cpu", dtype="float32"))


def _run_steps(engine, params, ps, check) -> list[list[int]]:
    """Step the engine by hand over prompts `ps`; `check(batch)` returns the step's logits."""
    reqs = [engine.add_request(p, params) for p in ps]
    while engine.has_work():
        batch = engine.scheduler.schedule()
        logits = check(batch)
        last = torch.tensor(batch.q_lens).cumsum(0) - 1
        picks = [(r, last[i]) for i, r in enumerate(batch.reqs) if batch.samples(i)]
        engine.scheduler.advance(batch)
        for req, row in picks:
            engine._accept(req, int(logits[row].argmax()), None)
    return [r.output_ids for r in reqs]


def test_lora_wrapped_projections_are_served_merged(tiny_path):
    """A LoRA-wrapped model (every projection and the LM head) runs the engine's forward on merged weights:
    each step's logits equal the model's own forward through the adapters (unmerged, LoraLinear); with the
    adapters switched off the weights are packed again and the logits are the base model's."""
    from astrai.model.lora import LoraSpec, adapters_disabled, apply_lora, lora_layers

    model = load_model(tiny_path)
    apply_lora(model, LoraSpec(rank=4, alpha=8.0, targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                           "up_proj", "down_proj", "lm_head")))
    torch.manual_seed(4)
    with torch.no_grad():
        for layer in lora_layers(model).values():
            layer.lora_B.weight.normal_(0.0, 0.3)
    engine = Engine(model, options=EngineOptions(device="cpu", dtype="float32", page_size=4, max_step_tokens=24, max_running=8))
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)

    def check(batch):
        ref = step_logits(engine, batch, fused=False)
        ids, pos, ctx, _ = engine.runner.prepare(batch)
        with torch.inference_mode():
            ours = engine.runner.logits(engine.runner.fused(ids, pos, ctx))
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
        return ref

    with_adapters = _run_steps(engine, params, prompts(5, 3), check)
    builds = engine.runner.fused.builds
    with adapters_disabled(model):
        assert engine.runner.sync_weights() and engine.runner.fused.builds == builds + 1
        engine.pool.reset_prefix_cache()
        without = _run_steps(engine, params, prompts(5, 3), check)
    assert with_adapters != without  # the adapters matter at this scale


@pytest.fixture(scope="module", params=list(CASES))
def family(request, tmp_path_factory):
    """(family, transformers model, checkpoint written by transformers): tests/model/families.py."""
    name = request.param
    hf = hf_model(name, seed=20 + list(CASES).index(name))
    path = tmp_path_factory.mktemp(f"fused-{name}")
    hf.save_pretrained(path)
    return name, hf, path


@pytest.mark.parametrize("own_rows,threads", [((0, -1), 1), ((1, 1 << 30), 1), (OWN_ROWS, 2)],
                         ids=["input-major", "own", "split"])
def test_every_family_runs_the_one_forward(family, own_rows, threads):
    """Every family (biases, q/k norms, Gemma's norms, scale, soft-capping and local/global layers, sliding
    windows, experts) on the engine's forward: ragged prefill with a radix-cached prefix, chunked prefill mixed
    with decode, decode past the window of 8; each step's logits equal the model's own forward (1e-4, float32),
    the greedy tokens equal transformers' `generate`."""
    name, hf, path = family
    engine = Engine(load_model(path), options=EngineOptions(device="cpu", dtype="float32", page_size=4, max_step_tokens=24,
                                                            max_running=8))
    engine.runner.fused.own_rows = own_rows
    engine.runner.fused.threads = threads
    rng = random.Random(list(CASES).index(name))
    shared = [rng.randrange(256) for _ in range(13)]
    ps = [shared + [rng.randrange(256) for _ in range(n)] for n in (1, 6, 19)] + [[rng.randrange(256)] * 3]
    engine.generate(ps[:1], SamplingParams(max_tokens=1, temperature=0.0))  # the shared prefix in the radix cache
    kinds = set()

    def check(batch):
        kinds.add("decode" if all(n == 1 for n in batch.q_lens) else "mixed")
        ref = step_logits(engine, batch, fused=False)  # writes the step's K/V; the fused pass rewrites it
        torch.testing.assert_close(step_logits(engine, batch, fused=True), ref, atol=1e-4, rtol=0)
        return ref

    new = 12
    outs = _run_steps(engine, SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True), ps, check)
    assert kinds == {"decode", "mixed"}
    for p, out in zip(ps, outs):
        assert out == hf.generate(torch.tensor([p]), max_new_tokens=new, min_new_tokens=new,
                                  do_sample=False)[0, len(p):].tolist()


def test_smollm2_chats_fused_equal_transformers_also_after_an_in_place_update(smollm2):
    """The real model, several chats at once (continuous batching, greedy, EOS honoured) against transformers
    one chat at a time; then the same in-place weight update on both sides, and again."""
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(smollm2)
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    engine = Engine.from_checkpoint(smollm2, EngineOptions(device="cpu", dtype="float32", kv_cache_tokens=4096))
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


@pytest.mark.parametrize("layout", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_grouped_and_gathered_equal_the_models_layer(layout, dtype):
    """The engine's sparse layer, grouped (one matmul per expert) and gathered (CUDA graphs: no shape that depends
    on the routing), against the model's SparseMoE on the same weights: Mixtral's renormalised float32 routing
    weights, Qwen3-MoE's unrenormalised ones cast back; top 3 of 6 so the order a token's experts are added in
    matters, and more tokens than some experts get."""
    from astrai.infer.fused import experts_forward
    from astrai.infer.packed import pack
    from astrai.model.layers import SparseMoE, activation

    cfg = ModelConfig.preset("tiny-moe", family=layout, num_local_experts=6, num_experts_per_tok=3,
                             norm_topk_prob=False)
    torch.manual_seed(8)
    model = CausalLM(cfg).to(dtype).eval()
    layer = model.model.layers[0]
    moe = layer.block_sparse_moe if layout == "mixtral" else layer.mlp
    assert isinstance(moe, SparseMoE) and moe.renormalise == (layout == "mixtral")
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.3)
        x = torch.randn(11, cfg.hidden_size).to(dtype)
        ref, _ = moe(x)
        experts = pack(model).layers[0].experts
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
        for static in (False, True):
            got = experts_forward(x, experts, activation(cfg.hidden_act), static=static)
            assert got.dtype == dtype
            torch.testing.assert_close(got, ref, **tol)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 33, 128, 129])
@pytest.mark.parametrize("parts", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", ["input-major", "transposed view"])
def test_split_products_equal_the_plain_product(rows, parts, layout):
    """`matmul`'s split products (inner dimension for 1-3 rows, output dimension up to SPLIT_N_ROWS, the
    plain product above or where a dimension does not divide) against float64, with and without a bias,
    on a contiguous [in, out] weight and on the transposed view of an [out, in] one (the down projection)."""
    from astrai.infer.fused import matmul, split_parts

    torch.manual_seed(rows * 10 + parts)
    k, n = 96, 60
    w_t = torch.randn(k, n) if layout == "input-major" else torch.randn(n, k).t()
    a, bias = torch.randn(rows, k), torch.randn(n)
    assert split_parts(a, parts) == (parts if rows <= 128 else 1)
    want = a.double() @ w_t.double()
    torch.testing.assert_close(matmul(a, w_t, split_parts(a, parts)).double(), want, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(matmul(a, w_t, split_parts(a, parts), bias).double(), want + bias.double(),
                               atol=1e-4, rtol=1e-5)
