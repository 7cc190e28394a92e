"""From preprocess rows to flat packed micro-batches, and which rows each rank reads when.

Every strategy trains on one flat row per micro-batch: documents back to back, `cu_seqlens`
marking them, position ids restarting per document, `targets` already shifted inside each
document (astrai.train.lm_loss.shift_targets). Single-output rows reuse astrai.data.load's
`collate_packed`; DPO and GRPO rows are the record-shaped output of the preprocess stage as it
is written today:
- DPO: chosen_input_ids/chosen_labels/rejected_input_ids/rejected_labels; each pair becomes two
  documents (chosen, rejected) in that order.
- GRPO: prompt_input_ids, completion_input_ids [G][], completion_labels [G][], rewards [G] (float32);
  each completion becomes one document prompt + completion, the prompt never trained.

`RankSampler` decides the order: a permutation per epoch from (seed, epoch), padded to a multiple
of the world size and dealt round-robin, so ranks see disjoint rows and the union of one step's
rows over 2 ranks equals one rank's step with the doubled batch. Its state is (epoch, step), so
a resume continues exactly where the checkpoint was taken.
"""

from __future__ import annotations

import math

import torch

from astrai.data.load import collate_packed
from astrai.schema import IGNORE_INDEX
from astrai.train.grpo_loss import group_advantages
from astrai.train.lm_loss import shift_targets


def _cu(lens: list[int]) -> torch.Tensor:
    cu = torch.zeros(len(lens) + 1, dtype=torch.long)
    cu[1:] = torch.tensor(lens, dtype=torch.long).cumsum(0)
    return cu


def _flat(docs_ids: list, docs_labels: list) -> dict:
    lens = [len(d) for d in docs_ids]
    ids = torch.tensor([t for d in docs_ids for t in d], dtype=torch.long)
    labels = torch.tensor([t for d in docs_labels for t in d], dtype=torch.long)
    cu = _cu(lens)
    pos = torch.cat([torch.arange(n) for n in lens]) if lens else torch.zeros(0, dtype=torch.long)
    return {"input_ids": ids, "position_ids": pos, "targets": shift_targets(labels, cu), "cu_seqlens": cu}


def collate_lm(rows: list[dict], train_all_tokens: bool) -> dict:
    """seq (every token trained: labels = input_ids) or sft (the labels column)."""
    b = collate_packed(rows)
    ids, cu = b["input_ids"][0], b["cu_seqlens"].long()
    labels = ids if train_all_tokens else b["labels"][0]
    return {"input_ids": ids, "position_ids": b["position_ids"][0], "targets": shift_targets(labels, cu),
            "cu_seqlens": cu}


def collate_dpo(rows: list[dict]) -> dict:
    ids, labels = [], []
    for r in rows:
        ids += [r["chosen_input_ids"], r["rejected_input_ids"]]
        labels += [r["chosen_labels"], r["rejected_labels"]]
    b = _flat(ids, labels)
    b["pairs"] = len(rows)
    return b


def collate_grpo(rows: list[dict], eps: float = 1e-4, scale: bool = True) -> dict:
    """`scale`: advantages divided by the group's std (every loss type but dr_grpo)."""
    ids, labels, adv, rewards, sizes = [], [], [], [], []
    for r in rows:
        prompt = list(r["prompt_input_ids"])
        rw = torch.tensor(r["rewards"], dtype=torch.float32)
        adv.append(group_advantages(rw, eps, scale))
        rewards.append(rw)
        sizes.append(len(rw))
        for comp, comp_labels in zip(r["completion_input_ids"], r["completion_labels"]):
            ids.append(prompt + list(comp))
            labels.append([IGNORE_INDEX] * len(prompt) + list(comp_labels))
    b = _flat(ids, labels)
    b["advantages"] = torch.cat(adv)
    b["rewards"] = torch.cat(rewards)
    b["group_sizes"] = sizes
    return b


def collate_scored(groups: list[tuple]) -> dict:
    """Online GRPO's groups (prompt ids, completion ids [G][], completion labels [G][], advantages [G],
    rewards [G]), already scored: each completion one document prompt + completion, as collate_grpo."""
    ids, labels = [], []
    for prompt, comps, comp_labels, _, _ in groups:
        for comp, lab in zip(comps, comp_labels):
            ids.append(list(prompt) + list(comp))
            labels.append([IGNORE_INDEX] * len(prompt) + list(lab))
    b = _flat(ids, labels)
    b["advantages"] = torch.cat([g[3] for g in groups])
    b["rewards"] = torch.cat([g[4] for g in groups])
    b["group_sizes"] = [len(g[1]) for g in groups]
    return b


class RankSampler:
    """Micro-batches of row indices for one rank; only full optimizer steps (the seed's formula)."""

    def __init__(self, n_rows: int, batch_size: int, grad_accum: int, rank: int = 0, world: int = 1,
                 seed: int = 0, shuffle: bool = True):
        self.n, self.batch, self.accum = n_rows, batch_size, grad_accum
        self.rank, self.world, self.seed, self.shuffle = rank, world, seed, shuffle

    @property
    def rows_per_rank(self) -> int:
        return math.ceil(self.n / self.world)

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.rows_per_rank / self.batch) // self.accum

    def order(self, epoch: int) -> list[int]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            perm = torch.randperm(self.n, generator=g).tolist()
        else:
            perm = list(range(self.n))
        total = self.rows_per_rank * self.world
        perm += perm[: total - len(perm)]  # pad by repeating the start, as DistributedSampler does
        return perm[self.rank::self.world]

    def windows(self, epoch: int, start_step: int = 0):
        """Yield (step_in_epoch, [micro-batch index lists]) for the optimizer steps of an epoch."""
        mine = self.order(epoch)
        per_step = self.batch * self.accum
        for step in range(start_step, self.steps_per_epoch):
            chunk = mine[step * per_step:(step + 1) * per_step]
            yield step, [chunk[i:i + self.batch] for i in range(0, len(chunk), self.batch) if chunk[i:i + self.batch]]
