"""The bundled pipelines (pipelines/*.yaml), as users copy them: they must not hide a data mistake."""

import glob
import json
import os
import shutil

import pytest

from astrai.config import load_pipeline

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PIPELINES = sorted(glob.glob(os.path.join(ROOT, "pipelines", "*.yaml")))


def _role_sections(pipe):
    sections = list(pipe.input.sections or [])
    for source in (pipe.input.sources or {}).values():
        sections += list(source.sections)
    return [s for s in sections if s.template]


@pytest.mark.parametrize("path", PIPELINES, ids=os.path.basename)
def test_no_bundled_pipeline_accepts_unknown_roles(path):
    # mask_default set explicitly masks a typo'd role (then the record has nothing trained and is
    # dropped as no_trained_tokens): unset, the typo is rejected as unknown_role, with its place
    pipe = load_pipeline(path)
    assert pipe.mask_default is None


def test_setting_mask_default_changes_the_fingerprint():
    # it changes what an unknown role does, so an output made without it is not up to date with it
    from astrai.data.preprocess import fingerprint

    path = os.path.join(ROOT, "pipelines", "chatml_sft.yaml")
    unset, masked = load_pipeline(path), load_pipeline(path, ("mask_default=mask",))
    assert fingerprint(unset, "tok", "tpl", []) != fingerprint(masked, "tok", "tpl", [])


def _reads_role_names(pipe) -> bool:
    """A section that reads role names from the records (not messages_from, whose roles are the pipeline's)."""
    return any(s.messages_from is None for s in _role_sections(pipe))


@pytest.mark.parametrize("path", [p for p in PIPELINES if _reads_role_names(load_pipeline(p))], ids=os.path.basename)
def test_a_role_typo_is_rejected_as_unknown_role(path, tiny_tokenizer, tmp_path):
    from astrai.data.preprocess import run_preprocess

    pipe = load_pipeline(path, ("preprocessing.on_error=skip",))
    good = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "good fine"}]
    typo = [{"role": "user", "content": "hello"}, {"role": "asistant", "content": "good fine"}]
    records = []
    keys = _role_sections(pipe)[0].message_keys or {}
    as_read = {v: k for k, v in _role_sections(pipe)[0].roles.items()}  # user -> human for ShareGPT
    for messages in (good, typo):
        if keys:  # written as the records hold them: ShareGPT's {from, value}
            messages = [{keys["role"]: as_read.get(m["role"], m["role"]), keys["content"]: m["content"]}
                        for m in messages]
            records.append({_role_sections(pipe)[0].field: messages})
            continue
        if pipe.input.sources:  # DPO pairs / GRPO groups: the typo sits in the prompt
            prompt = [dict(messages[1], content="yes"), messages[0]] if messages is typo else [messages[0]]
            records.append({"prompt": prompt, "chosen": [good[1]], "rejected": [dict(good[1], content="no")],
                            "completions": [{"text": "yes", "reward": 1.0}, {"text": "no", "reward": 0.0}]})
        else:
            records.append({"messages": messages, "answer": "yes"})  # the prompt pipeline keeps an answer
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    tokenizer = tiny_tokenizer
    if pipe.chat_template == "tokenizer":  # the model's own template: give the tiny tokenizer one (ChatML)
        from astrai.text.template import bundled_templates

        tokenizer = tmp_path / "tok"
        shutil.copytree(tiny_tokenizer, tokenizer)
        shutil.copy(bundled_templates()["chatml"], tokenizer / "chat_template.jinja")
    stats = run_preprocess(pipe, [str(data)], str(tmp_path / "out"), tokenizer=str(tokenizer), workers=1,
                           base_dir=os.path.dirname(path), log=lambda s: None)
    assert stats["records_kept"] == 1 and stats["rejected_by_reason"] == {"unknown_role": 1}
    (reject,) = [json.loads(line) for line in open(tmp_path / "out" / "rejects.jsonl")]
    assert reject["line"] == "2" and "asistant" in reject["detail"]


