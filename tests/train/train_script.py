"""A tiny training run used by the trainer tests, in-process or as a subprocess (kill, signal, torchrun).

    python train_script.py OUT [--kill-at STEP] [--sleep S] [--batch B] [--accum A] [--epochs N]
                               [--parallel ddp|fsdp] [--tied] [--moe] [--lora] [--val ROWS] [--opt KEY=JSON ...]
                               [--nan-at STEP,...] [--rng-log]
"""

import argparse
import hashlib
import json
import os
import signal
import time
from pathlib import Path

import torch

from astrai.model import CausalLM, ModelConfig
from astrai.schema import IGNORE_INDEX
from astrai.train.callbacks import Callback
from astrai.train.distributed import finish, setup, teardown
from astrai.config.train import TrainOptions
from astrai.train.strategies import make_strategy
from astrai.train.trainer import Trainer

CFG = ModelConfig.preset("tiny", vocab_size=128, hidden_size=32, intermediate_size=64)


def synthetic_rows(n=24, seed=0, max_doc=20):
    """Packed rows like ShardDataset gives: several documents, a masked prompt in each."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        lens = torch.randint(2, max_doc, (int(torch.randint(1, 4, (1,), generator=g)),), generator=g)
        ids = torch.randint(0, CFG.vocab_size, (int(lens.sum()),), generator=g)
        labels = ids.clone()
        start = 0
        for k in lens.tolist():
            labels[start:start + int(torch.randint(0, k, (1,), generator=g))] = IGNORE_INDEX
            start += k
        rows.append({"input_ids": ids, "labels": labels, "seq_lens": lens,
                     "position_ids": torch.cat([torch.arange(k) for k in lens.tolist()])})
    return rows


def options(out, **kw):
    base = dict(data="unused", output=str(out), strategy="sft", batch_size=2, grad_accum=2, epochs=2, lr=1e-2,
                warmup_steps=2, save_every=2, progress=False, seed=3)
    return TrainOptions(**{**base, **kw})


def model(seed=0, tied=False, moe=False, lora=False):
    """`lora`: rank-4 adapters on every projection (on a MoE model, also on the experts), B at random
    like after some training so the adapted model differs from its base."""
    torch.manual_seed(seed)
    cfg = CFG.replace(tie_word_embeddings=True) if tied else CFG
    m = CausalLM(cfg.replace(num_local_experts=4, num_experts_per_tok=2) if moe else cfg)
    if lora:
        from astrai.model.lora import LoraSpec, apply_lora, lora_layers

        apply_lora(m, LoraSpec(4, 8.0, targets=LoraSpec.targets + (("w1", "w2", "w3") if moe else ())))
        with torch.no_grad():
            for layer in lora_layers(m).values():
                layer.lora_B.weight.normal_(0, 0.02)
    return m


class KillAt(Callback):
    def __init__(self, step):
        self.step = step

    def on_batch_end(self, trainer):
        if trainer.state.at_boundary and trainer.state.global_step == self.step:
            if trainer.dist.active:  # every rank has logged this step before any of them dies
                torch.distributed.barrier()
            os.kill(os.getpid(), signal.SIGKILL)


class Sleep(Callback):
    def __init__(self, s):
        self.s = s

    def on_batch_end(self, trainer):
        time.sleep(self.s)


class NaNLossAt(Callback):
    """The loss of the given optimizer steps becomes NaN on rank 0 only (as a corrupt batch would make
    it): every rank must still decide alike."""

    def __init__(self, steps):
        self.steps, self.now = set(steps), 0

    def on_train_begin(self, trainer):
        inner = trainer.strategy.loss

        def loss(model, batch, env):
            task, aux, metrics = inner(model, batch, env)
            if self.now in self.steps and trainer.dist.rank == 0:
                task = task * float("nan")
            return task, aux, metrics
        trainer.strategy.loss = loss

    def on_batch_begin(self, trainer):
        self.now = trainer.state.global_step + 1


def rng_digest() -> str:
    import random

    import numpy as np
    h = hashlib.sha256(torch.get_rng_state().numpy().tobytes())
    h.update(repr(random.getstate()).encode() + np.random.get_state()[1].tobytes())
    return h.hexdigest()[:16]


class RngLog(Callback):
    """Ranks draw differently first (so their generators differ), then each appends its generator
    digest at every step boundary and after a resume to its own file beside the output (lines of two
    ranks in one shared stdout pipe were once seen one short): read back by rank_rng."""

    def __init__(self, out):
        self.out = out

    def _log(self, trainer, kind):
        r = trainer.dist.rank
        with open(f"{self.out}.rng-rank{r}.log", "a") as f:
            f.write(f"{kind} {r} {trainer.state.global_step} {rng_digest()}\n")

    def on_train_begin(self, trainer):
        r, s = trainer.dist.rank, trainer.state.global_step
        if s == 0:
            torch.rand(r + 1)
            import random
            random.random() if r else None
        self._log(trainer, "begin")

    def on_batch_end(self, trainer):
        if trainer.state.at_boundary:
            self._log(trainer, "step")


def rank_rng(out, kind: str) -> dict:
    """{(rank, step): generator digest} of the RngLog lines of one kind ("begin" or "step")."""
    out, found = Path(out), {}
    for p in sorted(out.parent.glob(f"{out.name}.rng-rank*.log")):
        for line in p.read_text().splitlines():
            k, r, s, digest = line.split()
            if k == kind:
                found[(int(r), int(s))] = digest
    return found


class UnsyncedGrads(Callback):
    """fsdp: after the backward of a micro-batch that does not end the step, no sharded gradient may
    exist yet (gradients accumulate unsharded; a reduce-scatter would have produced them)."""

    def __init__(self):
        self.checked = self.reduced = 0

    def on_batch_end(self, trainer):
        if not trainer.state.synced:
            self.checked += 1
            self.reduced += any(p.grad is not None for p in trainer.raw_model.parameters())


def rank_counts(out) -> list[dict]:
    """What each rank wrote after fit, by rank: why and at which step it stopped, and in an fsdp run
    UnsyncedGrads' counts and the local shard sizes."""
    out = Path(out)
    return [json.loads(p.read_text()) for p in sorted(out.parent.glob(f"{out.name}.counts-rank*.json"))]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--kill-at", type=int)
    p.add_argument("--sleep", type=float)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--parallel", default="ddp")
    p.add_argument("--tied", action="store_true")
    p.add_argument("--moe", action="store_true", help="4 experts, top 2")
    p.add_argument("--lora", action="store_true", help="train LoRA adapters only (train_script.model)")
    p.add_argument("--val", type=int, help="validation rows (validated every 3 steps)")
    p.add_argument("--opt", action="append", default=[], help="any other train option, e.g. compile=true")
    p.add_argument("--nan-at", help="comma-separated steps whose loss is NaN on rank 0")
    p.add_argument("--rng-log", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist = setup("cpu")
    cbs = []
    if args.kill_at:
        cbs.append(KillAt(args.kill_at))
    if args.sleep:
        cbs.append(Sleep(args.sleep))
    if args.nan_at:
        cbs.append(NaNLossAt(int(x) for x in args.nan_at.split(",")))
    if args.rng_log:
        cbs.insert(0, RngLog(args.out))  # before KillAt: the digest at the step killed is written
    if args.parallel == "fsdp":
        cbs.append(UnsyncedGrads())
    val = dict(val_data="unused", eval_every=3) if args.val else {}
    val.update({k: json.loads(v) for k, v in (o.split("=", 1) for o in args.opt)})
    t = Trainer(model(tied=args.tied, moe=args.moe, lora=args.lora), make_strategy("sft"), synthetic_rows(),
                options(args.out, batch_size=args.batch, grad_accum=args.accum, epochs=args.epochs,
                        parallel=args.parallel, **val),
                callbacks=tuple(cbs), dist=dist, val_dataset=synthetic_rows(args.val, seed=1) if args.val else None)
    unsynced = next((c for c in cbs if isinstance(c, UnsyncedGrads)), None)
    state = t.fit()
    end = {"stopped": state.stopped, "step": state.global_step}
    if unsynced:
        params = list(t.raw_model.parameters())
        moments = [s["exp_avg"] for s in t.optimizer.state.values()]
        end.update({"reduced_early": unsynced.reduced, "checked": unsynced.checked,
                    "local_params": sum(p.to_local().numel() for p in params),
                    "params": sum(p.numel() for p in params),
                    "local_adam": sum(m.to_local().numel() for m in moments), "adam": sum(m.numel() for m in moments)})
    # one file per rank beside the output (the ranks' lines in one shared stdout pipe were once seen
    # one short): read back by rank_counts
    Path(f"{args.out}.counts-rank{dist.rank}.json").write_text(json.dumps(end))
    print("STOPPED", state.stopped, "STEP", state.global_step, flush=True)
    finish(dist)  # see astrai.train.distributed.finish
    teardown(dist)


if __name__ == "__main__":
    main()
