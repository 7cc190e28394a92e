"""Model directories as untrusted input: pickles never opened, custom code never imported, broken or forged
safetensors files and indexes, FIFOs, absurd config values and size bombs: each refused with one
ModelFileError naming the file and the key or tensor, before anything large is allocated."""

import json
import math
import os
import pickle
import shutil
import signal
import struct
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from astrai.errors import InputError, ModelFileError
from astrai.model import CausalLM, ModelConfig, load_model, read_config, save_model

Q = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    path = tmp_path_factory.mktemp("good")
    torch.manual_seed(0)
    save_model(CausalLM(ModelConfig.preset("tiny", vocab_size=64)), path)
    return path


@pytest.fixture
def ckpt(good, tmp_path):
    """A fresh copy of a good checkpoint, to break."""
    return shutil.copytree(good, tmp_path / "ckpt")


@pytest.fixture(autouse=True)
def no_hang():
    """A FIFO or a bomb must fail at once: no test here may take long."""
    signal.signal(signal.SIGALRM, lambda *a: (_ for _ in ()).throw(TimeoutError("took over 60 s")))
    signal.alarm(60)
    yield
    signal.alarm(0)


def refused(path, match: str):
    with pytest.raises(ModelFileError, match=match) as e:
        load_model(path)
    assert isinstance(e.value, InputError) and isinstance(e.value, ValueError)  # one type every verb reports
    assert "\n" not in str(e.value)
    return str(e.value)


def set_config(path, **changes):
    d = json.loads((path / "config.json").read_text())
    d.update(changes)
    (path / "config.json").write_text(json.dumps(d))


