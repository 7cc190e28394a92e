"""`--set`: errors name the `--set` they come from and the form that works; --help examples run."""

import os
import re

import pytest

from astrai.cli import build_parser, main
from astrai.config import ConfigError, load_any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "recipes", "sft.yaml")
PIPELINE = os.path.join(ROOT, "pipelines", "chatml_sft.yaml")


def test_a_pipeline_key_on_a_recipe_shows_the_form_that_works(capsys):
    assert main(["run", RECIPE, "--set", "preprocessing.max_seq_len=1024"]) == 1
    err = capsys.readouterr().err
    assert "--set preprocessing.max_seq_len=1024" in err and "--set pipeline.preprocessing.max_seq_len=1024" in err
    assert "sft.yaml:3:1" not in err and "did you mean 'preprocess'" not in err
    loaded = load_any(RECIPE, ("pipeline.preprocessing.max_seq_len=1024",))  # that form works
    assert loaded.pipeline.preprocessing.max_seq_len == 1024


@pytest.mark.parametrize("target,override,key", [
    (PIPELINE, "preprocessing.max_seq_lenn=3", "max_seq_lenn"),
    (PIPELINE, "preprocessing.max_seq_len=x", "max_seq_len"),
    (RECIPE, "pipeline.preprocessing.packing_strategy=best", "packing_strategy"),
    (RECIPE, "preprocess.outputt=x", "outputt"),
])
def test_set_errors_name_their_set_not_a_file_line(target, override, key):
    with pytest.raises(ConfigError) as e:
        load_any(target, (override,))
    (problem,) = e.value.problems
    assert problem.path == f"--set {override}" and problem.line is None and key in problem.message


def test_every_set_example_in_help_runs():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "verb")
    checked = 0
    for verb, p in sub.choices.items():
        text = p.format_help()
        for example in re.findall(r"--set\s+([a-z][\w.]*=[^\s,;)]+)", text):
            target = RECIPE if verb == "run" else PIPELINE
            load_any(target, (example,))  # raises if the example does not work
            checked += 1
    assert checked >= 3
