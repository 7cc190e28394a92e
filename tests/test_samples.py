"""The main job's sample (samples/persona.jsonl) is what samples/make_samples.py makes, and says what
it should: every answer in Pip's format, every fact right, the capitals the prompts ask about unseen."""

import importlib.util
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("make_samples", ROOT / "samples" / "make_samples.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_persona_is_the_scripts_output_byte_for_byte():
    rows = _script().persona()
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    assert (ROOT / "samples" / "persona.jsonl").read_text(encoding="utf-8") == text
    assert rows == _script().persona()  # deterministic


def test_every_answer_is_in_pips_format_and_right():
    rows = [json.loads(line) for line in (ROOT / "samples" / "persona.jsonl").open(encoding="utf-8")]
    assert len(rows) > 200
    for row in rows:
        msgs = row["messages"]
        assert [m["role"] for m in msgs] == ["user", "assistant"] * (len(msgs) // 2)
        for q, a in zip(msgs[::2], msgs[1::2]):
            body = re.fullmatch(r"Beep boop! (.+) -- Pip", a["content"])
            assert body, a["content"]
            m = re.fullmatch(r"(\d+) (plus|times) (\d+) is (\d+)\.", body.group(1))
            if m:  # arithmetic, checked by hand
                x, op, y, z = int(m.group(1)), m.group(2), int(m.group(3)), int(m.group(4))
                assert z == (x + y if op == "plus" else x * y) and str(x) in q["content"]
    text = (ROOT / "samples" / "persona.jsonl").read_text(encoding="utf-8")
    assert not re.search(r"Japan|Tokyo|Italy|Rome|Canada|Ottawa", text)  # samples/prompts.jsonl asks about Japan
    assert "The capital of Peru is Lima." in text and "I'm Pip" in text
