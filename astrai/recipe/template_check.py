"""Before any work, in a recipe: data rendered with another chat template than its model serves with.

What each stage's output renders with is described before anything runs (astrai.recipe.kinds):
- a preprocess stage: `template` = {spec: the pipeline's template (`tokenizer` by default), tokenizer:
  the identity of the tokenizer it uses, dir: the pipeline's folder}, plus `template_mismatch`
  (the pipeline's `chat_template_mismatch`) and `template_kwargs`;
- a checkpoint stage: {spec: tokenizer, tokenizer: itself}: the model serves with its own template;
- a train stage: its data's template (the checkpoint it writes carries it: astrai.train.data).

Two equal descriptions are the same template and nothing is loaded (the usual recipe: `tokenizer:
base` and the default template). Otherwise both templates are loaded and compared by what they
render (astrai.text.drift): a packaged checkpoint is converted first if it was not yet (it would be
by the run anyway), and a tokenizer a stage has yet to make is not known, so not compared.
"""

from __future__ import annotations

from typing import Optional

from astrai.text.drift import MISMATCH_FIX, template_difference


def checkpoint_template(identity: str) -> dict:
    """The description of what a checkpoint (by its tokenizer identity) serves with: its own template."""
    return {"spec": "tokenizer", "tokenizer": identity}


def _tokenizer(identity: Optional[str]):
    from astrai.errors import InputError
    from astrai.text.tokenizer import load_tokenizer

    if not identity or identity.startswith("stage:"):
        return None  # made by a stage that has not run: not known before any work
    try:
        from astrai.model.packaged import PACKAGED, is_gguf, packaged_checkpoint

        if identity.startswith("package:") and identity[len("package:"):] in PACKAGED or is_gguf(identity):
            identity = str(packaged_checkpoint(identity))
        return load_tokenizer(identity)
    except (InputError, ValueError, OSError):  # the stage that names it reports its own problem
        return None


def _template(desc: dict, tok):
    from astrai.errors import InputError
    from astrai.text.template import resolve_template

    try:
        return resolve_template(desc["spec"], tok, desc.get("dir"))
    except InputError:
        return None


def drift_problem(data: dict, model: Optional[dict]) -> Optional[str]:
    """Why the data described by `data` (a preprocess stage's description) is rendered unlike what the
    model described by `model` (a template description) serves with; None when alike, allowed or unknown."""
    mine = data.get("template")
    if not mine or not model or data.get("template_mismatch") == "allow":
        return None
    if mine == model or (mine["spec"] == model["spec"] == "tokenizer" and mine["tokenizer"] == model["tokenizer"]):
        return None
    model_tok = _tokenizer(model["tokenizer"])
    if model_tok is None or not model_tok.chat_template:
        return None  # a model with no template of its own serves with whatever it is given
    data_tok = model_tok if mine["tokenizer"] == model["tokenizer"] else _tokenizer(mine["tokenizer"])
    if data_tok is None:
        return None
    data_template, model_template = _template(mine, data_tok), _template(model, model_tok)
    if data_template is None or model_template is None:
        return None  # the stage reports an unknown template itself
    diff = template_difference(data_template, model_template, model_tok.special_tokens_map,
                               data.get("template_kwargs") or {})
    return f"{diff}; {MISMATCH_FIX}" if diff else None
