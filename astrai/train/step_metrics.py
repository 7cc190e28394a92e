"""A step's metrics: accumulated over its micro-batches, then reduced across ranks in one collective."""

from __future__ import annotations

from astrai.train.distributed import Dist, all_sum


def add_metrics(sums: dict, counts: dict, metrics: dict):
    """Accumulate a loss's metrics: a number is a sum over units, a (sum, count) pair a mean of its own."""
    for k, v in metrics.items():
        if isinstance(v, tuple):
            sums[k] = sums.get(k, 0.0) + v[0]
            counts[k] = counts.get(k, 0.0) + v[1]
        else:
            sums[k] = sums.get(k, 0.0) + v


def reduce_metrics(sums: dict, counts: dict, units: float, dist: Dist, flag: float = 0.0,
                   raw: tuple = ()) -> tuple[dict, bool]:
    """Sum over ranks (one collective), then each sum divided by its count or by the units (the
    `raw` keys stay sums); a metric with a count of zero (e.g. no group with unequal rewards) is
    left out. Returns (values, whether any rank raised the flag)."""
    keys, ckeys = sorted(sums), sorted(counts)
    values = all_sum([sums[k] for k in keys] + [counts[k] for k in ckeys] + [flag], dist)
    total = dict(zip(keys, values))
    count = dict(zip(ckeys, values[len(keys):]))
    out = {k: total[k] if k in raw else total[k] / count[k] if k in count else total[k] / units
           for k in keys if count.get(k, 1.0) > 0}
    return out, values[-1] > 0
