"""The preprocess stage on a real two-node Ray cluster (head + one more node, both on this machine).

Slow (a cluster takes ~5 s to start and ~0.7 GB while up) and skipped when ray is not installed
(`pip install astrai[ray]`; CI installs it through the `test` extra).
"""

import os

import pytest

pytestmark = pytest.mark.slow


def test_the_cluster_runs_tasks_on_both_nodes(ray_cluster):
    import ray

    @ray.remote(num_cpus=1)  # each node of the fixture's cluster has one CPU
    def where(_):
        import time

        time.sleep(0.3)  # both tasks are running at once, so they cannot share a one-CPU node
        return ray.get_runtime_context().get_node_id(), os.environ.get("ASTRAI_FAULT_DIR")

    ray.init(address=ray_cluster, logging_level="ERROR", log_to_driver=False)
    try:
        assert len([n for n in ray.nodes() if n["Alive"]]) == 2
        got = ray.get([where.remote(i) for i in range(2)])
    finally:
        ray.shutdown()
    assert len({node for node, _ in got}) == 2
    assert {fault_dir for _, fault_dir in got} == {os.environ["ASTRAI_FAULT_DIR"]}


# ---------------------------------------------------------------------------------------------
# the preprocess stage: Ray vs the local process pool

WORDS = "hello world how are you today the quick brown fox jumps over lazy dog yes no maybe".split()


def chat_lines(n, seed=0, bad_every=0):
    """Chat records, some long (so bfd_split has chunks to cut) and, with bad_every, some rejected."""
    import json
    import random

    rng = random.Random(seed)
    lines = []
    for i in range(n):
        if bad_every and i % bad_every == bad_every - 1:
            lines.append(rng.choice(['{"messages": [{"role": "asistant", "content": "x"}]}', "{not json"]))
            continue
        msgs = [{"role": "system", "content": "be brief"}] if rng.random() < 0.3 else []
        for _ in range(rng.randint(1, 4)):
            msgs.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(1, 30)))})
            msgs.append({"role": "assistant", "content": " ".join(rng.choices(WORDS, k=rng.randint(1, 90)))})
        lines.append(json.dumps({"messages": msgs, "domain": rng.choice(["a", "b"])}))
    return "\n".join(lines) + "\n"


def pipeline(**pp):
    from astrai.config import Pipeline

    out = pp.pop("output", {})
    return Pipeline.model_validate({
        "version": 1, "chat_template": "chatml",
        "input": {"sections": [{"field": "messages", "action": "$role", "template": True}]},
        "preprocessing": {"on_error": "skip", "max_packed_len": 256, "partition_bytes": 6000, **pp},
        "output": {"domain_key": "domain", "max_tokens_per_shard": 6000, **out}})


def file_digests(out):
    """sha256 of every output file by relative path; the manifest without its absolute input paths."""
    import hashlib
    import json
    from pathlib import Path

    got = {}
    for f in sorted(Path(out).rglob("*")):
        if f.is_file():
            data = f.read_bytes()
            if f.name == "manifest.json":
                man = json.loads(data)
                man.pop("inputs")
                data = json.dumps(man, sort_keys=True).encode()
            got[str(f.relative_to(out))] = hashlib.sha256(data).hexdigest()
    return got


def run(pipe, data, out, tok, executor, address=None, log=None):
    from astrai.data.preprocess import run_preprocess

    return run_preprocess(pipe, [str(data)], str(out), tokenizer=str(tok), workers=2, log=log or (lambda s: None),
                          executor=executor, ray_address=address)


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    path = tmp_path_factory.mktemp("ray-in") / "chats.jsonl"
    path.write_text(chat_lines(500, seed=11, bad_every=41))
    return path


@pytest.mark.parametrize("strategy", ["none", "simple", "bfd", "bfd_split"])
def test_same_bytes_as_the_local_executor(ray_cluster, tiny_tokenizer, chats, tmp_path, strategy):
    import json

    import pyarrow.parquet as pq

    pipe = pipeline(packing_strategy=strategy)
    local = run(pipe, chats, tmp_path / "local", tiny_tokenizer, "local")
    logs = []
    remote = run(pipe, chats, tmp_path / "ray", tiny_tokenizer, "ray", ray_cluster, logs.append)
    assert any("as Ray tasks" in line for line in logs)  # it did run there
    want, got = file_digests(tmp_path / "local"), file_digests(tmp_path / "ray")
    assert len([f for f in want if f.startswith("data/")]) > 4  # several shards, from several tasks
    assert got == want and remote == local
    # the counts reconcile with what was written
    s = remote
    assert s["records_read"] == 500 == s["records_kept"] + s["records_filtered"] + s["records_rejected"]
    assert s["records_rejected"] == 12 == len((tmp_path / "ray" / "rejects.jsonl").read_text().splitlines())
    tables = [pq.read_table(tmp_path / "ray" / f) for f in want if f.startswith("data/")]
    assert s["rows"] == sum(t.num_rows for t in tables)
    assert s["tokens_written"] == sum(len(ids) for t in tables for ids in t.column("input_ids").to_pylist())
    assert json.loads((tmp_path / "ray" / "manifest.json").read_text())["counts"]["rows"] == s["rows"]


