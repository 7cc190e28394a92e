"""Load-back: our shards read by Hugging Face datasets, the torch Dataset, collates, export."""

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from astrai.config import Pipeline
from astrai.data.export import export
from astrai.data.preprocess import run_preprocess

torch = pytest.importorskip("torch")


def make(tmp_path, tok, strategy="bfd", n=60):
    import random

    rng = random.Random(0)
    words = "hello world how are you the quick brown fox".split()
    lines = []
    for i in range(n):
        msgs = [{"role": "user", "content": " ".join(rng.choices(words, k=rng.randint(1, 20)))},
                {"role": "assistant", "content": " ".join(rng.choices(words, k=rng.randint(1, 40)))}]
        lines.append(json.dumps({"messages": msgs}))
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(lines) + "\n")
    pipe = Pipeline.model_validate({
        "version": 1, "chat_template": "chatml",
        "input": {"sections": [{"field": "messages", "action": "$role", "template": True}]},
        "preprocessing": {"packing_strategy": strategy, "max_packed_len": 200}})
    out = tmp_path / "o"
    run_preprocess(pipe, [str(data)], str(out), tokenizer=str(tok), workers=1, log=lambda s: None)
    return out


def test_hf_datasets_reads_shards_directly(tmp_path, tiny_tokenizer, read_rows):
    datasets = pytest.importorskip("datasets")
    out = make(tmp_path, tiny_tokenizer)
    files = sorted(str(f) for f in Path(out, "data").glob("*.parquet"))
    ds = datasets.load_dataset("parquet", data_files=files, split="train", cache_dir=str(tmp_path / "hf"))
    rows = read_rows(out)
    assert len(ds) == len(rows)
    assert ds[0]["input_ids"] == rows[0]["input_ids"] and ds[0]["labels"] == rows[0]["labels"]
    assert set(ds.column_names) == {"input_ids", "labels", "position_ids", "seq_lens"}


def test_shard_dataset_and_collates(tmp_path, tiny_tokenizer, read_rows):
    from astrai.data.load import ShardDataset, collate_packed, collate_padded

    out = make(tmp_path, tiny_tokenizer)
    rows = read_rows(out)
    ds = ShardDataset(out)
    assert len(ds) == len(rows)
    for i in (0, len(ds) - 1):
        item = ds[i]
        assert item["input_ids"].tolist() == rows[i]["input_ids"]
        assert item["labels"].tolist() == rows[i]["labels"]
        assert item["seq_lens"].tolist() == rows[i]["seq_lens"]
    batch = [ds[0], ds[1]]
    packed = collate_packed(batch)
    lens = rows[0]["seq_lens"] + rows[1]["seq_lens"]
    assert packed["cu_seqlens"].tolist() == np.concatenate([[0], np.cumsum(lens)]).tolist()
    assert packed["input_ids"].shape == (1, sum(lens))
    # first token of every document is never a target (no cross-document prediction)
    starts = packed["cu_seqlens"][:-1].tolist()
    assert all(packed["labels"][0, s].item() == -100 for s in starts)
    # chat documents open with a masked header: with every token trained, exactly the first ones are masked
    trained = [{**r, "labels": r["input_ids"].clone()} for r in batch]
    want = [i for r in batch for i in r["input_ids"].tolist()]
    for s in starts:
        want[s] = -100
    assert collate_packed(trained)["labels"][0].tolist() == want
    pos = packed["position_ids"][0].tolist()
    assert all(pos[s] == 0 for s in packed["cu_seqlens"][:-1].tolist())
    padded = collate_padded(batch, pad_id=0)
    assert padded["input_ids"].shape[0] == len(lens)  # one document per padded row
    assert padded["attention_mask"].sum().item() == sum(lens)
    flat = rows[0]["input_ids"][: rows[0]["seq_lens"][0]]
    assert padded["input_ids"][0, : len(flat)].tolist() == flat


def test_export_formats(tmp_path, tiny_tokenizer, read_rows):
    out = make(tmp_path, tiny_tokenizer, strategy="none")
    rows = read_rows(out)
    assert export(str(out), "parquet", str(tmp_path / "pq"), rows_per_shard=7) == len(rows)
    re_rows = [r for f in sorted((tmp_path / "pq").glob("*.parquet")) for r in pq.read_table(f).to_pylist()]
    assert re_rows == rows and len(list((tmp_path / "pq").glob("*.parquet"))) == -(-len(rows) // 7)
    assert export(str(out), "jsonl", str(tmp_path / "x.jsonl")) == len(rows)
    first = json.loads((tmp_path / "x.jsonl").read_text().splitlines()[0])
    assert first["input_ids"] == rows[0]["input_ids"]
    assert "<|im_start|>assistant" in first["docs"][0]["text"]
    assert "<|im_start|>" not in first["docs"][0]["trained_text"]
    datasets = pytest.importorskip("datasets")
    export(str(out), "hf", str(tmp_path / "hf"))
    ds = datasets.load_from_disk(str(tmp_path / "hf"))
    assert ds[3]["labels"] == rows[3]["labels"]
    with pytest.raises(Exception, match="exists"):
        export(str(out), "hf", str(tmp_path / "hf"))
