"""run_train end to end on real preprocess output (tiny tokenizer): sft, dpo, grpo, seq; the final
directory loads in transformers with equal logits; invalid combinations are refused before work."""

import json
from pathlib import Path

import pytest
import torch

from astrai.config import load_pipeline
from astrai.data.preprocess import run_preprocess
from astrai.config.train import TrainOptions
from astrai.model.hf_config import config_to_hf
from astrai.train.run import TrainConfigError, run_train

ROOT = Path(__file__).resolve().parents[2]


def _pre(tmp_path, tok, name, records, pipeline):
    src = tmp_path / f"{name}.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / f"data-{name}"
    run_preprocess(load_pipeline(ROOT / "pipelines" / pipeline), [str(src)], str(out), tokenizer=str(tok),
                   workers=1, log=lambda s: None)
    return out


@pytest.fixture(scope="module")
def datasets(tmp_path_factory, tiny_tokenizer):
    tmp = tmp_path_factory.mktemp("train-data")
    chats = [{"messages": [{"role": "user", "content": f"how are you today number {i}"},
                           {"role": "assistant", "content": "fine thanks " * (1 + i % 4)}], "source": "x"}
             for i in range(24)]
    dpo = [{"prompt": [{"role": "user", "content": f"question {i} how are you"}],
            "chosen": [{"role": "assistant", "content": "fine thanks good"}],
            "rejected": [{"role": "assistant", "content": "no"}]} for i in range(8)]
    grpo = [{"prompt": [{"role": "user", "content": f"say yes {i}"}],
             "completions": [{"text": "yes<|im_end|>", "reward": 1.0}, {"text": "no maybe<|im_end|>", "reward": 0.2}]}
            for i in range(8)]
    text = [{"text": "the quick brown fox jumps over the lazy dog " * (1 + i % 3)} for i in range(16)]
    return {"sft": _pre(tmp, tiny_tokenizer, "sft", chats, "chatml_sft.yaml"),
            "dpo": _pre(tmp, tiny_tokenizer, "dpo", dpo, "dpo_chatml.yaml"),
            "grpo": _pre(tmp, tiny_tokenizer, "grpo", grpo, "grpo_chatml.yaml"),
            "text": _pre(tmp, tiny_tokenizer, "text", text, "pretrain_text.yaml")}


def _opts(data, out, **kw):
    return TrainOptions(**{"data": str(data), "output": str(out), "model": "tiny", "batch_size": 1, "max_steps": 2, "epochs": 20,
                           "progress": False, "lr": 1e-3, **kw})


def test_sft_final_checkpoint_loads_in_transformers(datasets, tmp_path, loads_in_transformers):
    transformers = pytest.importorskip("transformers")
    res = run_train(_opts(datasets["sft"], tmp_path / "run", strategy="sft"))
    assert res["steps"] == 2 and res["stopped"] is None and res["loss"] > 0
    final = Path(res["final"])
    for f in ("config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"):
        assert (final / f).exists(), f
    loads_in_transformers(final)
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(final / "tokenizer.json"))
    assert tok.convert_tokens_to_ids("<|im_end|>") is not None


def test_dpo_first_step_loss_is_log2(datasets, tmp_path):
    res = run_train(_opts(datasets["dpo"], tmp_path / "dpo", strategy="dpo", max_steps=1))
    # the policy starts as the reference: every margin is 0 and -log sigmoid(0) = log 2
    assert res["loss"] == pytest.approx(0.6931471805599453, abs=1e-6)


def test_grpo_and_seq_run(datasets, tmp_path):
    res = run_train(_opts(datasets["grpo"], tmp_path / "grpo", strategy="grpo", grpo_updates=2, max_steps=4))
    assert res["steps"] == 4 and res["loss"] == res["loss"]
    res = run_train(_opts(datasets["text"], tmp_path / "seq", strategy="seq", val_data=str(datasets["text"]),
                          eval_every=1))
    assert res["val_loss"] is not None and res["val_loss"] > 0


def test_invalid_combinations_are_refused(datasets, tmp_path):
    # (plain-text output now carries a labels column with every token trained, so sft accepts it)
    with pytest.raises(TrainConfigError, match="seq needs single-output rows"):
        run_train(_opts(datasets["dpo"], tmp_path / "a", strategy="seq"))
    with pytest.raises(TrainConfigError, match="dpo needs the dpo output"):
        run_train(_opts(datasets["sft"], tmp_path / "b", strategy="dpo"))
    cfg = tmp_path / "small-vocab.json"
    from astrai.model import ModelConfig
    cfg.write_text(json.dumps(config_to_hf(ModelConfig.preset("tiny", vocab_size=100))))
    with pytest.raises(TrainConfigError, match="embedding only 100"):
        run_train(_opts(datasets["sft"], tmp_path / "c", model=str(cfg)))
    assert not (tmp_path / "a").exists() and not (tmp_path / "c").exists()  # refused before any work
    with pytest.raises(ValueError, match="Extra inputs"):
        TrainOptions(data="d", output="o", lerning_rate=1.0)