def test_a_crashed_task_is_retried_and_the_output_is_unchanged(ray_cluster, tiny_tokenizer, chats, tmp_path):
    from pathlib import Path

    pipe = pipeline(packing_strategy="bfd")
    run(pipe, chats, tmp_path / "local", tiny_tokenizer, "local")
    faults = Path(os.environ["ASTRAI_FAULT_DIR"])
    for task in ("p00003", "packed-00002"):  # one partition task, one shard task: each dies once
        (faults / task).write_text("")
    run(pipe, chats, tmp_path / "ray", tiny_tokenizer, "ray", ray_cluster)
    assert not list(faults.iterdir())  # both faults fired
    assert file_digests(tmp_path / "ray") == file_digests(tmp_path / "local")


KILL_SCRIPT = """
import sys
from astrai.config import Pipeline
from astrai.data.preprocess import run_preprocess
p = Pipeline.model_validate_json(sys.argv[1])
run_preprocess(p, [sys.argv[2]], sys.argv[3], tokenizer=sys.argv[4], executor="ray", ray_address=sys.argv[5],
               log=lambda s: None)
"""


@pytest.mark.parametrize("strategy", ["simple", "bfd"])
def test_a_killed_driver_resumes_from_its_completed_partitions(ray_cluster, tiny_tokenizer, tmp_path, strategy):
    import signal
    import subprocess
    import sys
    import time

    data = tmp_path / "d.jsonl"
    data.write_text(chat_lines(2500, seed=5))
    pipe = pipeline(packing_strategy=strategy, partition_bytes=8000)
    run(pipe, data, tmp_path / "local", tiny_tokenizer, "local")
    script = tmp_path / "driver.py"
    script.write_text(KILL_SCRIPT)
    out = tmp_path / "ray"
    driver = subprocess.Popen([sys.executable, str(script), pipe.model_dump_json(), str(data), str(out),
                               str(tiny_tokenizer), ray_cluster], start_new_session=True)
    deadline = time.time() + 120
    while not list(out.glob(".work/p*.json")):  # a partition is complete: kill the driver now
        assert driver.poll() is None and time.time() < deadline, "the driver ended before a partition completed"
        time.sleep(0.01)
    os.killpg(driver.pid, signal.SIGKILL)
    driver.wait()
    assert not (out / "manifest.json").exists()
    logs = []
    run(pipe, data, out, tiny_tokenizer, "ray", ray_cluster, logs.append)
    resumed = [line for line in logs if line.startswith("resuming:")]
    assert resumed and int(resumed[0].split()[1]) >= 1, logs
    assert file_digests(out) == file_digests(tmp_path / "local")
    assert not list(out.rglob(".*.tmp-*")) and not list(out.glob(".ray-probe-*"))


def test_a_bad_record_stops_the_run_with_its_file_and_line(ray_cluster, tiny_tokenizer, tmp_path):
    from astrai.errors import RecordError

    data = tmp_path / "d.jsonl"
    data.write_text(chat_lines(300, seed=2) + '{"messages": [{"role": "asistant", "content": "x"}]}\n')
    with pytest.raises(RecordError) as e:  # re-raised as itself, not as a Ray wrapper
        run(pipeline(on_error="raise"), data, tmp_path / "o", tiny_tokenizer, "ray", ray_cluster)
    assert f"{data}:301:" in str(e.value) and "messages[0].role" in str(e.value)


def test_a_recipe_runs_on_ray_from_the_cli(ray_cluster, tiny_tokenizer, chats, tmp_path, capsys):
    import yaml

    from astrai.cli import main

    pipe = pipeline(packing_strategy="bfd")
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(pipe.model_dump(exclude_defaults=True)))
    (tmp_path / "r.yaml").write_text(yaml.safe_dump({"version": 1, "run_dir": "run", "stages": {"preprocess": {
        "pipeline": "p.yaml", "inputs": [str(chats)], "tokenizer": str(tiny_tokenizer),
        "executor": "ray", "ray_address": ray_cluster}}}))
    assert main(["run", str(tmp_path / "r.yaml")]) == 0
    assert "as Ray tasks" in capsys.readouterr().out
    assert main(["preprocess", str(tmp_path / "p.yaml"), "-i", str(chats), "-o", str(tmp_path / "local"),
                 "--tokenizer", str(tiny_tokenizer), "--workers", "2"]) == 0
    assert file_digests(tmp_path / "run" / "preprocess" / "output" / "train") == file_digests(tmp_path / "local")


def test_relative_paths_mean_the_drivers_working_directory(ray_cluster, tiny_tokenizer, chats, tmp_path,
                                                           monkeypatch):
    # Ray workers start in the directory their node was started from, not the driver's
    import shutil

    pipe = pipeline(packing_strategy="bfd")
    run(pipe, chats, tmp_path / "local", tiny_tokenizer, "local")
    shutil.copy(chats, tmp_path / chats.name)  # the same name: it is part of the fingerprint
    monkeypatch.chdir(tmp_path)
    run(pipe, chats.name, "ray", tiny_tokenizer, "ray", ray_cluster)
    local, remote = file_digests(tmp_path / "local"), file_digests(tmp_path / "ray")
    assert local.pop("rejects.jsonl") != remote.pop("rejects.jsonl")  # it names the input as given
    assert remote == local