class Marker:
    """Unpickling this would create a file: proof that nothing was unpickled if it never appears."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


def test_a_pickle_only_checkpoint_is_refused_and_never_unpickled(ckpt, tmp_path):
    marker = tmp_path / "unpickled"
    (ckpt / "model.safetensors").unlink()
    (ckpt / "pytorch_model.bin").write_bytes(pickle.dumps(Marker(marker)))
    msg = refused(ckpt, "pytorch_model.bin but no model.safetensors: pickle files can run code")
    assert "save_pretrained" in msg
    from astrai.cli import main

    assert main(["generate", str(ckpt), "--prompt", "hi", "--device", "cpu"]) == 1
    assert not marker.exists()


def test_custom_code_is_never_imported(ckpt, tmp_path):
    marker = tmp_path / "imported"
    (ckpt / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w')\n")
    auto_map = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    set_config(ckpt, auto_map=auto_map)
    assert load_model(ckpt).config.family == "llama"  # a known architecture: the standard code computes it
    set_config(ckpt, architectures=["EvilForCausalLM"], model_type="evil", auto_map=auto_map)
    msg = refused(ckpt, r"model_type 'evil' \(its auto_map names custom code, which astrai never imports\)")
    assert "Qwen2ForCausalLM (qwen2)" in msg and "Gemma3ForCausalLM (gemma3_text)" in msg
    set_config(ckpt, model_type="llama")
    refused(ckpt, "architecture 'EvilForCausalLM'.* is not one astrai models")
    assert not marker.exists()


def test_gemma3_with_its_image_encoder_is_refused_by_name(ckpt):
    set_config(ckpt, architectures=["Gemma3ForConditionalGeneration"], model_type="gemma3")
    refused(ckpt, "text-only Gemma3ForCausalLM")


def _rewrite(path, change):
    sd = load_file(str(path / "model.safetensors"))
    change(sd)
    save_file(sd, str(path / "model.safetensors"))


def test_tensors_disagreeing_with_the_config_are_named(ckpt):
    _rewrite(ckpt, lambda sd: sd.__setitem__(Q, torch.zeros(32, 64)))
    refused(ckpt, rf"{Q} is \[32, 64\], config.json implies \[64, 64\]")
    _rewrite(ckpt, lambda sd: sd.update({Q: torch.zeros(64, 64), "model.norm.weight": torch.ones(64, dtype=torch.int32)}))
    refused(ckpt, r"not floating point.*model.norm.weight \(I32\)")

    def swap(sd):
        sd["model.norm.weight"] = torch.ones(64)
        del sd["model.layers.1.mlp.up_proj.weight"]
        sd["model.layers.1.mlp.extra.weight"] = torch.ones(3)
    _rewrite(ckpt, swap)
    refused(ckpt, "missing 1: model.layers.1.mlp.up_proj.weight; unexpected 1: model.layers.1.mlp.extra.weight")


def test_nan_weights_are_refused_by_tensor(ckpt):
    def poison(sd):
        sd[Q][3, 5] = float("nan")
    _rewrite(ckpt, poison)
    refused(ckpt, f"tensor '{Q}' holds NaN or infinite values")


def _header(path) -> tuple[dict, bytes]:
    raw = (path / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write(path, header: dict, data: bytes, length=None):
    h = json.dumps(header).encode()
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(h) if length is None else length) + h + data)


def test_broken_safetensors_files_are_named(ckpt):
    header, data = _header(ckpt)
    _write(ckpt, header, data[: len(data) // 2])
    refused(ckpt, "fall outside the file's .* data bytes")
    _write(ckpt, header, data, length=10 ** 12)
    refused(ckpt, "header length 1,000,000,000,000 is larger than the file")
    (ckpt / "model.safetensors").write_bytes(struct.pack("<Q", 5) + b"{nope")
    refused(ckpt, "the safetensors header: invalid JSON")
    (ckpt / "model.safetensors").write_bytes(b"abc")
    refused(ckpt, "3 bytes: truncated")
    forged = json.loads(json.dumps(header))
    forged[Q]["data_offsets"] = [0, 10 ** 9]
    _write(ckpt, forged, data)
    refused(ckpt, f"tensor '{Q}': data offsets .* fall outside")
    forged = json.loads(json.dumps(header))
    forged[Q]["shape"] = [64, "x"]
    _write(ckpt, forged, data)
    refused(ckpt, f"tensor '{Q}': malformed shape")
    _write(ckpt, [1, 2], data)
    refused(ckpt, "header is not a JSON object")


def test_a_broken_or_escaping_index_is_refused(ckpt, tmp_path):
    (ckpt / "model.safetensors").rename(ckpt / "part-1.safetensors")
    index = ckpt / "model.safetensors.index.json"
    names = list(load_file(str(ckpt / "part-1.safetensors")))
    shutil.copy(ckpt / "part-1.safetensors", tmp_path / "outside.safetensors")
    for target in ("../outside.safetensors", str(tmp_path / "outside.safetensors"), ".."):
        index.write_text(json.dumps({"weight_map": {n: target for n in names}}))
        refused(ckpt, "points outside the checkpoint directory")
    index.write_text("{not json")
    refused(ckpt, "model.safetensors.index.json: invalid JSON")
    index.write_text(json.dumps({"weight_map": ["part-1.safetensors"]}))
    refused(ckpt, "weight_map must map tensor names to file names")
    index.write_text(json.dumps({"weight_map": {**{n: "part-1.safetensors" for n in names}, "extra.w": "part-1.safetensors"}}))
    refused(ckpt, "tensor 'extra.w' is listed in part-1.safetensors but that file does not hold it")
    index.write_text(json.dumps({"weight_map": {n: "part-1.safetensors" for n in names}}))
    assert load_model(ckpt).config.num_hidden_layers == 2  # the same files with a sound index load


@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
def test_a_fifo_or_a_directory_is_never_opened_as_a_file(ckpt, name):
    (ckpt / name).unlink()
    os.mkfifo(ckpt / name)  # opening it for reading would block forever
    t0 = time.perf_counter()
    refused(ckpt, f"{name}: is a FIFO .*not a regular file")
    assert time.perf_counter() - t0 < 5
    (ckpt / name).unlink()
    (ckpt / name).mkdir()
    refused(ckpt, f"{name}: is a directory")


BAD_CONFIGS = [
    (dict(num_attention_heads=0), r"num_attention_heads: must be an integer >= 1, got 0"),
    (dict(hidden_size="abc"), r"hidden_size: must be an integer >= 1, got 'abc'"),
    (dict(intermediate_size=-5), r"intermediate_size: must be an integer >= 1, got -5"),
    (dict(num_hidden_layers=2.5), r"num_hidden_layers: must be an integer"),
    (dict(num_key_value_heads=3), r"num_key_value_heads: 3 does not divide num_attention_heads \(4\)"),
    (dict(head_dim=7), r"head_dim: 7 must be even"),
    (dict(rope_theta=-1, rope_parameters=None), r"rope_theta: must be a positive finite number, got -1"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 0}), r"rope_scaling.factor: must be a positive finite"),
    (dict(rope_scaling="linear"), r"rope_scaling: must be a mapping"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), r"rope_scaling.low_freq_factor: missing"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0}),
     r"rope_scaling.high_freq_factor: must be above low_freq_factor"),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), r"rope_scaling.rope_type: 'dynamic'"),
    (dict(rope_scaling={"rope_type": "longrope", "factor": 2.0}), r"'longrope' is not modelled"),
    (dict(partial_rotary_factor=0.5), r"partial_rotary_factor: 0.5: partial rotary embeddings are not modelled"),
    (dict(rms_norm_eps=float("nan")), r"rms_norm_eps: must be a non-negative finite number"),
    (dict(hidden_act="relu"), r"hidden_act: 'relu' is not modelled"),
    (dict(attention_dropout=0.1), r"attention_dropout: 0.1: attention dropout is not modelled"),
    (dict(quantization_config={"quant_method": "gptq"}), r"quantization_config: quantized checkpoints"),
    (dict(tie_word_embeddings="yes"), r"tie_word_embeddings: must be true or false"),
    (dict(eos_token_id="</s>"), r"eos_token_id: must be a token id"),
    (dict(vocab_size=None), r"vocab_size: missing \(required\)"),
    (dict(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=0),
     r"sliding_window: must be an integer >= 1, got 0"),
    (dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], use_sliding_window=True, sliding_window=4,
          layer_types=["full_attention"]), r"layer_types: must list .* for each of the 2 layers"),
    (dict(model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts=2, num_experts_per_tok=3),
     r"num_experts_per_tok: 3 is more than the 2 experts"),
    (dict(model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts=2, router_jitter_noise=0.1),
     r"router_jitter_noise: 0.1: router noise"),
    (dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], attn_logit_softcapping=50.0),
     r"attn_logit_softcapping: 50.0: attention score soft-capping is not modelled"),
    (dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], use_bidirectional_attention=True),
     r"use_bidirectional_attention: bidirectional attention"),
    (dict(model_type="qwen2", architectures=["LlamaForCausalLM"]), r"architectures 'LlamaForCausalLM' and model_type"),
]


@pytest.mark.parametrize("changes,match", BAD_CONFIGS, ids=[m[:40] for _, m in BAD_CONFIGS])
def test_absurd_config_values_are_refused_by_key(ckpt, changes, match):
    set_config(ckpt, **changes)
    with pytest.raises(ModelFileError, match=match) as e:
        read_config(ckpt)
    assert str(e.value).startswith(str(ckpt / "config.json"))


def test_config_json_that_is_not_an_object(ckpt):
    (ckpt / "config.json").write_text("[1, 2]")
    refused(ckpt, "config.json: expected a JSON object, got list")
    (ckpt / "config.json").write_text("{")
    refused(ckpt, "config.json: invalid JSON")


@pytest.mark.parametrize("changes,match", [
    (dict(num_hidden_layers=3000), "num_hidden_layers 3000 but the weights hold 2 layers"),
    (dict(num_hidden_layers=1e9), "config.json: num_hidden_layers: 1,000,000,000 is more than 4,096"),
    (dict(model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts=10 ** 9),
     "config.json: num_local_experts: 1,000,000,000 is more than 4,096"),
    (dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_experts=4096, num_hidden_layers=4096),
     r"config.json: num_hidden_layers 4096 with num_local_experts 4096 is some [\d,]+ weight tensors"),
    (dict(vocab_size=10 ** 12), "config.json: vocab_size: 1,000,000,000,000 is more than"),
    (dict(num_attention_heads=2 ** 40, num_key_value_heads=1), "config.json: num_attention_heads: .* is more than"),
    (dict(hidden_size=10 ** 5), r"model.embed_tokens.weight is \[64, 64\], config.json implies \[64, 100000\]"),
    (dict(vocab_size=10 ** 6, intermediate_size=10 ** 6), r"config.json implies"),
])
def test_size_bombs_fail_at_once_before_allocating(ckpt, changes, match):
    set_config(ckpt, **changes)
    t0 = time.perf_counter()
    refused(ckpt, match)
    assert time.perf_counter() - t0 < 1.0


def test_a_fresh_model_from_an_oversized_config_is_refused_before_allocating(tmp_path):
    from astrai.model.weights import check_fits_memory, parameter_count

    cfg = ModelConfig.preset("tiny", hidden_size=10 ** 5, num_attention_heads=40, num_key_value_heads=8,
                             num_hidden_layers=1000, vocab_size=10 ** 6)
    assert parameter_count(cfg) > 10 ** 13
    t0 = time.perf_counter()
    with pytest.raises(ModelFileError, match=r"the model's weights need [\d,.]+ GiB in float32 .* but the machine"):
        check_fits_memory(cfg, torch.float32, "config.json")
    assert time.perf_counter() - t0 < 1.0


def test_parameter_count_is_the_module_trees():
    from astrai.model.weights import parameter_count

    for cfg in (ModelConfig.preset("tiny", attention_bias=True, mlp_bias=True, tie_word_embeddings=True),
                ModelConfig.preset("tiny-moe"),
                ModelConfig.preset("tiny", family="qwen3_moe", num_local_experts=4, moe_intermediate_size=16,
                                   mlp_only_layers=(1,)),
                ModelConfig.preset("tiny", family="gemma3_text", hidden_act="gelu_pytorch_tanh"),
                ModelConfig.preset("tiny", family="qwen2")):
        with torch.device("meta"):
            assert parameter_count(cfg) == CausalLM(cfg).num_parameters(), cfg.family
    assert math.isclose(parameter_count(ModelConfig.preset("1b")) / 1e9, 1.236, rel_tol=1e-3)


def test_tensors_are_read_at_the_headers_offsets_and_a_file_cut_after_its_check_is_named(tmp_path):
    from astrai.model.checkpoint_files import read_headers
    from astrai.model.hf_checkpoint import _read

    torch.manual_seed(0)
    save_model(CausalLM(ModelConfig.preset("tiny", vocab_size=64)), tmp_path / "m")
    want = load_file(str(tmp_path / "m" / "model.safetensors"))  # the safetensors library's own reading
    headers = read_headers(tmp_path / "m")
    got = _read(headers)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    weights = tmp_path / "m" / "model.safetensors"
    last = max(headers.values(), key=lambda i: i.offset)
    os.truncate(weights, weights.stat().st_size - 4)  # shortened between the header check and the read
    with pytest.raises(ModelFileError, match=rf"^{weights}: tensor '{last.name}': the file ends before its bytes"):
        _read(headers)
