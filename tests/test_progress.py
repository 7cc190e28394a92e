"""astrai.runtime.Progress: a tqdm bar on a terminal, a plain line every few seconds otherwise; wired into preprocess."""

import io
import sys
from pathlib import Path

import astrai.runtime as rt
from astrai.runtime import Progress


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_plain_lines_every_few_seconds_with_rate_and_eta():
    out, clock = io.StringIO(), Clock()
    p = Progress(10, "partitions", stream=out, clock=clock)
    clock.t += 1
    p.update(1, records=100, tokens=5000)
    assert out.getvalue() == ""  # not yet: one line per PROGRESS_EVERY_S
    clock.t += rt.PROGRESS_EVERY_S
    p.update(1, records=100, tokens=5000)  # 2 of 10 in 6 s: 0.333/s, 8 left -> 24 s
    line = out.getvalue().strip()
    assert line.startswith("progress: 2/10 partitions") and "200 records" in line and "10,000 tokens" in line
    assert "33 records/s" in line and "ETA 0:24" in line and "elapsed 0:06" in line
    for _ in range(8):
        p.update(1)
    assert out.getvalue().strip().splitlines()[-1].startswith("progress: 10/10 partitions")  # the last one always


def test_a_tqdm_bar_on_a_terminal():
    # one progress mechanism: on a terminal the bar is tqdm's, with the stage's counts after it
    out, clock = Tty(), Clock()
    p = Progress(4, "partitions", stream=out, clock=clock)
    assert type(p.bar).__module__.startswith("tqdm")
    for _ in range(4):
        clock.t += 1
        p.update(1, records=10)
    p.close()
    text = out.getvalue()
    assert "\r" in text and "4/4" in text and "partitions" in text and "40 records" in text
    assert "progress: " not in text  # no plain lines on a terminal


def test_preprocess_reports_progress(tmp_path, tiny_tokenizer, monkeypatch, capsys):
    sys.path.insert(0, str(Path(__file__).parent / "data"))
    from test_preprocess import chat_records, pipeline

    from astrai.data.preprocess import run_preprocess

    monkeypatch.setattr(rt, "PROGRESS_EVERY_S", 0.0)
    data = tmp_path / "d.jsonl"
    data.write_text(chat_records(60))
    stats = run_preprocess(pipeline(partition_bytes=3000), [str(data)], str(tmp_path / "o"),
                           tokenizer=str(tiny_tokenizer), workers=1, log=lambda s: None)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("progress: ")]
    assert len(lines) >= 3
    last = lines[-1]
    assert last.startswith(f"progress: {len(lines)}/{len(lines)} partitions")
    assert f"{stats['records_read']} records" in last and f"{stats['tokens']:,} tokens" in last
