"""The runner with fake stages: skip when current, rerun what changed and what reads it, nothing before;
resume after an interrupt; selection flags; summary, table, logs, metrics and the loss PNG."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from astrai.config import ConfigError
from astrai.recipe.fingerprint import code_version
from astrai.recipe.rundir import RunDir, RunLock
from astrai.recipe.runner import Runner

RECIPE = """\
version: 1
name: demo
run_dir: out
stages:
  tokenizer: {kind: tok, size: 20}
  data: {kind: make, inputs: [in.txt], tokenizer: tokenizer}
  fit: {data: data, lr: 0.5}
  score: {model: fit, data: data}
"""


@pytest.fixture
def run(recipe_file, kinds, load_recipe, calls):
    path = recipe_file(RECIPE)
    lines = []

    def go(overrides=(), **flags):
        calls.runs.clear()
        lines.clear()
        recipe = load_recipe(path, kinds, overrides)
        return Runner(recipe, kinds, log=lines.append).run(**flags)

    go.lines = lines
    go.root = path.parent / "out"
    return go


def statuses(summary):
    return {s["name"]: s["status"] for s in summary["stages"]}


def test_first_run_runs_all_second_skips_all(run, calls):
    s = run()
    assert statuses(s) == dict.fromkeys(["tokenizer", "data", "fit", "score"], "ran")
    assert calls.names() == ["tokenizer", "data", "fit", "score"]
    root = run.root
    assert json.loads((root / "summary.json").read_text())["stages"][2]["metrics"]["train_loss"] == \
        pytest.approx(0.26125)  # 4 -> 2.006 -> 1.009 -> 0.5105 -> 0.26125 (l/2 + 0.001*6 chars)
    assert (root / "data" / "output" / "data.txt").read_text() == "a\nb\nc\n"
    assert "wrote 6 chars" in (root / "data" / "log.txt").read_text()
    assert json.loads((root / "data" / "metrics.json").read_text()) == {"records": 3, "flavor": "sft"}
    assert (root / "fit" / "loss.png").read_bytes()[:4] == b"\x89PNG" and (root / "loss.png").exists()
    assert "loss_curve" not in s["stages"][2]["metrics"]  # the summary keeps figures, not curves
    table = run.lines[-1]
    assert table.splitlines()[0].split() == ["stage", "kind", "status", "time", "key", "figures"]
    assert "records 3" in table and "vocab_size 20" in table and "perplexity 1.5" in table

    s = run()
    assert statuses(s) == dict.fromkeys(["tokenizer", "data", "fit", "score"], "skipped")
    assert calls.runs == []
    assert any("up to date" in line for line in run.lines)
    assert "records 3" in run.lines[-1]  # a skipped stage still shows its figures


def test_changed_option_reruns_that_stage_and_its_readers_only(run, calls):
    run()
    s = run(overrides=["fit.lr=0.25"])  # a finished output is replaced (made aside, then swapped in)
    assert statuses(s) == {"tokenizer": "skipped", "data": "skipped", "fit": "replaced", "score": "replaced"}
    s = run(overrides=["tokenizer.size=30"])
    assert statuses(s) == dict(tokenizer="replaced", data="replaced", fit="replaced", score="replaced")
    assert run(overrides=["tokenizer.size=30"])["stages"][0]["status"] == "skipped"


def test_changed_input_file_reruns_from_the_stage_that_reads_it(run, calls, tmp_path):
    run()
    (tmp_path / "in.txt").write_text("a\nb\nc\nd\n")
    s = run()
    assert statuses(s) == {"tokenizer": "skipped", "data": "replaced", "fit": "replaced", "score": "replaced"}
    assert s["stages"][1]["metrics"]["records"] == 4


def test_only_from_force(run, calls):
    run()
    assert statuses(run(only="fit")) == {"tokenizer": "not selected", "data": "not selected", "fit": "skipped",
                                         "score": "not selected"}
    s = run(only="fit", force=True)
    assert statuses(s)["fit"] == "replaced" and calls.names() == ["fit"]
    # fit produced a new output: score, which reads it, is now stale; nothing before fit is
    assert statuses(run()) == {"tokenizer": "skipped", "data": "skipped", "fit": "skipped", "score": "replaced"}
    s = run(from_stage="data", force=True)
    assert calls.names() == ["data", "fit", "score"] and statuses(s)["tokenizer"] == "not selected"
    with pytest.raises(ConfigError, match="did you mean 'score'"):
        run(only="scor")


def test_unselected_inputs_must_be_done_and_current_before_any_work(run, calls):
    with pytest.raises(ConfigError, match=r"'data' has no finished output.*--from data"):
        run(from_stage="fit")
    assert calls.runs == [] and not (run.root / "fit").exists()
    run()
    with pytest.raises(ConfigError, match=r"'data' is out of date"):
        run(overrides=["data.flavor=sft", "data.packed=true", "data.inputs=[in.txt, in.txt]"], only="fit")
    assert calls.runs == []


def test_interrupt_then_rerun_resumes_and_matches_an_uninterrupted_run(run, calls, recipe_file, kinds,
                                                                     load_recipe, tmp_path):
    with pytest.raises(KeyboardInterrupt):
        run(overrides=["fit.stop_at=2"])
    state = json.loads((run.root / "fit" / "stage.json").read_text())
    assert state["status"] == "interrupted"
    summary = json.loads((run.root / "summary.json").read_text())
    assert statuses(summary) == {"tokenizer": "ran", "data": "ran", "fit": "interrupted", "score": "not run"}
    assert sorted(p.name for p in (run.root / "fit" / "output").iterdir()) == ["step0.json", "step1.json"]
    # stop_at is an option, so a rerun without it would be a different stage; resume keeps the options and
    # the stage itself skips finished steps. Emulate "the kill is gone" by removing the trigger from the
    # run function's view only: the fingerprint must not change, so patch the data, not the recipe.
    fit_kind = kinds["fit"]
    original = fit_kind.run

    def run_without_stop(ctx):
        ctx.options = ctx.options.model_copy(update={"stop_at": None})
        return original(ctx)

    object.__setattr__(fit_kind, "run", run_without_stop)
    s = run(overrides=["fit.stop_at=2"])
    assert statuses(s) == {"tokenizer": "skipped", "data": "skipped", "fit": "resumed", "score": "ran"}
    assert ("fit", True) in calls.runs
    resumed_loss = s["stages"][2]["metrics"]["train_loss"]
    object.__setattr__(fit_kind, "run", original)
    straight = run(force=True)["stages"][2]["metrics"]["train_loss"]
    assert resumed_loss == straight


def test_failure_is_recorded_and_the_rerun_resumes(run, calls):
    with pytest.raises(ValueError, match="boom"):
        run(overrides=["fit.fail_at=1"])
    assert json.loads((run.root / "fit" / "stage.json").read_text())["error"] == "boom"
    assert "failed: ValueError: boom" in (run.root / "fit" / "log.txt").read_text()
    assert statuses(json.loads((run.root / "summary.json").read_text()))["fit"] == "failed"
    with pytest.raises(ValueError, match="boom"):  # same options: the rerun continues in the same output
        run(overrides=["fit.fail_at=1"])
    assert calls.runs == [("fit", True)]


def test_stale_output_is_cleared_but_foreign_output_is_refused(run, calls):
    run()
    (run.root / "fit" / "output" / "extra.bin").write_text("x")
    run(overrides=["fit.lr=0.3"])
    assert not (run.root / "fit" / "output" / "extra.bin").exists()  # ours, made for other options: removed
    foreign = run.root / "data" / "stage.json"
    foreign.unlink()
    (run.root / "data" / "output" / "keep.me").write_text("x")
    with pytest.raises(RuntimeError, match="not made by astrai run"):
        run()
    assert (run.root / "data" / "output" / "keep.me").exists()


def _hold(path, write_pid=True):
    """Another process holding the run lock; with write_pid False it has not written its pid yet."""
    code = ("import fcntl, os, sys, time\n"
            f"fd = os.open({str(path)!r}, os.O_RDWR | os.O_CREAT)\nfcntl.flock(fd, fcntl.LOCK_EX)\n"
            + ("os.write(fd, str(os.getpid()).encode())\n" if write_pid else "")
            + "print('held', flush=True)\ntime.sleep(120)")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


@pytest.mark.parametrize("write_pid", [True, False])
def test_lock_refuses_a_live_holder_even_before_it_wrote_its_pid(tmp_path, write_pid):
    path = tmp_path / ".lock"
    holder = _hold(path, write_pid)
    try:
        with pytest.raises(RuntimeError, match=rf"in use by another `astrai run` \(pid {holder.pid}\)"):
            with RunDir(tmp_path).lock():
                pass
        assert path.read_text() == (str(holder.pid) if write_pid else "")  # never deleted nor rewritten
    finally:
        holder.kill()
        holder.wait()
    # the holder is gone: its lock went with it, whatever the file says
    with RunLock(path):
        assert path.read_text() == str(os.getpid())
    assert path.exists()  # the file stays: deleting it would race a run waiting on it


def test_a_pid_file_without_a_lock_proves_nothing(tmp_path):
    (tmp_path / ".lock").write_text(str(os.getppid()))  # a live process, but it holds no lock
    with RunLock(tmp_path / ".lock"):
        assert (tmp_path / ".lock").read_text() == str(os.getpid())


def test_code_version_follows_the_source(tmp_path, monkeypatch):
    pkg = tmp_path / "fake_stage_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "step.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = code_version(("fake_stage_pkg",))
    (pkg / "step.py").write_text("X = 2\n")
    code_version.cache_clear()
    assert code_version(("fake_stage_pkg",)) != before


# code that never changes what a stage writes: errors and their wording, the run lock and process
# plumbing, the user cache (values it holds are made by fingerprinted code), plots of the metrics, the bounded
# YAML and JSON readers (they parse as yaml/json do, or refuse), the command line, the recipe runner itself
NOT_RESULTS = ("astrai.errors", "astrai.plot", "astrai.runtime", "astrai.cache", "astrai.runtime_ray",
               "astrai.yaml_bounded", "astrai.json_bounded", "astrai.cli", "astrai.recipe.runner", "astrai.recipe.kinds", "astrai.recipe.fingerprint",
               "astrai.recipe.rundir", "astrai.recipe.table", "astrai.recipe.spec")


def _within(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _imported_modules(modules) -> set[str]:
    """Every astrai module the given modules (a package: all its files) import, transitively."""
    import ast
    import importlib.util

    def files(name):  # a listed package counts with all its files (as code_version hashes it), an imported one
        spec = importlib.util.find_spec(name)  # with its __init__.py
        if spec is None:
            return []
        if spec.submodule_search_locations and name in modules:
            return sorted(p for loc in spec.submodule_search_locations for p in Path(loc).rglob("*.py"))
        return [Path(spec.origin)]

    seen, todo = set(), list(modules)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for f in files(name):
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names = [node.module] + [f"{node.module}.{a.name}" for a in node.names
                                             if importlib.util.find_spec(node.module).submodule_search_locations
                                             and importlib.util.find_spec(f"{node.module}.{a.name}") is not None]
                else:
                    continue
                todo += [n for n in names if n.startswith("astrai.") or n == "astrai"]
    return seen


def test_every_stage_fingerprints_the_code_that_computes_its_output():
    # a change in any module a stage's code imports (the engine behind online GRPO's rollouts, the
    # chat template renderer behind preprocess) must rerun the stage, never reuse a stale output
    from astrai.recipe.builtin import recipe_kinds

    for name, kind in recipe_kinds().items():
        missing = sorted(m for m in _imported_modules(kind.code)
                         if m != "astrai" and not _within(m, kind.code) and not _within(m, NOT_RESULTS))
        assert not missing, f"stage kind {name}: its code list does not cover {missing}"


def test_data_stages_do_not_fingerprint_the_train_or_serve_options():
    # a new train option (astrai/config/train.py) once reran preprocess: its code list held all of astrai.config
    from astrai.recipe.builtin import recipe_kinds

    for name in ("tokenizer", "preprocess"):
        code = recipe_kinds()[name].code
        assert _within("astrai.config.pipeline", code), name
        for other in ("astrai.config.train", "astrai.config.infer", "astrai.config.serve", "astrai.config.recipe"):
            assert not _within(other, code), (name, other)
