"""Configuration: one declaration per option, every problem reported at once with its place.

    loading.py   safe YAML with line numbers, located problems, --set overrides, --help lines,
                 the StrictModel base and the combination-check protocol
    pipeline.py  the pipeline model (sections/sources, mask rules, preprocessing, output)
    stages.py    the stage registry: each stage's options model, run function and CLI verb
    recipe.py    the recipe model (one typed field per stage) and load_any (pipeline or recipe)

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
    **dict.fromkeys(("Loaded", "Recipe", "STAGE_OUTPUT", "detect_kind", "is_staged", "load_any", "load_recipe",
                     "run_dir_of", "split_overrides", "stage_output"), "recipe"),
    **dict.fromkeys(("STAGES", "PreprocessOptions", "Stage", "StageContext"), "stages"),
}
_ALIASES = {"PreprocessStage": "PreprocessOptions"}  # the name before the stage registry

__all__ = sorted([*_HOME, *_ALIASES])


def __getattr__(name: str):
    target = _ALIASES.get(name, name)
    if target not in _HOME:
        raise AttributeError(f"module 'astrai.config' has no attribute {name!r}")
    return getattr(importlib.import_module(f"astrai.config.{_HOME[target]}"), target)
