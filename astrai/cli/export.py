"""`astrai export OUT --to hf|jsonl|parquet DEST`: a preprocessed directory in another form."""

from __future__ import annotations

import sys


def help_for(verb: str) -> str:
    return "export a preprocessed directory to a HF dataset, readable JSONL or Parquet"


def add_arguments(p):
    p.add_argument("out", help="preprocessed output directory (holds manifest.json)")
    p.add_argument("--to", required=True, choices=["hf", "jsonl", "parquet"],
                   help="hf: save_to_disk dir; jsonl: rows with decoded text; parquet: re-sharded")
    p.add_argument("dest", help="destination path (must not exist)")
    p.add_argument("--rows-per-shard", type=int, default=100_000, help="parquet: rows per file [default: 100000]")
    p.add_argument("--tokenizer", default=None, help="jsonl: tokenizer for decoding [default: the manifest's]")


def run(args) -> int:
    from astrai.data.export import export

    if args.overrides:
        print("astrai export: --set has no effect here (export has no config keys)", file=sys.stderr)
        return 2
    n = export(args.out, args.to, args.dest, args.rows_per_shard, args.tokenizer)
    print(f"exported {n} rows to {args.dest} ({args.to})")
    return 0
