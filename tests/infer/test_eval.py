"""Eval: perplexity of packed rows equals transformers on each document alone; eval.json; the CLI."""

import io
import json
import math
import random
import shutil

import pytest
import torch

from astrai.cli import main
from astrai.config import Pipeline
from astrai.data.load import ShardDataset
from astrai.data.preprocess import run_preprocess
from astrai.infer.eval import EvalOptions, run_eval, shorten
from astrai.config.infer import EngineOptions
from astrai.model import CausalLM, ModelConfig, save_model
from astrai.schema import IGNORE_INDEX


@pytest.fixture(scope="module")
def data_and_checkpoint(tmp_path_factory, tiny_tokenizer):
    tmp = tmp_path_factory.mktemp("eval")
    rng = random.Random(0)
    words = "hello world how are you the quick brown fox".split()
    lines = []
    for _ in range(30):
        msgs = [{"role": "user", "content": " ".join(rng.choices(words, k=rng.randint(1, 12)))},
                {"role": "assistant", "content": " ".join(rng.choices(words, k=rng.randint(1, 20)))}]
        lines.append(json.dumps({"messages": msgs}))
    (tmp / "d.jsonl").write_text("\n".join(lines) + "\n")
    pipe = Pipeline.model_validate({
        "version": 1, "chat_template": "chatml",
        "input": {"sections": [{"field": "messages", "action": "$role", "template": True}]},
        "preprocessing": {"packing_strategy": "bfd", "max_packed_len": 160}})
    run_preprocess(pipe, [str(tmp / "d.jsonl")], str(tmp / "data"), tokenizer=str(tiny_tokenizer), workers=1,
                   log=lambda s: None)
    torch.manual_seed(0)
    ckpt = tmp / "ckpt"
    save_model(CausalLM(ModelConfig.preset("tiny", eos_token_id=None, initializer_range=0.05)), ckpt)
    shutil.copy(tiny_tokenizer / "tokenizer.json", ckpt / "tokenizer.json")
    shutil.copy(tiny_tokenizer / "tokenizer_config.json", ckpt / "tokenizer_config.json")
    return tmp / "data", ckpt


def hf_reference(ckpt, data):
    """Each document alone through transformers; NLL of its trained labels (shifted by one)."""
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(ckpt).eval()
    ds = ShardDataset(data)
    nll, count, multi = 0.0, 0, 0
    for i in range(len(ds)):
        row, start = ds[i], 0
        multi += len(row["seq_lens"]) > 1
        for n in row["seq_lens"].tolist():
            ids, labels = row["input_ids"][start:start + n], row["labels"][start:start + n]
            start += n
            with torch.no_grad():
                logits = hf(ids[None]).logits[0].double()
            lp = logits[:-1].log_softmax(-1)
            for t in range(1, n):
                if labels[t] != IGNORE_INDEX:
                    nll -= lp[t - 1, labels[t]].item()
                    count += 1
    assert multi > 0, "the fixture should pack several documents per row"
    return nll / count, count


def test_perplexity_matches_documents_alone(data_and_checkpoint, tmp_path):
    data, ckpt = data_and_checkpoint
    ref_loss, ref_count = hf_reference(ckpt, data)
    out = tmp_path / "eval.json"
    printed = io.StringIO()
    res = run_eval(EvalOptions(checkpoint=str(ckpt), data=str(data), output=str(out), samples=3,
                               sample_max_tokens=5, batch_tokens=300, engine=EngineOptions(device="cpu", dtype="float32")),
                   out=printed)
    assert res["trained_tokens"] == ref_count
    assert res["loss"] == pytest.approx(ref_loss, rel=1e-5)
    assert res["perplexity"] == pytest.approx(math.exp(ref_loss), rel=1e-5)
    saved = json.loads(out.read_text())
    assert saved["perplexity"] == res["perplexity"] and len(saved["samples"]) == 3
    s = saved["samples"][0]
    assert s["prompt"].endswith("<|im_start|>assistant\n") and s["reference"].endswith("<|im_end|>")
    assert 1 <= len(s["completion_token_ids"]) <= 5
    for s in saved["samples"]:
        assert f"[eval] prompt: {shorten(s['prompt'], keep='end')!r}\n" in printed.getvalue()


