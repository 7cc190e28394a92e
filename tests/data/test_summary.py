"""The run summary: rejects with reasons and their file, truncation cost, empty input, next command."""

import json
import sys
from pathlib import Path

from astrai.data.preprocess import run_preprocess

sys.path.insert(0, str(Path(__file__).parent))
from test_preprocess import chat_records, pipeline  # noqa: E402


def run(pipe, data, out, tok):
    logs = []
    stats = run_preprocess(pipe, [str(data)], str(out), tokenizer=str(tok), workers=1, log=logs.append)
    return stats, "\n".join(logs)


def test_summary_names_rejects_truncation_and_the_next_command(tmp_path, tiny_tokenizer):
    data = tmp_path / "d.jsonl"
    data.write_text(chat_records(40, bad_every=5))
    out = tmp_path / "o"
    stats, text = run(pipeline(max_seq_len=40), data, out, tiny_tokenizer)
    reasons = stats["rejected_by_reason"]
    assert f"rejected {stats['records_rejected']} (" in text and f"see {out}/rejects.jsonl" in text
    for reason, n in reasons.items():
        assert f"{reason} {n}" in text
    lost = stats["truncated_tokens"]
    assert lost > 0
    share = lost / (stats["tokens"] + lost)  # by hand: tokens counts what was kept after truncation
    assert f"{lost} tokens lost ({share:.1%} of the tokens)" in text
    assert text.rstrip().endswith(f"next: astrai inspect {out}")
    # replacing it with another fingerprint says so
    _, text = run(pipeline(max_seq_len=60), data, out, tiny_tokenizer)
    assert "replacing an existing output of another fingerprint" in text


def test_an_empty_input_warns(tmp_path, tiny_tokenizer):
    data = tmp_path / "d.jsonl"
    data.write_text("")
    stats, text = run(pipeline(), data, tmp_path / "o", tiny_tokenizer)
    assert stats["records_read"] == 0 and "warning: the inputs hold no records" in text


def test_the_bundled_sample_loses_almost_nothing_to_truncation(repo_root, tmp_path):
    from astrai.cli import main

    recipe = str(Path(repo_root) / "recipes" / "scratch_sft.yaml")
    for stage in ("tokenizer", "preprocess"):  # not train/eval: the data is the question here
        assert main(["run", recipe, "--set", f"run_dir={tmp_path}", "--only", stage]) == 0
    for split in ("train", "val"):
        stats = json.loads((tmp_path / "preprocess" / "output" / split / "stats.json").read_text())
        lost = stats["truncated_tokens"] + stats["pack_truncated_tokens"]
        assert lost / (stats["tokens"] + stats["truncated_tokens"]) <= 0.01, (split, lost)
