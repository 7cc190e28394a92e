"""Regenerate the bundled samples for recipes/pretrain.yaml, dpo.yaml and grpo.yaml (deterministic).

    pip install chitchat-dataset && python samples/make_samples.py

- pretrain.jsonl: {"text"} dialogue transcripts of chitchat-dataset conversations (MIT license);
- dpo.jsonl: {"prompt", "chosen", "rejected"}: a chitchat conversation up to a user turn; chosen is
  the reply the other speaker really gave, rejected a brush-off (BRUSH_OFFS: "ok", "idk", ...) (the
  preference taught: engage with what was said rather than brush it off);
- grpo.jsonl: {"prompt", "completions": [{"text", "reward"}]}: arithmetic questions written by this
  script that ask for an answer form (the number only, or a sentence), with the right answer in
  three forms scored by a stated rule (see `reward`): a format reward, as GRPO recipes use.
Conversations used here come after the 120 of chat.jsonl in id order, so the samples do not overlap.
"""

import json
import os
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
SKIP = 120  # chat.jsonl uses the first 120 conversations in id order


def conversations():
    import chitchat_dataset

    data = json.loads((Path(os.path.dirname(chitchat_dataset.__file__)) / "dataset.json").read_text())
    for cid in sorted(data)[SKIP:]:
        turns, speakers = [], []
        for turn in data[cid]["messages"]:
            text = " ".join(m["text"].strip() for m in turn if m["text"].strip())
            if text:
                turns.append(text)
                speakers.append(turn[0]["sender"])
        if len(turns) >= 4:
            yield cid, turns


def write(name: str, rows: list[dict]):
    path = HERE / name
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    print(f"{path}: {len(rows)} records, {path.stat().st_size} bytes")


def pretrain(convs, budget=150_000):
    rows, size = [], 0
    for cid, turns in convs:
        text = "\n".join(f"{'A' if i % 2 == 0 else 'B'}: {t}" for i, t in enumerate(turns))
        rows.append({"id": cid, "source": "chitchat", "text": text})
        size += len(text)
        if size >= budget:
            break
    return rows


BRUSH_OFFS = ["ok", "idk", "lol", "whatever", "k", "sure", "no idea", "hmm", "cool", "meh"]


def dpo(convs, n=240, seed=5):
    rng = random.Random(seed)
    rows = []
    for cid, turns in convs[:n]:
        k = 2 if len(turns) < 6 else 4  # the user turn that ends the prompt (0-based, even = user)
        prompt = [{"role": "user" if j % 2 == 0 else "assistant", "content": t} for j, t in enumerate(turns[:k + 1])]
        rows.append({"id": cid, "source": "chitchat", "prompt": prompt,
                     "chosen": [{"role": "assistant", "content": turns[k + 1]}],
                     "rejected": [{"role": "assistant", "content": rng.choice(BRUSH_OFFS)}]})
    return rows


# the answer forms a question may ask for, and a form never asked for
FORMS = {"number": ("Answer with the number only.", "{n}"),
         "sentence": ("Answer with a sentence.", "The answer is {n}.")}
OTHER_FORM = "I think it is {n}."
END_OF_TURN = "<|im_end|>"  # ChatML's: completions are trained up to the end of the turn, so the model stops


def reward(text: str, answer: int, asked: str) -> float:
    """1.0: the right answer in the form the question asks for; 0.2: the right answer in another
    form; 0.0: anything else."""
    text = text.removesuffix(END_OF_TURN)
    if text == FORMS[asked][1].format(n=answer):
        return 1.0
    return 0.2 if str(answer) in text.rstrip(".").split() else 0.0


def grpo(n=300, seed=11):
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        op = rng.choice("+-*")
        answer = {"+": a + b, "-": a - b, "*": a * b}[op]
        asked = rng.choice(sorted(FORMS))
        question = f"What is {a} {op} {b}? {FORMS[asked][0]}"
        candidates = [FORMS["number"][1], FORMS["sentence"][1], OTHER_FORM]
        rng.shuffle(candidates)
        texts = [c.format(n=answer) + END_OF_TURN for c in candidates]
        rows.append({"id": f"arith-{i:04d}", "source": "arithmetic",
                     "prompt": [{"role": "user", "content": question}],
                     "completions": [{"text": t, "reward": reward(t, answer, asked)} for t in texts]})
    return rows


def arithmetic(n=400, seed=21):
    """Online GRPO prompts (recipes/grpo_online.yaml): sums of two small numbers, the answer kept as a
    value column for the reward to check; nothing is trained on directly."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        rows.append({"id": f"sum-{i:04d}", "source": "arithmetic",
                     "messages": [{"role": "user", "content": f"What is {a} + {b}? Reply with only the number."}],
                     "answer": str(a + b)})
    return rows


if __name__ == "__main__":
    convs = list(conversations())
    write("pretrain.jsonl", pretrain(convs[:600]))
    write("dpo.jsonl", dpo(convs[600:]))
    write("grpo.jsonl", grpo())
    write("arithmetic.jsonl", arithmetic())
