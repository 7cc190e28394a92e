"""Record statistics: one computation for stats.json and for `astrai inspect`'s record view.

A `Tally` counts what one unit of work saw (a preprocess partition, or the records inspect shows):
records read/kept/filtered/rejected by reason, tokens, trained tokens, truncation, tokens per role,
domains and the document length histogram. Its `summary()` is plain JSON (a partition writes it
as its completion marker); `record_stats` merges summaries into the record part of stats.json,
`dataset_stats` adds the packing figures. Inspect calls the same two, so its numbers cannot drift
from what preprocess writes.

stats.json's `trained_tokens` (single output) is what the shards hold: the labels != -100 counted
as each row group was written (astrai.data.write.trained_count), so each packed piece's masked
first position and the packer's truncation are accounted for; `supervised_share` is it over
`tokens_written`. `trained_tokens_per_role` counts the records' own labels, before packing.
"""

from __future__ import annotations

from collections import Counter
from typing import Optional

import numpy as np

from astrai.schema import IGNORE_INDEX

# document length histogram: buckets <=16, <=32, ... <=131072, then >131072
HIST_EDGES = [2 ** k for k in range(4, 18)]
HIST_KEYS = [f"<={e}" for e in HIST_EDGES] + [f">{HIST_EDGES[-1]}"]
_COUNTERS = ("filtered", "rejected", "roles", "trained_roles", "domains", "hist")


def length_bucket(n: int) -> str:
    """The histogram bucket of a document of n tokens."""
    idx = int(np.searchsorted(HIST_EDGES, n))
    return HIST_KEYS[idx]


class Tally:
    def __init__(self):
        self.c = Counter()
        self.filtered, self.rejected = Counter(), Counter()
        self.roles, self.trained_roles, self.domains, self.hist = Counter(), Counter(), Counter(), Counter()

    def add_filtered(self, reason: str):
        self.filtered[reason] += 1

    def add_rejected(self, reason: str):
        self.rejected[reason] += 1

    def add_kept(self, out):
        """A kept record (astrai.data.process.RecordOutput): its domain and every sequence."""
        self.c["kept"] += 1
        if out.domain is not None:
            self.domains[out.domain] += 1
        for group in out.seqs.values():
            for seq in group:
                self.add_seq(seq)

    def add_seq(self, seq):
        self.c["tokens"] += len(seq)
        self.c["trained_tokens"] += seq.trained
        self.c["truncated_tokens"] += seq.truncated
        self.c["truncated_docs"] += bool(seq.truncated)
        self.hist[length_bucket(len(seq))] += 1
        counts = np.bincount(seq.token_msg + 1, minlength=len(seq.roles) + 1)
        trained = (np.bincount(seq.token_msg + 1, weights=(seq.labels != IGNORE_INDEX), minlength=len(seq.roles) + 1)
                   if seq.labels is not None else counts)
        # index 0 holds tokens outside any message: chat template text (headers, end-of-turn), or plain text
        for i, role in enumerate(["template" if seq.roles else "text"] + seq.roles):
            if counts[i]:
                self.roles[role] += int(counts[i])
            if trained[i]:
                self.trained_roles[role] += int(trained[i])

    def summary(self, **extra) -> dict:
        return {**self.c, "filtered": dict(self.filtered), "rejected": dict(self.rejected), "roles": dict(self.roles),
                "trained_roles": dict(self.trained_roles), "domains": dict(self.domains), "hist": dict(self.hist),
                **extra}


def _merge(summaries: list[dict]) -> tuple[Counter, dict]:
    total = Counter()
    merged = {k: Counter() for k in _COUNTERS}
    for s in summaries:
        for k, v in s.items():
            if k in merged:
                merged[k].update(v)
            elif isinstance(v, (int, float)):
                total[k] += v
    return total, merged


def record_stats(summaries: list[dict]) -> dict:
    """The record part of stats.json (keys in reading order), from Tally summaries."""
    total, merged = _merge(summaries)
    tokens = total["tokens"]
    stats = {
        "records_read": total["read"],
        "records_kept": total["kept"],
        "records_filtered": sum(merged["filtered"].values()),
        "records_rejected": sum(merged["rejected"].values()),
        "filtered_by_reason": dict(sorted(merged["filtered"].items())),
        "rejected_by_reason": dict(sorted(merged["rejected"].items())),
        "tokens": tokens,
        "trained_tokens": total["trained_tokens"],
        "supervised_share": (total["trained_tokens"] / tokens) if tokens else None,
        "truncated_tokens": total["truncated_tokens"],
        "truncated_docs": total["truncated_docs"],
        "tokens_per_role": dict(sorted(merged["roles"].items())),
        "trained_tokens_per_role": dict(sorted(merged["trained_roles"].items())),
        "records_per_domain": dict(sorted(merged["domains"].items())),
        "doc_length_histogram": {k: merged["hist"][k] for k in HIST_KEYS if merged["hist"][k]},
    }
    # The accounting identity (nothing is lost silently), asserted on every run.
    assert stats["records_read"] == stats["records_kept"] + stats["records_filtered"] + stats["records_rejected"]
    return stats


def dataset_stats(pipeline, summaries: list[dict], packing: Optional[dict]) -> dict:
    """stats.json: the record statistics, then rows, bins and packing (from the global packing pass
    when there is one, else from the partitions' own counts)."""
    total, _ = _merge(summaries)
    stats = record_stats(summaries)
    stats.update({
        "packing_strategy": pipeline.preprocessing.packing_strategy,
        "max_packed_len": pipeline.bin_capacity,
        "rows": total["rows"],
        "pack_truncated_tokens": total["pack_truncated_tokens"],
        "pack_truncated_docs": total["pack_truncated_docs"],
    })
    if packing:
        stats.update({k: v for k, v in packing.items() if k != "trained_written"})
        stats["tokens_written"] = stats["tokens"] - stats["pack_truncated_tokens"]
    else:
        stats["tokens_written"] = stats["tokens"] - stats["pack_truncated_tokens"]
        stats["bins"] = stats["rows"]
        ml = pipeline.bin_capacity
        single = pipeline.input.sources is None
        stats["packing_efficiency"] = (stats["tokens_written"] / (stats["rows"] * ml)) if (ml and stats["rows"]
                                                                                          and single) else None
    if pipeline.input.sources is None:
        # exact: the labels != -100 the shards hold (each packed piece's first position is masked, the
        # packer's truncation drops tokens); multi-output rows are written as processed
        stats["trained_tokens"] = packing["trained_written"] if packing else total["trained_written"]
        written = stats["tokens_written"]
        stats["supervised_share"] = stats["trained_tokens"] / written if written else None
    return stats
