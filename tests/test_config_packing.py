"""max_packed_len without packing is said, not ignored silently: a warning line naming
the fix (a warning, so `--set preprocessing.packing_strategy=none` on a packing pipeline still runs)."""

import json

from astrai.config import load_pipeline
from astrai.data.preprocess import run_preprocess


def test_max_packed_len_without_packing_warns(tmp_path, tiny_tokenizer):
    f = tmp_path / "p.yaml"
    f.write_text("version: 1\ninput:\n  sections:\n    - {field: text, action: train}\n"
                 "preprocessing:\n  max_seq_len: 64\n  max_packed_len: 128\n")
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": "hello world"}) + "\n")
    cases = [((), True), (("preprocessing.packing_strategy=bfd",), False), (("preprocessing.max_packed_len=null",), False)]
    for k, (overrides, warned) in enumerate(cases):
        logs = []
        run_preprocess(load_pipeline(f, overrides), [str(data)], str(tmp_path / f"o{k}"),
                       tokenizer=str(tiny_tokenizer), workers=1, log=logs.append)
        hits = [l for l in logs if l.startswith("warning:") and "max_packed_len" in l]
        assert bool(hits) == warned, (overrides, logs)
        assert all("packing_strategy" in h for h in hits)
