"""The preprocess stage end to end: accounting, packing semantics, determinism, resume, workers."""

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from astrai.config import Pipeline
from astrai.errors import RecordError
from astrai.data.preprocess import run_preprocess
from astrai.data.process import Processor, RecordOutput
from astrai.text.tokenizer import load_tokenizer
from astrai.schema import IGNORE_INDEX

WORDS = "hello world how are you today the quick brown fox jumps over lazy dog yes no maybe".split()


def chat_records(n, seed=0, bad_every=0):
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        if bad_every and i % bad_every == bad_every - 1:
            lines.append(rng.choice(['{"messages": [{"role": "asistant", "content": "x"}]}', '{not json',
                                     '{"messages": []}', '{"messages": [{"role": "user", "content": 5}]}']))
            continue
        msgs = []
        if rng.random() < 0.3:
            msgs.append({"role": "system", "content": "be brief"})
        for t in range(rng.randint(1, 4)):
            msgs.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(1, 30)))})
            msgs.append({"role": "assistant", "content": " ".join(rng.choices(WORDS, k=rng.randint(1, 80)))})
        lines.append(json.dumps({"messages": msgs, "domain": rng.choice(["a", "b"])}))
    return "\n".join(lines) + "\n"


def pipeline(**pp):
    out = pp.pop("output", {})
    on_error = pp.pop("on_error", "skip")
    return Pipeline.model_validate({
        "version": 1, "chat_template": "chatml",
        "input": {"sections": [{"field": "messages", "action": "$role", "template": True}]},
        "preprocessing": {"on_error": on_error, **pp}, "output": {"domain_key": "domain", **out}})


def digest(out):
    h = hashlib.sha256()
    for f in sorted(Path(out).rglob("*")):
        if f.is_file() and f.name != "manifest.json":
            h.update(str(f.relative_to(out)).encode() + f.read_bytes())
    man = json.loads(Path(out, "manifest.json").read_text())
    man.pop("inputs")  # absolute paths of the inputs
    h.update(json.dumps(man, sort_keys=True).encode())
    return h.hexdigest()


def reference_docs(pipe, tok_dir, text):
    """Independent of the stage: process each record alone, in order."""
    pr = Processor(pipe, load_tokenizer(str(tok_dir)))
    docs = []
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        r = pr.process_one(rec)
        if isinstance(r, RecordOutput):
            docs.append(r.seq())
    return docs


def test_accounting_and_rejects(tmp_path, tiny_tokenizer):
    data = tmp_path / "d.jsonl"
    data.write_text(chat_records(200, bad_every=10))
    stats = run_preprocess(pipeline(min_chars=40), [str(data)], str(tmp_path / "o"), tokenizer=str(tiny_tokenizer),
                           workers=1, log=lambda s: None)
    assert stats["records_read"] == 200
    assert stats["records_read"] == stats["records_kept"] + stats["records_filtered"] + stats["records_rejected"]
    assert stats["records_rejected"] == 20
    assert set(stats["rejected_by_reason"]) <= {"unknown_role", "invalid_json", "empty_conversation",
                                                 "non_string_content"}
    rejects = [json.loads(l) for l in (tmp_path / "o" / "rejects.jsonl").read_text().splitlines()]
    assert len(rejects) == 20 and all(r["file"].endswith("d.jsonl") and int(r["line"]) % 10 == 0 for r in rejects)
    assert sum(stats["records_per_domain"].values()) == stats["records_kept"]
    assert stats["filtered_by_reason"].get("too_short", 0) == stats["records_filtered"]


def test_on_error_raise_names_file_line_key(tmp_path, tiny_tokenizer):
    data = tmp_path / "d.jsonl"
    data.write_text(chat_records(5) + '{"messages": [{"role": "asistant", "content": "x"}]}\n')
    with pytest.raises(RecordError) as e:
        run_preprocess(pipeline(on_error="raise"), [str(data)], str(tmp_path / "o"), tokenizer=str(tiny_tokenizer),
                       workers=1, log=lambda s: None)
    msg = str(e.value)
    assert "d.jsonl:6:" in msg and "messages[0].role" in msg and "'asistant'" in msg


