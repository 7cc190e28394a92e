"""The Ray executor on its own: the missing-extra error, the node visibility check, retries and errors.

The cluster tests are slow (a real two-node local cluster from conftest's `ray_cluster`) and skip
without ray; the first two tests need no cluster and run in the default tier.
"""

import os
import sys
from pathlib import Path

import pytest

from astrai.runtime_ray import ClusterError, _node_problem, import_ray


def test_without_ray_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` does when it is not installed
    with pytest.raises(ClusterError, match=r"pip install 'astrai\[ray\]'"):
        import_ray()


def test_node_problem_names_what_a_node_cannot_see(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / ".probe").write_text("tok3n")
    data = tmp_path / "d.jsonl"
    data.write_text("{}\n")
    ok = [("input", str(data)), ("tokenizer", str(tmp_path))]
    assert _node_problem(ok, str(out), ".probe", "tok3n", str(tmp_path)) is None
    assert not [p for p in out.iterdir() if p.name != ".probe"]  # its own write probe is gone
    missing = str(tmp_path / "nope.jsonl")
    assert _node_problem(ok + [("input", missing)], str(out), ".probe", "tok3n", str(tmp_path)) == \
        f"cannot see input {missing} (no such file or directory)"
    # a directory with the output's name that is not the driver's: the probe is not there
    assert "does not see the output directory" in _node_problem(ok, str(out), ".probe", "other", str(tmp_path))
    # relative paths are taken from the driver's working directory, which the node must see too
    monkeypatch.chdir("/")
    assert _node_problem([("input", "d.jsonl")], str(out), ".probe", "tok3n", str(tmp_path)) is None
    gone = str(tmp_path / "gone")
    assert _node_problem([("input", "d.jsonl")], str(out), ".probe", "tok3n", gone).startswith(
        f"cannot see the working directory {gone}")


def test_cli_without_ray_names_the_extra(tmp_path, monkeypatch, capsys, tiny_tokenizer):
    from astrai.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)
    (tmp_path / "d.jsonl").write_text('{"text": "hello"}\n')
    (tmp_path / "p.yaml").write_text("version: 1\ninput: {sections: [{field: text}]}\n")
    args = ["preprocess", str(tmp_path / "p.yaml"), "-i", str(tmp_path / "d.jsonl"), "-o", str(tmp_path / "o"),
            "--tokenizer", str(tiny_tokenizer)]
    assert main(args + ["--executor", "ray"]) == 1
    assert "pip install 'astrai[ray]'" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()  # stopped before any work
    assert main(args + ["--ray-address", "10.0.0.1:6379"]) == 2
    assert "--ray-address is only used with --executor ray" in capsys.readouterr().err
    assert main(args) == 0 and (tmp_path / "o" / "manifest.json").exists()  # local needs no ray


def test_recipe_executor_keys_are_validated(tmp_path, capsys):
    from astrai.cli import main

    (tmp_path / "p.yaml").write_text("version: 1\ninput: {sections: [{field: text}]}\n")
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')  # validate checks that a recipe's inputs exist
    r = tmp_path / "r.yaml"
    block = "version: 1\nstages:\n  preprocess:\n    pipeline: p.yaml\n    inputs: [a.jsonl]\n    tokenizer: .\n"
    r.write_text(block + "    executor: ray\n    ray_address: 10.0.0.1:6379\n")
    assert main(["validate", str(r)]) == 0
    r.write_text(block + "    ray_address: 10.0.0.1:6379\n")
    assert main(["validate", str(r)]) == 1
    assert f"{r}:7:" in capsys.readouterr().out  # the problem sits on the ray_address line
    r.write_text(block + "    executor: rya\n")
    assert main(["validate", str(r)]) == 1
    out = capsys.readouterr().out
    assert "executor" in out and "'local'" in out and "'ray'" in out


@pytest.fixture
def executor(ray_cluster):
    from astrai.runtime_ray import RayExecutor

    with RayExecutor(ray_cluster, log=lambda s: None) as ex:
        yield ex


# Tasks here are stdlib functions, importable on every worker: fn(context, task) is
# shutil.copyfile(src, dst), the context (src) built by setup = partial(str, src).


@pytest.mark.slow
def test_a_task_whose_worker_dies_is_retried(executor, tmp_path):
    import shutil
    from functools import partial

    src = tmp_path / "src"
    src.write_text("payload")
    dsts = [str(tmp_path / f"dst{i}") for i in range(4)]
    fault = Path(os.environ["ASTRAI_FAULT_DIR"]) / "files-2"
    fault.write_text("")  # the third task kills its worker once
    logs = []
    executor.run_tasks(shutil.copyfile, dsts, setup=partial(str, str(src)), what="files", log=logs.append)
    assert not fault.exists()  # the fault fired (once: its file is gone)
    assert [Path(d).read_text() for d in dsts] == ["payload"] * 4 and logs == ["4 files done as Ray tasks"]


@pytest.mark.slow
def test_a_task_error_is_raised_as_itself(executor, tmp_path):
    import shutil
    from functools import partial

    src = tmp_path / "src"
    src.write_text("payload")
    bad = str(tmp_path / "no-such-dir" / "dst")
    with pytest.raises(FileNotFoundError) as e:
        executor.run_tasks(shutil.copyfile, [str(tmp_path / "ok"), bad], setup=partial(str, str(src)),
                           what="files", log=lambda s: None)
    assert bad in str(e.value)


@pytest.mark.slow
def test_check_nodes_passes_on_shared_paths_and_leaves_nothing(executor, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("{}\n")
    out = tmp_path / "out"
    out.mkdir()
    executor.check_nodes([("input", str(data))], out)
    assert list(out.iterdir()) == []
    with pytest.raises(ClusterError, match=r"ray node \S+ \(\w+\) cannot see input /no/such\.jsonl"):
        executor.check_nodes([("input", "/no/such.jsonl")], out)


@pytest.mark.slow
def test_a_node_that_cannot_see_the_input_is_named(executor, tmp_path):
    # A real third node whose view of the filesystem lacks the input: started in its own mount
    # namespace with an empty tmpfs over the input's directory (needs unshare; root or user namespaces).
    import signal
    import subprocess
    import time

    import ray

    if subprocess.run(["unshare", "-m", "--propagation", "private", "true"], capture_output=True).returncode:
        pytest.skip("unshare -m is not permitted here")
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / "d.jsonl").write_text("{}\n")
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    address = ray.get_runtime_context().gcs_address
    # num-cpus 0: only the zero-CPU check task can land there, no work of another test
    node = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c",
                             f"mount -t tmpfs none {hidden} && exec {ray_bin} start --address={address} "
                             f"--num-cpus=0 --object-store-memory={80 * 2 ** 20} --block --disable-usage-stats"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 60
        while len([n for n in ray.nodes() if n["Alive"]]) < 3:
            assert node.poll() is None and time.time() < deadline, "the third node did not start"
            time.sleep(0.2)
        new = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) == 0]
        with pytest.raises(ClusterError) as e:
            executor.check_nodes([("input", str(hidden / "d.jsonl"))], tmp_path)
        assert f"({new[0][:12]}) cannot see input {hidden / 'd.jsonl'} (no such file or directory)" in str(e.value)
    finally:
        node.send_signal(signal.SIGTERM)  # `ray start --block` stops its node's processes
        node.wait(30)
        deadline = time.time() + 60
        while len([n for n in ray.nodes() if n["Alive"]]) > 2 and time.time() < deadline:
            time.sleep(0.2)
