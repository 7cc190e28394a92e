"""`compile: true` (each decoder layer through torch.compile, the document loop left eager) trains the
same run as eager, and new document layouts after warm-up compile nothing new."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import train_script as ts  # noqa: E402

from astrai.train.strategies import make_strategy  # noqa: E402
from astrai.train.trainer import Trainer  # noqa: E402


class GraphCount(ts.Callback):
    """Dynamo's count of distinct compiled graphs after each optimizer step."""

    def __init__(self):
        self.graphs = []

    def on_optimizer_step(self, trainer):
        from torch._dynamo.utils import counters

        self.graphs.append(counters["stats"]["unique_graphs"])


@pytest.mark.slow
def test_compiled_layers_train_like_eager_without_recompiling(tmp_path):
    torch._dynamo.reset()
    rows = ts.synthetic_rows(16, seed=5)  # 1-3 documents per row, lengths 2..19: every step a new layout
    runs = {}
    for compiled in (False, True):
        count = GraphCount()
        t = Trainer(ts.model(), make_strategy("sft"), rows, ts.options(
            tmp_path / str(compiled), batch_size=1, grad_accum=1, epochs=1, shuffle=False, compile=compiled,
            save_every=100), callbacks=(count,))
        runs[compiled] = ([h["loss"] for h in t.fit().history], count.graphs)
    eager, compiled = runs[False][0], runs[True][0]
    assert len(eager) == len(compiled) == 16
    for a, b in zip(eager, compiled):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(a)), (eager, compiled)
    graphs = runs[True][1]
    # the first steps compile (a static graph, then a dynamic-shape one); later layouts reuse them
    assert graphs[0] > 0 and graphs[-1] == graphs[3], graphs


def _compiled_graphs(tmp_path, layers: int) -> list[int]:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()  # its counts are the process's, not the reset's
    count = GraphCount()
    torch.manual_seed(0)
    model = ts.CausalLM(ts.CFG.replace(num_hidden_layers=layers))
    Trainer(model, make_strategy("sft"), ts.synthetic_rows(4, seed=5), ts.options(
        tmp_path / str(layers), batch_size=1, grad_accum=1, epochs=1, shuffle=False, compile=True,
        save_every=100), callbacks=(count,)).fit()
    return count.graphs


@pytest.mark.slow
def test_every_layer_shares_the_compiled_graphs(tmp_path, caplog):
    """More layers than dynamo's recompile_limit (8): as many graphs as for 2 layers, none left eager
    (each layer's layer_idx once made its own graph, and layers past the limit ran uncompiled)."""
    two = _compiled_graphs(tmp_path, 2)
    with caplog.at_level("WARNING", logger="torch._dynamo"):
        twelve = _compiled_graphs(tmp_path, 12)
    assert twelve == two, (two, twelve)
    assert "recompile_limit" not in caplog.text
