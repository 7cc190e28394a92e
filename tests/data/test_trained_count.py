"""stats.json's trained_tokens is exact: the number of labels != -100 in the written shards (every
token when no labels column is written), for every packing strategy, text and chat, after a resume,
and for DPO/GRPO rows."""

import json
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from astrai.config import Pipeline, load_pipeline
from astrai.data.preprocess import run_preprocess

sys.path.insert(0, str(Path(__file__).parent))
from test_preprocess import chat_records, pipeline  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def counted(out) -> int:
    """The reference: read every shard back and count, column by column, as a trainer would."""
    n = 0
    for f in sorted(Path(out, "data").glob("*.parquet")):
        t = pq.read_table(f)
        label_cols = [c for c in t.column_names if c == "labels" or c.endswith("_labels")]
        if not label_cols:  # no labels column: every token is trained
            n += sum(len(ids) for ids in t.column("input_ids").to_pylist())
        for c in label_cols:
            for row in t.column(c).to_pylist():
                flat = [x for piece in row for x in piece] if row and isinstance(row[0], list) else row
                n += sum(1 for x in flat if x != -100)
    return n


def text_pipeline(strategy, max_len):
    pp = {"packing_strategy": strategy, "partition_bytes": 4000}
    if strategy != "none":
        pp["max_packed_len"] = max_len
    if strategy == "bfd_split":
        pp["max_seq_len"] = 4 * max_len  # documents longer than a row, split across rows
    return Pipeline.model_validate({"version": 1, "input": {"sections": [{"field": "text", "action": "train"}]},
                                    "preprocessing": pp})


@pytest.mark.parametrize("kind", ["chat", "text"])
@pytest.mark.parametrize("strategy", ["none", "simple", "bfd", "bfd_split"])
def test_trained_tokens_equal_the_labels_written(tmp_path, tiny_tokenizer, strategy, kind):
    data = tmp_path / "d.jsonl"
    text = chat_records(150, seed=3)
    if kind == "text":
        data.write_text("".join(json.dumps({"text": " ".join(m["content"] for m in json.loads(l)["messages"])}) + "\n"
                                for l in text.splitlines()))
        pipe = text_pipeline(strategy, 160)
    else:
        data.write_text(text)
        pipe = pipeline(packing_strategy=strategy, max_packed_len=None if strategy == "none" else 160,
                        partition_bytes=4000)
    stats = run_preprocess(pipe, [str(data)], str(tmp_path / "o"), tokenizer=str(tiny_tokenizer), workers=1,
                           log=lambda s: None)
    n = counted(tmp_path / "o")
    assert stats["trained_tokens"] == n
    assert stats["supervised_share"] == pytest.approx(n / stats["tokens_written"])
    if strategy != "none":  # the shards mask each piece's first position: the records' own count is larger
        assert sum(stats["trained_tokens_per_role"].values()) > n
    again = json.loads((tmp_path / "o" / "stats.json").read_text())
    assert again["trained_tokens"] == n


class Killed(Exception):
    pass


@pytest.mark.parametrize("strategy", ["simple", "bfd_split"])
def test_trained_tokens_exact_after_a_resume(tmp_path, tiny_tokenizer, monkeypatch, strategy):
    # the run dies after some partitions (simple) or shards (bfd_split) are done; the rerun skips
    # those, and still counts what they wrote
    import astrai.data.preprocess.pack as pack
    import astrai.data.preprocess.run as run_mod

    data = tmp_path / "d.jsonl"
    data.write_text(chat_records(300, seed=5))
    pipe = pipeline(packing_strategy=strategy, max_packed_len=128, partition_bytes=4000,
                    output={"max_tokens_per_shard": 2000, "domain_key": "domain"})
    clean = run_preprocess(pipe, [str(data)], str(tmp_path / "clean"), tokenizer=str(tiny_tokenizer), workers=1,
                           log=lambda s: None)
    calls, armed = [], [True]
    if strategy == "simple":
        real = run_mod.tokenize_partitions  # one worker: the partitions run in this process, as one stream

        def dies(worker, tasks, on_done):
            def done(task):  # killed once two partitions are done, the third already read and encoded
                on_done(task)
                calls.append(task.name)
                if len(calls) == 2 and armed[0]:
                    raise Killed
            return real(worker, tasks, on_done=done)
        monkeypatch.setattr(run_mod, "tokenize_partitions", dies)
    else:
        real = pack.write_packed_shard

        def dies(worker, task):
            calls.append(task.name)
            if len(calls) == 3 and armed[0]:
                raise Killed
            return real(worker, task)
        monkeypatch.setattr(pack, "write_packed_shard", dies)
    out = tmp_path / "o"
    with pytest.raises(Killed):
        run_preprocess(pipe, [str(data)], str(out), tokenizer=str(tiny_tokenizer), workers=1, log=lambda s: None)
    if strategy == "bfd_split":  # a shard's count is a cache (not fsynced): lost, it is counted from the shard
        (out / ".work" / "packed-00000.json").unlink()
    calls.clear()
    armed[0] = False
    logged = []
    stats = run_preprocess(pipe, [str(data)], str(out), tokenizer=str(tiny_tokenizer), workers=1, log=logged.append)
    if strategy == "simple":  # two partitions were done before the kill: skipped now
        assert any(line.startswith("resuming: 2 of ") for line in logged)
    else:  # two shards were done before the kill: written once
        assert len(calls) == len(list((out / "data").glob("*.parquet"))) - 2
    assert stats["trained_tokens"] == counted(out) == clean["trained_tokens"]


def test_dpo_and_grpo_trained_tokens(tmp_path, tiny_tokenizer):
    dpo = tmp_path / "dpo.jsonl"
    dpo.write_text("".join(json.dumps({
        "prompt": [{"role": "user", "content": f"question {i} how are you"}],
        "chosen": [{"role": "assistant", "content": "fine thanks"}],
        "rejected": [{"role": "assistant", "content": "no"}]}) + "\n" for i in range(5)))
    grpo = tmp_path / "grpo.jsonl"
    grpo.write_text("".join(json.dumps({
        "prompt": [{"role": "user", "content": "say yes"}],
        "completions": [{"text": "yes<|im_end|>", "reward": 0.8}, {"text": "no<|im_end|>", "reward": 1}]}) + "\n"
        for _ in range(3)))
    for name, data in (("dpo_chatml.yaml", dpo), ("grpo_chatml.yaml", grpo)):
        out = tmp_path / name
        stats = run_preprocess(load_pipeline(ROOT / "pipelines" / name), [str(data)], str(out),
                               tokenizer=str(tiny_tokenizer), workers=1, log=lambda s: None)
        assert stats["trained_tokens"] == counted(out) > 0
