"""Inspect: see exactly which tokens will be trained, before spending GPU hours (the verb is
astrai.cli.inspect, which resolves the pipeline or recipe and calls these).

Two sources, one view:

- records: the first N input records (or the chosen ones, counted from 0 in input order) go
  through the same `Processor` as `astrai preprocess`, so the token ids, labels and the
  filter/reject reasons shown are exactly what preprocess writes.
- a written dataset (a preprocess output directory): rows of the Parquet shards, i.e. bins, their
  documents (from seq_lens) and position ids as written, decoded with the tokenizer recorded in
  manifest.json, and the statistics from stats.json.

Only what is shown is read, so a few records of a huge file come back in about the time it takes
to load the tokenizer. The package, in the order the data flows:

    records.py   records mode: read only the wanted input records, process them as preprocess does
    dataset.py   dataset mode: read only the wanted rows of the shards
    views.py     what is shown: SeqView (one token sequence), Entry (a record or row), Report
    tokens.py    the exact text each token adds; aligning two pipelines' tokens for --compare
    layout.py    text cells: styles, lines, wrapping, colour or plain markers
    text.py      --format text: terminal or plain output, --table, --compare columns, statistics
    jsonl.py     --format json: one object per line
    html.py      --format html: one self-contained page with hover details
"""

from astrai.data.inspect.dataset import dataset_report
from astrai.data.inspect.html import render_html
from astrai.data.inspect.jsonl import render_json
from astrai.data.inspect.records import records_report
from astrai.data.inspect.text import render_text
from astrai.data.inspect.tokens import add_compare_marks

__all__ = ["add_compare_marks", "dataset_report", "records_report", "render_html", "render_json", "render_text"]
