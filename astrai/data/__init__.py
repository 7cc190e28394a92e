"""The data path: read, render, tokenize, mask, filter, truncate, pack, write, load back, inspect.

NOTE: nothing here imports torch at module import time (astrai.data.load imports it lazily), so
preprocessing runs in environments without torch.
"""

from astrai.errors import InputError, RecordError

__all__ = ["InputError", "RecordError"]
