"""Shards edited after preprocessing are refused, never read: cut short, rewritten with the same size
(even with their mtime put back), their Arrow cache left stale or edited, a manifest pointing outside
the dataset or lacking its checks. preprocess does not call such an output up to date. And eval
refuses held-out data made with another tokenizer than the checkpoint's."""

import json
import os
import shutil

import pyarrow.ipc as ipc
import pytest

from astrai.config import Pipeline
from astrai.data.load import ShardDataset
from astrai.data.preprocess import run_preprocess
from astrai.data.shard_check import file_sha256
from astrai.errors import InputError

PIPE = Pipeline.model_validate({
    "version": 1, "chat_template": "chatml",
    "input": {"sections": [{"field": "messages", "action": "$role", "template": True}]},
    "preprocessing": {"packing_strategy": "bfd", "max_packed_len": 160}})


def _chats(n=30):
    words = "hello world how are you the quick brown fox".split()
    return [{"messages": [{"role": "user", "content": " ".join(words[(i + j) % 9] for j in range(1 + i % 5))},
                          {"role": "assistant", "content": " ".join(words[(i * 3 + j) % 9] for j in range(2 + i % 7))}]}
            for i in range(n)]


def _preprocess(tmp_path, tokenizer, name="data"):
    src = tmp_path / "d.jsonl"
    if not src.exists():
        src.write_text("".join(json.dumps(r) + "\n" for r in _chats()))
    run_preprocess(PIPE, [str(src)], str(tmp_path / name), tokenizer=str(tokenizer), workers=1, log=lambda s: None)
    return tmp_path / name


@pytest.fixture
def data(tmp_path, tiny_tokenizer):
    return _preprocess(tmp_path, tiny_tokenizer)


def _rows(ds):
    return [ds[i]["input_ids"].tolist() for i in range(len(ds))]


def _shard(data):
    return data / json.loads((data / "manifest.json").read_text())["shards"][0]


def _flip_byte_keep_times(path, at=None):
    """Change one byte in the middle (same size, same footer: the same row count), then set the mtime
    back as someone covering their tracks would."""
    st = os.stat(path)
    raw = bytearray(path.read_bytes())
    i = at if at is not None else len(raw) // 3
    raw[i] ^= 0xFF
    with open(path, "r+b") as fh:
        fh.write(raw)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_size == st.st_size and os.stat(path).st_mtime_ns == st.st_mtime_ns


def test_the_manifest_records_every_shard(data):
    man = json.loads((data / "manifest.json").read_text())
    assert set(man["shard_checks"]) == set(man["shards"]) and man["shards"]
    for shard, rec in man["shard_checks"].items():
        assert rec["bytes"] == os.path.getsize(data / shard) and rec["sha256"] == file_sha256(data / shard)
        assert rec["rows"] > 0
    assert len(man["tokenizer"]["content"]) == 64


def test_a_shard_cut_short_is_refused(data):
    shard = _shard(data)
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(InputError, match=r"bytes, the manifest records .*changed after preprocessing"):
        ShardDataset(data)


@pytest.mark.parametrize("cached_first", [False, True])
def test_a_shard_edited_in_place_with_its_mtime_put_back_is_refused_and_no_stale_cache_is_read(data, cached_first):
    if cached_first:
        ShardDataset(data)  # the Arrow cache exists and is valid for the original shard
    _flip_byte_keep_times(_shard(data))
    with pytest.raises(InputError, match="content differs from the manifest's digest"):
        ShardDataset(data)


def test_an_edited_cache_is_rebuilt_from_the_verified_shard(data):
    good = _rows(ShardDataset(data))
    [cache] = list((data / "cache").glob("*.arrow"))
    table = ipc.open_file(str(cache)).read_all()
    bad = table.slice(0, table.num_rows - 1)  # a valid Arrow file with one row less
    with ipc.new_file(str(cache), bad.schema) as w:
        w.write_table(bad)
    assert _rows(ShardDataset(data)) == good


def test_manifest_shards_outside_the_dataset_or_without_checks_are_refused(data, tmp_path):
    man = json.loads((data / "manifest.json").read_text())
    shutil.copy(_shard(data), tmp_path / "outside.parquet")
    rec = next(iter(man["shard_checks"].values()))
    bad = {**man, "shards": ["../outside.parquet"], "shard_checks": {"../outside.parquet": rec}}
    (data / "manifest.json").write_text(json.dumps(bad))
    with pytest.raises(InputError, match="not a .parquet file in"):
        ShardDataset(data)
    old = {k: v for k, v in man.items() if k != "shard_checks"}  # as an older astrai wrote it
    (data / "manifest.json").write_text(json.dumps(old))
    with pytest.raises(InputError, match="no shard checks .* run astrai preprocess again"):
        ShardDataset(data)


def test_preprocess_does_not_call_edited_shards_up_to_date(data, tiny_tokenizer, tmp_path):
    good = _rows(ShardDataset(data))
    shard = _shard(data)
    shard.write_bytes(shard.read_bytes()[:-10])
    lines = []
    run_preprocess(PIPE, [str(tmp_path / "d.jsonl")], str(data), tokenizer=str(tiny_tokenizer), workers=1,
                   log=lines.append)
    assert not any("up to date" in line for line in lines)
    assert _rows(ShardDataset(data)) == good


def test_eval_refuses_data_made_with_another_tokenizer(tmp_path, tiny_tokenizer, capsys):
    import torch

    from astrai.cli import main
    from astrai.infer.eval import EvalOptions, run_eval
    from astrai.model import CausalLM, ModelConfig, save_model

    other = tmp_path / "other-tok"
    shutil.copytree(tiny_tokenizer, other)
    tj = json.loads((other / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    a, b = sorted(vocab)[20:22]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # the same size and tokens, two ids swapped
    (other / "tokenizer.json").write_text(json.dumps(tj))
    theirs = _preprocess(tmp_path, other, "theirs")
    ours = _preprocess(tmp_path, tiny_tokenizer, "ours")
    torch.manual_seed(0)
    ckpt = tmp_path / "ckpt"
    save_model(CausalLM(ModelConfig.preset("tiny", eos_token_id=None)), ckpt)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_tokenizer / f, ckpt / f)
    opts = dict(checkpoint=str(ckpt), samples=0, output=str(tmp_path / "eval.json"))
    assert run_eval(EvalOptions(data=str(ours), **opts))["perplexity"] > 1  # the same tokenizer: scored
    (tmp_path / "eval.json").unlink()
    with pytest.raises(ValueError, match=r"made with another tokenizer \(digest .*\) than the checkpoint"):
        run_eval(EvalOptions(data=str(theirs), **opts))
    assert not (tmp_path / "eval.json").exists()
    capsys.readouterr()  # the preprocess progress lines
    assert main(["eval", str(ckpt), "--data", str(theirs), "--samples", "0"]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "another tokenizer" in err and "perplexity" not in err
