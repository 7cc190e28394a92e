"""JSON read from files astrai did not write, with bounded size and nesting.

The one reader for the JSON files of a model, adapter or training checkpoint (config.json, a
safetensors header, adapter_config.json, trainer_state.json, ...): only a regular file is opened
(astrai.errors.open_regular: a FIFO or a device is refused before a byte is read), its size is
checked against `max_bytes` before it is read, and the parsed value may nest at most MAX_DEPTH
containers deep. Python's json parser recurses per level, so a file of 100,000 '[' ends in a
RecursionError, and a value that parses just under the interpreter's limit still breaks whatever
walks it next (copying, dumping, validating); the files read here nest a few levels, so anything
deeper is refused as not being one. Every refusal is one line of the caller's error type naming
the file (`where`) and what is wrong.

NOTE: imports nothing from astrai but astrai.errors: every layer may use it.
"""

from __future__ import annotations

import json
import os
from typing import Any, Union

from astrai.errors import InputError, PathLike, open_regular

MAX_DEPTH = 64  # containers inside containers; HF configs and safetensors headers nest 2-4 levels


def loads(raw: Union[bytes, str], where: str, what: str = "JSON file", error: type = InputError,
          max_depth: int = MAX_DEPTH) -> Any:
    """The value of a JSON document (UTF-8 bytes or text), or `error` naming `where`."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, (bytes, bytearray)) else raw
        value = json.loads(text)
    except UnicodeDecodeError as e:
        raise error(f"{where}: not UTF-8 text (byte {e.start}: {e.reason}); not {_a(what)}") from None
    except json.JSONDecodeError as e:
        raise error(f"{where}: invalid JSON: {e.msg} (line {e.lineno} column {e.colno})") from None
    except RecursionError:
        raise error(f"{where}: JSON nested more than {max_depth} levels deep; not {_a(what)}") from None
    if depth(value, max_depth) > max_depth:
        raise error(f"{where}: JSON nested more than {max_depth} levels deep; not {_a(what)}")
    return value


def _a(what: str) -> str:
    return ("an " if what[:1].lower() in "aeiou" else "a ") + what


def depth(value: Any, stop: int = MAX_DEPTH) -> int:
    """How many containers deep `value` nests (0 for a scalar), counted without recursion; the count
    stops once it passes `stop`."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, level = todo.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, level)
            if level > stop:
                return level
            todo.extend((child, level + 1) for child in (v.values() if isinstance(v, dict) else v)
                        if isinstance(child, (dict, list)))
    return deepest


def read_json(path: PathLike, what: str, max_bytes: int, error: type = InputError,
              max_depth: int = MAX_DEPTH) -> Any:
    """The JSON value of a regular file of at most `max_bytes` bytes."""
    with open_regular(path, "rb", what, error=error) as f:
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:
            raise error(f"{path}: {size:,} bytes, more than {_a(what)} can reasonably hold ({max_bytes:,})")
        raw = f.read(max_bytes + 1)  # a file that grew after the check is still read only this far
    if len(raw) > max_bytes:
        raise error(f"{path}: more than {max_bytes:,} bytes, more than {_a(what)} can reasonably hold")
    return loads(raw, str(path), what, error, max_depth)
