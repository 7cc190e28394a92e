"""QLoRA on the real SmolLM2-135M-Instruct: the NF4 base holds its decoder projections in at most a fifth of
their float32 bytes, a few steps lower the validation loss from the NF4 base's own, and the adapters
load in PEFT over the full-precision checkpoint."""

import json
import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("torchao")
sys.path.insert(0, os.path.dirname(__file__))
from test_real_model import smollm2_data  # noqa: E402,F401  (the bundled chats in SmolLM2's template)


@pytest.mark.slow
def test_short_qlora_lowers_val_loss_and_the_adapters_load_in_peft(smollm2, smollm2_data, tmp_path):  # noqa: F811
    from astrai.config.train import TrainOptions
    from astrai.model import load_model
    from astrai.model.lora import lora_layers
    from astrai.model.quant import quantized_bytes
    from astrai.train.adapters import add_adapters
    from astrai.train.run import run_train

    torch.set_num_threads(2)
    opts = TrainOptions(data=str(smollm2_data["train"]), val_data=str(smollm2_data["val"]),
                        output=str(tmp_path / "run"), model=str(smollm2), max_steps=4, batch_size=1, eval_every=4,
                        warmup_steps=0, scheduler="constant", save_every=100, progress=False, lr=2e-3,
                        lora={"rank": 8, "alpha": 16, "quantize_base": "nf4"})
    model = add_adapters(load_model(smollm2), opts)
    layers = lora_layers(model).values()  # the default targets: all 7 projections of each of the 30 layers
    assert len(layers) == 7 * 30
    fp32 = sum(4 * layer.base_layer.in_features * layer.base_layer.out_features for layer in layers)
    assert quantized_bytes(model) <= 0.2 * fp32, (quantized_bytes(model), fp32)
    del model

    res = run_train(opts)
    val = {r["step"]: r["val_loss"] for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text()
                                                  .splitlines()) if "val_loss" in r}
    assert val[4] < val[0] - 0.05, val  # from the NF4 base's own loss (step 0) down
    peft = pytest.importorskip("peft")
    base = transformers.AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    pm = peft.PeftModel.from_pretrained(base, Path(res["final"])).eval()
    ids = torch.tensor(transformers.AutoTokenizer.from_pretrained(smollm2)("Hi! How was your day?")["input_ids"])
    with torch.no_grad():
        assert torch.isfinite(pm(input_ids=ids[None]).logits).all()
