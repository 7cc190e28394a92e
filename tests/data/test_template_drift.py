"""Data rendered with another chat template than the model serves with is refused before any work
(astrai.data.preflight.check_model_template, astrai.text.drift), unless the pipeline allows it; the
checkpoint training writes then carries the template the data used (TrainData.write_tokenizer), so
what generate and serve render is what was trained, checked against transformers."""

import json
import shutil

import pytest

from astrai.config import load_pipeline
from astrai.errors import InputError
from astrai.text.template import TEMPLATE_DIR, ChatTemplate

# a ChatML template that adds a default system prompt when the conversation has none (SmolLM2's shape)
OWN = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
       "{{ '<|im_start|>system\\nYou are Tiny, a helpful assistant.<|im_end|>\\n' }}{% endif %}"
       "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
       "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
PIPELINE = """\
version: 1
input: {format: messages}
preprocessing: {max_seq_len: 256}
"""
CONV = [{"role": "user", "content": "hello how are you"}, {"role": "assistant", "content": "good thanks"}]


@pytest.fixture
def model_dir(tmp_path, tiny_tokenizer):
    """A model checkpoint's tokenizer files (config.json beside them) with their own template."""
    d = tmp_path / "model"
    d.mkdir()
    shutil.copy(tiny_tokenizer / "tokenizer.json", d / "tokenizer.json")
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    (d / "chat_template.jinja").write_text(OWN)
    (d / "config.json").write_text("{}")
    return d


def _run(tmp_path, model_dir, *sets):
    from astrai.data.preprocess import run_preprocess

    (tmp_path / "p.yaml").write_text(PIPELINE)
    (tmp_path / "d.jsonl").write_text(json.dumps({"messages": CONV}) + "\n")
    pipe = load_pipeline(tmp_path / "p.yaml", sets)
    out = tmp_path / "out"
    run_preprocess(pipe, [str(tmp_path / "d.jsonl")], str(out), tokenizer=str(model_dir), workers=1,
                   log=lambda s: None)
    return out


def test_first_difference_by_hand():
    from astrai.text.drift import first_difference

    assert first_difference("abc", "abc") is None
    assert first_difference("abc", "abd") == 2
    assert first_difference("ab", "abc") == 2 and first_difference("", "x") == 0


def test_templates_that_render_alike_are_not_drift():
    from astrai.text.drift import template_difference

    chatml = (TEMPLATE_DIR / "chatml.jinja").read_text()
    same = ChatTemplate("{#- the same template, another source text -#}\n" + chatml, "copy")
    assert template_difference(same, ChatTemplate(chatml, "chatml"), {}) is None
    diff = template_difference(ChatTemplate(chatml, "chatml"), ChatTemplate(OWN, "own"), {})
    assert "chatml" in diff and "own" in diff and "at character 12" in diff  # after '<|im_start|>'
    assert "You are Tiny" in diff


def test_another_template_than_the_models_is_refused_before_any_work(tmp_path, model_dir):
    with pytest.raises(InputError) as e:
        _run(tmp_path, model_dir, "chat_template=chatml")
    msg = str(e.value)
    assert "chat template chatml" in msg and f"tokenizer:{model_dir}" in msg and "You are Tiny" in msg
    assert "chat_template_mismatch: allow" in msg
    assert not (tmp_path / "out").exists()  # refused before any work: not even the output directory
    # a tokenizer directory that is not a model's (no config.json) serves nobody: nothing to compare
    (model_dir / "config.json").unlink()
    assert (_run(tmp_path, model_dir, "chat_template=chatml") / "manifest.json").exists()


def test_allowed_drift_ships_the_datas_template_with_the_checkpoint(tmp_path, model_dir, read_rows):
    transformers = pytest.importorskip("transformers")
    from astrai.train.data import TrainData

    out = _run(tmp_path, model_dir, "chat_template=chatml", "chat_template_mismatch=allow")
    final = tmp_path / "final"
    final.mkdir()
    TrainData(out).write_tokenizer(final)
    assert (final / "chat_template.jinja").read_text() == (TEMPLATE_DIR / "chatml.jinja").read_text()
    (row,) = read_rows(out)
    served = transformers.AutoTokenizer.from_pretrained(str(final))  # the checkpoint as any tool loads it
    assert list(served.apply_chat_template(CONV, tokenize=True, return_dict=False)) == row["input_ids"]


def test_the_default_template_is_the_models_and_ships_with_the_checkpoint(tmp_path, model_dir, read_rows):
    transformers = pytest.importorskip("transformers")
    from astrai.train.data import TrainData

    out = _run(tmp_path, model_dir)
    final = tmp_path / "final"
    final.mkdir()
    TrainData(out).write_tokenizer(final)
    (row,) = read_rows(out)
    served = transformers.AutoTokenizer.from_pretrained(str(final))
    assert list(served.apply_chat_template(CONV, tokenize=True, return_dict=False)) == row["input_ids"]
    assert "You are Tiny" in served.decode(row["input_ids"])