# -- the training render is the serving render --------------------------------------------------
# For every bundled chat pipeline that renders with the model's own template, on the real SmolLM2:
# the ids a preprocess run writes for a conversation are the ids transformers' apply_chat_template
# gives for it (the independent reference), and the ids `astrai generate`/`serve` render for its
# prompt from the checkpoint training writes (its tokenizer files, from TrainData.write_tokenizer)
# are the reference's prompt ids and the start of the training row: the model is trained on exactly
# what it will be shown, default system prompt included.

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of Peru?"}, {"role": "assistant", "content": "Lima."}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Capital of Chile?"},
     {"role": "assistant", "content": "Santiago."}],
]


def _as_format(fmt, conv):
    """One conversation as a record of each format, written out by hand."""
    system = [m["content"] for m in conv if m["role"] == "system"]
    user = next(m["content"] for m in conv if m["role"] == "user")
    answer = next(m["content"] for m in conv if m["role"] == "assistant")
    if fmt == "messages":
        return {"messages": conv}
    if fmt == "prompts":
        return {"messages": conv[:-1], "answer": conv[-1]["content"]}
    if fmt == "sharegpt":
        names = {"user": "human", "assistant": "gpt", "system": "system"}
        return {"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in conv]}
    if fmt == "alpaca":
        return {"instruction": user, "input": "", "output": answer, **({"system": system[0]} if system else {})}
    return {"prompt": user, "completion": answer}  # prompt_completion: no system message


def _own_template_pipelines():
    """(pipeline file, format override): every bundled pipeline rendering with the model's template,
    the format-driven one under each format."""
    from astrai.config.formats import FORMAT_NAMES

    out = []
    for path in PIPELINES:
        pipe = load_pipeline(path)
        if pipe.template_spec != "tokenizer" or pipe.input.sources:
            continue
        if any(s.add_generation_prompt for s in pipe.input.single_sections):
            out.append((os.path.basename(path), "prompts"))  # online GRPO's: the prompt is the whole row
        elif pipe.input.format is not None:
            out += [(os.path.basename(path), f) for f in FORMAT_NAMES]
        else:
            sec = pipe.input.single_sections[0]
            out.append((os.path.basename(path), "sharegpt" if sec.message_keys else
                        "alpaca" if sec.messages_from else "messages"))
    return out


@pytest.mark.parametrize("name,fmt", _own_template_pipelines())
def test_training_rows_are_what_serve_renders_on_smollm2(name, fmt, smollm2, tmp_path):
    transformers = pytest.importorskip("transformers")
    from astrai.data.preprocess import run_preprocess
    from astrai.text.prompt import chat_template_for, encode_prompt
    from astrai.text.tokenizer import load_tokenizer
    from astrai.train.data import TrainData

    convs = [c for c in CONVERSATIONS if fmt != "prompt_completion" or c[0]["role"] != "system"]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(_as_format(fmt, c)) + "\n" for c in convs))
    path = os.path.join(ROOT, "pipelines", name)
    driven = load_pipeline(path).input.format is not None  # a pipeline of `input.format`: read as fmt
    pipe = load_pipeline(path, ("preprocessing.packing_strategy=none",), input_format=fmt if driven else None)
    run_preprocess(pipe, [str(data)], str(tmp_path / "out"), tokenizer=str(smollm2), workers=1, log=lambda s: None)
    import pyarrow.parquet as pq

    rows = [r for f in sorted((tmp_path / "out" / "data").glob("*.parquet")) for r in pq.read_table(f).to_pylist()]
    final = tmp_path / "final"
    final.mkdir()
    TrainData(tmp_path / "out").write_tokenizer(final)  # what final/ and final/merged/ get
    served = load_tokenizer(str(final))
    reference = transformers.AutoTokenizer.from_pretrained(str(smollm2))
    assert len(rows) == len(convs)
    for conv, row in zip(convs, rows):
        want = reference.apply_chat_template(conv if fmt != "prompts" else conv[:-1], tokenize=True,
                                             add_generation_prompt=fmt == "prompts", return_dict=False)
        assert row["input_ids"] == list(want)
        prompt = encode_prompt(conv[:-1], served, chat_template_for(served))  # generate's and serve's path
        ref_prompt = list(reference.apply_chat_template(conv[:-1], tokenize=True, add_generation_prompt=True,
                                                        return_dict=False))
        assert prompt == ref_prompt == row["input_ids"][:len(prompt)]
        if conv[0]["role"] != "system":  # the template's default system prompt is in both
            assert "You are a helpful AI assistant named SmolLM" in reference.decode(prompt)
