"""Shared by the online GRPO tests (tests/rl): the prompts, a reward file, and the slow obvious decode."""

import torch

from astrai.model import CausalContext

QUESTIONS = ["hello how are you today", "the quick brown fox jumps over the lazy dog please answer",
             "what number is one two three", "good day"]

REWARDS = '''
def score(completion, sample):
    if len(completion) % 7 == 3:
        raise ValueError("a failing reward")
    return completion.count("e") / (1 + len(completion)) + (sample["answer"] in completion)
'''


def prompt_ids(root, n=None):
    from astrai.train.data import TrainData

    ds = TrainData(root / "data").dataset
    return [ds[i]["input_ids"].tolist() for i in range(len(ds) if n is None else n)]


def greedy_by_hand(model, ids, n, stop):
    """The slow obvious decode: the model's own forward over the whole sequence for each new token."""
    ids, out = list(ids), []
    with torch.no_grad():
        for _ in range(n):
            h = model(torch.tensor(ids), torch.arange(len(ids)), CausalContext())
            t = int(model.logits(h[-1:]).argmax(-1))
            out.append(t)
            ids.append(t)
            if t in stop:
                break
    return out
