"""What a finished preprocess run tells its user, from stats.json alone (one home for the wording).

Every line answers a question a user has after a run: how much was kept, what was rejected or
filtered and why (and where the rejects are), how many tokens truncation cost, whether the input
was empty, and what to run next.
"""

from __future__ import annotations


def _reasons(by_reason: dict) -> str:
    return ", ".join(f"{r} {n}" for r, n in sorted(by_reason.items(), key=lambda kv: (-kv[1], kv[0])))


def summary_lines(stats: dict, out: str, shards: int) -> list[str]:
    read = stats["records_read"]
    if read == 0:
        return [f"warning: the inputs hold no records; {out} is empty (check the -i paths and file contents)"]
    lines = [f"{out}: {stats['records_kept']} records kept of {read} read, {stats['rows']} rows, "
             f"{stats['tokens_written']} tokens ({stats['trained_tokens']} trained) in {shards} shard(s)"]
    if stats["records_rejected"]:
        lines.append(f"  rejected {stats['records_rejected']} ({_reasons(stats['rejected_by_reason'])}): "
                     f"see {out}/rejects.jsonl")
    if stats["records_filtered"]:
        lines.append(f"  filtered {stats['records_filtered']} ({_reasons(stats['filtered_by_reason'])})")
    lost = stats["truncated_tokens"] + stats.get("pack_truncated_tokens", 0)
    if lost:
        docs = stats["truncated_docs"] + stats.get("pack_truncated_docs", 0)
        before = stats["tokens"] + stats["truncated_tokens"]  # stats["tokens"] counts after max_seq_len
        fixes = []  # each counter has its own cure: bfd_split cannot undo a max_seq_len cut
        if stats["truncated_tokens"]:
            fixes.append(f"raise max_seq_len ({stats['truncated_tokens']} tokens over it)")
        if stats.get("pack_truncated_tokens", 0):
            fixes.append(f"use packing_strategy: bfd_split ({stats['pack_truncated_tokens']} tokens over "
                         f"max_packed_len)")
        lines.append(f"  truncated {docs} document(s): {lost} tokens lost ({lost / before:.1%} of the tokens); "
                     f"{' and '.join(fixes)} to keep them")
    lines.append(f"  next: astrai inspect {out}")
    return lines
