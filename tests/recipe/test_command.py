"""`astrai run` / `astrai validate` / `astrai inspect` on a recipe of named stages, through the CLI."""

import json

from astrai.cli import main

RECIPE = """\
version: 1
name: cli
stages:
  tokenizer: {inputs: [chat.jsonl], vocab_size: 320}
  preprocess: {pipeline: sft.yaml, inputs: [chat.jsonl], tokenizer: tokenizer, holdout: 0.25, workers: 1}
"""


def _write(tmp_path, pipeline):
    with open(tmp_path / "chat.jsonl", "w") as fh:
        for i in range(20):
            fh.write(json.dumps({"messages": [{"role": "user", "content": f"count to {i}"},
                                              {"role": "assistant", "content": " ".join(map(str, range(i)))}]}) + "\n")
    (tmp_path / "sft.yaml").write_text(pipeline)
    (tmp_path / "r.yaml").write_text(RECIPE)
    return tmp_path / "r.yaml"


def test_run_flags_validate_and_inspect(tmp_path, capsys, sft_pipeline):
    recipe = _write(tmp_path, sft_pipeline("{max_seq_len: 128}"))
    assert main(["inspect", str(recipe)]) == 1  # the tokenizer is made by running its stage: said so
    assert "--only tokenizer" in capsys.readouterr().err
    assert main(["run", str(recipe)]) == 0
    out = capsys.readouterr().out
    assert "preprocess  preprocess  ran" in out and (tmp_path / "runs" / "cli" / "summary.json").exists()
    assert main(["run", str(recipe), "--only", "preprocess", "--force"]) == 0
    out = capsys.readouterr().out
    assert "tokenizer   tokenizer   not selected" in out and "preprocess  preprocess  replaced" in out
    assert main(["run", str(recipe), "--set", "preprocess.holdout=0.5"]) == 0
    assert "tokenizer   tokenizer   skipped" in capsys.readouterr().out
    assert main(["inspect", str(recipe), "-n", "1"]) == 0  # now the tokenizer exists
    capsys.readouterr()
    assert main(["validate", str(recipe)]) == 0

    recipe.write_text(RECIPE.replace("tokenizer: tokenizer", "tokenizer: tokeniser"))
    assert main(["validate", str(recipe)]) == 1
    out = capsys.readouterr().out
    assert "r.yaml:5:" in out and "did you mean 'tokenizer'" in out
    assert main(["run", str(recipe)]) == 1
    assert main(["run", str(recipe.with_name("sft.yaml")), "--force"]) == 1  # a pipeline: no stages to force