def test_yaml_config_paths_and_located_errors(datasets, tmp_path):
    from astrai.config import ConfigError
    from astrai.cli import main
    from astrai.cli.train import load_train_config

    cfg = tmp_path / "train.yaml"
    cfg.write_text(f"data: {datasets['sft']}\noutput: run\nmodel: tiny\nbatch_size: 1\nmax_steps: 1\n"
                   f"epochs: 5\nprogress: false\n")
    opts = load_train_config(cfg, ["lr=0.001"])
    assert opts.output == str(tmp_path / "run") and opts.lr == 0.001 and opts.model == "tiny"
    assert main(["train", str(cfg)]) == 0 and (tmp_path / "run" / "final" / "model.safetensors").exists()
    cfg.write_text("data: d\noutput: o\nlerning_rate: 1\nbatch_size: zero\n")
    with pytest.raises(ConfigError) as e:
        load_train_config(cfg)
    text = str(e.value)
    assert "3:1: lerning_rate: unknown key" in text and "4:" in text and "batch_size" in text


def test_recipe_runs_preprocess_then_train(tmp_path, tiny_tokenizer):
    from astrai.cli import main

    records = [{"messages": [{"role": "user", "content": f"how are you {i}"},
                             {"role": "assistant", "content": "fine thanks " * (1 + i % 3)}]} for i in range(12)]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "r.yaml").write_text(
        f"version: 1\nrun_dir: run\nstages:\n  preprocess: {{pipeline: {ROOT / 'pipelines' / 'chatml_sft.yaml'}, "
        f"inputs: [chat.jsonl], tokenizer: {tiny_tokenizer}}}\n"
        "  train: {data: preprocess, model: tiny, batch_size: 1, epochs: 4, max_steps: 2, progress: false}\n")
    assert main(["run", str(tmp_path / "r.yaml")]) == 0
    out = tmp_path / "run" / "train" / "output"
    assert (out / "final" / "model.safetensors").exists()
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["dpo", "grpo"])
def test_torchrun_fsdp_equals_one_process_through_the_cli(datasets, tmp_path, strategy):
    """`astrai train` under torchrun, 2 CPU processes with fsdp (the policy sharded, the frozen
    reference replicated, GRPO's old-policy forward on the shards), trains what 1 process trains
    with the doubled batch; rank 0's final/ holds the gathered full model."""
    import os
    import subprocess
    import sys

    from astrai.model.hf_checkpoint import read_tensors

    runs = {}
    for name, procs, batch in (("one", 1, 2), ("fsdp", 2, 1)):
        cfg = tmp_path / f"{name}.yaml"
        cfg.write_text(f"data: {datasets[strategy]}\noutput: {name}\nmodel: tiny\nstrategy: {strategy}\n"
                       f"batch_size: {batch}\ngrad_accum: 2\nmax_steps: 4\nepochs: 20\nprogress: false\n"
                       f"lr: 0.01\nparallel: fsdp\ndtype: float64\n")
        launch = [sys.executable] if procs == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                     "--nproc_per_node", str(procs)]
        r = subprocess.run(launch + ["-m", "astrai.cli", "train", str(cfg)], capture_output=True, text=True,
                           timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert r.returncode == 0, r.stderr[-3000:]
        losses = [json.loads(x)["loss"] for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        runs[name] = losses, read_tensors(tmp_path / name / "final")
    (one, w1), (two, w2) = runs["one"], runs["fsdp"]
    assert len(one) >= 2  # grpo logs once per drawn batch (2 updates each)
    # float64: equal up to summation order (tests/train/test_fsdp.py says why not float32)
    torch.testing.assert_close(two, one, atol=1e-9, rtol=0)
    assert sorted(w1) == sorted(w2)
    for k, v in w1.items():
        assert w2[k].shape == v.shape, k
        torch.testing.assert_close(w2[k], v, atol=1e-9, rtol=0)


def test_astrai_train_ends_with_a_summary(datasets, tmp_path, capsys):
    from astrai.cli import main

    cfg = tmp_path / "train.yaml"
    cfg.write_text(f"data: {datasets['dpo']}\nval_data: {datasets['dpo']}\noutput: run\nmodel: tiny\n"
                   f"strategy: dpo\nbatch_size: 2\nmax_steps: 3\nepochs: 50\neval_every: 3\nprogress: false\n")
    assert main(["train", str(cfg)]) == 0
    out = capsys.readouterr().out
    run = tmp_path / "run"
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in recs if "loss" in r]
    first, last = losses[0], losses[-1]
    assert recs[0]["step"] == 0 and recs[0]["val_reward_accuracy"] == 0.0  # before the first step: policy = reference
    lines = out.splitlines()
    assert lines[0].startswith("trained 3 steps in ") and lines[0].endswith(f"loss {first:.4g} -> {last:.4g}")
    val = [r for r in recs if "val_reward_accuracy" in r]
    assert f"held-out reward accuracy 0 -> {val[-1]['val_reward_accuracy']:.4g}" in out
    assert f"final model: {run / 'final'}" in out and f"curves: {run / 'loss.png'}" in out
    assert (run / "loss.png").stat().st_size > 1000
    assert f"next: astrai generate {run / 'final'}" in out and "{" not in out  # no bare dict
