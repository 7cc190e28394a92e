"""Benchmark: QLoRA (`lora: {quantize_base: nf4}`) against LoRA on a float32 base, SmolLM2-135M-Instruct.

Each method runs in a fresh child process, the two alternating (--rounds times), on the same packed
rows of the bundled chats (bench/finetune.py's preparation: SmolLM2's own template, assistant turns
trained), with the same seed, adapters (rank 16 on every projection), lr and steps:

- the model is built as the train stage builds it (astrai.train.run.build_model): QLoRA reads the
  checkpoint layer by layer straight into NF4, LoRA reads it in float32;
- base bytes: the frozen decoder projections as held (NF4 codes + scales, or float32), and the whole
  frozen base (with the float32 embedding, norms; the LM head is tied to the embedding);
- RSS after loading (VmRSS once the model and adapters are built) and the peak while loading (VmHWM);
- peak RSS of the steps: VmHWM reset (/proc/self/clear_refs) after the model is built (and
  malloc_trim), so the figure is the training steps' own peak, process included;
- step time: the mean of the steps after the first (a warm-up);
- val loss: on held-out rows (not trained on) before the first step and after the last.

Targets (issue 32): frozen base <= 0.2x its float32 bytes, peak RSS <= 0.6x, step time <= 1.5x,
val loss within 2% of LoRA's.

Run: python bench/qlora.py [--steps 6] [--row-len 512] [--val-rows 4] [--rounds 2] [--threads 2] [--return-freed]
     python bench/qlora.py --kernels   # NF4 quantize/dequantize against torchao's; int8/int4/nf4 batch-1 forwards
     python bench/qlora.py --base-loss # the base's val loss (no step) through each weight format
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from finetune import pick_rows, prepare  # noqa: E402

from astrai.config.train import TrainOptions  # noqa: E402
from astrai.data.load import ShardDataset  # noqa: E402

LR = 2e-3


class Rows:
    """Some rows of a dataset, as the trainer indexes a dataset."""

    def __init__(self, ds, idx):
        self.ds, self.idx = ds, idx

    def __len__(self):
        return len(self.idx)

    def __getitem__(self, i):
        return self.ds[self.idx[i]]


def _status_mb(key: str) -> float:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith(key)) / 1024


def _peak_mb() -> float:
    return _status_mb("VmHWM:")


def _rss_mb() -> float:
    return _status_mb("VmRSS:")


def child(a, mode: str):
    from astrai.model.checkpoint_files import read_headers
    from astrai.model.lora import lora_layers
    from astrai.model.quant import QuantizedLinear, quantized_bytes
    from astrai.train.adapters import add_adapters
    from astrai.train.run import build_model
    from astrai.train.strategies import make_strategy
    from astrai.train.trainer import Trainer

    if a.return_freed:  # before anything is loaded: every tensor of 256 KiB or more gets its own mapping
        from astrai.train.host_memory import return_freed_memory

        return_freed_memory()
    ckpt, data = prepare(a.row_len, Path(a.work))
    ds = ShardDataset(data)
    rows = pick_rows(data, a.steps + a.val_rows, a.row_len)
    train, val = rows[:a.steps], Rows(ds, rows[a.steps:])
    work = Path(tempfile.mkdtemp(prefix="bench-qlora-"))
    lora = {"quantize_base": "nf4"} if mode == "qlora" else {}
    opts = TrainOptions(data=str(data), output=str(work), model=str(ckpt), lr=LR, progress=False, save_every=10 ** 6,
                        batch_size=1, warmup_steps=0, scheduler="constant", lora=lora, seed=0,
                        return_freed_memory=a.return_freed)
    t = time.perf_counter()
    # as the train stage builds it: QLoRA reads the checkpoint layer by layer straight into NF4
    model = build_model(str(ckpt), None, 0, torch.float32, "nf4" if mode == "qlora" else None)
    fp32_proj = sum(4 * m.in_features * m.out_features for n, m in model.model.layers.named_modules()
                    if isinstance(m, (torch.nn.Linear, QuantizedLinear)))
    fp32_base = 4 * sum(i.numel for i in read_headers(ckpt).values())  # the tied LM head is stored once
    add_adapters(model, opts)
    setup_s = time.perf_counter() - t
    load_peak, after_load = _peak_mb(), _rss_mb()
    proj = quantized_bytes(model) if mode == "qlora" else fp32_proj
    adapters = {id(p) for layer in lora_layers(model).values() for p in (layer.lora_A.weight, layer.lora_B.weight)}
    rest = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values()
               if id(p) not in adapters and not any(p is q.base_layer.weight for q in lora_layers(model).values()))
    trainer = Trainer(model, make_strategy("sft"), ds, opts, val_dataset=val)
    trainer.raw_model.train()
    before = trainer.validate()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # give back what loading and quantizing freed
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS
    rss0 = _peak_mb()
    secs = []
    for row in train:
        t = time.perf_counter()
        trainer._train_window([[row]])
        secs.append(time.perf_counter() - t)
    peak = _peak_mb()
    after = trainer.validate()
    print(json.dumps({"mode": mode, "return_freed_memory": a.return_freed, "projections_bytes": proj, "projections_fp32_bytes": fp32_proj,
                      "base_bytes": proj + rest, "base_fp32_bytes": fp32_base, "setup_s": round(setup_s, 1),
                      "load_peak_rss_mb": round(load_peak), "rss_after_load_mb": round(after_load),
                      "rss_before_steps_mb": round(rss0), "peak_rss_mb": round(peak),
                      "step_s": round(statistics.mean(secs[1:]), 3), "val_loss_start": round(before, 4),
                      "val_loss": round(after, 4)}))


def base_losses(a):
    """Validation loss of the frozen base alone (no adapters, no step) on the bench's held-out rows, with
    every decoder projection replaced by its round trip through each weight format: float32 (none),
    astrai's NF4, torchao's own `to_nf4` (the reference), NF4 without double quantization (float32
    absmax per block of 64) and with blocks of 32, int8 per channel, int4 per group of 64."""
    from torchao.quantization import to_nf4 as torchao_to_nf4

    from astrai.model.lora import LORA_TARGETS
    from astrai.model.quant import NF4_CODE_BOOK, nf4_dequantize, nf4_scaler_block, to_nf4
    from astrai.train.run import build_model
    from astrai.train.strategies import make_strategy
    from astrai.train.trainer import Trainer

    def plain_nf4(w, block):  # QLoRA's NF4 with a float32 absmax per block: no double quantization
        book = torch.tensor(NF4_CODE_BOOK)
        blocks = w.reshape(-1, block)
        absmax = blocks.abs().amax(1, keepdim=True)
        codes = torch.bucketize(blocks / absmax, (book[1:] + book[:-1]) / 2)
        return (book[codes] * absmax).reshape(w.shape)

    formats = {
        "float32": lambda w: w,
        "nf4 (astrai)": lambda w: nf4_dequantize(to_nf4(w)),
        "nf4 (torchao to_nf4)": lambda w: torchao_to_nf4(w, 64, nf4_scaler_block(w.numel() // 64))
        .get_original_weight(),
        "nf4 block 64, no double quantization": lambda w: plain_nf4(w, 64),
        "nf4 block 32, no double quantization": lambda w: plain_nf4(w, 32),
        "int8 per channel": lambda w: _roundtrip(w, "int8"),
        "int4 group 64": lambda w: _roundtrip(w, "int4"),
    }
    ckpt, data = prepare(a.row_len, Path(a.work))
    ds = ShardDataset(data)
    rows = pick_rows(data, a.steps + a.val_rows, a.row_len)
    val = Rows(ds, rows[a.steps:])
    opts = TrainOptions(data=str(data), output=tempfile.mkdtemp(prefix="bench-qlora-"), model=str(ckpt),
                        progress=False, batch_size=1, seed=0)
    out = {}
    for name, roundtrip in formats.items():
        model = build_model(str(ckpt), None, 0, torch.float32)
        with torch.no_grad():
            for n, m in model.model.layers.named_modules():
                if n.rsplit(".", 1)[-1] in LORA_TARGETS and isinstance(m, torch.nn.Linear):
                    m.weight.copy_(roundtrip(m.weight))
        out[name] = round(Trainer(model, make_strategy("sft"), ds, opts, val_dataset=val).validate(), 4)
        print(json.dumps({name: out[name]}), flush=True)
    ref = out["float32"]
    print(json.dumps({k: [v, round(v / ref, 4)] for k, v in out.items()}, indent=1))


def _roundtrip(w: torch.Tensor, kind: str) -> torch.Tensor:
    from astrai.model.quant import quantize_weight

    return quantize_weight(w, None, kind, "w").dequantize()


def kernels(a):
    """NF4 quantize / dequantize, astrai's against torchao's own, and batch-1 forwards of the int8 / int4 /
    NF4 layers against a float32 matmul, on SmolLM2's MLP shape (1536 x 576) and its embedding-sized
    LM head (49152 x 576)."""
    from torchao.quantization import to_nf4 as torchao_to_nf4

    from astrai.model.quant import nf4_dequantize, nf4_scaler_block, quantize_linear, to_nf4

    def timed(f, reps=5):
        f()
        t = time.perf_counter()
        for _ in range(reps):
            f()
        return (time.perf_counter() - t) / reps

    torch.manual_seed(0)
    out = {}
    for shape in ((1536, 576), (49152, 576)):
        w = torch.randn(*shape) * 0.02
        n = to_nf4(w)
        key = "x".join(map(str, shape))
        ours_q, theirs_q = timed(lambda: to_nf4(w), 2), timed(
            lambda: torchao_to_nf4(w, 64, nf4_scaler_block(w.numel() // 64)), 2)
        ours_d, theirs_d = timed(lambda: nf4_dequantize(n)), timed(lambda: n.get_original_weight())
        out[f"{key} nf4 quantize s: astrai, torchao"] = [round(ours_q, 4), round(theirs_q, 4)]
        out[f"{key} nf4 dequantize s: astrai, torchao"] = [round(ours_d, 4), round(theirs_d, 4)]
        lin = torch.nn.Linear(shape[1], shape[0], bias=False)
        x = torch.randn(1, shape[1])
        base = timed(lambda: lin(x), 50)
        with torch.no_grad():
            for kind in ("int8", "int4", "nf4"):
                q = quantize_linear(lin, kind)
                out[f"{key} batch-1 forward / float32: {kind}"] = round(timed(lambda: q(x), 50) / base, 3)
    print(json.dumps(out, indent=1))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6, help="training steps per child, the first a warm-up")
    p.add_argument("--row-len", type=int, default=512)
    p.add_argument("--val-rows", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2, help="lora, qlora children alternating this many times")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "astrai-bench-finetune"))
    p.add_argument("--return-freed", action="store_true", help="both children with return_freed_memory: true "
                   "(glibc returns freed tensors of 256 KiB or more to the system; astrai.train.host_memory)")
    p.add_argument("--kernels", action="store_true", help="only the NF4 / int8 / int4 layer timings")
    p.add_argument("--base-loss", action="store_true", help="only the base's val loss through each weight format")
    p.add_argument("--child", choices=("lora", "qlora"), help=argparse.SUPPRESS)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    if a.child:
        return child(a, a.child)
    if a.kernels:
        return kernels(a)
    if a.base_loss:
        return base_losses(a)
    from child import run_child

    runs = {"lora": [], "qlora": []}
    for _ in range(a.rounds):
        for mode in ("lora", "qlora"):
            r, _, _ = run_child([sys.executable, __file__, "--child", mode, "--steps", str(a.steps), "--row-len",
                                 str(a.row_len), "--val-rows", str(a.val_rows), "--threads", str(a.threads),
                                 "--work", a.work] + (["--return-freed"] if a.return_freed else []),
                                cwd=str(HERE), what=f"{mode} child")
            runs[mode].append(r)
            print(json.dumps(r), flush=True)
    lo, q = runs["lora"], runs["qlora"]

    def ratio(key):
        return round(statistics.median(b[key] for b in q) / statistics.median(x[key] for x in lo), 3)

    print(json.dumps({
        "frozen projections NF4 / float32 bytes": round(q[0]["projections_bytes"] / q[0]["projections_fp32_bytes"], 3),
        "whole frozen base QLoRA / LoRA bytes": round(q[0]["base_bytes"] / lo[0]["base_bytes"], 3),
        "peak RSS of the steps QLoRA / LoRA": ratio("peak_rss_mb"),
        "RSS after loading QLoRA / LoRA": ratio("rss_after_load_mb"),
        "peak RSS while loading QLoRA / LoRA": ratio("load_peak_rss_mb"),
        "step time QLoRA / LoRA": ratio("step_s"),
        "val loss after the steps QLoRA / LoRA": ratio("val_loss"),
        "val loss start QLoRA / LoRA (the NF4 base alone)": ratio("val_loss_start")}, indent=1))


if __name__ == "__main__":
    main()
