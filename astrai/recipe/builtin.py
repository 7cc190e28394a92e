"""The recipe facts (kinds.StageKind) of the stages, named by the stage registry's `recipe_kind`.

`astrai run` knows nothing about a stage but its registry entry (astrai.config.stages) and the
StageKind that entry names; a new stage adds one of each.
"""

from __future__ import annotations

from astrai.recipe.kinds import StageKind
from astrai.recipe.preprocess_stage import (PreprocessOptions, check_preprocess, describe_preprocess,
                                            preprocess_extra, run_preprocess_stage)
from astrai.recipe.tokenizer import TokenizerOptions, run_tokenizer_stage


def _describe_tokenizer(options, base_dir, upstream) -> dict:
    return {"chat_template": options.chat_template}


def _tokenizer_extra(options, base_dir) -> dict:
    """The chat template's text goes into tokenizer_config.json: a bundled or .jinja file counts."""
    if not options.chat_template:
        return {}
    from astrai.text.template import resolve_template
    from astrai.recipe.fingerprint import text_digest

    return {"chat_template": text_digest(resolve_template(options.chat_template, base_dir=base_dir).source)}


# the configuration modules data stages read (not the train, serve or recipe option models: a change
# there must not rerun preprocessing)
_CONFIG = ("astrai.config.loading", "astrai.config.pipeline", "astrai.config.formats")

TOKENIZER = StageKind(
    "tokenizer", TokenizerOptions, run_tokenizer_stage, produces="tokenizer", files=("inputs",),
    code=("astrai.recipe.tokenizer", "astrai.data.read", "astrai.data.lines", "astrai.data.streams",
          "astrai.data.holdout", "astrai.text", *_CONFIG, "astrai.schema"), describe=_describe_tokenizer,
    extra=_tokenizer_extra,
    figures=("vocab_size", "records"))

PREPROCESS = StageKind(
    "preprocess", PreprocessOptions, run_preprocess_stage, produces="data",
    refs={"tokenizer": ("tokenizer", "model")}, path_refs=frozenset({"tokenizer"}), files=("inputs", "pipeline"),
    code=("astrai.data", *_CONFIG, "astrai.schema", "astrai.text", "astrai.recipe.preprocess_stage",
          "astrai.recipe.template_check", "astrai.model.packaged", "astrai.model.gguf_file", "astrai.model.quant"),
    describe=describe_preprocess, check=check_preprocess, extra=preprocess_extra,
    figures=("records_kept", "tokens", "trained_tokens", "packing_efficiency", "val_records_kept"),
    stamped=("train", "val"))


# what a train or eval stage runs besides its own package: the engine (eval's samples, online GRPO's
# rollouts) and its kernels, the data loader, the options' defaults, tokenizer and template code
# (tests/recipe/test_runner.py checks every stage's list against what its code imports)
_RUNTIME = ("astrai.infer", "astrai.kernels", "astrai.data", "astrai.config", "astrai.text", "astrai.schema",
            "astrai.recipe.preprocess_stage", "astrai.recipe.template_check")


def _train_kind() -> StageKind:
    from astrai.model.config import PRESETS
    from astrai.recipe.train_stage import (GROWABLE, TrainStageOptions, check_train, continues_train, describe_train,
                                           run_train_stage)

    return StageKind(
        "train", TrainStageOptions, run_train_stage, produces="model",
        refs={"data": ("data",), "val_data": ("data",), "model": ("model",)}, path_refs=frozenset({"model"}),
        literals={"model": tuple(PRESETS)},
        code=("astrai.train", "astrai.model", "astrai.rl", "astrai.recipe.train_stage", *_RUNTIME),
        describe=describe_train,
        check=check_train, figures=("steps", "train_loss", "val_loss_start", "val_loss", "val_loss_drop",
                                    "val_reward_accuracy_start", "val_reward_accuracy", "val_reward_margin",
                                    "val_policy_reward_start", "val_policy_reward", "reward_first", "reward_last",
                                    "val_reward_mean_start", "val_reward_mean"),
        stamped=("final",), unstamped=("eval.json",), growable=GROWABLE, continues=continues_train)


def _eval_kind() -> StageKind:
    from astrai.recipe.eval_stage import EvalStageOptions, check_eval, run_eval_stage

    return StageKind(
        "eval", EvalStageOptions, run_eval_stage, produces="report",
        refs={"model": ("model",), "data": ("data",), "ref_model": ("model",)},
        path_refs=frozenset({"model", "ref_model"}),
        code=("astrai.model", "astrai.recipe.eval_stage", *_RUNTIME), check=check_eval,
        figures=("perplexity", "loss", "reward_accuracy", "reward_margin", "policy_reward", "reward_mean",
                 "policy_accuracy", "samples"))


def _checkpoint_kind() -> StageKind:
    from astrai.recipe.checkpoint_stage import (CheckpointOptions, check_checkpoint, checkpoint_extra,
                                                describe_checkpoint, run_checkpoint_stage)

    return StageKind(
        "checkpoint", CheckpointOptions, run_checkpoint_stage, produces="model",
        # what it reads and describes (config), converts (packaged) and how it locates a package; not the
        # whole of astrai.model: a change to the layers would rerun it and, through its output, preprocess
        code=("astrai.recipe.checkpoint_stage", "astrai.model.packaged", "astrai.model.config",
              "astrai.model.hf_config", "astrai.model.checkpoint_files", "astrai.model.gguf_file",
              "astrai.model.quant", "astrai.text",
              "astrai.recipe.template_check", *_CONFIG, "astrai.schema"),
        describe=describe_checkpoint,
        check=check_checkpoint, extra=checkpoint_extra, figures=("architecture", "layers", "vocab_size"))


def checkpoint_kind():
    return _checkpoint_kind() if _installed("astrai.model") else None


def train_kind():
    """The train stage's recipe facts, or None where astrai.train is not part of the install."""
    return _train_kind() if _installed("astrai.train", "astrai.model") else None


def eval_kind():
    return _eval_kind() if _installed("astrai.infer", "astrai.model") else None


def _installed(*packages) -> bool:
    import importlib.util

    return all(importlib.util.find_spec(p) is not None for p in packages)


def recipe_kinds() -> dict[str, StageKind]:
    """Every stage kind a `stages:` recipe may use: the registry entries (astrai.config.stages) that
    name their recipe facts, each a StageKind or a function returning one (None: not installed)."""
    import importlib

    from astrai.config.stages import STAGES

    kinds = {}
    for stage in STAGES.values():
        if not stage.recipe_kind:
            continue
        module, _, attr = stage.recipe_kind.partition(":")
        kind = getattr(importlib.import_module(module), attr)
        kind = kind if isinstance(kind, StageKind) else kind()
        if kind is not None:
            kinds[stage.name] = kind
    return kinds
