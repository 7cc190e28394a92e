"""`astrai train` as a user meets it: one writer per output (a second run fails at once naming the
directory and the holder's pid, under torchrun too, without hanging), a diverging run exits 1 with
one line and leaves no final model, and data whose tokenizer changed since preprocessing is refused
before any step."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from astrai.config import load_pipeline
from astrai.config.train import TrainOptions
from astrai.data.preprocess import run_preprocess
from astrai.errors import InputError
from astrai.runtime import output_lock
from astrai.train.run import run_train

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory, tiny_tokenizer):
    tmp = tmp_path_factory.mktemp("sft")
    tok = tmp / "tok"
    shutil.copytree(tiny_tokenizer, tok)
    chats = [{"messages": [{"role": "user", "content": f"how are you today number {i}"},
                           {"role": "assistant", "content": "fine thanks " * (1 + i % 4)}]} for i in range(24)]
    src = tmp / "chat.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in chats))
    run_preprocess(load_pipeline(ROOT / "pipelines" / "chatml_sft.yaml"), [str(src)], str(tmp / "data"),
                   tokenizer=str(tok), workers=1, log=lambda s: None)
    return tmp


def _opts(data, out, **kw):
    return TrainOptions(**{"data": str(data), "output": str(out), "model": "tiny", "batch_size": 1, "max_steps": 2, "epochs": 20,
                           "progress": False, "lr": 1e-3, **kw})


def _config(tmp_path, data, out, **kw):
    cfg = tmp_path / "train.yaml"
    cfg.write_text(json.dumps({"data": str(data), "output": str(out), "model": "tiny", "batch_size": 1,
                               "max_steps": 2, "epochs": 20, "progress": False, **kw}))
    return cfg


def _cli(*args, torchrun=False):
    head = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m"] if torchrun \
        else [sys.executable, "-m"]
    return subprocess.run(head + ["astrai.cli", *args], capture_output=True, text=True, timeout=300, env=ENV)


def test_a_second_run_on_a_locked_output_fails_at_once_naming_dir_and_pid(sft_data, tmp_path):
    out = tmp_path / "out"
    with output_lock(out):
        t = time.perf_counter()
        with pytest.raises(InputError) as e:
            run_train(_opts(sft_data / "data", out))
        assert time.perf_counter() - t < 5
    assert str(out) in str(e.value) and f"pid {os.getpid()}" in str(e.value)
    assert list(out.iterdir()) == []  # nothing written by the refused run
    assert run_train(_opts(sft_data / "data", out))["steps"] == 2  # released: the next run works


def _hold_lock(path):
    p = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom astrai.runtime import output_lock\n"
                          f"l = output_lock({str(path)!r}).__enter__()\nprint('held', flush=True)\ntime.sleep(300)"],
                         stdout=subprocess.PIPE, text=True, env=ENV)
    assert p.stdout.readline().strip() == "held"
    return p


@pytest.mark.slow
@pytest.mark.parametrize("torchrun", [False, True])
def test_the_cli_refuses_a_second_writer_in_one_line(sft_data, tmp_path, torchrun):
    out = tmp_path / "out"
    holder = _hold_lock(out)
    try:
        r = _cli("train", str(_config(tmp_path, sft_data / "data", out)), torchrun=torchrun)
    finally:
        holder.kill()
        holder.wait()
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    # rank 0 names the holder; under torchrun rank 1 says rank 0 could not lock it
    assert lines and all(str(out) in ln for ln in lines) and any(f"pid {holder.pid}" in ln for ln in lines), \
        r.stderr[-2000:]
    assert "Traceback" not in r.stderr or torchrun  # torchrun prints its own report of the failed ranks
    if not torchrun:
        assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_a_diverging_cli_run_exits_1_in_one_line_without_final(sft_data, tmp_path):
    out = tmp_path / "out"
    r = _cli("train", str(_config(tmp_path, sft_data / "data", out, lr=1e6, max_steps=8, save_every=1,
                                  keep_last=1)))
    assert r.returncode == 1, r.stderr[-2000:]
    assert len(r.stderr.strip().splitlines()) == 1 and "non-finite" in r.stderr and "Traceback" not in r.stderr
    assert not (out / "final").exists()


def test_data_whose_tokenizer_changed_is_refused_before_any_step(sft_data, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(sft_data / "data", data)
    tok = tmp_path / "tok"
    shutil.copytree(sft_data / "tok", tok)
    man = json.loads((data / "manifest.json").read_text())
    man["tokenizer"]["path"] = str(tok)
    (data / "manifest.json").write_text(json.dumps(man))
    tj = json.loads((tok / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    a, b = sorted(vocab)[10:12]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two tokens swap ids: same size, other meaning
    (tok / "tokenizer.json").write_text(json.dumps(tj))
    with pytest.raises(InputError) as e:
        run_train(_opts(data, tmp_path / "out"))
    msg = str(e.value)
    assert "changed since" in msg and man["tokenizer"]["fingerprint"][:12] in msg and str(tok) in msg
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
