"""The user's astrai cache: $ASTRAI_CACHE, else $XDG_CACHE_HOME/astrai, else ~/.cache/astrai.

What goes there can always be made again from its inputs (a packaged model converted once, a
tokenizer's content digest): a missing, unreadable or unwritable cache costs time, never a result.
`remembered(kind, key, make, valid)` is the whole protocol for small values: the entry `kind/key`
is read when it is there and `valid`, else made and written atomically (a reader sees no half
entry); keys are digests of everything the value depends on.

NOTE: this module imports only astrai.runtime and astrai.errors: every layer may use it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from astrai.errors import InputError
from astrai.runtime import atomic_write_text


def cache_root() -> Path:
    if os.environ.get("ASTRAI_CACHE"):
        return Path(os.environ["ASTRAI_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg) / "astrai"
    try:
        return Path.home() / ".cache" / "astrai"
    except RuntimeError:  # no $HOME and no password entry to find one (some containers)
        raise InputError("no home directory for astrai's cache: set ASTRAI_CACHE=DIR (or XDG_CACHE_HOME)") from None


def remembered(kind: str, key: str, make: Callable[[], str], valid: Callable[[str], bool]) -> str:
    """The cached text of `kind/key` when present and valid, else make() (then cached, if the cache is writable)."""
    try:
        path = cache_root() / kind / key
    except InputError:  # nowhere to keep it: made every time
        return make()
    try:
        text = path.read_text(encoding="utf-8")
        if valid(text):
            return text
    except (OSError, UnicodeDecodeError):
        pass
    text = make()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, text, durable=False)
    except OSError:
        pass  # a read-only home or a full disk: the value was made, it is just not kept
    return text
