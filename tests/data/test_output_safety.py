"""Output directories: ours only by astrai's marker, one writer at a time, never read as input."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from astrai.errors import InputError
from astrai.data.preprocess import run_preprocess
from astrai.runtime import OUTPUT_MARKER, output_lock
sys.path.insert(0, str(Path(__file__).parent))
from test_preprocess import chat_records, pipeline  # noqa: E402


def snapshot(folder):
    return {str(f.relative_to(folder)): (f.read_bytes() if f.is_file() else None) for f in sorted(folder.rglob("*"))}


def run(pipe, inputs, out, tok, **kw):
    return run_preprocess(pipe, [str(i) for i in inputs], str(out), tokenizer=str(tok), workers=1,
                          log=kw.pop("log", lambda s: None), **kw)


@pytest.mark.parametrize("lookalike", ["stats.json", "manifest.json", ".work"])
def test_a_user_dir_that_looks_like_ours_is_refused_and_untouched(tmp_path, tiny_tokenizer, lookalike):
    data = tmp_path / "d.jsonl"
    data.write_text(chat_records(5))
    user = tmp_path / "mine"
    (user / "data" / "deep").mkdir(parents=True)
    (user / "data" / "deep" / "thesis.tex").write_text("years of work")
    (user / "data" / "part-00000-0000.parquet").write_text("named like ours, but mine")
    if lookalike == ".work":
        (user / ".work").mkdir()
        (user / ".work" / "fingerprint").write_text("abc")
    else:
        (user / lookalike).write_text("{}")
    before = snapshot(user)
    with pytest.raises(InputError, match="not an astrai output.*nothing in it was touched"):
        run(pipeline(), [data], user, tiny_tokenizer)
    assert snapshot(user) == before


def test_replacing_our_output_deletes_only_what_we_wrote(tmp_path, tiny_tokenizer, read_rows):
    data = tmp_path / "d.jsonl"
    data.write_text(chat_records(30, bad_every=5))
    out = tmp_path / "o"
    run(pipeline(), [data], out, tiny_tokenizer)
    assert (out / OUTPUT_MARKER).is_file() and (out / "rejects.jsonl").exists()
    (out / "notes.md").write_text("my notes")
    (out / "data" / "readme.txt").write_text("mine")
    (out / "data" / "other.parquet").write_text("mine too")
    logs = []
    run(pipeline(max_seq_len=30), [data], out, tiny_tokenizer, log=logs.append)
    assert (out / "notes.md").read_text() == "my notes"
    assert (out / "data" / "readme.txt").read_text() == "mine"
    assert (out / "data" / "other.parquet").read_text() == "mine too"
    man = json.loads((out / "manifest.json").read_text())
    assert "data/other.parquet" not in man["shards"]
    import pyarrow.parquet as pq

    assert all(len(ids) <= 30 for s in man["shards"] for ids in pq.read_table(out / s)["input_ids"].to_pylist())
    assert any("replacing an existing output of another fingerprint" in m for m in logs)


def test_a_second_writer_is_refused_at_once(tmp_path, tiny_tokenizer):
    data = tmp_path / "d.jsonl"
    data.write_text(chat_records(5))
    out = tmp_path / "o"
    with output_lock(out):
        with pytest.raises(InputError, match="being written by another astrai run"):
            run(pipeline(), [data], out, tiny_tokenizer)
    run(pipeline(), [data], out, tiny_tokenizer)  # released: the next run goes ahead
    assert (out / "manifest.json").exists()


def test_the_lock_dies_with_its_process(tmp_path):
    out = tmp_path / "o"
    holder = subprocess.Popen([sys.executable, "-c", f"""
import sys, time
from astrai.runtime import output_lock
with output_lock({str(out)!r}):
    print("held", flush=True)
    time.sleep(60)
