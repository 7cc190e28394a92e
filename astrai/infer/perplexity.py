"""Perplexity with document isolation, and held-out prompts, for the eval stage (see eval.py).

Perplexity is token-weighted over trained tokens only: exp(sum of -log p(label) / number of
trained tokens), where a token is trained when its label (Hugging Face convention, not shifted)
is not IGNORE_INDEX; position t-1 predicts label t inside a document. `DocumentContext` runs causal
attention separately inside each document of a packed row (no token sees another document, and no
document's first token is predicted from the previous one), with the row's stored position ids
(restarting per document in doc_reset mode): the same numbers as running each document alone.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Optional

import torch

from astrai.model.attention import AttentionContext, causal_sdpa
from astrai.schema import IGNORE_INDEX


class DocumentContext(AttentionContext):
    """Block-diagonal causal attention: each document of the flat batch attends only to itself."""

    def __init__(self, doc_lens: list[int]):
        self.doc_lens = doc_lens

    def rope_tables(self, position_ids, rope):
        """None: the engine's fused forward then applies RoPE through `rotary` (the model's own)."""
        return None

    def attend(self, layer_idx, q, k, v, window=None, scale=None):
        out, start = torch.empty_like(q), 0
        for n in self.doc_lens:
            out[start:start + n] = causal_sdpa(q[start:start + n], k[start:start + n], v[start:start + n], window, scale)
            start += n
        return out


def _batches(dataset, max_rows: Optional[int], batch_tokens: int):
    """Whole rows, grouped up to batch_tokens tokens per forward."""
    batch, size = [], 0
    for i in range(min(len(dataset), max_rows or len(dataset))):
        row = dataset[i]
        if batch and size + len(row["input_ids"]) > batch_tokens:
            yield batch
            batch, size = [], 0
        batch.append(row)
        size += len(row["input_ids"])
    if batch:
        yield batch


@torch.inference_mode()
def perplexity(model, dataset, max_rows: Optional[int] = None, batch_tokens: int = 8192, device="cpu") -> dict:
    nll, count, docs, rows = 0.0, 0, 0, 0
    for batch in _batches(dataset, max_rows, batch_tokens):
        ids = torch.cat([r["input_ids"] for r in batch]).to(device)
        pos = torch.cat([r["position_ids"] for r in batch]).to(device)
        labels = torch.cat([r["labels"] for r in batch]).to(device)
        doc_lens = [n for r in batch for n in r["seq_lens"].tolist()]
        hidden = model(ids, pos, DocumentContext(doc_lens))
        # position t predicts label t + 1 when both are in the same document and the label is trained
        target = torch.full_like(labels, IGNORE_INDEX)
        target[:-1] = labels[1:]
        last = torch.tensor(doc_lens, device=device).cumsum(0) - 1  # a document's last token predicts nothing
        target[last] = IGNORE_INDEX
        where = (target != IGNORE_INDEX).nonzero().squeeze(1)
        for chunk in where.split(1024):  # never hold [T, vocab] logits at once
            logits = model.logits(hidden[chunk]).float()
            nll += torch.nn.functional.cross_entropy(logits, target[chunk], reduction="sum").item()
        count += len(where)
        docs += len(doc_lens)
        rows += len(batch)
    loss = nll / count if count else float("nan")
    return {"loss": loss, "perplexity": math.exp(loss) if count else float("nan"), "trained_tokens": count,
            "documents": docs, "rows": rows}


MIN_PROMPT = 8  # tokens: more than a bare role header


def held_out_prompts(dataset, n: int, scan_rows: int = 200) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, reference ids) for n held-out documents that have a trained part after a prompt;
    a document trained from its first token (pretraining) is cut in half instead.

    Packed rows can hold pieces of documents cut by bfd_split, which start anywhere (mid-text, or
    at a lone assistant header). Whole documents of one template all start with the same token, so
    documents starting with the most common first token, with a prompt of at least MIN_PROMPT
    tokens, come first (in dataset order); the others only fill up what is left."""
    found = []
    for i in range(min(len(dataset), scan_rows)):
        row, start = dataset[i], 0
        for length in row["seq_lens"].tolist():
            ids, labels = row["input_ids"][start:start + length], row["labels"][start:start + length]
            start += length
            trained = (labels != IGNORE_INDEX).nonzero()
            if len(trained) == 0:
                continue
            first = int(trained[0, 0]) or max(1, length // 2)
            if first < length:
                found.append((ids[:first].tolist(), ids[first:][labels[first:] != IGNORE_INDEX].tolist()))
        if len(found) >= 20 * n:
            break
    if not found:
        return []
    usual = Counter(p[0] for p, _ in found).most_common(1)[0][0]
    # a stable sort: whole documents first, each group in dataset order
    return sorted(found, key=lambda c: not (c[0][0] == usual and len(c[0]) >= MIN_PROMPT))[:n]
