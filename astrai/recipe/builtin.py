"""The stage kinds this package defines, as the recipe runner sees them (kinds.StageKind).

Train, eval and generate join here as one entry each when their stages land; `astrai run` knows
nothing else about a stage than its entry.
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
    from astrai.data.template import resolve_template
    from astrai.recipe.fingerprint import text_digest

    return {"chat_template": text_digest(resolve_template(options.chat_template, base_dir=base_dir).source)}


TOKENIZER = StageKind(
    "tokenizer", TokenizerOptions, run_tokenizer_stage, produces="tokenizer", files=("inputs",),
    code=("astrai.recipe.tokenizer", "astrai.data.read", "astrai.data.template"), describe=_describe_tokenizer,
    extra=_tokenizer_extra,
    figures=("vocab_size", "records"))

PREPROCESS = StageKind(
    "preprocess", PreprocessOptions, run_preprocess_stage, produces="data",
    refs={"tokenizer": ("tokenizer",)}, path_refs=frozenset({"tokenizer"}), files=("inputs", "pipeline"),
    code=("astrai.data", "astrai.config", "astrai.schema", "astrai.recipe.preprocess_stage"),
    describe=describe_preprocess, check=check_preprocess, extra=preprocess_extra,
    figures=("records_kept", "tokens", "trained_tokens", "packing_efficiency", "val_records_kept"))


def _train_kind() -> StageKind:
    from astrai.model.config import PRESETS
    from astrai.recipe.train_stage import TrainStageOptions, check_train, describe_train, run_train_stage

    return StageKind(
        "train", TrainStageOptions, run_train_stage, produces="model",
        refs={"data": ("data",), "val_data": ("data",), "model": ("model",)}, path_refs=frozenset({"model"}),
        literals={"model": tuple(PRESETS)},
        code=("astrai.train", "astrai.model", "astrai.recipe.train_stage"), describe=describe_train,
        check=check_train, figures=("steps", "train_loss", "val_loss_start", "val_loss", "val_loss_drop"))


def _eval_kind() -> StageKind:
    from astrai.recipe.eval_stage import EvalStageOptions, check_eval, run_eval_stage

    return StageKind(
        "eval", EvalStageOptions, run_eval_stage, produces="report",
        refs={"model": ("model",), "data": ("data",)}, path_refs=frozenset({"model"}),
        code=("astrai.infer", "astrai.model", "astrai.recipe.eval_stage"), check=check_eval,
        figures=("perplexity", "loss", "samples"))


def builtin_kinds() -> dict[str, StageKind]:
    import importlib.util

    kinds = [TOKENIZER, PREPROCESS]
    for make, packages in ((_train_kind, ("astrai.train", "astrai.model")),
                           (_eval_kind, ("astrai.infer", "astrai.model"))):
        if all(importlib.util.find_spec(p) is not None for p in packages):  # part of this install
            kinds.append(make())
    return {k.name: k for k in kinds}