@pytest.mark.parametrize("strategy", ["none", "simple", "bfd", "bfd_split"])
def test_every_token_accounted_for(tmp_path, tiny_tokenizer, strategy, read_rows):
    text = chat_records(150, seed=3)
    data = tmp_path / "d.jsonl"
    data.write_text(text)
    max_len = 160
    pipe = pipeline(packing_strategy=strategy, max_packed_len=max_len, partition_bytes=4000)
    stats = run_preprocess(pipe, [str(data)], str(tmp_path / "o"), tokenizer=str(tiny_tokenizer), workers=1,
                           log=lambda s: None)
    ref = reference_docs(pipe, tiny_tokenizer, text)
    out_rows = read_rows(tmp_path / "o")
    pieces = []
    for r in out_rows:
        assert sum(r["seq_lens"]) == len(r["input_ids"]) == len(r["labels"]) == len(r["position_ids"])
        if strategy != "none":
            assert len(r["input_ids"]) <= max_len
        start = 0
        for n in r["seq_lens"]:
            assert r["position_ids"][start:start + n] == list(range(n))  # doc_reset
            pieces.append((tuple(r["input_ids"][start:start + n]), tuple(r["labels"][start:start + n])))
            start += n
    ref_docs = [(tuple(d.input_ids.tolist()), tuple(d.labels.tolist())) for d in ref]
    if strategy == "none":
        assert pieces == ref_docs  # input order, whole documents
    elif strategy == "bfd_split":
        # nothing lost: every document is the concatenation of its chunks, chunks <= max_len
        # a continuation chunk's first token has no context in its row: never a target (B12)
        chunks = [(d[0][s:s + max_len], (IGNORE_INDEX,) + d[1][s + 1:s + max_len] if s else d[1][s:s + max_len])
                  for d in ref_docs for s in range(0, len(d[0]), max_len)]
        assert Counter(pieces) == Counter(chunks)
        assert stats["pack_truncated_tokens"] == 0
        long_docs = [d for d in ref_docs if len(d[0]) > max_len]
        assert long_docs, "the test data must contain documents longer than max_len"
    else:
        kept = [(d[0][:max_len], d[1][:max_len]) for d in ref_docs]  # keep_start truncation of long ones
        assert Counter(pieces) == Counter(kept)
        assert stats["pack_truncated_tokens"] == sum(max(0, len(d[0]) - max_len) for d in ref_docs)
    if strategy == "simple":
        assert pieces == [(d[0][:max_len], d[1][:max_len]) for d in ref_docs]  # input order kept
    assert stats["tokens_written"] == sum(len(p[0]) for p in pieces)
    assert stats["rows"] == len(out_rows)


def test_workers_give_identical_bytes(tmp_path, tiny_tokenizer):
    data = tmp_path / "d.jsonl"
    data.write_text(chat_records(300, seed=5))
    for strategy in ("none", "bfd"):
        outs = []
        for w in (1, 2):
            out = tmp_path / f"o-{strategy}-{w}"
            run_preprocess(pipeline(packing_strategy=strategy, max_packed_len=256, partition_bytes=5000),
                           [str(data)], str(out), tokenizer=str(tiny_tokenizer), workers=w, log=lambda s: None)
            outs.append(digest(out))
        assert outs[0] == outs[1], strategy


