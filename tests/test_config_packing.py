"""max_packed_len without packing is a located config error naming the fix (issue 14 B9)."""

import pytest

from astrai.config import ConfigError, load_pipeline


def test_max_packed_len_without_packing_is_an_error(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text("version: 1\ninput:\n  sections:\n    - {field: text, action: train}\n"
                 "preprocessing:\n  max_seq_len: 64\n  max_packed_len: 128\n")
    with pytest.raises(ConfigError) as e:
        load_pipeline(f)
    msg = str(e.value)
    assert f"{f}:7:" in msg and "preprocessing.max_packed_len" in msg and "packing_strategy" in msg
    # the fix it names works
    assert load_pipeline(f, ("preprocessing.packing_strategy=bfd",)).packed_len == 128
    assert load_pipeline(f, ("preprocessing.max_packed_len=null",)).packed_len == 64
