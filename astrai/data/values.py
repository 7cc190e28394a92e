"""Checks on raw record values, so that what is written is what the record says.

- value sections (rewards, scores) match their declared value_type, and fit the column they are
  written to: float32 (NaN, inf and anything past float32's range are rejected, never written as
  NaN/inf), int64;
- texts can be tokenized and written as UTF-8 (no lone surrogates, which JSON escapes and Python
  strings allow).

Each failure is a RecordError with a stable reason (wrong_type, non_finite, out_of_range,
invalid_unicode) and the record's key, so the run rejects that record and goes on.
"""

from __future__ import annotations

import math

import numpy as np

from astrai.errors import RecordError


FLOAT32_MAX = float(np.finfo(np.float32).max)
INT64_RANGE = (-(2 ** 63), 2 ** 63 - 1)


def check_value(v, value_type: str, key: str):
    """A value field checked against its declared type and range, so every record writes the same
    column type and no value changes on the way (a float column is float32: NaN, inf and anything
    past float32's range are rejected, not written as NaN/inf)."""
    def num(x):
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    ok = {"float": num(v), "int": isinstance(v, int) and not isinstance(v, bool),
          "float_list": isinstance(v, list) and all(num(x) for x in v),
          "string": isinstance(v, str), "bool": isinstance(v, bool)}[value_type]
    if not ok:
        hint = " (declare value_type: float_list for a list of numbers)" if isinstance(v, list) else ""
        raise RecordError("wrong_type", f"value_type {value_type}: got {type_name(v)} {v!r:.40}{hint}", key=key)
    if value_type == "float":
        return _float32(v, key)
    if value_type == "float_list":
        return [_float32(x, f"{key}[{i}]") for i, x in enumerate(v)]
    if value_type == "int" and not INT64_RANGE[0] <= v <= INT64_RANGE[1]:
        raise RecordError("out_of_range", f"value_type int: {_big(v)} does not fit in int64", key=key)
    if value_type == "string":
        check_unicode(v, key)
    return v


def _float32(x, key: str) -> float:
    try:
        f = float(x)
    except OverflowError:  # an int past float64 (10**400)
        raise RecordError("out_of_range", f"{_big(x)} does not fit in float32", key=key) from None
    if not math.isfinite(f):
        raise RecordError("non_finite", f"{f} is not a finite number", key=key)
    # np.float32 rounds to nearest: values just past the max round down to it, anything beyond is inf
    with np.errstate(over="ignore"):
        too_big = not math.isfinite(np.float32(f))
    if too_big:
        raise RecordError("out_of_range", f"{f:.6g} does not fit in float32 (max {FLOAT32_MAX:.6g})", key=key)
    return f


def _big(n: int) -> str:
    digits = str(abs(n))
    return str(n) if len(digits) <= 20 else f"{'-' if n < 0 else ''}{digits[0]}.{digits[1:4]}e{len(digits) - 1}"


def check_unicode(text: str, key) -> None:
    """Text the tokenizer and the UTF-8 writers can take: no lone surrogates (valid in JSON escapes
    and Python strings, not in UTF-8)."""
    if text.isascii():  # O(1) in CPython: the common case costs nothing
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RecordError("invalid_unicode", f"lone surrogate U+{ord(text[e.start]):04X} at character {e.start} "
                                             f"(not encodable as UTF-8)", key=key) from None


def type_name(v) -> str:
    return "null" if v is None else type(v).__name__
