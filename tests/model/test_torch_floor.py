"""The torch floor: pyproject.toml and astrai.model.torch_floor.TORCH_FLOOR agree, the floor covers every
version-bound feature the code uses (each with the release that made it public), and an older
torch is refused at import with the pip line."""

import re
from pathlib import Path

import pytest

from astrai.model.torch_floor import TORCH_FLOOR, check_torch_version

ROOT = Path(__file__).resolve().parents[2]
# what the code uses that older torch lacks: (the release that made it public, a file that uses it)
FEATURES = {
    "enable_gqa=": ((2, 5), "astrai/model/attention.py"),  # F.scaled_dot_product_attention(enable_gqa=...)
    "from torch.distributed.fsdp import fully_shard": ((2, 6), "astrai/train/distributed.py"),  # before: _composable
    "from torch.distributed.fsdp import FSDPModule": ((2, 6), "astrai/train/distributed.py"),
    "torch.compiler.is_compiling": ((2, 3), "astrai/model/rope.py"),
}


def test_pyproject_states_the_floor():
    text = (ROOT / "pyproject.toml").read_text()
    (spec,) = re.findall(r'"torch>=(\d+)\.(\d+)"', text)
    assert tuple(map(int, spec)) == TORCH_FLOOR


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_the_floor_covers_each_feature_used(feature):
    since, path = FEATURES[feature]
    assert feature in (ROOT / path).read_text(), f"{path} no longer uses {feature}: update the table"
    assert since <= TORCH_FLOOR


def test_an_older_torch_is_refused_with_the_fix():
    check_torch_version("2.6.0+cpu")
    check_torch_version("2.13.0")
    with pytest.raises(ImportError, match=r"astrai needs torch >= 2.6 .* found 2.5.1: pip install 'torch>=2.6'"):
        check_torch_version("2.5.1")
    with pytest.raises(ImportError, match="found 2.4.0a0"):
        check_torch_version("2.4.0a0+git123")
