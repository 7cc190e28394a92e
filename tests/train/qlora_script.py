"""One QLoRA training run on train_script's synthetic rows, as a process of its own (or a rank under
torchrun): python qlora_script.py OUT [--batch N] [--parallel ddp|fsdp]. Rank 0 prints the per-step
losses as JSON; a refused configuration prints `REFUSED <message>` and exits 3."""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import train_script as ts  # noqa: E402

from astrai.model import CausalLM, ModelConfig  # noqa: E402
from astrai.train.adapters import add_adapters  # noqa: E402
from astrai.train.distributed import finish, setup, teardown  # noqa: E402
from astrai.train.run import TrainConfigError  # noqa: E402
from astrai.train.strategies import make_strategy  # noqa: E402
from astrai.train.trainer import Trainer  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--parallel", default="ddp")
    a = p.parse_args()
    torch.set_num_threads(1)
    dist = setup("cpu")
    opts = ts.options(a.out, batch_size=a.batch, grad_accum=2, epochs=1, parallel=a.parallel, save_every=100,
                      lora={"rank": 4, "alpha": 8, "quantize_base": "nf4"})
    torch.manual_seed(0)
    model = CausalLM(ModelConfig.preset("tiny", vocab_size=ts.CFG.vocab_size))  # sizes that divide NF4's 64
    try:
        add_adapters(model, opts)
    except TrainConfigError as e:
        print("REFUSED", e, flush=True)
        teardown(dist)
        sys.exit(3)
    Trainer(model, make_strategy("sft"), ts.synthetic_rows(), opts, dist=dist).fit()
    if dist.is_main:
        with open(os.path.join(a.out, "metrics.jsonl")) as fh:
            print(json.dumps([json.loads(line)["loss"] for line in fh if '"loss"' in line]), flush=True)
    finish(dist)
    teardown(dist)


if __name__ == "__main__":
    main()
