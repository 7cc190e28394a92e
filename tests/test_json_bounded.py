"""Bounded JSON (astrai.json_bounded) and every JSON file astrai reads from a model, adapter or training
checkpoint: too deep, too large or not a regular file is one error naming the file, never a
RecursionError, a hang or a read of the whole file."""

import json
import os
import struct

import pytest
import torch

from astrai.errors import InputError, ModelFileError
from astrai.json_bounded import MAX_DEPTH, depth, loads, read_json

DEEP = [MAX_DEPTH + 1, 5000, 200_000]  # just over the bound; over the parser's recursion; far over


def nested(levels: int) -> str:
    return '{"a": ' + "[" * (levels - 1) + "1" + "]" * (levels - 1) + "}"


def test_depth_is_counted_by_hand():
    assert depth(1) == 0 and depth([]) == 1 and depth({"a": [1, {"b": []}]}) == 4
    assert depth(json.loads(nested(10))) == 10


@pytest.mark.parametrize("levels", DEEP)
def test_too_deep_is_one_error(levels):
    with pytest.raises(InputError, match=rf"^x.json: JSON nested more than {MAX_DEPTH} levels deep; not a config$"):
        loads(nested(levels), "x.json", "config")
    assert loads(nested(MAX_DEPTH), "x.json")["a"]  # the bound itself is fine


def test_size_and_kind_are_checked_before_reading(tmp_path):
    f = tmp_path / "big.json"
    with open(f, "wb") as fh:
        fh.truncate(1 << 33)  # sparse 8 GiB
    with pytest.raises(InputError, match=r"big.json: 8,589,934,592 bytes, more than a thing can reasonably hold"):
        read_json(f, "thing", 1 << 20)
    os.mkfifo(tmp_path / "fifo.json")
    with pytest.raises(InputError, match="is a FIFO"):
        read_json(tmp_path / "fifo.json", "thing", 1 << 20)
    (tmp_path / "bad.json").write_bytes(b"\xff{}")
    with pytest.raises(InputError, match="bad.json: not UTF-8"):
        read_json(tmp_path / "bad.json", "thing", 1 << 20)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from astrai.model import CausalLM, ModelConfig, save_model

    path = tmp_path_factory.mktemp("ckpt")
    save_model(CausalLM(ModelConfig.preset("tiny", vocab_size=64)), path)
    return path


@pytest.mark.parametrize("levels", DEEP)
def test_a_deep_config_json_is_refused_by_file(checkpoint, tmp_path, levels):
    from astrai.model import read_config

    (tmp_path / "config.json").write_text(json.dumps({**json.loads((checkpoint / "config.json").read_text()),
                                                     "rope_scaling": None})[:-1] + ', "x": ' + nested(levels) + "}")
    with pytest.raises(ModelFileError, match=rf"config.json: JSON nested more than {MAX_DEPTH} levels deep"):
        read_config(tmp_path)


@pytest.mark.parametrize("levels", DEEP)
def test_a_deep_safetensors_header_is_refused_by_file(tmp_path, levels):
    from astrai.model.checkpoint_files import read_header

    header = nested(levels).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(ModelFileError, match=r"model.safetensors: the safetensors header: JSON nested more than"):
        read_header(tmp_path / "model.safetensors")


@pytest.mark.parametrize("levels", DEEP)
def test_a_deep_adapter_config_is_refused_by_file(tmp_path, levels):
    from astrai.model.adapter_files import read_adapter_config

    (tmp_path / "adapter_config.json").write_text(nested(levels))
    with pytest.raises(ModelFileError, match=rf"adapter_config.json: JSON nested more than {MAX_DEPTH}"):
        read_adapter_config(tmp_path)


@pytest.mark.parametrize("levels", DEEP)
def test_deep_training_state_files_are_refused_by_file(tmp_path, levels):
    from astrai.train import resume
    from astrai.train.state_files import CheckpointError, read_scheduler

    (tmp_path / "trainer_state.json").write_text(nested(levels))
    with pytest.raises(CheckpointError, match=rf"trainer_state.json: JSON nested more than {MAX_DEPTH}"):
        resume.read_state(tmp_path)
    (tmp_path / "scheduler.json").write_text(nested(levels))
    with pytest.raises(CheckpointError, match=rf"scheduler.json: JSON nested more than {MAX_DEPTH}"):
        read_scheduler(tmp_path, None)
    assert torch  # the train package imports torch; keep the import visible


@pytest.mark.parametrize("name", ["generation_config.json", "tokenizer_config.json"])
def test_deep_generation_and_tokenizer_configs_are_one_error_line(make_chat_checkpoint, tiny_tokenizer, tmp_path,
                                                                 capsys, name):
    from astrai.cli import main

    ckpt = make_chat_checkpoint(tmp_path / "ckpt", tiny_tokenizer)
    (ckpt / name).write_text(nested(5000))
    assert main(["generate", str(ckpt), "--prompt", "hi", "--max-tokens", "1", "--device", "cpu"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {ckpt / name}: JSON nested more than {MAX_DEPTH} levels deep; not a "
                   f"{'generation_config.json' if name.startswith('gen') else 'tokenizer file'}"], err
