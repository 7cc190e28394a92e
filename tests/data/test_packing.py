"""Tests for astrai.data.packing: exact agreement with a plain reference, invariants, hand cases."""

from __future__ import annotations

import numpy as np
import pytest

from astrai.data.packing import BinPlan, packing_efficiency, plan_bins

STRATEGIES = ["none", "simple", "bfd", "bfd_split"]
MODES = ["keep_start", "keep_end"]


# ----------------------------------------------------------------------------------------------
# Reference: the definitions written out item by item, as plainly as possible.


def kept_range(length, max_len, mode):
    """(start, kept length) of a document after truncation."""
    if max_len is None or length <= max_len:
        return 0, length
    if mode == "keep_start":
        return 0, max_len
    return length - max_len, max_len


def ref_plan(lengths, max_len, strategy, mode="keep_start"):
    lengths = [int(x) for x in lengths]
    truncated_tokens = 0
    truncated_docs = 0
    items = []  # (doc, start, length)
    if strategy == "bfd_split":
        for d, length in enumerate(lengths):
            s = 0
            while s < length:
                items.append((d, s, min(max_len, length - s)))
                s += max_len
    else:
        for d, length in enumerate(lengths):
            s, k = kept_range(length, max_len, mode)
            if k < length:
                truncated_tokens += length - k
                truncated_docs += 1
            items.append((d, s, k))

    bins = []  # list of lists of items
    if strategy == "none":
        bins = [[it] for it in items]
    elif strategy == "simple":
        used = None
        for it in items:
            if used is None or used + it[2] > max_len:
                bins.append([])
                used = 0
            bins[-1].append(it)
            used += it[2]
    else:
        order = sorted(items, key=lambda it: (-it[2], it[0], it[1]))
        remaining = []  # remaining capacity per bin
        for it in order:
            best = None
            for b, cap in enumerate(remaining):
                if cap >= it[2] and (best is None or cap < remaining[best]):
                    best = b
            if best is None:
                bins.append([])
                remaining.append(max_len)
                best = len(bins) - 1
            bins[best].append(it)
            remaining[best] -= it[2]

    pieces = [it for b in bins for it in b]
    offsets = [0]
    for b in bins:
        offsets.append(offsets[-1] + len(b))
    return BinPlan(
        piece_doc=np.array([p[0] for p in pieces], dtype=np.int64),
        piece_start=np.array([p[1] for p in pieces], dtype=np.int64),
        piece_len=np.array([p[2] for p in pieces], dtype=np.int64),
        bin_offsets=np.array(offsets, dtype=np.int64),
        truncated_tokens=truncated_tokens,
        truncated_docs=truncated_docs,
    )


def bins_of(plan):
    """The plan as a list of bins, each a list of (doc, start, len) tuples."""
    out = []
    for b in range(plan.n_bins):
        lo, hi = plan.bin_offsets[b], plan.bin_offsets[b + 1]
        out.append(
            [(int(d), int(s), int(n)) for d, s, n in zip(plan.piece_doc[lo:hi], plan.piece_start[lo:hi], plan.piece_len[lo:hi])]
        )
    return out


def assert_same(plan, ref):
    for f in ("piece_doc", "piece_start", "piece_len", "bin_offsets"):
        a = getattr(plan, f)
        assert a.dtype == np.int64, f
        np.testing.assert_array_equal(a, getattr(ref, f), err_msg=f)
    assert plan.truncated_tokens == ref.truncated_tokens
    assert plan.truncated_docs == ref.truncated_docs
    assert plan == ref


def check_invariants(plan, lengths, max_len, strategy):
    lengths = np.asarray(lengths, dtype=np.int64)
    n_pieces = plan.piece_len.shape[0]
    assert plan.bin_offsets[0] == 0 and plan.bin_offsets[-1] == n_pieces
    assert np.all(np.diff(plan.bin_offsets) >= 1)  # monotonic, and no empty bins
    assert np.all(plan.piece_len >= 1)
    assert np.all(plan.piece_start >= 0)
    assert np.all(plan.piece_start + plan.piece_len <= lengths[plan.piece_doc])
    if max_len is not None:
        assert np.all(plan.bin_lengths() <= max_len)
    assert int(plan.bin_lengths().sum()) == int(plan.piece_len.sum())
    # Token accounting: each document's pieces are disjoint, and together with the dropped
    # tokens they cover the document.
    kept = np.zeros_like(lengths)
    np.add.at(kept, plan.piece_doc, plan.piece_len)
    assert int(kept.sum()) + plan.truncated_tokens == int(lengths.sum())
    assert plan.truncated_docs == int(np.count_nonzero(kept < lengths))
    order = np.lexsort((plan.piece_start, plan.piece_doc))
    d, s, n = plan.piece_doc[order], plan.piece_start[order], plan.piece_len[order]
    same_doc = d[1:] == d[:-1]
    assert np.all(s[1:][same_doc] == (s + n)[:-1][same_doc])  # consecutive, no overlap
    if strategy == "bfd_split":
        assert plan.truncated_tokens == 0 and np.array_equal(kept, lengths)
    if strategy != "bfd_split":
        assert np.array_equal(np.sort(plan.piece_doc), np.arange(lengths.shape[0]))  # one piece per doc


