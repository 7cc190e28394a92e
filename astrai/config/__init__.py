"""Configuration: one declaration per option, every problem reported at once with its place.

    loading.py   safe YAML with line numbers, located problems, --set overrides, --help lines,
                 the StrictModel base and the combination-check protocol
    pipeline.py  the pipeline model (sections/sources, mask rules, preprocessing, output)
    stages.py    the stage registry: each stage kind's recipe facts and CLI verb
    recipe.py    load_any (a pipeline, or a recipe's preprocess stage), the run-directory rule, and
                 the refusal of the older recipe form

NOTE: nothing here imports torch or anything under astrai.data/train/infer (stage run functions
are named by dotted path and imported only when a stage runs).
"""

import importlib

# Names are loaded from their module on first use (PEP 562), so that importing one module of this
# package (astrai.data imports astrai.config.pipeline) does not load the others (the recipe model).
_HOME = {
    **dict.fromkeys(("ConfigError", "Problem", "StrictModel", "apply_overrides", "load_yaml", "model_help",
                     "parse_set", "validate_data"), "loading"),
    **dict.fromkeys(("DEFAULT_MASK", "InputConfig", "Output", "Pipeline", "Preprocessing", "Section", "Source",
                     "load_pipeline"), "pipeline"),
    **dict.fromkeys(("Loaded", "OLD_FORM_KEYS", "STAGE_OUTPUT", "detect_kind", "is_staged", "load_any", "old_form_error",
                     "run_dir_of", "split_overrides", "stage_output"), "recipe"),
    **dict.fromkeys(("STAGES", "Stage"), "stages"),
}
_ALIASES: dict[str, str] = {}

__all__ = sorted([*_HOME, *_ALIASES])


def __getattr__(name: str):
    target = _ALIASES.get(name, name)
    if target not in _HOME:
        raise AttributeError(f"module 'astrai.config' has no attribute {name!r}")
    return getattr(importlib.import_module(f"astrai.config.{_HOME[target]}"), target)