"""], stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2])
    try:
        assert holder.stdout.readline().strip() == "held"
        from astrai.runtime import OutputBusy

        with pytest.raises(OutputBusy):
            output_lock(out).__enter__()
    finally:
        holder.kill()  # a crash: no cleanup runs
        holder.wait()
    with output_lock(out):  # nothing stale is left behind
        pass


@pytest.mark.parametrize("strategy", ["none", "bfd"])
def test_an_output_inside_its_input_directory(tmp_path, tiny_tokenizer, strategy):
    src = tmp_path / "src"
    src.mkdir()
    (src / "d.jsonl").write_text(chat_records(20, bad_every=4))
    out = src / "out"
    first = run(pipeline(packing_strategy=strategy, max_packed_len=256), [src], out, tiny_tokenizer)
    for _ in range(2):  # the rerun sees our shards and rejects.jsonl under src/ and must not read them
        again = run(pipeline(packing_strategy=strategy, max_packed_len=256), [src], out, tiny_tokenizer)
        assert again["records_read"] == first["records_read"] == 20
    other = run(pipeline(packing_strategy=strategy, max_packed_len=256, min_chars=5), [f"{src}/**/*.jsonl"], out,
                tiny_tokenizer)
    assert other["records_read"] == 20
    with pytest.raises(InputError, match="own output"):
        run(pipeline(), [out / "rejects.jsonl"], out, tiny_tokenizer)


def test_workers_must_be_positive(tmp_path, tiny_tokenizer):
    data = tmp_path / "d.jsonl"
    data.write_text(chat_records(2))
    for n in (0, -1):
        with pytest.raises(InputError, match="--workers"):
            run_preprocess(pipeline(), [str(data)], str(tmp_path / "o"), tokenizer=str(tiny_tokenizer), workers=n)


def test_an_input_truncated_mid_run_fails_and_a_restore_is_not_up_to_date(tmp_path, tiny_tokenizer, monkeypatch):
    import astrai.data.preprocess.run as pre

    data = tmp_path / "d.jsonl"
    full = chat_records(60, seed=3)
    data.write_text(full)
    out = tmp_path / "o"
    pipe = pipeline(partition_bytes=2000)
    real = pre.tokenize_partitions  # one worker: the partitions run in this process, as one stream
    calls = []

    def truncate_after_first(worker, tasks, on_done):
        def done(task):
            on_done(task)
            calls.append(task)
            if len(calls) == 1:
                data.write_text(full[: len(full) // 2])  # the writer of the input is not done yet

        real(worker, tasks, on_done=done)

    with monkeypatch.context() as m:
        m.setattr(pre, "tokenize_partitions", truncate_after_first)
        with pytest.raises(InputError, match="changed while it was being read"):
            run(pipe, [data], out, tiny_tokenizer)
    assert not (out / "manifest.json").exists()
    data.write_text(full)  # the old bytes again: same digest as the run that saw half of them
    stats = run(pipe, [data], out, tiny_tokenizer)
    assert stats["records_read"] == 60


def test_workers_exit_when_their_parent_dies(tmp_path):
    import signal
    import time

    pids = tmp_path / "pids"
    pids.mkdir()
    script = f"""
import os, time
from astrai.runtime import run_tasks

def work(ctx, task):
    open(os.path.join({str(pids)!r}, str(os.getpid())), "w").close()
    time.sleep(60)

run_tasks(work, list(range(6)), workers=2, setup=lambda: None, context=0)
"""
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=Path(__file__).parents[2])
    deadline = time.time() + 30
    while len(list(pids.iterdir())) < 2 and time.time() < deadline:
        time.sleep(0.1)
    workers = [int(p.name) for p in pids.iterdir()]
    assert len(workers) == 2
    parent.send_signal(signal.SIGKILL)
    parent.wait()

    def alive(pid):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        # a zombie reparented to init (or to us) is gone for our purpose
        try:
            return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
        except OSError:
            return False

    deadline = time.time() + 5
    while any(alive(p) for p in workers) and time.time() < deadline:
        time.sleep(0.1)
    left = [p for p in workers if alive(p)]
    for p in left:  # do not leave them behind when the test fails
        os.kill(p, signal.SIGKILL)
    assert not left, "workers outlived their parent"


@pytest.mark.parametrize("name", ["data", ".work", "cache"])
def test_a_link_planted_in_our_output_is_refused_never_written_through(tmp_path, tiny_tokenizer, name):
    from astrai.runtime import LinkRefused

    data = tmp_path / "d.jsonl"
    data.write_text(chat_records(5))
    out = tmp_path / "o"
    run(pipeline(), [data], out, tiny_tokenizer)
    outside = tmp_path / "outside"
    outside.mkdir()
    if (out / name).exists():
        import shutil
        shutil.rmtree(out / name)
    (out / name).symlink_to(outside)
    with pytest.raises(LinkRefused) as e:
        run(pipeline(max_seq_len=30), [data], out, tiny_tokenizer)  # another fingerprint: rewrites the output
    assert e.value.filename == str(out / name) and list(outside.iterdir()) == []
