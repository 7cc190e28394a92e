"""Packed shards are safe in any Hugging Face trainer: labels are always written, with
IGNORE_INDEX at each document's first position, so transformers' Trainer on a packed row gives the
token-weighted loss of its documents run alone (nothing learnt across a document boundary)."""

import json
import random
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from astrai.config import Pipeline
from astrai.data.preprocess import run_preprocess
from astrai.schema import IGNORE_INDEX

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

WORDS = "hello world how are you today the quick brown fox jumps over lazy dog yes no maybe".split()


def write_inputs(tmp_path, chat: bool):
    rng = random.Random(4)
    lines = []
    for _ in range(40):
        text = " ".join(rng.choices(WORDS, k=rng.randint(3, 25)))
        if chat:
            lines.append(json.dumps({"messages": [{"role": "user", "content": text},
                                                  {"role": "assistant", "content": text[::-1]}]}))
        else:
            lines.append(json.dumps({"text": text}))
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(lines) + "\n")
    return f


def preprocess(tmp_path, tok, strategy, chat):
    sections = ([{"field": "messages", "action": "$role", "template": True}] if chat
                else [{"field": "text", "action": "train"}])
    pipe = Pipeline.model_validate({
        "version": 1, **({"chat_template": "chatml"} if chat else {}), "input": {"sections": sections},
        "preprocessing": {"packing_strategy": strategy, "max_seq_len": 60, "max_packed_len": 120}})
    out = tmp_path / f"o-{strategy}-{chat}"
    run_preprocess(pipe, [str(write_inputs(tmp_path, chat))], str(out), tokenizer=str(tok), workers=1,
                   log=lambda s: None)
    return out


def causal_lm_collator(rows):
    """What a causal-LM collator does with one row: labels from the data, else the input ids."""
    (r,) = rows
    batch = {"input_ids": torch.tensor([r["input_ids"]]),
             "labels": torch.tensor([r["labels"] if "labels" in r else r["input_ids"]])}
    if "position_ids" in r:
        batch["position_ids"] = torch.tensor([r["position_ids"]])
    return batch


def tiny_llama(vocab):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   use_cache=False)
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("strategy,chat", [("bfd", False), ("simple", False), ("bfd_split", False), ("bfd", True)])
def test_packed_row_loss_through_trainer_equals_documents_alone(tmp_path, tiny_tokenizer, strategy, chat):
    from datasets import Dataset

    out = preprocess(tmp_path, tiny_tokenizer, strategy, chat)
    rows = [r for f in sorted((out / "data").glob("*.parquet")) for r in pq.read_table(f).to_pylist()]
    assert all("labels" in r for r in rows)
    row = max(rows, key=lambda r: len(r["seq_lens"]))
    assert len(row["seq_lens"]) >= 3
    starts = np.cumsum([0] + row["seq_lens"][:-1])
    assert all(row["labels"][s] == IGNORE_INDEX for s in starts)

    model = tiny_llama(512)
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "tr"), per_device_eval_batch_size=1,
                                          report_to=[], use_cpu=True, remove_unused_columns=False)
    trainer = transformers.Trainer(model=model, args=args, data_collator=causal_lm_collator,
                                   eval_dataset=Dataset.from_list([{k: row[k] for k in row if k != "seq_lens"}]))
    packed_loss = trainer.evaluate()["eval_loss"]

    # reference: each document alone, its own labels (position 0 is never a target after the shift)
    total, count = 0.0, 0
    with torch.no_grad():
        for s, n in zip(starts, row["seq_lens"]):
            ids = torch.tensor([row["input_ids"][s:s + n]])
            labels = ids.clone() if not chat else torch.tensor([row["labels"][s:s + n]])
            k = int((labels[0, 1:] != IGNORE_INDEX).sum())
            if k:
                total += model(input_ids=ids, labels=labels).loss.item() * k
                count += k
    assert packed_loss == pytest.approx(total / count, rel=1e-5)


def test_unpacked_pretraining_still_omits_labels(tmp_path, tiny_tokenizer):
    pipe = Pipeline.model_validate({"version": 1, "input": {"sections": [{"field": "text", "action": "train"}]}})
    out = tmp_path / "o"
    run_preprocess(pipe, [str(write_inputs(tmp_path, False))], str(out), tokenizer=str(tiny_tokenizer), workers=1,
                   log=lambda s: None)
    (shard,) = sorted((out / "data").glob("*.parquet"))
    assert "labels" not in pq.read_schema(shard).names
    assert "labels" not in json.loads((out / "manifest.json").read_text())["columns"]
