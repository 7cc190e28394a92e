"""tokenizer -> preprocess as recipe stages: real outputs, the held-out split, reruns by fingerprint."""

import json

import pytest

from astrai.config import ConfigError
from astrai.recipe.command import load_recipe_spec
from astrai.recipe.preprocess_stage import data_dirs
from astrai.recipe.runner import Runner

RECIPE = """\
version: 1
name: mini
run_dir: run
stages:
  tokenizer: {inputs: [chat.jsonl], vocab_size: 400}
  preprocess: {pipeline: sft.yaml, inputs: [chat.jsonl], tokenizer: tokenizer, holdout: 0.1, workers: 1}
"""


@pytest.fixture
def recipe(tmp_path, sft_pipeline):
    words = "red green blue cat dog sun moon tree river stone".split()
    with open(tmp_path / "chat.jsonl", "w") as fh:
        for i in range(60):
            q = " ".join(words[(i + j) % 10] for j in range(5))
            fh.write(json.dumps({"id": str(i), "messages": [{"role": "user", "content": f"say {q}"},
                                                            {"role": "assistant", "content": q[::-1]}]}) + "\n")
    (tmp_path / "sft.yaml").write_text(sft_pipeline("{max_seq_len: 256, packing_strategy: bfd, max_packed_len: 256}"))
    (tmp_path / "r.yaml").write_text(RECIPE)
    return tmp_path / "r.yaml"


def run(path, overrides=(), **flags):
    spec, kinds = load_recipe_spec(str(path), overrides)
    return Runner(spec, kinds, log=lambda m: None).run(**flags)


def test_tokenizer_then_preprocess_with_holdout(recipe):
    s = run(recipe)
    assert [x["status"] for x in s["stages"]] == ["ran", "ran"]
    root = recipe.parent / "run"
    train, val = data_dirs(root / "preprocess" / "output")
    man = json.loads((train / "manifest.json").read_text())
    assert man["tokenizer"]["path"] == str(root / "tokenizer" / "output")  # the stage's own tokenizer
    assert man["counts"]["records_kept"] == 54 and json.loads((val / "manifest.json").read_text())["counts"][
        "records_kept"] == 6
    assert not (root / "preprocess" / "output" / "split").exists()  # the inputs are read in place, not copied
    m = s["stages"][1]["metrics"]
    assert m["records_kept"] == 54 and m["val_records_kept"] == 6 and 0 < m["trained_tokens"] < m["tokens"]

    assert [x["status"] for x in run(recipe)["stages"]] == ["skipped", "skipped"]
    assert [x["status"] for x in run(recipe, ["preprocess.holdout=0.2"])["stages"]] == ["skipped", "replaced"]
    assert [x["status"] for x in run(recipe, ["preprocess.holdout=0.2", "tokenizer.vocab_size=420"])["stages"]] \
        == ["replaced", "replaced"]
    # an edit to the pipeline file is an input change: preprocess reruns, the tokenizer does not
    pipeline = recipe.parent / "sft.yaml"
    pipeline.write_text(pipeline.read_text().replace("max_seq_len: 256", "max_seq_len: 200"))
    assert [x["status"] for x in run(recipe, ["preprocess.holdout=0.2", "tokenizer.vocab_size=420"])["stages"]] \
        == ["skipped", "replaced"]


def test_bad_pipeline_and_missing_tokenizer_are_refused_before_work(recipe):
    pipeline = recipe.parent / "sft.yaml"
    good = pipeline.read_text()
    pipeline.write_text(good.replace("max_seq_len", "max_seqlen"))
    with pytest.raises(ConfigError) as e:
        run(recipe)
    [p] = e.value.problems
    assert p.path == "stages.preprocess.pipeline" and p.line == 6 and "did you mean 'max_seq_len'" in p.message
    assert not (recipe.parent / "run").exists()

    pipeline.write_text(good)
    recipe.write_text(RECIPE.replace(", tokenizer: tokenizer", ""))
    with pytest.raises(ConfigError, match="names no tokenizer"):
        run(recipe)


@pytest.mark.parametrize("bad_line,side", [(60, "val"), (13, "train")])
def test_rejects_name_the_users_file_and_line(recipe, bad_line, side):
    # the split reads the user's file in place: a bad record is reported at its own line, on the
    # side its position falls (line 60 -> position 59: held out at 0.1), never in a copy
    data = recipe.parent / "chat.jsonl"
    lines = data.read_text().splitlines()
    lines.insert(bad_line - 1, '{"messages": [{"role": "asistant", "content": "x"}]}')
    data.write_text("\n".join(lines) + "\n")
    (recipe.parent / "sft.yaml").write_text(
        (recipe.parent / "sft.yaml").read_text().replace("mask_default: mask\n", "").replace(
            "packing_strategy: bfd", "on_error: skip, packing_strategy: bfd"))
    run(recipe)
    out = recipe.parent / "run" / "preprocess" / "output" / side
    (reject,) = [json.loads(line) for line in (out / "rejects.jsonl").open()]
    assert (reject["file"], reject["line"], reject["reason"]) == (str(data), str(bad_line), "unknown_role")
