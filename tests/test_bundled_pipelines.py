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
