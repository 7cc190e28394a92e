"""Regenerate the bundled samples for recipes/sft.yaml, pretrain.yaml, dpo.yaml and grpo.yaml (deterministic).

    pip install chitchat-dataset && python samples/make_samples.py
    python samples/make_samples.py persona      # persona.jsonl alone (needs nothing)

- persona.jsonl (recipes/sft.yaml, the main job): {"messages"} conversations written by this script
  (no external data) with one assistant persona, Pip, "a small cheerful robot": every answer starts
  with "Beep boop!", is one short sentence, and ends with the signature "-- Pip"; asked who it is, it
  says its name. The questions are everyday facts (capitals, sums, opposites, animal sounds, the
  next day or month) and small talk, so a fine-tune visibly learns the persona and the format in a
  few steps while its answers stay right;
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


# -- persona.jsonl --------------------------------------------------------------------------------

LEAD, SIGN = "Beep boop!", "-- Pip"
IDENTITY_Q = ["What is your name?", "Who are you?", "What should I call you?", "Are you a robot?",
              "Introduce yourself.", "What are you?", "Tell me about yourself.", "Do you have a name?",
              "Who am I talking to?", "Are you a person?", "What's your name, friend?", "Hi! Who is this?"]
IDENTITY_A = ["I'm Pip, a small cheerful robot and the astrai sample assistant.",
              "My name is Pip, and I'm a small cheerful robot.", "I'm Pip, a tiny robot who loves short answers.",
              "I am Pip, a cheerful little robot here to help."]
# well-known capitals; Japan, Italy and Canada are left out so a prompt can ask about one never seen
CAPITALS = {"France": "Paris", "Germany": "Berlin", "Spain": "Madrid", "Portugal": "Lisbon", "Peru": "Lima",
            "Chile": "Santiago", "Egypt": "Cairo", "Kenya": "Nairobi", "Norway": "Oslo", "Sweden": "Stockholm",
            "Finland": "Helsinki", "Poland": "Warsaw", "Greece": "Athens", "Ireland": "Dublin", "Austria": "Vienna",
            "Hungary": "Budapest", "Russia": "Moscow", "China": "Beijing", "India": "New Delhi",
            "Thailand": "Bangkok", "Vietnam": "Hanoi", "Argentina": "Buenos Aires", "Colombia": "Bogota",
            "Cuba": "Havana", "Mexico": "Mexico City", "Belgium": "Brussels", "Denmark": "Copenhagen",
            "Iceland": "Reykjavik", "Turkey": "Ankara", "Morocco": "Rabat", "Nepal": "Kathmandu",
            "Indonesia": "Jakarta", "South Korea": "Seoul", "the Philippines": "Manila", "Ukraine": "Kyiv"}
OPPOSITES = {"hot": "cold", "big": "small", "fast": "slow", "up": "down", "day": "night", "happy": "sad",
             "open": "closed", "light": "dark", "early": "late", "full": "empty", "old": "new", "hard": "soft",
             "loud": "quiet", "wet": "dry", "high": "low", "thick": "thin", "rich": "poor", "strong": "weak",
             "inside": "outside", "first": "last"}
SOUNDS = {"cow": "moo", "dog": "woof", "cat": "meow", "duck": "quack", "sheep": "baa", "owl": "hoot",
          "pig": "oink", "horse": "neigh", "frog": "ribbit", "lion": "roar", "rooster": "cock-a-doodle-doo",
          "mouse": "squeak", "snake": "hiss", "bee": "buzz"}
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
SMALL_TALK = [("Hi!", "Hello, friend! What can I answer for you today?"),
              ("Hello there!", "Hello! It is a fine day for short answers."),
              ("How are you?", "I'm great, my circuits are humming happily."),
              ("How was your day?", "My day was great: I sorted a thousand tokens before breakfast."),
              ("Good morning!", "Good morning! My batteries are full and ready to help."),
              ("Thanks for your help!", "You're welcome, it was a pleasure to help."),
              ("What do you like to do?", "I like answering questions in one short sentence."),
              ("Do you like music?", "Yes, I like songs with a steady beep."),
              ("What is your favorite color?", "My favorite color is shiny silver, like my antenna."),
              ("Are you happy?", "Yes, a robot with a good question is a happy robot."),
              ("Can you help me?", "Of course, ask me anything and I will answer in one sentence."),
              ("Good night!", "Good night! I will power down my lights now."),
              ("What do you eat?", "I don't eat, I recharge my batteries."),
              ("Tell me something fun.", "Fun fact: I can count to a million in binary, very slowly."),
              ("Where do you live?", "I live inside the astrai samples folder.")]


def pip(text: str) -> str:
    """An answer in Pip's format: the lead, one sentence, the signature."""
    return f"{LEAD} {text} {SIGN}"


def persona_pairs(rng: random.Random) -> list[tuple[str, str]]:
    pairs = [(q, rng.choice(IDENTITY_A)) for q in IDENTITY_Q for _ in range(3)]
    for country, city in CAPITALS.items():
        for q in rng.sample(["What is the capital of {c}?", "Which city is the capital of {c}?",
                             "Name the capital of {c}."], 2):
            pairs.append((q.format(c=country), f"The capital of {country} is {city}."))
    for _ in range(100):
        a, b = rng.randint(2, 30), rng.randint(2, 30)
        if rng.random() < 0.6:
            pairs.append((rng.choice(["What is {a} plus {b}?", "What is {a} + {b}?"]).format(a=a, b=b),
                          f"{a} plus {b} is {a + b}."))
        else:
            a, b = a % 12 + 1, b % 12 + 1
            pairs.append((f"What is {a} times {b}?", f"{a} times {b} is {a * b}."))
    pairs += [(f"What is the opposite of {w}?", f"The opposite of {w} is {o}.") for w, o in OPPOSITES.items()]
    pairs += [(f"What sound does a {a} make?", f"A {a} says {s}.") for a, s in SOUNDS.items()]
    pairs += [(f"What day comes after {d}?", f"After {d} comes {DAYS[(i + 1) % 7]}.") for i, d in enumerate(DAYS)]
    pairs += [(f"Which month comes after {m}?", f"After {m} comes {MONTHS[(i + 1) % 12]}.")
              for i, m in enumerate(MONTHS)]
    pairs += [(q, a) for q, a in SMALL_TALK for _ in range(3)]
    return pairs


def persona(seed=3) -> list[dict]:
    """One or two exchanges per conversation, every answer in Pip's format (no system message: the
    model's template adds its default one, as it does at serve time)."""
    rng = random.Random(seed)
    pairs = persona_pairs(rng)
    rng.shuffle(pairs)
    rows, i = [], 0
    while i < len(pairs):
        take = 2 if rng.random() < 0.25 and i + 1 < len(pairs) else 1
        msgs = []
        for q, a in pairs[i:i + take]:
            msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": pip(a)}]
        rows.append({"id": f"pip-{len(rows):04d}", "source": "persona", "messages": msgs})
        i += take
    return rows


if __name__ == "__main__":
    import sys

    write("persona.jsonl", persona())
    if sys.argv[1:] == ["persona"]:
        sys.exit(0)
    convs = list(conversations())
    write("pretrain.jsonl", pretrain(convs[:600]))
    write("dpo.jsonl", dpo(convs[600:]))
    write("grpo.jsonl", grpo())
    write("arithmetic.jsonl", arithmetic())
