"""Reward functions for online GRPO: built-ins chosen by name, and the user's own functions.

Each reward maps one completion to a float; the step's reward of a completion is the weighted sum
over the configured functions (`rewards: [{name: ..., weight: ...}, ...]`). Built-ins:

- exact_match:   1 when the completion's final answer (`extract`) equals the reference column's
                 value as text (both stripped), else 0.
- numeric_match: 1 when the final answer parses as a number within `tolerance * max(1, |ref|)` of
                 the reference column's number (commas in numbers ignored), else 0.
- format:        1 when `pattern` is found in the completion (the stripped completion matches it
                 whole with `fullmatch`), else 0.
- length_penalty: DAPO's soft overlong punishment (`soft_overlong`) with L_max = max_tokens and
                 L_cache = buffer.

A user function is `function: "module:name"` (an importable module) or `"path/file.py:name"` (a
file; `astrai train` and recipes read a relative path from the config's or recipe's folder): the user's own code, loaded on purpose
from the config, never from the data. It is called as `name(completion, sample)`, where sample is
a dict: `prompt` (text), `completion_tokens`, `truncated`, and the row's value columns (e.g.
`answer`). A reward is a real number: a Python or numpy int/float, or a 0-d array or tensor of
one; it must be finite and within float32's range (rewards are trained as float32). A call that
raises, gives anything else, or outlives `reward_timeout` (astrai.rl.reward_worker) fails that
one completion: it is counted (`reward_errors`), logged with the error (file:line of the user's
code, the exception) and given advantage 0 (the group's statistics use its other completions);
training goes on, unless one function fails on more than `reward_error_share` of a step's
completions: then the run stops with a RewardError quoting the function's first failure.
"""


from __future__ import annotations

import importlib
import importlib.util
import math
import numbers
import re
import sys
import traceback
from pathlib import Path
from typing import Callable, Iterator, Optional

from astrai.config.train import RewardSpec
from astrai.errors import InputError

FLOAT32_MAX = 3.4028234663852886e38


class RewardError(InputError):
    """A reward function failed on too large a share of a step's completions: the run stops."""


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


def soft_overlong(n: int, truncated: bool, l_max: int, buffer: int) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), in [-1, 0]: 0 for n <= L_max - L_cache,
    (L_max - L_cache - n) / L_cache up to L_max, and -1 for a completion cut at max_tokens (or longer)."""
    if truncated or n > l_max:
        return -1.0
    if n <= l_max - buffer:
        return 0.0
    return (l_max - buffer - n) / buffer


def length_penalty(text: str, sample: dict, spec: RewardSpec) -> float:
    return soft_overlong(sample["completion_tokens"], sample["truncated"], spec.max_tokens, spec.buffer)


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


def as_reward(v) -> float:
    """A function's return value as a reward, or the reason it is not one (TypeError / ValueError)."""
    if not isinstance(v, numbers.Real) and getattr(v, "ndim", None) == 0 and hasattr(v, "item"):
        v = v.item()  # a 0-d numpy array or torch tensor
    if isinstance(v, bool) or type(v).__name__ == "bool_" or not isinstance(v, numbers.Real):
        raise TypeError(f"returned {type(v).__name__} {v!r:.40}, not a number")
    x = float(v)
    if not math.isfinite(x):
        raise ValueError(f"returned {x}, not a finite number")
    if abs(x) > FLOAT32_MAX:
        raise ValueError(f"returned {x:g}, beyond float32's range (|reward| <= 3.4e38; rewards are trained as float32)")
    return x


class Functions:
    """The configured functions, loaded in this process; `call` runs one on one completion."""

    def __init__(self, specs: list[RewardSpec]):
        self.specs = specs
        self.fns, self.files = [], []
        for s in specs:
            fn = BUILTINS[s.name] if s.name else load_function(s.function)
            code = getattr(fn, "__code__", None)
            # where a user function's failure is located: its own file (astrai's built-ins: no place)
            self.files.append(None if s.name else code.co_filename if code else None)
            self.fns.append(fn if s.name else _user(fn))

    def call(self, j: int, text: str, sample: dict) -> tuple[Optional[float], Optional[str]]:
        """(value, None), or (None, the failure: `key: file:line: Type: message`)."""
        spec, fn, file = self.specs[j], self.fns[j], self.files[j]
        try:
            return as_reward(fn(text, sample, spec)), None
        except Exception as e:
            return None, f"{spec.key}: {_where(e, fn, file)}{type(e).__name__}: {e}"