def test_streamed_simple_packing_is_next_fit_over_the_partition(tmp_path, tiny_tokenizer, monkeypatch, read_rows):
    # The simple packer plans chunks of pending documents and carries the open bin over; planning
    # 3 documents at a time must give the bins of one plan over the whole partition (the default
    # chunk is larger than this input), truncation counts included.
    import astrai.data.preprocess.shards as shards

    data = tmp_path / "d.jsonl"
    data.write_text(chat_records(120, seed=7))
    pipe = pipeline(packing_strategy="simple", max_seq_len=400, max_packed_len=150)
    outs = []
    for chunk in (shards.PLAN_CHUNK, 3):
        monkeypatch.setattr(shards, "PLAN_CHUNK", chunk)
        out = tmp_path / f"o{chunk}"
        stats = run_preprocess(pipe, [str(data)], str(out), tokenizer=str(tiny_tokenizer), workers=1,
                               log=lambda s: None)
        outs.append((digest(out), stats))
    assert outs[0] == outs[1] and outs[0][1]["pack_truncated_docs"] > 0 and len(read_rows(tmp_path / "o3")) > 3


def test_rerun_is_noop_and_changes_invalidate(tmp_path, tiny_tokenizer, read_rows):
    data = tmp_path / "d.jsonl"
    data.write_text(chat_records(50))
    out = tmp_path / "o"
    logs = []
    run_preprocess(pipeline(), [str(data)], str(out), tokenizer=str(tiny_tokenizer), workers=1, log=logs.append)
    first = digest(out)
    run_preprocess(pipeline(), [str(data)], str(out), tokenizer=str(tiny_tokenizer), workers=1, log=logs.append)
    assert "up to date" in logs[-1] and digest(out) == first
    run_preprocess(pipeline(max_seq_len=20), [str(data)], str(out), tokenizer=str(tiny_tokenizer), workers=1,
                   log=logs.append)
    assert digest(out) != first and all(len(r["input_ids"]) <= 20 for r in read_rows(out))
    data.write_text(chat_records(40))
    run_preprocess(pipeline(max_seq_len=20), [str(data)], str(out), tokenizer=str(tiny_tokenizer), workers=1,
                   log=logs.append)
    assert json.loads((out / "stats.json").read_text())["records_read"] == 40


def test_refuses_foreign_output_dir(tmp_path, tiny_tokenizer):
    data = tmp_path / "d.jsonl"
    data.write_text(chat_records(3))
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "precious.txt").write_text("keep me")
    with pytest.raises(Exception, match="not an astrai output"):
        run_preprocess(pipeline(), [str(data)], str(tmp_path / "o"), tokenizer=str(tiny_tokenizer), workers=1,
                       log=lambda s: None)


@pytest.mark.parametrize("old", ["interrupted", "complete"])
def test_killed_while_replacing_an_old_output(tmp_path, tiny_tokenizer, monkeypatch, old, read_rows):
    # Run A leaves an output (interrupted after every partition is done, or complete); run B, with
    # another pipeline, is killed while it deletes that output, right after its first shard went. A
    # rerun of A must not take the leftovers for its own (resume into, or "up to date" over) a
    # directory whose shards are gone.
    import astrai.data.preprocess.run as pre

    data = tmp_path / "d.jsonl"
    data.write_text(chat_records(120, seed=4))
    a, b = pipeline(partition_bytes=5000), pipeline(partition_bytes=5000, min_chars=10)

    def run(pipe, out):
        run_preprocess(pipe, [str(data)], str(out), tokenizer=str(tiny_tokenizer), workers=1, log=lambda s: None)

    run(a, tmp_path / "clean")
    out = tmp_path / "o"
    if old == "interrupted":
        with monkeypatch.context() as m:
            m.setattr(pre, "dataset_stats", lambda *args: (_ for _ in ()).throw(KeyboardInterrupt))
            with pytest.raises(KeyboardInterrupt):
                run(a, out)
    else:
        run(a, out)
    assert list((out / "data").glob("*.parquet"))
    unlink = os.unlink

    def unlink_then_die(path, *args, **kw):
        unlink(path, *args, **kw)
        if str(path).endswith(".parquet"):
            raise KeyboardInterrupt  # SIGKILL right here, the first shard gone, the others still there

    with monkeypatch.context() as m:
        m.setattr(pre.os, "unlink", unlink_then_die)
        with pytest.raises(KeyboardInterrupt):
            run(b, out)
    run(a, out)
    assert read_rows(out) == read_rows(tmp_path / "clean") and digest(out) == digest(tmp_path / "clean")


