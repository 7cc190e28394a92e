"""QLoRA (`lora.quantize_base: nf4`): only the adapters train over an NF4 base a fifth of its float32 size;
final/ is a PEFT adapter that loads over the full-precision base, and over the NF4-dequantized base
(torchao's own dequantizer) gives astrai's logits; final/merged/ is that base plus the adapters; a
stopped run continues bitwise; a base whose sizes do not divide the NF4 block is refused by name."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchao")
sys.path.insert(0, os.path.dirname(__file__))
from test_run import _opts, datasets  # noqa: E402,F401  (the module's preprocessed sft data)

from astrai.config.train import LORA_TARGETS, TrainOptions  # noqa: E402
from astrai.model import CausalContext, CausalLM, ModelConfig, load_model, save_model  # noqa: E402
from astrai.model.adapter_files import read_adapter  # noqa: E402
from astrai.model.quant import nf4_scaler_block, quantized_bytes  # noqa: E402
from astrai.train.adapters import add_adapters  # noqa: E402
from astrai.train.run import TrainConfigError, run_train  # noqa: E402

QLORA = {"rank": 4, "alpha": 16, "target_modules": ["q_proj", "v_proj", "down_proj"], "quantize_base": "nf4"}
# float32 throughout: the two sides compute the same function, only the summation order differs (as the
# LoRA test's tolerance on logits of magnitude ~1)
F32 = 1e-4


def _logits(model, ids):
    with torch.no_grad():
        return model.logits(model(ids, torch.arange(len(ids)), CausalContext()))


def _projection_weights(model):
    return {f"{n}.weight": m for n, m in model.model.layers.named_modules()
            if n.rsplit(".", 1)[-1] in LORA_TARGETS and isinstance(m, torch.nn.Linear)}


def _torchao_dequantized_base(base_dir, out):
    """The base with every decoder projection replaced by torchao's own NF4 round trip (to_nf4, then
    get_original_weight), written as a plain checkpoint."""
    from torchao.quantization import to_nf4

    m = load_model(base_dir)
    with torch.no_grad():
        for lin in _projection_weights(m).values():
            w = lin.weight
            lin.weight.copy_(to_nf4(w.detach(), 64, nf4_scaler_block(w.numel() // 64)).get_original_weight())
    save_model(m, out)
    return out


def test_only_adapters_train_and_the_base_is_a_fifth_of_float32(datasets, base_dir):  # noqa: F811
    opts = _opts(datasets["sft"], "unused", model=str(base_dir), lora=QLORA)
    fp32 = sum(lin.weight.numel() * 4 for lin in _projection_weights(load_model(base_dir)).values())
    model = add_adapters(load_model(base_dir), opts)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable) == 2 * 3 * 2  # 2 layers x 3 targets x (A, B)
    assert not any(isinstance(m, torch.nn.Linear) and m.weight.is_floating_point() and type(m.weight) is torch.nn.Parameter
                   for n, m in model.model.layers.named_modules() if n.rsplit(".", 1)[-1] in LORA_TARGETS)
    assert quantized_bytes(model) <= 0.2 * fp32, (quantized_bytes(model), fp32)
    assert model.adapter.quantized == "nf4"


def test_final_loads_in_peft_over_the_full_and_the_dequantized_base(datasets, base_dir, tmp_path):  # noqa: F811
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    res = run_train(_opts(datasets["sft"], tmp_path / "run", model=str(base_dir), max_steps=3, lr=2e-2,
                          lora=QLORA))
    final = Path(res["final"])
    for f in ("adapter_config.json", "adapter_model.safetensors", "merged/config.json", "merged/model.safetensors"):
        assert (final / f).exists(), f
    assert json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"] == \
        str(base_dir.resolve())
    tensors, _ = read_adapter(final)
    assert len(tensors) == 12 and any(float(t.abs().max()) > 0 for k, t in tensors.items() if "lora_B" in k)

    # over the full-precision base, as the adapter names it: every tensor lands where PEFT puts it
    full = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base_dir), final)
    sd = full.state_dict()
    for k, t in tensors.items():
        peft_key = "base_model.model." + k.replace(".lora_A.weight", ".lora_A.default.weight").replace(
            ".lora_B.weight", ".lora_B.default.weight")
        assert torch.equal(sd[peft_key], t), k

    # astrai's QLoRA model (NF4 base + the trained adapters) against PEFT over the dequantized base
    ours = add_adapters(load_model(base_dir), _opts(datasets["sft"], "unused", model=str(base_dir), lora=QLORA))
    missing = ours.load_state_dict(tensors, strict=False)
    assert not missing.unexpected_keys
    deq = _torchao_dequantized_base(base_dir, tmp_path / "deq")
    pm = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(deq), final).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(final / "merged", dtype=torch.float32).eval()
    ids = torch.randint(0, 448, (13,))
    with torch.no_grad():
        want = pm(input_ids=ids[None]).logits[0]
        torch.testing.assert_close(_logits(ours, ids), want, atol=F32, rtol=0)
        torch.testing.assert_close(merged(input_ids=ids[None]).logits[0], want, atol=F32, rtol=0)
        # and the NF4 base is not the full-precision one: the comparison above could tell them apart
        assert float((full(input_ids=ids[None]).logits[0] - want).abs().max()) > 10 * F32


def _by_step(out, key):
    return {r["step"]: r[key] for r in map(json.loads, Path(out, "metrics.jsonl").read_text().splitlines()) if key in r}


def test_a_stopped_qlora_run_continues_bitwise(datasets, base_dir, tmp_path):  # noqa: F811
    common = dict(model=str(base_dir), lora=QLORA, scheduler="constant", save_every=2, lr=1e-2)
    run_train(_opts(datasets["sft"], tmp_path / "whole", max_steps=4, **common))
    run_train(_opts(datasets["sft"], tmp_path / "cut", max_steps=2, **common))
    run_train(_opts(datasets["sft"], tmp_path / "cut", max_steps=4, **common))  # resumes from step 2
    whole, cut = _by_step(tmp_path / "whole", "loss"), _by_step(tmp_path / "cut", "loss")
    lines = [json.loads(r) for r in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "loss" in r] == [1, 2, 3, 4]  # continued at 3, not started over
    assert sorted(whole) == [1, 2, 3, 4] and whole == cut  # float equality, every step
    a, _ = read_adapter(tmp_path / "whole" / "final")
    b, _ = read_adapter(tmp_path / "cut" / "final")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_a_base_that_does_not_divide_the_block_is_refused_by_name(datasets, tmp_path, tiny_tokenizer):  # noqa: F811
    save_model(CausalLM(ModelConfig.preset("tiny", vocab_size=448, intermediate_size=96)), tmp_path / "odd")
    with pytest.raises(TrainConfigError, match=r"lora\.quantize_base: model\.layers\.0\.mlp\.down_proj(\.base_layer)?: "
                                               r"input dimension 96 is not a multiple of the nf4 block size 64"):
        run_train(_opts(datasets["sft"], tmp_path / "run", model=str(tmp_path / "odd"), lora=QLORA))


def test_quantize_base_is_an_option_of_the_lora_block():
    assert TrainOptions(output="o", lora={"quantize_base": "nf4"}).lora.quantize_base == "nf4"
    with pytest.raises(ValueError, match="quantize_base"):
        TrainOptions(output="o", lora={"quantize_base": "int3"})


def _script(out, *args, procs=1):
    import subprocess

    script = os.path.join(os.path.dirname(__file__), "qlora_script.py")
    launcher = [sys.executable] if procs == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                   "--nproc_per_node", str(procs)]
    return subprocess.run(launcher + [script, str(out), *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.slow
def test_ddp_on_two_processes_equals_one_and_fsdp_is_refused(tmp_path):
    one = _script(tmp_path / "one", "--batch", "4")
    two = _script(tmp_path / "two", "--batch", "2", procs=2)
    assert one.returncode == 0 and two.returncode == 0, (one.stderr[-2000:], two.stderr[-2000:])
    a, b = (json.loads(r.stdout.strip().splitlines()[-1]) for r in (one, two))
    assert len(a) == 3 and len(b) == 3
    for x, y in zip(a, b):  # float32: the same sums, split over two ranks and reduced
        assert abs(x - y) < 1e-5, (a, b)
    fsdp = _script(tmp_path / "fsdp", "--batch", "2", "--parallel", "fsdp", procs=2)
    assert fsdp.returncode != 0 and "REFUSED train config: lora.quantize_base runs under parallel: ddp" in fsdp.stdout
