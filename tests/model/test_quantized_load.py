"""A checkpoint read straight into a quantized base (load_model(..., quantize="nf4")): each decoder
projection is quantized as it is read, so the float32 base is never held whole. Checked against
quantizing after a full-precision load (the same model, bit for bit), torchao's own `to_nf4` codes,
and the process's peak resident memory against a float32 load of the same checkpoint."""

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("torchao")

from astrai.config.train import LORA_TARGETS  # noqa: E402
from astrai.model import CausalContext, CausalLM, ModelConfig, load_model, save_model  # noqa: E402
from astrai.model.quant import NF4Linear, QuantError, nf4_scaler_block, quantize_layers  # noqa: E402


def _logits(model, ids):
    with torch.no_grad():
        return model.logits(model(ids, torch.arange(len(ids)), CausalContext()))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("nf4-load") / "base"
    save_model(CausalLM(ModelConfig.preset("tiny", vocab_size=448, tie_word_embeddings=True)), path)
    return path


def test_loading_into_nf4_equals_quantizing_after_a_full_load_and_torchaos_codes(ckpt):
    from torchao.quantization import to_nf4

    new = load_model(ckpt, quantize="nf4", quantize_modules=LORA_TARGETS)
    full = load_model(ckpt)
    plain = {n: m.weight.detach().clone() for n, m in full.model.layers.named_modules()
             if n.rsplit(".", 1)[-1] in LORA_TARGETS and isinstance(m, torch.nn.Linear)}
    old = load_model(ckpt)
    quantize_layers(old, "nf4", LORA_TARGETS)
    layers = {n: m for n, m in new.model.layers.named_modules() if n.rsplit(".", 1)[-1] in LORA_TARGETS}
    assert len(layers) == len(plain) == 2 * 7 and all(isinstance(m, NF4Linear) for m in layers.values())
    for n, m in layers.items():  # the codes and scales torchao computes from the float32 weight
        w = plain[n]
        ref = to_nf4(w, 64, nf4_scaler_block(w.numel() // 64))
        for part in ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean"):
            assert torch.equal(getattr(m.weight, part), getattr(ref, part)), (n, part)
    # embeddings, norms and the (tied) LM head stay float32 parameters, equal to the checkpoint's
    for n, p in new.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, full.get_parameter(n)), n
    assert new.lm_head.weight is new.model.embed_tokens.weight
    ids = torch.randint(0, 448, (11,))
    assert torch.equal(_logits(new, ids), _logits(old, ids))
    assert not torch.equal(_logits(new, ids), _logits(full, ids))  # the comparison above can tell


def test_a_size_that_does_not_divide_the_block_is_refused_before_any_tensor_is_read(tmp_path, monkeypatch):
    import astrai.model.hf_checkpoint as hf

    save_model(CausalLM(ModelConfig.preset("tiny", vocab_size=448, intermediate_size=96)), tmp_path / "odd")
    monkeypatch.setattr(hf, "_read", lambda *a, **k: pytest.fail("a tensor was read"))
    with pytest.raises(QuantError, match=r"model\.layers\.0\.mlp\.down_proj: input dimension 96 is not a multiple "
                                         r"of the nf4 block size 64"):
        load_model(tmp_path / "odd", quantize="nf4", quantize_modules=LORA_TARGETS)


_MEASURE = """
import json, sys
import torch
from astrai.config.train import LORA_TARGETS
from astrai.model import load_model
from astrai.model.quant import _torchao, quantize_layers
_torchao()  # its import is not the model's memory
torch.set_num_threads(1)
def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))
def peak():
    return status("VmHWM")
with open("/proc/self/clear_refs", "w") as f:  # the peak so far (imports) set back to what is resident now
    f.write("5")
before = peak()
if sys.argv[2] == "streamed":
    m = load_model(sys.argv[1], quantize="nf4", quantize_modules=LORA_TARGETS)
else:
    m = load_model(sys.argv[1])
    quantize_layers(m, "nf4", LORA_TARGETS)
print(json.dumps(peak() - before))
"""


def test_loading_into_nf4_never_holds_the_float32_base(tmp_path):
    torch.manual_seed(0)
    config = ModelConfig.preset("tiny", vocab_size=256, hidden_size=512, intermediate_size=2048, num_hidden_layers=6,
                                num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=True)
    save_model(CausalLM(config), tmp_path / "m")
    projections = 6 * (4 * 512 * 512 + 3 * 512 * 2048) * 4  # float32 bytes of the decoder projections: 100 MB
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    grew = {}
    for way in ("streamed", "after"):
        r = subprocess.run([sys.executable, "-c", _MEASURE, str(tmp_path / "m"), way], capture_output=True, text=True,
                           timeout=300, env=env)
        assert r.returncode == 0, r.stderr[-2000:]
        grew[way] = json.loads(r.stdout.strip().splitlines()[-1])
    assert grew["after"] >= 0.9 * projections, grew  # a full load holds every float32 projection at once
    # NF4 (an eighth) plus about one layer in float32: at least half the float32 projections never resident
    assert grew["streamed"] <= grew["after"] - 0.5 * projections, grew