def _where(e: BaseException, fn, file: Optional[str]) -> str:
    """'file:line: ' of the user's code: the deepest frame in its file that the exception passed,
    or the function's own first line for a value it returned; '' for a built-in."""
    if file is None:
        return ""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == file]
    if frames:
        return f"{file}:{frames[-1].lineno}: "
    user = getattr(fn, "user", None)
    return f"{file}:{user.__code__.co_firstlineno}: " if user is not None else f"{file}: "


class Scorer:
    """The configured reward functions; `score_all` gives (total, per-function values, error or None)
    per completion. With `timeout` the functions run in a worker process (astrai.rl.reward_worker),
    each call given up on after `timeout` seconds; without, in this process."""

    def __init__(self, specs: list[RewardSpec], max_tokens: int, timeout: Optional[float] = None,
                 error_share: float = 1.0):
        self.specs = [s.model_copy(update={"max_tokens": s.max_tokens or max_tokens}) for s in specs]
        keys = [s.key for s in self.specs]
        dup = sorted({k for k in keys if keys.count(k) > 1})
        if dup:
            raise InputError(f"rewards: {dup} named twice; give each a distinct label")
        self.keys, self.error_share = keys, error_share
        self.last_failures: dict = {}  # of the last score_all: name -> (failed calls, the first failure)
        self.local, self.worker = None, None
        if timeout is None:
            self.local = Functions(self.specs)
        else:  # started now: a function that cannot be loaded is said before any step
            from astrai.rl.reward_worker import RewardWorker

            self.worker = RewardWorker(self.specs, timeout)

    def score(self, text: str, sample: dict) -> tuple[Optional[float], dict, Optional[str]]:
        return self.score_all([(text, sample)])[0]

    def _calls(self, items: list[tuple[str, dict]]) -> Iterator[tuple[int, int, Optional[float], Optional[str]]]:
        if self.worker is not None:
            yield from self.worker.results(items, len(self.specs))
            return
        for k, (text, sample) in enumerate(items):
            for j in range(len(self.specs)):
                yield (k, j, *self.local.call(j, text, sample))

    def score_all(self, items: list[tuple[str, dict]], what: Optional[str] = None
                  ) -> list[tuple[Optional[float], dict, Optional[str]]]:
        """Every function on every (completion, sample). `what` (e.g. "step 3"): the share check is on,
        and RewardError names it; a function's failures past `error_share` of the items stop at once."""
        n, m = len(items), len(self.specs)
        got: list[list] = [[None] * m for _ in items]
        failed, first = [0] * (m + 1), [None] * (m + 1)  # [m]: the weighted sum
        for k, j, value, err in self._calls(items):
            got[k][j] = (value, err)
            if err is not None:
                self._failed(j, err, failed, first, n, what)
        out = []
        for k in range(n):
            values = {key: v for key, (v, e) in zip(self.keys, got[k]) if e is None}
            errors = [e for _, e in got[k] if e is not None]
            total = None
            if not errors:
                total = sum(spec.weight * values[key] for spec, key in zip(self.specs, self.keys))
                if not abs(total) <= FLOAT32_MAX:
                    errors.append(f"the weighted sum of the rewards, {total:g}, is beyond float32's range")
                    self._failed(m, errors[-1], failed, first, n, what)
                    total = None
            out.append((total, values, "; ".join(errors) or None))
        names = self.keys + ["the weighted sum"]
        self.last_failures = {names[j]: (failed[j], first[j]) for j in range(m + 1) if failed[j]}
        return out

    def _failed(self, j: int, err: str, failed: list, first: list, n: int, what: Optional[str]):
        failed[j] += 1
        first[j] = first[j] or err
        if what is not None and failed[j] > self.error_share * n:
            name = (self.keys + ["the weighted sum"])[j]
            raise RewardError(f"{what}: reward function {name!r} failed on more than reward_error_share "
                              f"{self.error_share:g} of the {n} completions ({failed[j]} so far), so the run stops; "
                              f"its first failure: {first[j]}")

    def close(self):
        if self.worker is not None:
            self.worker.close()


def _user(fn: Callable) -> Callable:
    def call(text, sample, spec):
        return fn(text, dict(sample))
    call.user = fn
    return call