def test_long_sample_texts_are_marked_where_cut():
    assert shorten("abc", 3) == "abc" and shorten("abcd", 3) == "ab…" and shorten("abcd", 3, keep="end") == "…cd"
    system = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n" + "x" * 300
    assert len(shorten(system, keep="end")) == 200 and shorten(system, keep="end").startswith("…x")


def test_eval_cli(data_and_checkpoint, tmp_path, capsys):
    data, ckpt = data_and_checkpoint
    out = tmp_path / "e.json"
    rc = main(["eval", str(ckpt), "--data", str(data), "--output", str(out), "--samples", "1", "--max-rows", "2",
               "--device", "cpu"])
    assert rc == 0 and json.loads(out.read_text())["rows"] == 2
    assert "[eval] perplexity" in capsys.readouterr().out
    assert main(["eval", str(ckpt), "--device", "cpu"]) == 1
    assert "data" in capsys.readouterr().err


def test_eval_stage_in_a_recipe(data_and_checkpoint, tmp_path, tiny_tokenizer, capsys):
    _, ckpt = data_and_checkpoint
    (tmp_path / "d.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hello"},
                                                               {"role": "assistant", "content": "hi there"}]}) + "\n")
    (tmp_path / "pipe.yaml").write_text(
        f"version: 1\ntokenizer: {tiny_tokenizer}\nchat_template: chatml\n"
        "input:\n  sections:\n    - {field: messages, action: $role, template: true}\n")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        "version: 1\nrun_dir: run\nstages:\n  preprocess: {pipeline: pipe.yaml, inputs: [d.jsonl]}\n"
        f"  eval: {{model: {ckpt}, data: preprocess, split: train, samples: 1, sample_max_tokens: 3,\n"
        "         engine: {device: cpu}}\n")
    assert main(["run", str(recipe)]) == 0
    res = json.loads((tmp_path / "run" / "eval" / "output" / "eval.json").read_text())
    assert res["documents"] == 1 and len(res["samples"]) == 1
    bad = tmp_path / "bad.yaml"
    bad.write_text(recipe.read_text().replace("samples: 1", "sample: 1"))
    assert main(["validate", str(bad)]) == 1
    assert "sample" in capsys.readouterr().out


def test_sample_prompts_prefer_whole_documents():
    """Packed rows with bfd_split pieces: samples come from documents that start like the others
    (the template's first token) with a real prompt, not from pieces cut mid-text or a bare header."""
    from astrai.infer.perplexity import held_out_prompts
    from astrai.schema import IGNORE_INDEX

    S, HDR = 1, 2  # <|im_start|>, "assistant" header token

    def doc(prompt, answer):
        ids = prompt + answer
        return ids, [IGNORE_INDEX] * len(prompt) + answer

    piece_mid = doc([50, 51], [52, 53])                 # a piece cut mid-text
    piece_hdr = doc([S, HDR], [60, 61, 62])             # a piece starting at the assistant header
    whole1 = doc([S, 10, 11, 12, 13, 14, 15, S, HDR], [70, 71])
    whole2 = doc([S, 20, 21, 22, 23, 24, 25, S, HDR], [80])
    rows = []
    for docs in ([piece_mid, piece_hdr], [whole1], [piece_mid, whole2]):
        rows.append({"input_ids": torch.tensor([t for d in docs for t in d[0]]),
                     "labels": torch.tensor([t for d in docs for t in d[1]]),
                     "seq_lens": torch.tensor([len(d[0]) for d in docs])})
    got = held_out_prompts(rows, 2)
    assert got == [(whole1[0][:9], [70, 71]), (whole2[0][:9], [80])]
    assert held_out_prompts(rows, 4)[2:] == [([50, 51], [52, 53]), ([S, HDR], [60, 61, 62])]  # then the rest
