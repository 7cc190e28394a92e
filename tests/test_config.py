"""Config loading: every problem at once, with key path and line; overrides; safe YAML only."""

import glob
import os
import textwrap

import pytest

from astrai.config import ConfigError, Pipeline, load_any, load_pipeline, parse_set

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write(tmp_path, text, name="p.yaml"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def problems(path, **kw):
    with pytest.raises(ConfigError) as e:
        load_pipeline(path, **kw)
    return e.value.problems


def test_every_problem_reported_with_line(tmp_path):
    p = write(tmp_path, """\
        version: 1
        chat_template: chatml
        input:
          sections:
            - {field: messages, action: $role}
        preprocessing:
          max_seq_lenn: 2048
          batch_size: "big"
          truncation_mode: keep_middle
        output:
          position_ids_mode: doc_reset
        """)
    found = {(x.path, x.line) for x in problems(p)}
    assert ("input.sections[0].action", 5) in found  # invalid combination
    assert ("preprocessing.max_seq_lenn", 7) in found  # typo
    assert ("preprocessing.batch_size", 8) in found  # wrong type
    assert ("preprocessing.truncation_mode", 9) in found  # bad enum
    msgs = {x.path: x.message for x in problems(p)}
    assert "did you mean 'max_seq_len'" in msgs["preprocessing.max_seq_lenn"]
    assert "template: true" in msgs["input.sections[0].action"]


def test_columns_are_reported(tmp_path):
    p = write(tmp_path, "version: 1\ninput:\n  sections:\n    - {field: text, action: train, colour: red}\n")
    (prob,) = problems(p)
    assert prob.path == "input.sections[0].colour" and prob.line == 4 and prob.column > 1


def test_sections_and_sources_together_rejected(tmp_path):
    p = write(tmp_path, """\
        version: 1
        input:
          sections: [{field: text}]
          sources: {chosen: {sections: [{field: text}]}}
        """)
    (prob,) = problems(p)
    assert prob.path == "input" and "exactly one of" in prob.message


def test_packing_needs_length_and_single_output(tmp_path):
    p = write(tmp_path, """\
        version: 1
        input: {sources: {chosen: {sections: [{field: text}]}}}
        preprocessing: {packing_strategy: bfd}
        """)
    msgs = [x.message for x in problems(p)]
    assert any("needs preprocessing.max_packed_len" in m for m in msgs)
    assert any("single-output" in m for m in msgs)


def test_value_columns_never_overwrite_other_columns(tmp_path):
    # a value's column is named after its field (single output) or its source (multi-output): it
    # must not replace the token columns, nor another value of the same source
    p = write(tmp_path, """\
        version: 1
        chat_template: chatml
        input:
          sections:
            - {field: messages, action: $role, template: true}
            - {field: labels, action: value}
        """)
    (prob,) = problems(p)
    assert prob.path == "input.sections[1].field" and "labels" in prob.message and prob.line == 6
    p = write(tmp_path, """\
        version: 1
        input:
          sources:
            completion: {sections: [{field: text}]}
            rewards: {sections: [{field: reward, action: value}, {field: score, action: value}]}
        """)
    (prob,) = problems(p)
    assert prob.path == "input.sources.rewards.sections[1].field" and "one value" in prob.message


def test_single_output_needs_a_token_section(tmp_path):
    # value sections alone validated, then crashed the writer (KeyError) after reading the data
    p = write(tmp_path, "version: 1\ninput: {sections: [{field: score, action: value}]}\n")
    (prob,) = problems(p)
    assert prob.path == "input.sections" and "at least one train" in prob.message


def test_separator_needs_a_plain_section(tmp_path):
    p = write(tmp_path, "version: 1\nchat_template: chatml\n"
                        "input: {sections: [{field: m, action: $role, template: true, separator: '\\n'}]}\n")
    (prob,) = problems(p)
    assert prob.path == "input.sections[0].separator" and "template" in prob.message


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_pipeline(tmp_path / "nope.yaml")
    assert "no such file" in str(e.value) and "nope.yaml" in str(e.value)


def test_a_template_section_renders_with_the_models_own_template_by_default(tmp_path):
    p = write(tmp_path, "version: 1\ninput: {sections: [{field: messages, action: $role, template: true}]}\n")
    assert load_pipeline(p).template_spec == "tokenizer"
    assert load_pipeline(p, ("chat_template=chatml",)).template_spec == "chatml"
    plain = write(tmp_path, "version: 1\ninput: {sections: [{field: text}]}\n", "plain.yaml")
    assert load_pipeline(plain).template_spec is None  # nothing is rendered: no template is looked for


def test_valid_pipeline_defaults(tmp_path):
    p = write(tmp_path, "version: 1\ninput: {sections: [{field: text}]}\n")
    pipe = load_pipeline(p)
    assert pipe.preprocessing.packing_strategy == "none"
    assert pipe.output.position_ids_mode == "doc_reset"
    assert pipe.mask["assistant"] == "train" and pipe.mask["user"] == "mask"


def test_overrides_are_typed_and_validated(tmp_path):
    p = write(tmp_path, "version: 1\ninput: {sections: [{field: text}]}\n")
    pipe = load_pipeline(p, overrides=("preprocessing.max_seq_len=4096", "output.position_ids_mode=continuous"))
    assert pipe.preprocessing.max_seq_len == 4096
    assert pipe.output.position_ids_mode == "continuous"
    (prob,) = problems(p, overrides=("preprocessing.max_seq_len=lots",))
    # named by the --set it came from (the file has no such line), with the key in the message
    assert prob.path == "--set preprocessing.max_seq_len=lots" and prob.line is None
    assert prob.message.startswith("preprocessing.max_seq_len: ")
    assert parse_set("a.b=[1, 2]") == (["a", "b"], [1, 2])
    with pytest.raises(ValueError):
        parse_set("novalue")


def test_yaml_cannot_construct_python_objects(tmp_path):
    p = write(tmp_path, "version: 1\ninput: !!python/object/apply:os.system ['echo pwned']\n")
    (prob,) = problems(p)
    assert "invalid YAML" in prob.message


def test_recipe_train_block_is_validated(tmp_path):
    from astrai.recipe.command import load_recipe_spec

    write(tmp_path, "version: 1\ninput: {sections: [{field: text}]}\n", "pipe.yaml")
    write(tmp_path, '{"text": "x"}\n', "x.jsonl")
    r = write(tmp_path, "version: 1\nstages:\n  preprocess: {pipeline: pipe.yaml, inputs: [x.jsonl], tokenizer: .}\n"
                        "  train: {data: preprocess, lr: 1.0e-4, lerning_rate: 2, eval_every: 5}\n", "r.yaml")
    with pytest.raises(ConfigError) as e:
        load_recipe_spec(r)
    got = {(p.path, p.message.split(" (")[0].split(";")[0]) for p in e.value.problems}
    assert ("stages.train.lerning_rate", "unknown key 'lerning_rate'") in got


def test_the_older_recipe_form_is_refused_with_the_new_form(tmp_path):
    # one form of recipe: top-level stage blocks get the same recipe shown under `stages:`
    import yaml

    from astrai.recipe.command import load_recipe_spec

    write(tmp_path, "version: 1\ninput: {sections: [{field: text}]}\n", "pipe.yaml")
    write(tmp_path, '{"text": "x"}\n', "x.jsonl")
    old = ("version: 1\nname: demo\npreprocess: {pipeline: pipe.yaml, inputs: [x.jsonl], output: out, holdout: 0.1}\n"
           "train: {strategy: seq, output: model}\neval: {checkpoint: model/final}\n")
    r = write(tmp_path, old, "r.yaml")
    for load in (load_recipe_spec, load_any):
        with pytest.raises(ConfigError) as e:
            load(r)
        (problem,) = e.value.problems
        assert (problem.path, problem.line) == ("preprocess", 3)
        assert "stages:" in problem.message and "preprocess.output, train.output: gone" in problem.message
    shown = problem.message.split("(see recipes/sft.yaml):\n", 1)[1].split("\n    preprocess.output")[0]
    new = yaml.safe_load(shown)
    assert new == {"version": 1, "name": "demo", "stages": {
        "preprocess": {"pipeline": "pipe.yaml", "inputs": ["x.jsonl"], "holdout": 0.1},
        "train": {"data": "preprocess", "strategy": "seq"},
        "eval": {"model": "train", "data": "preprocess"}}}
    # the form shown is one that loads (given a tokenizer)
    new["stages"]["preprocess"]["tokenizer"] = "."
    r.write_text(yaml.safe_dump(new, sort_keys=False))
    spec, _ = load_recipe_spec(r)
    assert [s.name for s in spec.stages] == ["preprocess", "train", "eval"]


def test_python_api_reads_the_same_models():
    pipe = Pipeline.model_validate({"version": 1, "input": {"sections": [{"field": "text"}]}})
    assert pipe.bin_capacity is None
    with pytest.raises(Exception):
        Pipeline.model_validate({"version": 1, "input": {"sections": [{"field": "m", "action": "$role"}]}})


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "pipelines", "*.yaml"))
                                    + glob.glob(os.path.join(ROOT, "recipes", "*.yaml"))))
def test_every_bundled_yaml_validates(path):
    if "recipes" in path:  # chained stages: every stage, reference and input (astrai.recipe)
        from astrai.recipe.command import load_recipe_spec

        spec, kinds = load_recipe_spec(path)
        assert spec.stages and all(s.kind in kinds for s in spec.stages)
        return
    cfg = load_any(path)
    assert isinstance(cfg.pipeline, Pipeline) and not cfg.is_recipe


def test_overrides_index_lists(tmp_path):
    p = write(tmp_path, "version: 1\ninput: {sections: [{field: text}, {field: more, action: train}]}\n")
    pipe = load_pipeline(p, overrides=("input.sections.1.action=mask",))
    assert pipe.input.sections[1].action == "mask" and pipe.input.sections[0].action == "train"
    with pytest.raises(ConfigError) as e:
        load_pipeline(p, overrides=("input.sections.5.action=mask",))
    assert e.value.problems[0].path == "--set" and "2-item list" in e.value.problems[0].message
