"""The column contract between the preprocess stage and the stages that read its output.

Train, eval, inspect and export read shards through these names and rules; the writer and the
config checks use the same ones. A second copy of any of them elsewhere is a bug waiting for the
first to change.

Rows (one per packed bin, or per record unpacked):
- single output: `input_ids`, `labels` (IGNORE_INDEX where not trained; omitted when every token
  is trained), `position_ids` (unless position_ids_mode none), `seq_lens` — all list<int32>;
- multi-output (DPO pairs, GRPO groups): per token source `{source}_input_ids` and
  `{source}_labels` (list<int32>, or list<list<int32>> for a list source);
- value columns (a reward, a score): named by `value_column`, typed by `VALUE_TYPES`.

NOTE: plain Python only (no numpy, pyarrow or torch): everything may import it.
"""

from __future__ import annotations

from typing import Literal, Optional

IGNORE_INDEX = -100  # label of a token that is not trained (Hugging Face convention, labels not shifted)

INPUT_IDS = "input_ids"
LABELS = "labels"
POSITION_IDS = "position_ids"
SEQ_LENS = "seq_lens"
TOKEN_COLUMNS = (INPUT_IDS, LABELS, POSITION_IDS, SEQ_LENS)
SOURCE_TOKEN_COLUMNS = (INPUT_IDS, LABELS)  # what a token source writes, prefixed with its name

# value_type of a value section -> the Arrow type of its column. float is float32 so that a reward
# of 0.8 never becomes 0 (a bug users paid for elsewhere); a list source holds one value per item,
# so its column is a list of that type.
ValueType = Literal["float", "float_list", "int", "string", "bool"]
VALUE_TYPES = {"float": "float32", "float_list": "list<float32>", "int": "int64", "string": "string",
               "bool": "bool"}


def source_column(source: str, column: str) -> str:
    """A token column of a multi-output source, e.g. ('chosen', 'labels') -> 'chosen_labels'."""
    return f"{source}_{column}"


def source_of_column(name: str) -> Optional[str]:
    """The source whose input_ids column this is ('chosen_input_ids' -> 'chosen'), else None."""
    suffix = "_" + INPUT_IDS
    return name[: -len(suffix)] if name.endswith(suffix) else None


def is_source_token_column(name: str) -> bool:
    return name.endswith(tuple("_" + c for c in SOURCE_TOKEN_COLUMNS))


def value_column(source: str, field: str) -> str:
    """The column a value section writes: named after its field in single-output pipelines (source
    ''), after its source in multi-output ones (so a source carries at most one value)."""
    return source or field


def arrow_value_type(value_type: str, per_item: bool = False):
    """The pyarrow type of a value column (imported lazily: this module stays dependency-free)."""
    import pyarrow as pa

    t = {"float32": pa.float32(), "list<float32>": pa.list_(pa.float32()), "int64": pa.int64(),
         "string": pa.string(), "bool": pa.bool_()}[VALUE_TYPES[value_type]]
    return pa.list_(t) if per_item else t
