"""Held-out preference figures for the eval stage: DPO pairs against a reference model, scored groups
(GRPO data) by how the model would choose among their candidates; and prompts to sample from.

Each answer is scored by its summed log-prob over its trained tokens (labels unshifted, HF
convention: position t predicts label t + 1 inside one document), answers evaluated as separate
documents (perplexity.DocumentContext) in forwards of up to `batch_tokens` tokens. The figures
are astrai.model.scores', the same that training logs per step and at validation:
- DPO: reward_accuracy, reward_margin, reward_chosen, reward_rejected (beta * (model - reference)
  per answer; TRL's rewards/*), logp_chosen, logp_rejected, over `pairs`; the reference is the
  model DPO started from (a recipe's `ref_model: sft`); at the reference itself every reward is 0;
- groups: policy_reward (the candidates' rewards weighted by the model's probability of each),
  policy_accuracy, reward_mean (the data's: what choosing at random collects), over `groups`.
"""

from __future__ import annotations

from typing import Optional

import torch

from astrai.infer.perplexity import DocumentContext
from astrai.model.scores import choice_figures, dpo_figures, reward_figures
from astrai.schema import IGNORE_INDEX


def _ids(x) -> torch.Tensor:
    return torch.as_tensor(x, dtype=torch.long)


@torch.inference_mode()
def doc_logps(model, docs: list[tuple], device="cpu", batch_tokens: int = 8192) -> torch.Tensor:
    """[len(docs)] float64: each (ids, labels) document's summed log p(label) over trained tokens."""
    out, batch, size = [], [], 0
    for ids, labels in docs:
        if batch and size + len(ids) > batch_tokens:
            out.append(_batch_logps(model, batch, device))
            batch, size = [], 0
        batch.append((_ids(ids), _ids(labels)))
        size += len(ids)
    if batch:
        out.append(_batch_logps(model, batch, device))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)


def _batch_logps(model, batch, device) -> torch.Tensor:
    lens = [len(ids) for ids, _ in batch]
    ids = torch.cat([i for i, _ in batch]).to(device)
    labels = torch.cat([lab for _, lab in batch]).to(device)
    pos = torch.cat([torch.arange(n) for n in lens]).to(device)
    hidden = model(ids, pos, DocumentContext(lens))
    target = torch.full_like(labels, IGNORE_INDEX)
    target[:-1] = labels[1:]
    target[torch.tensor(lens, device=device).cumsum(0) - 1] = IGNORE_INDEX  # a document's last token predicts nothing
    lp = torch.zeros(len(ids), dtype=torch.float64, device=device)
    where = (target != IGNORE_INDEX).nonzero().squeeze(1)
    for chunk in where.split(1024):  # never hold [T, vocab] logits at once
        z = model.logits(hidden[chunk]).float()
        lp[chunk] = (z.gather(1, target[chunk, None])[:, 0] - torch.logsumexp(z, dim=-1)).double()
    doc = torch.repeat_interleave(torch.arange(len(lens), device=device), torch.tensor(lens, device=device))
    return torch.zeros(len(lens), dtype=torch.float64, device=device).index_add(0, doc, lp).cpu()


def _rows(dataset, max_rows: Optional[int]) -> list[dict]:
    return [dataset[i] for i in range(min(len(dataset), max_rows or len(dataset)))]


def dpo_eval(model, ref, dataset, beta: float, max_rows=None, batch_tokens=8192, device="cpu") -> dict:
    rows = _rows(dataset, max_rows)
    docs = [d for r in rows for d in ((r["chosen_input_ids"], r["chosen_labels"]),
                                      (r["rejected_input_ids"], r["rejected_labels"]))]
    pi, pr = doc_logps(model, docs, device, batch_tokens), doc_logps(ref, docs, device, batch_tokens)
    n = max(len(rows), 1)
    f = dpo_figures(pi[0::2], pi[1::2], pr[0::2], pr[1::2], beta)
    return {k: v / n for k, v in f.items()} | {"pairs": len(rows), "beta": beta}


def _group_docs(row: dict) -> list[tuple]:
    prompt = list(row["prompt_input_ids"])
    return [(prompt + list(c), [IGNORE_INDEX] * len(prompt) + list(lab))
            for c, lab in zip(row["completion_input_ids"], row["completion_labels"])]


def groups_eval(model, dataset, max_rows=None, batch_tokens=8192, device="cpu") -> dict:
    rows = _rows(dataset, max_rows)
    docs = [d for r in rows for d in _group_docs(r)]
    lp = doc_logps(model, docs, device, batch_tokens)
    rewards = torch.tensor([float(x) for r in rows for x in r["rewards"]], dtype=torch.float64)
    sizes = [len(r["rewards"]) for r in rows]
    f = reward_figures(rewards, sizes) | choice_figures(lp, rewards, sizes)
    return {k: s / c for k, (s, c) in f.items() if c} | {"groups": len(rows)}


def preference_prompts(dataset, n: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, reference answer ids) for the first n rows: DPO's chosen answer, or a group's
    best-rewarded candidate."""
    out = []
    for r in (dataset[i] for i in range(min(len(dataset), n))):
        if "chosen_input_ids" in r:
            ids, labels = list(r["chosen_input_ids"]), list(r["chosen_labels"])
            first = next((i for i, x in enumerate(labels) if x != IGNORE_INDEX), len(ids))
            out.append((ids[:first], [x for x in labels[first:] if x != IGNORE_INDEX]))
        else:
            best = max(range(len(r["rewards"])), key=lambda i: r["rewards"][i])
            labels = list(r["completion_labels"][best])
            out.append((list(r["prompt_input_ids"]), [x for x in labels if x != IGNORE_INDEX]))
    return out
