"""A recipe refuses, before any work, data rendered with another chat template than its model serves
with (astrai.recipe.template_check): at the preprocess stage when its tokenizer is the checkpoint's,
at the train stage when the model is another one; `chat_template_mismatch: allow` lets it through,
and the trained checkpoint (final/ and final/merged/) then carries the data's template. A missing
report_to tracker is refused there too, and by `astrai train` before anything is written."""

import json
import shutil

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("astrai.train")

from astrai.config import ConfigError  # noqa: E402
from astrai.recipe.command import load_recipe_spec  # noqa: E402
from astrai.recipe.runner import Runner  # noqa: E402
from astrai.text.template import TEMPLATE_DIR  # noqa: E402

OWN = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
       "{{ '<|im_start|>system\\nYou are Tiny, a helpful assistant.<|im_end|>\\n' }}{% endif %}"
       "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
       "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
RECIPE = """\
version: 1
name: ft
run_dir: run
stages:
  base: {kind: checkpoint, path: ckpt}
  preprocess: {pipeline: p.yaml, inputs: [chat.jsonl], tokenizer: base, holdout: 0.2, workers: 1}
  train: {data: preprocess, model: base, lora: {rank: 4, alpha: 8, merge: true}, max_steps: 2, batch_size: 2,
          progress: false}
"""
PIPELINE = """\
version: 1
input: {format: messages}
preprocessing: {max_seq_len: 256}
"""


@pytest.fixture
def recipe(tmp_path, tiny_tokenizer):
    from astrai.model import CausalLM, ModelConfig, save_model

    torch.manual_seed(0)
    save_model(CausalLM(ModelConfig.preset("tiny", tie_word_embeddings=True)), tmp_path / "ckpt")
    shutil.copy(tiny_tokenizer / "tokenizer.json", tmp_path / "ckpt" / "tokenizer.json")
    (tmp_path / "ckpt" / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    (tmp_path / "ckpt" / "chat_template.jinja").write_text(OWN)
    with open(tmp_path / "chat.jsonl", "w") as fh:
        for i in range(10):
            fh.write(json.dumps({"messages": [{"role": "user", "content": f"how are you {i}"},
                                              {"role": "assistant", "content": "good thanks"}]}) + "\n")
    (tmp_path / "p.yaml").write_text(PIPELINE)
    (tmp_path / "r.yaml").write_text(RECIPE)
    return tmp_path / "r.yaml"


def run(path, overrides=()):
    spec, kinds = load_recipe_spec(str(path), overrides)
    return Runner(spec, kinds, log=lambda m: None).run()


def test_another_template_is_refused_at_the_stage_that_renders_it(recipe, tmp_path):
    with pytest.raises(ConfigError) as e:
        load_recipe_spec(str(recipe), ("preprocess.overrides=[chat_template=chatml]",))
    (p,) = e.value.problems
    assert p.path == "stages.preprocess.pipeline" and p.line == 6
    assert "chat template chatml" in p.message and "You are Tiny" in p.message
    assert "chat_template_mismatch: allow" in p.message
    # a tokenizer that is not the model's (a plain tokenizer directory): the train stage compares
    (tmp_path / "tok").mkdir()
    shutil.copy(tmp_path / "ckpt" / "tokenizer.json", tmp_path / "tok")
    shutil.copy(tmp_path / "ckpt" / "tokenizer_config.json", tmp_path / "tok")
    with pytest.raises(ConfigError) as e:
        load_recipe_spec(str(recipe), ("preprocess.overrides=[chat_template=chatml]", "preprocess.tokenizer=tok"))
    drift = [p for p in e.value.problems if "You are Tiny" in p.message]
    assert [p.path for p in drift] == ["stages.train.data"]
    assert not (tmp_path / "run").exists()


def test_allowed_drift_trains_and_the_checkpoint_serves_the_datas_template(recipe, tmp_path, read_rows):
    from astrai.text.prompt import chat_template_for, encode_prompt
    from astrai.text.tokenizer import load_tokenizer

    run(recipe, ("preprocess.overrides=[chat_template=chatml, chat_template_mismatch=allow]",))
    final = tmp_path / "run" / "train" / "output" / "final"
    chatml = (TEMPLATE_DIR / "chatml.jinja").read_text()
    assert (final / "chat_template.jinja").read_text() == chatml
    assert (final / "merged" / "chat_template.jinja").read_text() == chatml
    row = read_rows(tmp_path / "run" / "preprocess" / "output" / "train")[0]
    served = load_tokenizer(str(final / "merged"))
    prompt = encode_prompt([{"role": "user", "content": "how are you 0"}], served, chat_template_for(served))
    assert row["input_ids"][:len(prompt)] == prompt  # generate/serve render the prompt as the data was


def test_the_default_is_the_models_template_in_data_and_checkpoint(recipe, tmp_path, read_rows):
    run(recipe)
    final = tmp_path / "run" / "train" / "output" / "final"
    assert (final / "chat_template.jinja").read_text() == OWN
    assert (final / "merged" / "chat_template.jinja").read_text() == OWN


def test_a_missing_report_to_tracker_is_refused_before_any_work(recipe, tmp_path, monkeypatch):
    from astrai.train import report

    monkeypatch.setitem(report.EXTRAS, "wandb", ("astrai_no_such_module", "wandb"))
    with pytest.raises(ConfigError, match=r"stages\.train\.report_to: report_to: wandb needs the "
                                          r"astrai_no_such_module package: pip install 'astrai\[wandb\]'"):
        load_recipe_spec(str(recipe), ("train.report_to=wandb",))


def test_astrai_train_refuses_drift_and_missing_trackers_before_writing(recipe, tmp_path, monkeypatch, capsys):
    from astrai.cli import main
    from astrai.train import report

    (tmp_path / "tok").mkdir()  # data rendered with ChatML on the model's tokenizer files, but not the model
    shutil.copy(tmp_path / "ckpt" / "tokenizer.json", tmp_path / "tok")
    assert main(["preprocess", str(tmp_path / "p.yaml"), "-i", str(tmp_path / "chat.jsonl"), "-o",
                 str(tmp_path / "data"), "--tokenizer", str(tmp_path / "tok"), "--set", "chat_template=chatml",
                 "--workers", "1"]) == 0
    (tmp_path / "t.yaml").write_text("data: data\nmodel: ./ckpt\noutput: out\nmax_steps: 1\nprogress: false\n")
    assert main(["train", str(tmp_path / "t.yaml")]) == 1
    err = capsys.readouterr().err
    assert "chat template chatml" in err and "You are Tiny" in err and not (tmp_path / "out").exists()
    monkeypatch.setitem(report.EXTRAS, "wandb", ("astrai_no_such_module", "wandb"))
    assert main(["train", str(tmp_path / "t.yaml"), "--set", "model=tiny", "--set", "report_to=wandb"]) == 1
    assert "pip install 'astrai[wandb]'" in capsys.readouterr().err and not (tmp_path / "out").exists()
