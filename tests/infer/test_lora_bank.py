"""Several LoRA adapters served side by side on one base (astrai.infer.lora_bank): each request's output
equals its adapter merged into the base and served alone (astrai.model.adapter_files.load_checkpoint:
W + s B A, an independent path), whatever the other rows of the step run; prefixes are never shared
across adapters; names and targets the bank cannot serve are refused."""

import pytest
import torch

from astrai.config.infer import EngineOptions, SamplingParams
from astrai.errors import InvalidRequest
from astrai.infer.engine import Engine
from astrai.infer.lora_bank import GROUPS, AdapterBank
from astrai.model import CausalLM, ModelConfig, load_model, save_model
from astrai.model.adapter_config import AdapterError, read_adapter_config
from astrai.model.adapter_files import load_checkpoint, read_adapter, save_adapter
from astrai.model.lora import LoraSpec, apply_lora, lora_layers

CFG = ModelConfig.preset("tiny", vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2)
OPTS = EngineOptions(device="cpu", dtype="float32", kv_cache_tokens=2048, page_size=4)
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
SPECS = {  # different ranks, scalings and targets
    "a": LoraSpec(4, 8.0),
    "b": LoraSpec(8, 4.0, targets=("q_proj", "v_proj")),
    "c": LoraSpec(2, 2.0, targets=("o_proj", "gate_proj", "down_proj")),
}


def _bank_dirs(root, cfg):
    torch.manual_seed(0)
    base = root / "base"
    save_model(CausalLM(cfg), base)
    out = {}
    for seed, (name, spec) in enumerate(SPECS.items(), 1):
        model = load_model(base)
        torch.manual_seed(seed)
        apply_lora(model, spec, base=str(base))
        with torch.no_grad():
            for layer in lora_layers(model).values():
                layer.lora_B.weight.normal_(0, 0.3)  # large enough that each adapter changes the greedy tokens
        save_adapter(model, root / name)
        out[name] = root / name
    return base, out


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return _bank_dirs(tmp_path_factory.mktemp("bank"), CFG)


@pytest.fixture(scope="module")
def both_dirs(dirs, tmp_path_factory):  # grouped-query attention (k/v narrower than q) and not (q, k, v alike)
    mha = ModelConfig.preset("tiny", vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                             num_key_value_heads=CFG.num_attention_heads)
    return {"gqa": dirs, "mha": _bank_dirs(tmp_path_factory.mktemp("bank_mha"), mha)}


PROMPTS = [[1, 5, 9, 13, 2, 7], [7, 7, 3], [40, 41, 42, 43, 44, 45, 46, 47, 48], [3, 1, 4, 1, 5, 9, 2, 6]]


def _alone(path, base=None):
    return Engine(load_checkpoint(path, base), options=OPTS)


def test_each_row_equals_its_adapter_merged_and_served_alone(dirs):
    base, adapters = dirs
    engine = Engine.from_checkpoint(base, OPTS, adapters=adapters)
    assert engine.adapter_names == ["a", "b", "c"]
    mix = [None, "a", "b", "c", "a", "c", None, "b"]  # every adapter and the base in the same steps
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(mix))]
    got = [c.token_ids for c in engine.generate(prompts, GREEDY, adapters=mix)]
    want = {name: _alone(adapters[name]) for name in adapters}
    want[None] = _alone(base)
    for p, name, g in zip(prompts, mix, got):
        assert g == want[name].generate([p], GREEDY)[0].token_ids, name
    # the adapters do change the output (else the comparison above could not fail)
    assert len({tuple(want[n].generate([PROMPTS[2]], GREEDY)[0].token_ids) for n in want}) == 4


def test_step_logits_match_the_merged_weights_within_float32_rounding(dirs):
    base, adapters = dirs
    engine = Engine.from_checkpoint(base, OPTS, adapters=adapters)
    for name in adapters:
        # the engine's logits of the prompt's last token, through a one-token generation with logprobs
        one = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
        a = engine.generate([PROMPTS[2]], one, adapters=[name])[0]
        b = _alone(adapters[name]).generate([PROMPTS[2]], one)[0]
        la = a.logprobs[0].top
        lb = b.logprobs[0].top
        assert [t for t, _ in la] == [t for t, _ in lb]
        assert max(abs(x - y) for (_, x), (_, y) in zip(la, lb)) < 1e-4


