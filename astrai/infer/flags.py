"""Command-line flags read off pydantic option models, so each option is declared once (STYLE 4).

`add_flags(parser, Model)` adds `--field-name` for every scalar field of the model and of its
nested option models (flattened: SamplingParams.max_tokens is `--max-tokens`), with the field's
description and default as help. `build(Model, args, overrides)` gathers the flags that were given,
applies `--set dotted.key=value` overrides (typed as YAML, as for every verb) and validates: an
unknown key or a bad value is an error naming the key.
"""

from __future__ import annotations

import argparse
import typing
from typing import Any, Optional

from pydantic import BaseModel, ValidationError


def _nested(annotation) -> Optional[type[BaseModel]]:
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _scalar(annotation):
    """(argparse type, is_list, is_bool) for a field annotation."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is typing.Union and len(args) == 1:
        annotation = args[0]
    if typing.get_origin(annotation) is list:
        return typing.get_args(annotation)[0], True, False
    if annotation is bool:
        return bool, False, True
    if typing.get_origin(annotation) is typing.Literal:
        return str, False, False
    return annotation if annotation in (int, float, str) else str, False, False


def add_flags(parser: argparse.ArgumentParser, model: type[BaseModel], skip: tuple[str, ...] = (),
              path: str = "", defaults: Optional[BaseModel] = None) -> None:
    """`defaults`: the instance a nested model field defaults to (its values are the ones shown)."""
    for name, f in model.model_fields.items():
        if name in skip:
            continue
        default = f.default if f.default_factory is None else f.default_factory()
        if defaults is not None:
            default = getattr(defaults, name)
        sub = _nested(f.annotation)
        if sub is not None:
            add_flags(parser, sub, skip, f"{path}{name}.", default)
            continue
        typ, is_list, is_bool = _scalar(f.annotation)
        flag = (f.json_schema_extra or {}).get("flag") or "--" + name.replace("_", "-")
        help_ = f"{f.description or ''} [default: {default}]"
        dest = (path + name).replace(".", "__")
        metavar = name.upper()
        if is_bool:
            parser.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=None, help=help_)
        elif is_list:
            parser.add_argument(flag, dest=dest, type=typ, action="append", default=None, metavar=metavar,
                                help=help_ + " (repeatable)")
        else:
            choices = list(typing.get_args(f.annotation)) if typing.get_origin(f.annotation) is typing.Literal else None
            parser.add_argument(flag, dest=dest, type=typ, default=None, choices=choices,
                                metavar=None if choices else metavar, help=help_)


def build(model: type[BaseModel], args: argparse.Namespace, overrides: list[str] = (), **given: Any):
    from astrai.config import apply_overrides

    data: dict = {}
    for dest, value in vars(args).items():
        if value is None or "__" not in dest and dest not in model.model_fields:
            continue
        node, *parts = dest.split("__")
        keys = [node] + parts
        d = data
        for k in keys[:-1]:
            d = d.setdefault(k, {})
        d[keys[-1]] = value
    data.update({k: v for k, v in given.items() if v is not None})
    apply_overrides(data, list(overrides))
    try:
        return model.model_validate(data)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg'].removeprefix('Value error, ')}"
                             for err in e.errors())
        raise ValueError(f"invalid options: {problems}") from None
