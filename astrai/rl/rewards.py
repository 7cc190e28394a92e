"""Reward functions for online GRPO: built-ins chosen by name, and the user's own functions.

Each reward maps one completion to a float; the step's reward of a completion is the weighted sum
over the configured functions (`rewards: [{name: ..., weight: ...}, ...]`). Built-ins:

- exact_match:   1 when the completion's final answer (`extract`) equals the reference column's
                 value as text (both stripped), else 0.
- numeric_match: 1 when the final answer parses as a number within `tolerance * max(1, |ref|)` of
                 the reference column's number (commas in numbers ignored), else 0.
- format:        1 when `pattern` is found in the completion (the stripped completion matches it
                 whole with `fullmatch`), else 0.
- length_penalty: DAPO's soft overlong punishment with L_max = max_tokens and L_cache = buffer:
                 0 for n <= L_max - L_cache, (L_max - L_cache - n) / L_cache up to L_max, and -1
                 for a completion cut at max_tokens (or longer than L_max).

A user function is `function: "module:name"` (an importable module) or `"path/file.py:name"` (a
file; `astrai train` and recipes read a relative path from the config's or recipe's folder): the user's own code, loaded on purpose
from the config, never from the data. It is called as `name(completion, sample)`, where sample is
a dict: `prompt` (text), `completion_tokens`, `truncated`, and the row's value columns (e.g.
`answer`). A function that raises or gives something other than a finite number fails that one
completion: it is counted (`reward_errors`), logged with the message, and given advantage 0 (the
group's statistics use its other completions); training goes on.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import re
import sys
from pathlib import Path
from typing import Callable, Optional

from astrai.config.train import RewardSpec
from astrai.errors import InputError

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S)


def final_answer(text: str, how: str) -> Optional[str]:
    """The part of a completion taken as its final answer (None: it gives none)."""
    if how == "whole":
        return text.strip()
    if how == "last_line":
        lines = [ln for ln in text.strip().splitlines() if ln.strip()]
        return lines[-1].strip() if lines else None
    if how == "answer_tag":
        found = ANSWER_TAG.findall(text)
        return found[-1].strip() if found else None
    found = NUMBER.findall(text)
    return found[-1] if found else None


def to_number(s) -> Optional[float]:
    try:
        return float(str(s).replace(",", "").strip())
    except ValueError:
        return None


def exact_match(text: str, sample: dict, spec: RewardSpec) -> float:
    ans = final_answer(text, spec.extract)
    return float(ans is not None and ans == str(_reference(sample, spec)).strip())


def numeric_match(text: str, sample: dict, spec: RewardSpec) -> float:
    ref = to_number(_reference(sample, spec))
    if ref is None:
        raise ValueError(f"column {spec.column!r} holds {_reference(sample, spec)!r}, not a number")
    got = to_number(final_answer(text, spec.extract) or "")
    return float(got is not None and abs(got - ref) <= spec.tolerance * max(1.0, abs(ref)))


def format_match(text: str, sample: dict, spec: RewardSpec) -> float:
    pattern = _compiled(spec.pattern)
    return float(bool(pattern.fullmatch(text.strip()) if spec.fullmatch else pattern.search(text)))


def length_penalty(text: str, sample: dict, spec: RewardSpec) -> float:
    n, l_max, buf = sample["completion_tokens"], spec.max_tokens, spec.buffer
    if sample["truncated"] or n > l_max:
        return -1.0
    if n <= l_max - buf:
        return 0.0
    return (l_max - buf - n) / buf


BUILTINS: dict[str, Callable[[str, dict, RewardSpec], float]] = {
    "exact_match": exact_match, "numeric_match": numeric_match, "format": format_match,
    "length_penalty": length_penalty}

_PATTERNS: dict[str, re.Pattern] = {}


def _compiled(pattern: str) -> re.Pattern:
    if pattern not in _PATTERNS:
        _PATTERNS[pattern] = re.compile(pattern, re.S)
    return _PATTERNS[pattern]


def _reference(sample: dict, spec: RewardSpec):
    if spec.column not in sample:
        raise KeyError(f"the data has no column {spec.column!r} (its value columns: "
                       f"{sorted(k for k in sample if k not in ('prompt', 'completion_tokens', 'truncated'))})")
    return sample[spec.column]


def load_function(spec: str) -> Callable:
    """'module:name' or 'file.py:name' -> the function; a clear InputError when it cannot be found."""
    module, _, name = spec.rpartition(":")
    try:
        if module.endswith(".py") or "/" in module:
            path = Path(module).resolve()
            if not path.is_file():
                raise InputError(f"reward function {spec!r}: no file {path}")
            mod_spec = importlib.util.spec_from_file_location(f"astrai_user_reward_{path.stem}", path)
            mod = importlib.util.module_from_spec(mod_spec)
            mod_spec.loader.exec_module(mod)
        else:
            if "" not in sys.path and str(Path.cwd()) not in sys.path:
                sys.path.insert(0, str(Path.cwd()))  # a module next to where the run starts, as python -m would
            mod = importlib.import_module(module)
    except InputError:
        raise
    except Exception as e:  # the user's module failed to import: say which and why, in one line
        raise InputError(f"reward function {spec!r}: importing {module!r} failed: {type(e).__name__}: {e}") from None
    fn = getattr(mod, name, None)
    if not callable(fn):
        raise InputError(f"reward function {spec!r}: {module!r} has no function {name!r}")
    return fn


class Scorer:
    """The configured reward functions; `score` gives (total, per-function values, error or None)."""

    def __init__(self, specs: list[RewardSpec], max_tokens: int):
        self.specs = [s.model_copy(update={"max_tokens": s.max_tokens or max_tokens}) for s in specs]
        keys = [s.key for s in self.specs]
        dup = sorted({k for k in keys if keys.count(k) > 1})
        if dup:
            raise InputError(f"rewards: {dup} named twice; give each a distinct label")
        self.keys = keys
        self.fns = [BUILTINS[s.name] if s.name else _user(load_function(s.function)) for s in self.specs]

    def score(self, text: str, sample: dict) -> tuple[Optional[float], dict, Optional[str]]:
        values, total = {}, 0.0
        for spec, key, fn in zip(self.specs, self.keys, self.fns):
            try:
                v = fn(text, sample, spec)
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise TypeError(f"returned {type(v).__name__} {v!r:.40}, not a number")
                v = float(v)
                if not math.isfinite(v):
                    raise ValueError(f"returned {v}")
            except Exception as e:
                return None, values, f"{key}: {type(e).__name__}: {e}"
            values[key] = v
            total += spec.weight * v
        return total, values, None


def _user(fn: Callable) -> Callable:
    return lambda text, sample, spec: fn(text, dict(sample))
