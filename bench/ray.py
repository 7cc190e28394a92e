"""Wall time of the Ray executor against the local process pool, on the same machine and input.

    python bench/ray.py [--records 4000] [--partition-mib 1] [--packing bfd] [--repeats 2]

Both runs use 2 CPUs: the local pool with `workers: 2`, Ray as a two-node cluster started here
(ray.cluster_utils.Cluster: a head and a second node process, one CPU each, 100 MiB object store
each), so Ray pays for what a real cluster pays (scheduling, a worker process per node, the
driver's round trips) but gains no extra cores. The overhead ratio (Ray time / local time) is
expected above 1 here; it is reported as measured. The cluster's start is reported apart: a
cluster is started once and serves many runs.

Each run is a fresh child process (`run_preprocess` inside it, interpreter start-up excluded),
writing into a fresh directory; local and Ray runs alternate and the best of --repeats is kept,
since the machine is shared. The outputs must be byte-identical (sha256 over data/*.parquet and
stats.json), which is checked too.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# This file is named ray.py: its folder goes to the end of the import path, after site-packages,
# so that `import ray` (here, and in the Ray driver of the child runs) finds Ray, not this file.
sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != HERE] + [str(HERE)]

from e2e import PIPELINE, TOKENIZER, output_digest, pipeline_overrides  # noqa: E402

NODE_CPUS = 1
OBJECT_STORE = 100 * 2 ** 20


def child(args):
    """One run in this (fresh) process; prints one JSON line with the time and the stats."""
    from astrai.config import load_pipeline
    from astrai.data.preprocess import run_preprocess

    pipe = load_pipeline(PIPELINE, tuple(pipeline_overrides(args.packing, args.partition_bytes)))
    t0 = time.perf_counter()
    stats = run_preprocess(pipe, [args.input], args.out, tokenizer=TOKENIZER, workers=2, base_dir=str(ROOT),
                           log=lambda s: None, executor=args.executor, ray_address=args.ray_address)
    print(json.dumps({"seconds": time.perf_counter() - t0, "stats": stats}))


def run(input_path: Path, out: Path, packing: str, partition_bytes: int, executor: str, address: str) -> dict:
    from child import run_child

    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--input", str(input_path), "--out", str(out),
           "--packing", packing, "--partition-bytes", str(partition_bytes), "--executor", executor,
           "--ray-address", address]
    res, stderr, _ = run_child(cmd, str(ROOT), dict(os.environ), f"{executor} run (packing={packing})")
    if stderr.strip():
        print(f"  [{executor} stderr] {stderr.strip()[-500:]}")
    return res


def start_cluster():
    from ray.cluster_utils import Cluster

    t0 = time.perf_counter()
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": NODE_CPUS, "object_store_memory": OBJECT_STORE, "include_dashboard": False})
    cluster.add_node(num_cpus=NODE_CPUS, object_store_memory=OBJECT_STORE)
    cluster.wait_for_nodes()
    return cluster, time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=4000, help="conversations in the input (real ones, cycled)")
    ap.add_argument("--partition-mib", type=float, default=1.0, help="preprocessing.partition_bytes in MiB")
    ap.add_argument("--packing", default="bfd", help="comma-separated packing strategies to measure")
    ap.add_argument("--repeats", type=int, default=2, help="runs per executor, alternating; best time kept")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--input", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--partition-bytes", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--executor", help=argparse.SUPPRESS)
    ap.add_argument("--ray-address", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)

    from data import chats, write_jsonl

    source, records = chats(args.records)
    partition_bytes = int(args.partition_mib * (1 << 20))
    tmp = Path(tempfile.mkdtemp(prefix="astrai-raybench-", dir="/tmp"))
    os.environ["RAY_TMPDIR"] = str(tmp)  # the cluster's sockets and logs stay private and are removed
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    input_path = tmp / "chats.jsonl"
    size = write_jsonl(input_path, records, source, args.records)
    from astrai.data.read import plan_partitions

    n_parts = len(plan_partitions([input_path], partition_bytes))
    print(f"data: {source}, {args.records} conversations, {size / 2**20:.1f} MiB JSONL, {n_parts} partitions of "
          f"<= {args.partition_mib:g} MiB; cpus: {os.cpu_count()}; tokenizer {TOKENIZER}")
    print(f"load average before: {os.getloadavg()[0]:.1f} (2 free cores read ~0; other work skews both executors)")
    cluster, t_start = start_cluster()
    print(f"ray: 2 nodes x {NODE_CPUS} CPU started in {t_start:.1f} s (not counted below)")
    failed = []
    try:
        for packing in [p.strip() for p in args.packing.split(",") if p.strip()]:
            best, digests = {}, {}
            for rep in range(args.repeats):
                for executor in ("local", "ray"):
                    out = tmp / f"out-{packing}-{executor}-{rep}"
                    res = run(input_path, out, packing, partition_bytes, executor, cluster.address)
                    digests.setdefault(executor, set()).add(output_digest(out)[0])
                    if executor not in best or res["seconds"] < best[executor]["seconds"]:
                        best[executor] = res
                    shutil.rmtree(out)
            st = best["local"]["stats"]
            print(f"\npacking={packing}: {st['records_read']} records, {st['tokens']} tokens, {st['rows']} rows")
            for executor, label in (("local", "local, workers=2:"), ("ray", "ray, 2 nodes x 1 CPU:")):
                r = best[executor]
                print(f"  {label:<24} {r['seconds']:6.2f} s  {st['tokens'] / r['seconds']:9,.0f} tokens/s")
            ratio = best["ray"]["seconds"] / best["local"]["seconds"]
            print(f"  overhead ratio ray/local wall time: {ratio:.2f}x (above 1 expected on one machine)")
            same = len(set().union(*digests.values())) == 1
            print(f"  byte-identical (sha256 of data/*.parquet + stats.json): {'PASS' if same else 'FAIL'}")
            if not same:
                failed.append(f"{packing}: ray output differs from local")
        print(f"\nload average after: {os.getloadavg()[0]:.1f}")
    finally:
        cluster.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\noverall: {'FAIL (' + '; '.join(failed) + ')' if failed else 'PASS'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