def test_stale_temporary_files_in_the_output_root_are_removed(tmp_path, tiny_tokenizer):
    # stats.json, manifest.json and rejects.jsonl are written under temporary names there too
    data = tmp_path / "d.jsonl"
    data.write_text(chat_records(20))
    out = tmp_path / "o"
    run_preprocess(pipeline(min_chars=3), [str(data)], str(out), tokenizer=str(tiny_tokenizer), workers=1,
                   log=lambda s: None)
    (out / ".manifest.json.tmp-12345").write_text("{")  # a run killed while writing its manifest
    run_preprocess(pipeline(), [str(data)], str(out), tokenizer=str(tiny_tokenizer), workers=1, log=lambda s: None)
    assert not list(out.rglob(".*.tmp-*"))


@pytest.mark.parametrize("strategy", ["none", "bfd"])
def test_max_items_over_several_partitions_and_files(tmp_path, tiny_tokenizer, strategy):
    # the limit runs out in the middle of the data; later partitions, and a file of blank lines
    # (a partition without records), read nothing
    blank, data = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    blank.write_text("\n\n\n")
    text = chat_records(200, seed=3)
    data.write_text(text)
    pipe = pipeline(packing_strategy=strategy, max_packed_len=256, max_items=77, partition_bytes=4000)
    stats = run_preprocess(pipe, [str(blank), str(data)], str(tmp_path / "o"), tokenizer=str(tiny_tokenizer),
                           workers=2, log=lambda s: None)
    ref = reference_docs(pipe, tiny_tokenizer, "\n".join(text.splitlines()[:77]))
    assert stats["records_read"] == 77 and stats["records_kept"] == len(ref)
    assert stats["tokens"] == sum(len(d) for d in ref)


KILL_SCRIPT = """
import sys
if __name__ != "__main__":
    raise SystemExit  # never re-run by a worker process
from astrai.config import Pipeline
from astrai.data.preprocess import run_preprocess
p = Pipeline.model_validate_json(sys.argv[1])
run_preprocess(p, [sys.argv[2]], sys.argv[3], tokenizer=sys.argv[4], workers=int(sys.argv[5]), log=lambda s: None)
"""


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["simple", "bfd"])
def test_sigkill_and_rerun_is_byte_identical(tmp_path, tiny_tokenizer, strategy):
    data = tmp_path / "d.jsonl"
    data.write_text(chat_records(1500, seed=9))
    pipe = pipeline(packing_strategy=strategy, max_packed_len=256, partition_bytes=20000,
                    output={"max_tokens_per_shard": 5000, "domain_key": "domain"})
    clean = tmp_path / "clean"
    t0 = time.time()
    run_preprocess(pipe, [str(data)], str(clean), tokenizer=str(tiny_tokenizer), workers=1, log=lambda s: None)
    t_full = time.time() - t0 + 1.5  # plus interpreter start-up in the subprocess
    want = digest(clean)
    script = tmp_path / "run.py"
    script.write_text(KILL_SCRIPT)
    out = tmp_path / "killed"
    args = [sys.executable, str(script), pipe.model_dump_json(), str(data), str(out), str(tiny_tokenizer), "2"]
    rng = random.Random(1)
    kills = 0
    for attempt in range(4):
        proc = subprocess.Popen(args, start_new_session=True)
        try:
            proc.wait(timeout=rng.uniform(0.3, t_full))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the whole group: workers die too
            proc.wait()
            kills += 1
        if (out / "manifest.json").exists():
            break
    assert kills >= 1
    subprocess.run(args, check=True)
    assert digest(out) == want
    assert not list(out.rglob(".*.tmp-*"))


