"""Errors for people: each names the file, the line or record, the key and the reason."""

from __future__ import annotations

from typing import Optional


class InputError(Exception):
    """A problem with an input path, a tokenizer or a template: stops the run."""


class RecordError(Exception):
    """One bad record. `reason` is a short stable code counted in stats.json (e.g. missing_field)."""

    def __init__(self, reason: str, detail: str, file: str = "", line: Optional[str] = None, key: str = ""):
        self.reason = reason
        self.detail = detail
        self.file = file
        self.line = line
        self.key = key
        super().__init__(self._text())

    def __reduce__(self):  # keeps the fields across process boundaries (worker -> main)
        return (RecordError, (self.reason, self.detail, self.file, self.line, self.key))

    def located(self, file: str, line: Optional[str]) -> "RecordError":
        """The same error with its place: file and line ("12") or record ("record 3", "row 7")."""
        return RecordError(self.reason, self.detail, file, line, self.key)

    def at_key(self, key: str) -> "RecordError":
        return RecordError(self.reason, self.detail, self.file, self.line, key)

    def _text(self) -> str:
        where = f"{self.file}:{self.line}: " if self.file else ""
        key = f"{self.key}: " if self.key else ""
        return f"{where}{key}{self.detail} [{self.reason}]"

    def as_json(self) -> dict:
        return {"file": self.file, "line": self.line, "key": self.key, "reason": self.reason, "detail": self.detail}


class ModelFileError(InputError, ValueError):
    """A model directory, config.json or weights file that astrai refuses to load (it names the file and
    the key or tensor). A ValueError too, so callers that catch bad values catch it."""
