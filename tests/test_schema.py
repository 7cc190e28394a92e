"""astrai.schema: the naming rules and types the writer, the config checks and the readers share."""

import pyarrow as pa

from astrai.schema import (
    IGNORE_INDEX, TOKEN_COLUMNS, VALUE_TYPES, arrow_value_type, is_source_token_column, source_column,
    source_of_column, value_column,
)


def test_column_names():
    assert IGNORE_INDEX == -100  # Hugging Face's ignore index: what every trainer expects
    assert TOKEN_COLUMNS == ("input_ids", "labels", "position_ids", "seq_lens")
    assert source_column("chosen", "labels") == "chosen_labels"
    assert source_of_column("completion_input_ids") == "completion" and source_of_column("rewards") is None
    assert is_source_token_column("rejected_labels") and not is_source_token_column("rewards")
    # a value is named after its field in single-output pipelines, after its source otherwise
    assert value_column("", "score") == "score" and value_column("rewards", "reward") == "rewards"


def test_value_types_are_arrow_types():
    assert arrow_value_type("float") == pa.float32()  # 0.8 stays 0.8, never an integer
    assert arrow_value_type("float", per_item=True) == pa.list_(pa.float32())
    assert arrow_value_type("float_list") == pa.list_(pa.float32())
    assert {arrow_value_type(t) for t in VALUE_TYPES} == {pa.float32(), pa.list_(pa.float32()), pa.int64(),
                                                         pa.string(), pa.bool_()}
