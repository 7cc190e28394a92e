"""LoRA adapter directories as untrusted input (astrai.model.adapter_files, adapter_config): special and
huge files, malformed configs, hostile target_modules regexes, non-finite weights and scalings. Each is
refused with one line (AdapterError, or ModelFileError for the checkpoint files' checks) naming the file
and the key or tensor, at once, before any tensor is read where the header already tells; nothing hangs
(every test runs under a 60 s alarm)."""

import json
import math
import os
import shutil
import signal
import struct
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from astrai.errors import InputError, ModelFileError
from astrai.model import CausalLM, ModelConfig, save_model
from astrai.model.adapter_files import load_checkpoint, read_adapter, save_adapter
from astrai.model.lora import LoraSpec, apply_lora, lora_layers

CFG = ModelConfig.preset("tiny", vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2)
Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


@pytest.fixture(autouse=True)
def no_hang():
    signal.signal(signal.SIGALRM, lambda *a: (_ for _ in ()).throw(TimeoutError("took over 60 s")))
    signal.alarm(60)
    yield
    signal.alarm(0)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(base dir, adapter dir) of a tiny base and an adapter with non-zero A and B on it."""
    root = tmp_path_factory.mktemp("made")
    torch.manual_seed(0)
    model = CausalLM(CFG)
    save_model(model, root / "base")
    torch.manual_seed(1)
    apply_lora(model, LoraSpec(4, 8.0, targets=("q_proj", "v_proj")), base=str(root / "base"))
    with torch.no_grad():
        for layer in lora_layers(model).values():
            layer.lora_B.weight.normal_(0, 0.05)
    save_adapter(model, root / "adapter")
    return root / "base", root / "adapter"


@pytest.fixture
def adapter(made, tmp_path):
    """A fresh copy of the adapter (its base stays where it names it), to break."""
    return shutil.copytree(made[1], tmp_path / "adapter")


def refused(adapter, match: str) -> str:
    t0 = time.perf_counter()
    with pytest.raises(ModelFileError, match=match) as e:  # AdapterError, or the checkpoint files' own
        load_checkpoint(adapter)
    assert time.perf_counter() - t0 < 10
    assert isinstance(e.value, InputError)  # the kind the CLI prints as one line
    assert "\n" not in str(e.value)
    return str(e.value)


def set_config(adapter, **changes):
    path = adapter / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def rewrite(adapter, change):
    path = adapter / "adapter_model.safetensors"
    sd = load_file(path)
    change(sd)
    save_file(sd, path, metadata={"format": "pt"})


# ---- files that are not what they say --------------------------------------------------------

@pytest.mark.parametrize("name", ["adapter_config.json", "adapter_model.safetensors"])
def test_a_fifo_a_device_or_a_directory_is_refused_at_once(adapter, name):
    path = adapter / name
    path.unlink()
    os.mkfifo(path)  # opening it would block until a writer comes
    refused(adapter, f"{name}: is a FIFO .*not a regular file")
    path.unlink()
    path.symlink_to("/dev/zero")  # reading it would never end
    refused(adapter, f"{name}: is a character device")
    path.unlink()
    path.mkdir()
    refused(adapter, f"{name}: is a directory")


def test_a_huge_config_is_refused_by_its_size_unread(adapter):
    with open(adapter / "adapter_config.json", "r+b") as f:
        f.truncate(5 << 30)  # sparse: 5 GiB that cost nothing on disk, and 5 GiB of memory if read
    refused(adapter, r"adapter_config.json: 5,368,709,120 bytes, more than an adapter config can reasonably hold")


def test_a_huge_tensor_is_refused_from_its_header_unread(adapter):
    # a well-formed file whose one tensor claims 3 GiB (sparse): the shape is wrong for the base, which
    # the header says before a byte of the tensor is read
    path = adapter / "adapter_model.safetensors"
    rows = 3 * 2 ** 30 // (4 * 32)
    header = json.dumps({Q_A: {"dtype": "F32", "shape": [rows, 32], "data_offsets": [0, rows * 32 * 4]}}).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + rows * 32 * 4)
    refused(adapter, rf"tensor {Q_A} is \[{rows}, 32\], but base .* needs \[4, 32\]")


def test_a_header_longer_than_the_file_is_refused(adapter):
    (adapter / "adapter_model.safetensors").write_bytes(struct.pack("<Q", 2 ** 40) + b"{}")
    refused(adapter, "adapter_model.safetensors: header length 1,099,511,627,776 is larger than the file")


# ---- adapter_config.json values ---------------------------------------------------------------

BAD_CONFIGS = [
    (dict(r=0), r"r: must be an integer in 1\.\.65536, got 0"),
    (dict(r=-4), r"r: must be an integer in 1\.\.65536, got -4"),
    (dict(r=4.0), r"r: must be an integer .*, got 4\.0"),
    (dict(r=True), r"r: must be an integer .*, got True"),
    (dict(r="4"), r"r: must be an integer .*, got '4'"),
    (dict(r=0, use_rslora=True), r"r: must be an integer .*, got 0"),
    (dict(lora_alpha="8"), r"lora_alpha: must be a finite number, got '8'"),
    (dict(lora_alpha=float("nan")), r"lora_alpha: must be a finite number, got nan"),
    (dict(lora_alpha=float("inf")), r"lora_alpha: must be a finite number, got inf"),
    (dict(lora_alpha=1e308), r"lora_alpha: 1e\+308 with r 4: the scaling lora_alpha / r = 2\.5e\+307 is beyond 10000"),
    (dict(lora_alpha=1e6, use_rslora=True), r"lora_alpha: 1000000\.0 with r 4: the scaling lora_alpha / sqrt\(r\)"),
    (dict(use_rslora="yes"), r"use_rslora: must be true or false, got 'yes'"),
    (dict(target_modules="("), r"target_modules: '\(' is not a valid regular expression: missing \), unterminated"),
    (dict(target_modules=5), r"target_modules: must be a list of module names or one regular expression, got 5"),
    (dict(target_modules=[]), r"target_modules: must be a list of module names"),
    (dict(target_modules=None), r"target_modules: missing"),
    (dict(target_modules=["q_proj", 3]), r"target_modules: must be a list of module names"),
    (dict(exclude_modules="[a-"), r"exclude_modules: '\[a-' is not a valid regular expression"),
    (dict(target_modules=r"(q)_\1"), r"target_modules: back-references are not supported"),
    (dict(target_modules="(?i)Q_PROJ"), r"target_modules: case-insensitive matching"),
    (dict(target_modules=r"\bq_proj"), r"target_modules: word boundaries"),
    (dict(target_modules="(?=q).*"), r"target_modules: look-ahead"),
    (dict(target_modules="(a{100}){100}"), r"target_modules: it expands to more than 5000 automaton states"),
    (dict(target_modules="q" * 1001), r"target_modules: a pattern of 1,001 characters"),
    (dict(target_modules="embed_tokens"), r"target_modules: 'embed_tokens' selects no linear layer of base"),
    (dict(use_dora=True), r"use_dora: True: DoRA changes what the adapter computes"),
    (dict(lora_bias=True), r"lora_bias: True: a bias on lora_B"),
    (dict(layer_replication=[[0, 1]]), r"layer_replication: \[\[0, 1\]\]: layer replication"),
    (dict(alora_invocation_tokens=[5, 6]), r"alora_invocation_tokens: \[5, 6\]: activated LoRA"),
    (dict(rank_pattern={"q_proj": 2}), r"rank_pattern: .*per-module ranks"),
    (dict(modules_to_save=["lm_head"]), r"modules_to_save: \['lm_head'\]"),
    (dict(some_future_option={"scale": 2}), r"some_future_option: \{'scale': 2\}: an option astrai does not know"),
    (dict(peft_type="PREFIX_TUNING"), r"peft_type: 'PREFIX_TUNING'; only LORA"),
    (dict(task_type="SEQ_CLS"), r"task_type: 'SEQ_CLS'"),
    (dict(bias="all"), r"bias: 'all': the adapter trains biases"),
    (dict(base_model_name_or_path=5), r"base_model_name_or_path: must be a path, got 5"),
]


@pytest.mark.parametrize("changes,match", BAD_CONFIGS, ids=[m[:40] for _, m in BAD_CONFIGS])
def test_malformed_adapter_configs_are_one_line_naming_the_file_and_key(adapter, changes, match):
    set_config(adapter, **changes)
    msg = refused(adapter, match)
    assert msg.startswith(f"{adapter / 'adapter_config.json'}: "), msg


def test_an_unknown_key_left_empty_and_inert_peft_keys_are_accepted(adapter, made):
    set_config(adapter, some_future_option=None, lora_ga_config=None, megatron_core="megatron.core",
               qalora_group_size=16, peft_version="0.99.0", loftq_config={}, lora_dropout=0.3)
    load_checkpoint(adapter)


def test_the_cli_prints_one_error_line(adapter, capsys):
    from astrai.cli import main

    set_config(adapter, r=0)
    assert main(["generate", str(adapter), "--prompt", "hi", "--device", "cpu"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {adapter / 'adapter_config.json'}: r: must be an integer in 1..65536, got 0"]


# ---- tensors -----------------------------------------------------------------------------------

def test_an_a_without_its_b_is_refused_by_name(adapter):
    rewrite(adapter, lambda sd: [sd.pop(k) for k in [k for k in sd if "lora_B" in k]])
    refused(adapter, r"adapter_model.safetensors: 4 tensor\(s\) of the modules target_modules selects are missing: "
                     r"base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight")


def test_a_tensor_for_a_module_not_selected_is_refused(adapter):
    set_config(adapter, target_modules=["v_proj"])
    refused(adapter, rf"tensor {Q_A} is for model.layers.0.self_attn.q_proj, which target_modules does not select")


def test_a_rank_that_disagrees_with_the_tensors_is_refused(adapter):
    set_config(adapter, r=8)
    refused(adapter, rf"tensor {Q_A} is \[4, 32\], but base .* needs \[8, 32\] \(r=8, 32 -> 32\)")


def test_integer_tensors_are_refused(adapter):
    rewrite(adapter, lambda sd: sd.update({Q_A[len("base_model.model."):]: sd.pop(Q_A).to(torch.int32)}))
    refused(adapter, r"q_proj.lora_A.weight is I32, not floating point")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("which", ["lora_A", "lora_B"])
def test_non_finite_adapter_weights_are_refused_by_tensor(adapter, which, value):
    def poison(sd):
        key = Q_A.replace("lora_A", which)
        sd[key][0, 0] = value

    rewrite(adapter, poison)
    refused(adapter, rf"adapter_model.safetensors: tensor {Q_A.replace('lora_A', which)} holds NaN or infinite")


def test_a_merge_that_overflows_is_refused(adapter):
    def huge(sd):
        for k in sd:
            sd[k].fill_(1e30)  # finite in float32, B @ A is not

    rewrite(adapter, huge)
    refused(adapter, r"adapter_config.json: merging the adapter of model.layers.0.self_attn.q_proj \(scaling 2\) "
                     r"gives non-finite weights in float32")


def test_a_base_claiming_a_billion_experts_is_refused_at_once(adapter, made, tmp_path):
    base = shutil.copytree(made[0], tmp_path / "base")
    cfg = json.loads((base / "config.json").read_text())
    cfg.update(model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts=10 ** 9)
    (base / "config.json").write_text(json.dumps(cfg))
    t0 = time.perf_counter()
    with pytest.raises(ModelFileError, match=r"config.json: num_local_experts: 1,000,000,000 is more than 4,096"):
        load_checkpoint(adapter, base=base)
    assert time.perf_counter() - t0 < 2


def test_a_sound_adapter_still_merges_exactly(made):
    """The checks refuse nothing sound: the merged weight is W + alpha/r * B @ A, by hand."""
    base, adapter = made
    tensors, _ = read_adapter(adapter)
    model = load_checkpoint(adapter)
    plain = load_file(base / "model.safetensors")
    name = "model.layers.1.self_attn.v_proj"
    want = plain[f"{name}.weight"] + 8.0 / 4 * tensors[f"{name}.lora_B.weight"] @ tensors[f"{name}.lora_A.weight"]
    torch.testing.assert_close(dict(model.named_parameters())[f"{name}.weight"].detach(), want, atol=1e-6, rtol=0)
    assert math.isfinite(float(model.model.layers[0].self_attn.q_proj.weight.sum()))


def test_an_adapter_on_a_tied_lm_head_is_refused(adapter, made, tmp_path):
    # merging into lm_head would change the input embeddings it shares its weight with (PEFT's unmerged
    # forward changes only the output): the merged model would not be the adapter's
    base = shutil.copytree(made[0], tmp_path / "base")
    cfg = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    set_config(adapter, target_modules=["q_proj", "v_proj", "lm_head"])
    with pytest.raises(ModelFileError, match=r"adapter_config.json: target_modules selects lm_head, whose weight base "
                                             r".* ties to its input embeddings"):
        load_checkpoint(adapter, base=base)
