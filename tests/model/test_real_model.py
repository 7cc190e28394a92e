"""The real pretrained SmolLM2-135M-Instruct (tests/conftest.py smollm2): greedy chat generation through
the engine equals transformers' `generate` token for token, and answers the question."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def test_greedy_chat_equals_transformers(smollm2):
    from astrai.infer.engine import Engine
    from astrai.infer.request import SamplingParams

    chat = [{"role": "user", "content": "What is the capital of France?"}]
    tok = transformers.AutoTokenizer.from_pretrained(smollm2)
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    enc = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ref = hf.generate(**enc, max_new_tokens=24, do_sample=False)[0, enc["input_ids"].shape[1]:].tolist()
    (out,) = Engine.from_checkpoint(smollm2).generate([chat], SamplingParams(max_tokens=24, temperature=0))
    assert out.prompt_token_ids == enc["input_ids"][0].tolist()  # the template's default system prompt
    assert out.token_ids == ref[:len(out.token_ids)] and ref[len(out.token_ids) - 1] == tok.eos_token_id
    assert out.text == "The capital of France is Paris."


def test_eval_perplexity_equals_transformers_on_documents_alone(smollm2, tmp_path, capsys):
    """`astrai eval` on packed held-out chats (SmolLM2's own template and tokenizer, several documents per
    row): the same loss as transformers over the same trained tokens, each document run alone."""
    import json
    import math
    from pathlib import Path

    from astrai.cli import main
    from astrai.data.load import ShardDataset
    from astrai.schema import IGNORE_INDEX

    root = Path(__file__).resolve().parents[2]
    chats = (root / "samples" / "chat.jsonl").read_text().splitlines()[:10]
    (tmp_path / "chats.jsonl").write_text("\n".join(chats) + "\n")
    (tmp_path / "pipe.yaml").write_text(
        f"version: 1\ntokenizer: {smollm2}\nchat_template: tokenizer\n"
        "input:\n  sections:\n    - {field: messages, action: $role, template: true}\n"
        "mask: {system: mask, user: mask, assistant: train}\n"
        "preprocessing: {packing_strategy: bfd, max_packed_len: 1024, max_seq_len: 400}\n")
    assert main(["preprocess", str(tmp_path / "pipe.yaml"), "-i", str(tmp_path / "chats.jsonl"),
                 "-o", str(tmp_path / "data"), "--workers", "1"]) == 0
    assert main(["eval", str(smollm2), "--data", str(tmp_path / "data"), "--output", str(tmp_path / "eval.json"),
                 "--samples", "0", "--device", "cpu"]) == 0
    got = json.loads((tmp_path / "eval.json").read_text())

    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    ds = ShardDataset(tmp_path / "data")
    nll, count, docs = 0.0, 0, 0
    for i in range(len(ds)):
        row, start = ds[i], 0
        for n in row["seq_lens"].tolist():
            ids, labels = row["input_ids"][start:start + n], row["labels"][start:start + n]
            start, docs = start + n, docs + 1
            with torch.no_grad():
                lp = hf(ids[None], use_cache=False).logits[0, :-1].double().log_softmax(-1)
            trained = (labels[1:] != IGNORE_INDEX).nonzero()[:, 0]
            nll -= lp[trained, labels[1:][trained]].sum().item()
            count += len(trained)
    assert docs > len(ds) and docs == got["documents"]  # several documents per packed row
    assert got["trained_tokens"] == count > 300
    # float32 through 30 layers: per-token log-probs agree to ~1e-5, the mean loss (4.44) to 2e-5 measured
    assert got["loss"] == pytest.approx(nll / count, abs=1e-4)
    assert got["perplexity"] == pytest.approx(math.exp(nll / count), rel=1e-4)
    assert 1.5 < got["perplexity"] < 100  # a real model on real chats: neither random nor memorised