WORKER_KILL_SCRIPT = """
import os, signal, sys
if __name__ != "__main__":
    raise SystemExit
import astrai.data.preprocess.run as pre
from astrai.config import Pipeline
real = pre.tokenize_partition
def tokenize_dies(worker, task):
    if task.part.index == 2:
        os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer does, to one worker
    return real(worker, task)
if sys.argv[5] == "kill":
    pre.tokenize_partition = tokenize_dies
p = Pipeline.model_validate_json(sys.argv[1])
pre.run_preprocess(p, [sys.argv[2]], sys.argv[3], tokenizer=sys.argv[4], workers=2, log=lambda s: None)
"""


@pytest.mark.slow
def test_a_killed_worker_fails_the_run_instead_of_hanging(tmp_path, tiny_tokenizer):
    data = tmp_path / "d.jsonl"
    data.write_text(chat_records(200, seed=2))
    pipe = pipeline(partition_bytes=5000)
    run_preprocess(pipe, [str(data)], str(tmp_path / "clean"), tokenizer=str(tiny_tokenizer), workers=1,
                   log=lambda s: None)
    script = tmp_path / "run.py"
    script.write_text(WORKER_KILL_SCRIPT)
    args = [sys.executable, str(script), pipe.model_dump_json(), str(data), str(tmp_path / "o"), str(tiny_tokenizer)]
    r = subprocess.run(args + ["kill"], capture_output=True, text=True, timeout=60)  # multiprocessing.Pool hung here
    assert r.returncode != 0 and "worker process died" in r.stderr, r.stderr[-2000:]
    subprocess.run(args + ["ok"], check=True, timeout=60)
    assert digest(tmp_path / "o") == digest(tmp_path / "clean")


def test_dpo_and_grpo_rows(tmp_path, tiny_tokenizer, read_rows):
    from astrai.config import load_pipeline
    from astrai.data.load import ShardDataset

    root = Path(__file__).resolve().parents[2] / "pipelines"
    dpo = tmp_path / "dpo.jsonl"
    dpo.write_text("".join(json.dumps({
        "prompt": [{"role": "user", "content": f"question {i} how are you"}],
        "chosen": [{"role": "assistant", "content": "fine thanks"}],
        "rejected": [{"role": "assistant", "content": "no"}]}) + "\n" for i in range(5)))
    run_preprocess(load_pipeline(root / "dpo_chatml.yaml"), [str(dpo)], str(tmp_path / "dpo"),
                   tokenizer=str(tiny_tokenizer), workers=1, log=lambda s: None)
    (row,) = read_rows(tmp_path / "dpo")[:1]
    assert set(row) == {"chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels"}
    first_c = next(i for i, l in enumerate(row["chosen_labels"]) if l != -100)
    first_r = next(i for i, l in enumerate(row["rejected_labels"]) if l != -100)
    assert first_c == first_r and row["chosen_input_ids"][:first_c] == row["rejected_input_ids"][:first_r]

    grpo = tmp_path / "grpo.jsonl"
    grpo.write_text("".join(json.dumps({
        "prompt": [{"role": "user", "content": "say yes"}],
        "completions": [{"text": "yes<|im_end|>", "reward": 0.8}, {"text": "no<|im_end|>", "reward": 1}]}) + "\n"
        for _ in range(3)))
    run_preprocess(load_pipeline(root / "grpo_chatml.yaml"), [str(grpo)], str(tmp_path / "grpo"),
                   tokenizer=str(tiny_tokenizer), workers=1, log=lambda s: None)
    t = pq.read_table(sorted((tmp_path / "grpo" / "data").glob("*.parquet"))[0])
    assert str(t.schema.field("rewards").type) == "list<element: float>"
    r = t.to_pylist()[0]
    assert r["rewards"] == pytest.approx([0.8, 1.0])  # float32, never truncated to int
    assert len(r["completion_input_ids"]) == 2 and "prompt_labels" not in r
    ds = ShardDataset(tmp_path / "grpo")
    assert ds[0]["completion_input_ids"] == r["completion_input_ids"]
