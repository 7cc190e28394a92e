"""The torch floor, checked when the first torch module of astrai.model is imported (attention,
transformer: every train and infer path goes through them), so an old torch gets one message
instead of an error deep in a step: torch >= 2.6 (pyproject.toml states the same; a test keeps
them equal), for scaled_dot_product_attention(enable_gqa=...) (2.5) and the public FSDP2
`fully_shard` (2.6).
"""

from __future__ import annotations

import re

import torch

TORCH_FLOOR = (2, 6)


def check_torch_version(version: str = torch.__version__) -> None:
    found = tuple(int(x) for x in re.match(r"(\d+)\.(\d+)", version).groups())
    if found < TORCH_FLOOR:
        floor = ".".join(map(str, TORCH_FLOOR))
        raise ImportError(f"astrai needs torch >= {floor} (scaled_dot_product_attention's enable_gqa, 2.5; "
                          f"torch.distributed.fsdp.fully_shard, 2.6), found {version}: pip install 'torch>={floor}'")


check_torch_version()