@pytest.mark.parametrize("ids, q_lens", [
    ([1, 2, 3], [1, 1, 1]),  # one decode token per adapter
    ([0, 1, 3, 0, 3], [1, 1, 1, 1, 1]),  # base tokens, an adapter between the present ones absent
    ([2, 0, 1, 2, 3], [4, 3, 1, 2, 5]),  # prefill rows of uneven counts
    ([3, 3], [5, 2]),  # one adapter only
    ([1, 0], [1, 1]),
    ([1, 2], [2, 1]),  # in slot order, the last adapter's slots not all filled: the product has more rows
    ([1, 1, 2, 2, 2], [1, 1, 1, 1, 1]),  # than tokens (a server's decode step of 2 + 3 requests)
])
@pytest.mark.parametrize("attention", ["gqa", "mha"])
def test_each_tokens_low_rank_term_is_its_own_adapters_product(both_dirs, attention, ids, q_lens):
    base, adapters = both_dirs[attention]
    model = load_model(base)
    bank = AdapterBank.load(adapters, base, model, torch.float32, torch.device("cpu"))
    names = list(adapters)
    tensors = {n: read_adapter(adapters[n])[0] for n in names}
    scaling = {n: read_adapter_config(adapters[n]).scaling for n in names}
    rows = bank.rows(ids, q_lens, torch.float32, torch.device("cpu"))
    per_token = [a for a, q in zip(ids, q_lens) for _ in range(q)]
    torch.manual_seed(1)
    for i, layer in enumerate(model.model.layers):
        for group, projs in GROUPS.items():
            h = torch.randn(len(per_token), layer.get_submodule(projs[0]).in_features)
            got = bank.delta(i, group, h, rows)
            for t, a in enumerate(per_token):  # scaling * B A h_t of the token's adapter, projection by projection
                want = []
                for p in projs:
                    out = layer.get_submodule(p).out_features
                    key = f"model.layers.{i}.{p}"
                    t_ = tensors[names[a - 1]] if a else {}
                    if f"{key}.lora_A.weight" not in t_:
                        want.append(torch.zeros(out))
                        continue
                    lora_a, lora_b = t_[f"{key}.lora_A.weight"], t_[f"{key}.lora_B.weight"]
                    want.append(scaling[names[a - 1]] * (lora_b @ (lora_a @ h[t])))
                torch.testing.assert_close(got[t], torch.cat(want), rtol=1e-5, atol=1e-5)
                if not a:
                    assert not got[t].any()  # the base's tokens get exactly nothing


def test_prefixes_are_never_shared_across_adapters(dirs):
    base, adapters = dirs
    engine = Engine.from_checkpoint(base, OPTS, adapters=adapters)
    long = list(range(1, 30))
    first = engine.generate([long], GREEDY, adapters=["a"])[0]
    assert first.cached_tokens == 0
    assert engine.generate([long], GREEDY, adapters=["b"])[0].cached_tokens == 0  # a's K/V is not b's
    assert engine.generate([long], GREEDY)[0].cached_tokens == 0  # nor the base's
    again = engine.generate([long], GREEDY, adapters=["a"])[0]
    assert again.cached_tokens > 0 and again.token_ids == first.token_ids


def test_unknown_adapter_and_unservable_targets_are_refused(dirs, tmp_path):
    base, adapters = dirs
    engine = Engine.from_checkpoint(base, OPTS, adapters={"a": adapters["a"]})
    with pytest.raises(InvalidRequest, match="adapter 'zz' is not served here"):
        engine.generate([PROMPTS[0]], GREEDY, adapters=["zz"])
    with pytest.raises(Exception, match="adapter directory"):
        Engine.from_checkpoint(adapters["a"], OPTS, adapters={"b": adapters["b"]})
    untied = tmp_path / "untied"
    torch.manual_seed(0)
    save_model(CausalLM(ModelConfig.preset("tiny", vocab_size=96, hidden_size=32, intermediate_size=48,
                                           num_hidden_layers=2, tie_word_embeddings=False)), untied)
    model = load_model(untied)
    apply_lora(model, LoraSpec(2, 2.0, targets=("q_proj", "lm_head")), base=str(untied))
    save_adapter(model, tmp_path / "head")
    with pytest.raises(AdapterError, match="lm_head is not served beside other adapters"):
        Engine.from_checkpoint(untied, OPTS, adapters={"head": tmp_path / "head"})