# ----------------------------------------------------------------------------------------------
# Randomized agreement with the reference


def random_case(rng):
    n = int(rng.integers(0, 60))
    max_len = int(rng.choice([1, 2, 3, 5, 8, 16, 17, 64, 100]))
    kind = rng.integers(0, 4)
    if kind == 0:  # mostly small items, many per bin
        lengths = rng.integers(1, max(2, max_len // 3 + 1), size=n)
    elif kind == 1:  # up to and past max_len
        lengths = rng.integers(1, 2 * max_len + 2, size=n)
    elif kind == 2:  # few distinct values: large equal-length groups
        lengths = rng.choice(rng.integers(1, max_len + 1, size=3), size=n)
    else:  # far past max_len
        lengths = rng.integers(1, 5 * max_len + 1, size=n)
    return lengths.astype(np.int64), max_len


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("mode", MODES)
def test_matches_reference_random(strategy, mode):
    rng = np.random.default_rng(1234 + STRATEGIES.index(strategy) * 10 + MODES.index(mode))
    for _ in range(600):
        lengths, max_len = random_case(rng)
        plan = plan_bins(lengths, max_len, strategy, mode)
        assert_same(plan, ref_plan(lengths, max_len, strategy, mode))
        check_invariants(plan, lengths, max_len, strategy)


@pytest.mark.parametrize("strategy", ["bfd", "bfd_split"])
def test_matches_reference_larger(strategy):
    # Longer runs so that buckets accumulate many chunks and groups end mid-bucket often.
    rng = np.random.default_rng(99)
    for max_len in (7, 31, 128, 300):
        for _ in range(6):
            n = int(rng.integers(200, 800))
            lengths = rng.integers(1, int(max_len * 1.5) + 1, size=n)
            plan = plan_bins(lengths, max_len, strategy)
            assert_same(plan, ref_plan(lengths, max_len, strategy))
            check_invariants(plan, lengths, max_len, strategy)


def test_none_without_max_len():
    lengths = np.array([5, 1, 300, 2])
    plan = plan_bins(lengths, None, "none")
    assert_same(plan, ref_plan(lengths, None, "none"))
    check_invariants(plan, lengths, None, "none")
    assert plan.truncated_tokens == 0 and plan.n_bins == 4


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_deterministic(strategy):
    rng = np.random.default_rng(7)
    lengths = rng.integers(1, 3000, size=20_000)
    a = plan_bins(lengths, 1024, strategy)
    b = plan_bins(lengths.copy(), 1024, strategy)
    assert a == b


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_input_types(strategy):
    # Lists and other integer dtypes give the same plan as int64 arrays.
    lengths = [3, 9, 4, 4, 1, 12, 6]
    ref = plan_bins(np.array(lengths, dtype=np.int64), 10, strategy)
    assert plan_bins(lengths, 10, strategy) == ref
    assert plan_bins(np.array(lengths, dtype=np.uint16), 10, strategy) == ref
    assert plan_bins(np.array(lengths, dtype=np.int32), np.int64(10), strategy) == ref


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_empty(strategy):
    plan = plan_bins(np.array([], dtype=np.int64), 8, strategy)
    assert plan.n_bins == 0 and plan.piece_len.shape == (0,)
    assert np.array_equal(plan.bin_offsets, [0])
    assert plan.bin_lengths().shape == (0,)
    assert packing_efficiency(plan, 8) == 0.0


def test_large_max_len_sort_path():
    # max_len >= 65536 takes the comparison-sort path instead of the uint16 radix path.
    rng = np.random.default_rng(5)
    lengths = rng.integers(1, 150_000, size=300)
    for strategy in ("bfd", "bfd_split"):
        plan = plan_bins(lengths, 100_000, strategy)
        assert_same(plan, ref_plan(lengths, 100_000, strategy))


# ----------------------------------------------------------------------------------------------
# Hand-computed cases


def test_hand_none():
    plan = plan_bins([3, 12, 5], 10, "none")
    assert bins_of(plan) == [[(0, 0, 3)], [(1, 0, 10)], [(2, 0, 5)]]
    assert (plan.truncated_tokens, plan.truncated_docs) == (2, 1)
    plan = plan_bins([3, 12, 5], 10, "none", "keep_end")
    assert bins_of(plan) == [[(0, 0, 3)], [(1, 2, 10)], [(2, 0, 5)]]


def test_hand_simple():
    # 4+5 fit (9); 3 would make 12 -> new bin; 3+6 = 9; 15 -> truncated to 10, own bin; 1.
    plan = plan_bins([4, 5, 3, 6, 15, 1], 10, "simple")
    assert bins_of(plan) == [
        [(0, 0, 4), (1, 0, 5)],
        [(2, 0, 3), (3, 0, 6)],
        [(4, 0, 10)],
        [(5, 0, 1)],
    ]
    assert (plan.truncated_tokens, plan.truncated_docs) == (5, 1)
    assert plan.bin_lengths().tolist() == [9, 9, 10, 1]
    assert packing_efficiency(plan, 10) == pytest.approx(29 / 40)


def test_hand_bfd():
    # Sorted: doc1(7) doc4(6) doc0(5) doc3(5) doc2(3) doc5(2) doc6(2), max_len 10.
    # doc1 -> new bin0 (cap 3); doc4 -> new bin1 (cap 4); doc0 -> new bin2 (cap 5);
    # doc3 -> bin2 (cap 5 fits exactly, cap 0); doc2 (3) -> bin0 (cap 3 < 4); doc5 (2) -> bin1
    # (cap 4, only one left that fits: caps 0,4,0); doc6 (2) -> bin1 (cap 2).
    plan = plan_bins([5, 7, 3, 5, 6, 2, 2], 10, "bfd")
    assert bins_of(plan) == [
        [(1, 0, 7), (2, 0, 3)],
        [(4, 0, 6), (5, 0, 2), (6, 0, 2)],
        [(0, 0, 5), (3, 0, 5)],
    ]
    assert packing_efficiency(plan, 10) == 1.0


def test_hand_bfd_tie_lowest_bin():
    # Three 6s open bins 0,1,2 (cap 4 each); the 4s go to bins 0 and 1, the lowest indices.
    plan = plan_bins([6, 6, 6, 4, 4], 10, "bfd")
    assert bins_of(plan) == [[(0, 0, 6), (3, 0, 4)], [(1, 0, 6), (4, 0, 4)], [(2, 0, 6)]]


def test_hand_bfd_best_not_first():
    # After 7 (cap 3) and 5 (cap 5), the 3 goes to the tighter bin 0, then the 4 to bin 1.
    plan = plan_bins([7, 5, 4, 3], 10, "bfd")
    assert bins_of(plan) == [[(0, 0, 7), (3, 0, 3)], [(1, 0, 5), (2, 0, 4)]]


def test_hand_bfd_truncation():
    plan = plan_bins([13, 4, 6], 10, "bfd", "keep_end")
    # doc0 -> 10 tokens from offset 3, full bin; doc2 (6) -> bin1; doc1 (4) -> bin1.
    assert bins_of(plan) == [[(0, 3, 10)], [(2, 0, 6), (1, 0, 4)]]
    assert (plan.truncated_tokens, plan.truncated_docs) == (3, 1)


def test_hand_bfd_split():
    # doc0 = 23 -> chunks (0,0,10) (0,10,10) (0,20,3); doc2 = 10 -> (2,0,10); doc1 = 7.
    # Sorted: (0,0,10) (0,10,10) (2,0,10) (1,0,7) (0,20,3).
    plan = plan_bins([23, 7, 10], 10, "bfd_split")
    assert bins_of(plan) == [[(0, 0, 10)], [(0, 10, 10)], [(2, 0, 10)], [(1, 0, 7), (0, 20, 3)]]
    assert (plan.truncated_tokens, plan.truncated_docs) == (0, 0)


# ----------------------------------------------------------------------------------------------
# Errors


def test_bad_strategy():
    with pytest.raises(ValueError, match="none, simple, bfd, bfd_split"):
        plan_bins([1, 2], 8, "first_fit")


def test_bad_truncation_mode():
    with pytest.raises(ValueError, match="keep_start, keep_end"):
        plan_bins([1, 2], 8, "bfd", "keep_middle")


@pytest.mark.parametrize("strategy", ["simple", "bfd", "bfd_split"])
def test_missing_max_len(strategy):
    with pytest.raises(ValueError, match="needs max_len"):
        plan_bins([1, 2], None, strategy)


@pytest.mark.parametrize("max_len", [0, -3, 2.5])
def test_bad_max_len(max_len):
    with pytest.raises(ValueError, match="max_len"):
        plan_bins([1, 2], max_len, "bfd")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_zero_length(strategy):
    with pytest.raises(ValueError, match=r"lengths\[2\] = 0"):
        plan_bins([3, 4, 0, -1], 8, strategy)


def test_bad_lengths_shape_and_dtype():
    with pytest.raises(ValueError, match="1-D"):
        plan_bins([[1, 2]], 8, "bfd")
    with pytest.raises(ValueError, match="integers"):
        plan_bins([1.0, 2.0], 8, "bfd")
