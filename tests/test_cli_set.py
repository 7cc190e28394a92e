"""`--set`: errors name the `--set` they come from and the form that works; --help examples run."""

import os
import re

import pytest

from astrai.cli import build_parser, main
from astrai.config import ConfigError, load_any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "recipes", "scratch_sft.yaml")
PIPELINE = os.path.join(ROOT, "pipelines", "chatml_sft.yaml")


def test_a_pipeline_key_on_a_recipe_reaches_its_pipeline(capsys):
    # a staged recipe: the pipeline key goes to its preprocess stage, after the recipe's own overrides
    from astrai.recipe.command import load_recipe_spec

    spec, _ = load_recipe_spec(RECIPE, ("preprocessing.max_seq_len=256",))
    assert spec.stage("preprocess").options.overrides[-1] == "preprocessing.max_seq_len=256"
    assert main(["validate", RECIPE, "--set", "preprocessing.max_seq_len=lots"]) == 1
    out = capsys.readouterr().out
    assert "--set preprocessing.max_seq_len=lots" in out and "did you mean 'preprocess'" not in out


def test_a_pipeline_key_on_a_recipe_reaches_its_pipeline_in_inspect_too(tmp_path):
    # load_any (inspect, validate) reads a recipe's preprocess stage as `astrai run` does
    (tmp_path / "p.yaml").write_text("version: 1\ninput: {sections: [{field: text}]}\n")
    r = tmp_path / "r.yaml"
    r.write_text("version: 1\nstages:\n  preprocess: {pipeline: p.yaml, inputs: [a.jsonl], "
                 "overrides: [preprocessing.max_seq_len=512]}\n")
    assert load_any(r).pipeline.preprocessing.max_seq_len == 512
    for o in ("preprocessing.max_seq_len=1024", "pipeline.preprocessing.max_seq_len=1024"):
        assert load_any(r, (o,)).pipeline.preprocessing.max_seq_len == 1024
    assert load_any(r, ("preprocess.inputs=[b.jsonl]",)).recipe_inputs == [str(tmp_path / "b.jsonl")]
    with pytest.raises(ConfigError) as e:
        load_any(r, ("preprocessing.max_seq_lenn=3",))
    assert "max_seq_lenn" in str(e.value)


@pytest.mark.parametrize("target,override,key", [
    (PIPELINE, "preprocessing.max_seq_lenn=3", "max_seq_lenn"),
    (PIPELINE, "preprocessing.max_seq_len=x", "max_seq_len"),
])
def test_set_errors_name_their_set_not_a_file_line(target, override, key):
    with pytest.raises(ConfigError) as e:
        load_any(target, (override,))
    (problem,) = e.value.problems
    assert problem.path == f"--set {override}" and problem.line is None and key in problem.message


@pytest.mark.parametrize("override,needle", [
    ("train.lr=fast", "stages.train.lr: "),
    ("holdout=0.1", "'holdout' is an option of stage 'preprocess': preprocess.holdout"),
])
def test_recipe_set_errors_name_their_set_not_a_file_line(override, needle):
    from astrai.recipe.command import load_recipe_spec

    with pytest.raises(ConfigError) as e:
        load_recipe_spec(RECIPE, (override,))
    (problem,) = e.value.problems
    assert problem.path == f"--set {override}" and problem.line is None and needle in problem.message


def test_every_set_example_in_help_runs():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "verb")
    checked = 0
    for verb, p in sub.choices.items():
        text = p.format_help()
        for example in re.findall(r"--set\s+([a-z][\w.]*=[^\s,;)]+)", text):
            if verb == "run":  # a recipe of named stages
                from astrai.recipe.command import load_recipe_spec

                load_recipe_spec(RECIPE, (example,))  # raises if the example does not work
            else:
                load_any(PIPELINE, (example,))
            checked += 1
    assert checked >= 3
