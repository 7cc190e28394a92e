"""Recipe parsing: every bad recipe is refused before any work, each problem with its line and fix."""

import pytest

from astrai.config import ConfigError
from astrai.recipe.spec import stage_overrides

GOOD = """\
version: 1
name: demo
stages:
  tokenizer: {kind: tok, size: 20}
  data: {kind: make, inputs: [in.txt], tokenizer: tokenizer}
  fit: {data: data, lr: 0.5}
  score: {model: fit, data: data}
"""


def problems_of(path, kinds, load_recipe):
    with pytest.raises(ConfigError) as e:
        load_recipe(path, kinds)
    return [(p.path, p.line, p.message) for p in e.value.problems]


def test_good_recipe_resolves_names_and_describes_outputs(recipe_file, kinds, load_recipe):
    r = load_recipe(recipe_file(GOOD), kinds)
    assert [(s.name, s.kind, s.index) for s in r.stages] == [("tokenizer", "tok", 0), ("data", "make", 1),
                                                             ("fit", "fit", 2), ("score", "score", 3)]
    assert r.stage("score").refs == {"model": "fit", "data": "data"}
    assert r.stage("data").refs == {"tokenizer": "tokenizer"} and r.stage("data").paths == {}
    assert r.stage("fit").described == {"tokenizer": "tokenizer", "produces": "model"}
    assert r.name == "demo" and r.run_dir == recipe_file(GOOD).parent / "runs" / "demo"
    assert r.stage("fit").options.lr == 0.5


def test_unknown_stage_reference_names_line_and_suggestion(recipe_file, kinds, load_recipe):
    path = recipe_file(GOOD.replace("fit: {data: data,", "fit: {data: dta,"))
    [(key, line, msg)] = problems_of(path, kinds, load_recipe)
    assert key == "stages.fit.data" and line == 6
    assert "unknown stage 'dta'" in msg and "did you mean 'data'" in msg


def test_reference_to_a_later_stage_and_to_itself_and_a_cycle(recipe_file, kinds, load_recipe):
    later = GOOD.replace("  fit: {data: data, lr: 0.5}\n  score: {model: fit, data: data}\n",
                         "  score: {model: fit, data: data}\n  fit: {data: data, lr: 0.5}\n")
    [(key, line, msg)] = problems_of(recipe_file(later), kinds, load_recipe)
    assert key == "stages.score.model" and line == 6 and "'fit' comes after 'score'" in msg and "move 'fit'" in msg

    cyc = """version: 1
stages:
  a: {kind: fit, data: b}
  b: {kind: make, inputs: [in.txt], tokenizer: a}
"""
    probs = problems_of(recipe_file(cyc), kinds, load_recipe)
    assert any(k == "stages.a.data" and "cycle: a -> b -> a" in m for k, _, m in probs), probs
    assert any(k == "stages.b.tokenizer" and "cycle: b -> a -> b" in m for k, _, m in probs), probs

    self_ref = "version: 1\nstages:\n  d: {kind: make, inputs: [in.txt], tokenizer: d}\n"
    [(key, line, msg)] = problems_of(recipe_file(self_ref), kinds, load_recipe)
    assert key == "stages.d.tokenizer" and line == 3 and "cycle: d -> d" in msg


def test_wrong_sort_of_output(recipe_file, kinds, load_recipe):
    path = recipe_file(GOOD.replace("score: {model: fit,", "score: {model: data,"))
    [(key, line, msg)] = problems_of(path, kinds, load_recipe)
    assert key == "stages.score.model" and line == 7
    assert "'data' is a make stage (its output is data); model needs model" in msg


def test_missing_input_unknown_kind_unknown_option_all_at_once(recipe_file, kinds, load_recipe):
    bad = """version: 1
stages:
  data: {kind: make, inputs: [nope.jsonl]}
  fit: {data: data, lrr: 0.1}
  eval2: {model: fit}
  score: {kind: scor, model: fit, data: data}
"""
    probs = problems_of(recipe_file(bad), kinds, load_recipe)
    by_key = {k: (line, m) for k, line, m in probs}
    assert by_key["stages.data.inputs"][0] == 3 and "missing input: nope.jsonl" in by_key["stages.data.inputs"][1]
    assert by_key["stages.fit.lrr"][0] == 4 and "did you mean 'lr'" in by_key["stages.fit.lrr"][1]
    assert "unknown stage kind 'eval2'" in by_key["stages.eval2"][1] and "set `kind:`" in by_key["stages.eval2"][1]
    assert "did you mean 'score'" in by_key["stages.score.kind"][1] and by_key["stages.score.kind"][0] == 6
    assert [line for _, line, _ in probs] == sorted(line for _, line, _ in probs)


def test_consumer_checks_what_it_reads(recipe_file, kinds, load_recipe, tmp_path):
    dpo = GOOD.replace("inputs: [in.txt], tokenizer", "inputs: [in.txt], flavor: dpo, packed: false, tokenizer")
    probs = problems_of(recipe_file(dpo), kinds, load_recipe)
    assert [(k, line) for k, line, _ in probs] == [("stages.fit.data", 6), ("stages.fit.data", 6)]
    assert "makes dpo data" in probs[0][2] and "needs packed data" in probs[1][2]

    (tmp_path / "other_tok").mkdir()
    other_tok = GOOD + ("  data2: {kind: make, inputs: [in.txt], tokenizer: other_tok}\n"
                        "  score2: {kind: score, model: fit, data: data2}\n")
    [(key, line, msg)] = problems_of(recipe_file(other_tok), kinds, load_recipe)
    assert key == "stages.score2.data" and line == 9 and "another tokenizer" in msg


def test_path_reference_instead_of_a_stage(recipe_file, kinds, load_recipe, tmp_path):
    (tmp_path / "tokdir").mkdir()
    r = load_recipe(recipe_file(GOOD.replace("tokenizer: tokenizer", "tokenizer: tokdir")), kinds)
    assert r.stage("data").paths == {"tokenizer": "tokdir"} and r.stage("data").refs == {}
    probs = problems_of(recipe_file(GOOD.replace("tokenizer: tokenizer", "tokenizer: tokdr")), kinds, load_recipe)
    assert "neither a stage" in probs[0][2] and "does not exist" in probs[0][2]


def test_overrides_address_stages_by_name(recipe_file, kinds, load_recipe):
    assert stage_overrides(["fit.lr=1", "run_dir=x", "name=y"], ["fit", "data"]) == \
        ["stages.fit.lr=1", "run_dir=x", "name=y"]
    r = load_recipe(recipe_file(GOOD), kinds, overrides=["fit.lr=0.25"])
    assert r.stage("fit").options.lr == 0.25
    with pytest.raises(ConfigError, match="lr"):
        load_recipe(recipe_file(GOOD), kinds, overrides=["fit.lr=fast"])


def test_top_level_problems(recipe_file, kinds, load_recipe):
    probs = problems_of(recipe_file("version: 2\nstage: {}\n"), kinds, load_recipe)
    msgs = " | ".join(m for _, _, m in probs)
    assert "version must be 1" in msgs and "did you mean 'stages'" in msgs and "stages must be a mapping" in msgs
