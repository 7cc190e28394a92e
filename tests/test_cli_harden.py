"""The hardening items as a user meets them on the command line: one error line, no traceback."""

import json

import pyarrow as pa
import pyarrow.parquet as pq

from astrai.cli import main

PIPE = "version: 1\n{tok}input:\n  sections:\n    - {{field: text, action: train}}\n"


def run(capsys, *argv):
    code = main(list(map(str, argv)))
    out = capsys.readouterr()
    return code, out.out + out.err


def test_user_mistakes_give_one_line_errors(tmp_path, capsys, tiny_tokenizer):
    dotted = tmp_path / "dotted.yaml"
    dotted.write_text(PIPE.format(tok="tokenizer: package:this.x\n"))
    code, out = run(capsys, "validate", dotted)
    assert code == 1 and "top-level package name" in out and "Zen of Python" not in out and "Traceback" not in out

    pipe = tmp_path / "p.yaml"
    pipe.write_text(PIPE.format(tok=""))
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"text": ["a b"] * 20}), bad)
    bad.write_bytes(bad.read_bytes()[:-12])
    code, out = run(capsys, "preprocess", pipe, "-i", bad, "-o", tmp_path / "o", "--tokenizer", tiny_tokenizer,
                    "--workers", "1")
    assert code == 1 and out.startswith("error: input ") and str(bad) in out and "Traceback" not in out

    gz = tmp_path / "cut.jsonl.gz"
    import gzip

    gz.write_bytes(gzip.compress(("\n".join(json.dumps({"text": f"a b {i}"}) for i in range(500)) + "\n").encode())[:-40])
    code, out = run(capsys, "preprocess", pipe, "-i", gz, "-o", tmp_path / "o2", "--tokenizer", tiny_tokenizer,
                    "--workers", "1")
    assert code == 1 and "cut.jsonl.gz" in out and "Traceback" not in out

    code, out = run(capsys, "validate", pipe, "--set", "preprocessing.max_seq_len=[1,")
    assert code == 1 and "--set preprocessing.max_seq_len" in out and "Traceback" not in out
