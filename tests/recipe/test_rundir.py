"""The run directory as something to protect: a run_dir holding a user's files is refused untouched
(and so are /, a home directory and stage names that would leave it); a hand-edited stage output is
not up to date; a finished output is never removed before its replacement is complete (Ctrl-C and a
kill during the swap keep it); a stage whose only change is a grown step count continues."""

import json
import os

import pytest

from astrai.config import ConfigError
from astrai.recipe import rundir
from astrai.recipe.rundir import RunDirError
from astrai.recipe.runner import Runner

RECIPE = """\
version: 1
name: demo
run_dir: {run_dir}
stages:
  tokenizer: {{kind: tok, size: 20}}
  data: {{kind: make, inputs: [in.txt], tokenizer: tokenizer}}
  fit: {{data: data, lr: 0.5}}
  score: {{model: fit, data: data}}
"""


@pytest.fixture
def run(recipe_file, kinds, load_recipe, calls, tmp_path):
    lines = []

    def go(overrides=(), run_dir="out", text=RECIPE, **flags):
        calls.runs.clear()
        lines.clear()
        recipe = load_recipe(recipe_file(text.format(run_dir=run_dir)), kinds, overrides)
        return Runner(recipe, kinds, log=lines.append).run(**flags)

    go.lines = lines
    go.root = tmp_path / "out"
    return go


def statuses(summary):
    return {s["name"]: s["status"] for s in summary["stages"]}


def test_a_run_dir_with_user_files_is_refused_untouched(run, tmp_path, calls):
    user = tmp_path / "mine"
    user.mkdir()
    (user / "summary.json").write_text("my notes")
    (user / ".lock").write_text("my lock")
    with pytest.raises(RunDirError, match=r"holds files astrai did not write"):
        run(run_dir="mine")
    assert calls.runs == [] and sorted(p.name for p in user.iterdir()) == [".lock", "summary.json"]
    assert (user / "summary.json").read_text() == "my notes" and (user / ".lock").read_text() == "my lock"


def test_an_empty_run_dir_is_claimed_and_then_ours(run, tmp_path):
    (tmp_path / "out").mkdir()
    assert set(statuses(run()).values()) == {"ran"}
    assert json.loads((tmp_path / "out" / rundir.RUN_MARKER).read_text())["written_by"] == "astrai"
    assert set(statuses(run()).values()) == {"skipped"}


@pytest.mark.parametrize("where", ["/", "home", "home-empty", "home-parent"])
def test_root_and_home_directories_are_refused(run, tmp_path, monkeypatch, calls, where):
    home = tmp_path / "home" / "me"
    home.mkdir(parents=True)
    if where != "home-empty":
        (home / "notes.txt").write_text("x")
    monkeypatch.setenv("HOME", str(home))
    target = {"/": "/", "home": str(home), "home-empty": str(home), "home-parent": str(home.parent)}[where]
    with pytest.raises(RunDirError, match=r"filesystem root or a home directory"):
        run(run_dir=target)
    assert calls.runs == [] and not (home / rundir.RUN_MARKER).exists() and not (home / "tokenizer").exists()


@pytest.mark.parametrize("name", ["../../x", "/tmp/abs", "1", "''", "a/b", ".", "..", "x y", "ünï"])
def test_stage_names_that_are_not_plain_names_are_refused_with_key_and_line(run, tmp_path, name, calls):
    text = RECIPE + f"  {name}: {{{{kind: score, model: fit, data: data}}}}\n"
    with pytest.raises(ConfigError) as e:
        run(text=text)
    [p] = e.value.problems
    assert p.line == 9 and "not a plain name" in p.message
    assert calls.runs == [] and not (tmp_path / "out").exists() and not (tmp_path / "x").exists()


def test_names_differing_in_case_only_are_refused(run):
    with pytest.raises(ConfigError, match="only in case"):
        run(text=RECIPE + "  Score: {{kind: score, model: fit, data: data}}\n")


def test_a_stage_folder_linked_out_of_the_run_dir_is_refused(run, tmp_path):
    run()
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    os.rename(run.root / "score", tmp_path / "score-old")
    os.symlink(outside, run.root / "score")
    with pytest.raises(RunDirError, match="link out of the run directory"):
        run(overrides=["fit.lr=0.3"])
    assert list(outside.iterdir()) == []


def test_a_hand_edited_output_is_not_up_to_date(run, calls):
    run()
    out = run.root / "data" / "output" / "data.txt"
    text = out.read_text()
    out.write_text("x\ny\nz\n")  # same size, other bytes
    s = run()
    assert statuses(s) == {"tokenizer": "skipped", "data": "replaced", "fit": "replaced", "score": "replaced"}
    assert any("data.txt was changed" in line for line in run.lines)
    assert out.read_text() == text  # made again from the inputs
    # rewritten with the same bytes (new times and inode), a temporary file and a cache: still current
    out.unlink()
    out.write_text(text)
    (run.root / "data" / "output" / ".partial.tmp-1").write_text("?")
    (run.root / "data" / "output" / "cache").mkdir()
    (run.root / "data" / "output" / "cache" / "x.arrow").write_text("?")
    assert set(statuses(run()).values()) == {"skipped"}
    (run.root / "fit" / "output" / "step9.json").write_text("{}")  # a file added by hand
    assert statuses(run())["fit"] == "replaced"


def test_ctrl_c_during_a_replacement_keeps_the_last_output_and_the_rerun_resumes_it(run, calls, kinds):
    run()
    before = sorted(p.name for p in (run.root / "fit" / "output").iterdir())
    metrics = json.loads((run.root / "fit" / "metrics.json").read_text())
    with pytest.raises(KeyboardInterrupt):
        run(overrides=["fit.lr=0.25", "fit.stop_at=2"])
    assert sorted(p.name for p in (run.root / "fit" / "output").iterdir()) == before  # the last good output
    assert json.loads((run.root / "fit" / "metrics.json").read_text()) == metrics
    state = json.loads((run.root / "fit" / "stage.json").read_text())
    assert state["status"] == "done" and state["pending"]["status"] == "interrupted"
    summary = json.loads((run.root / "summary.json").read_text())
    assert statuses(summary)["fit"] == "interrupted (previous output kept)"
    assert sorted(p.name for p in (run.root / "fit" / "output.next").iterdir()) == ["step0.json", "step1.json"]
    # the score stage still reads the previous fit output, which is still current for it
    assert statuses(run(only="score"))["score"] == "skipped"

    fit = kinds["fit"]
    original = fit.run

    def without_stop(ctx):  # the same options (fingerprint), the interrupt gone
        return original(type(ctx)(**{**ctx.__dict__, "options": ctx.options.model_copy(update={"stop_at": None})}))

    object.__setattr__(fit, "run", without_stop)
    try:
        s = run(overrides=["fit.lr=0.25", "fit.stop_at=2"])
    finally:
        object.__setattr__(fit, "run", original)
    assert statuses(s)["fit"] == "replaced" and ("fit", True) in calls.runs  # resumed in output.next
    assert not (run.root / "fit" / "output.next").exists() and "(replaced the output of" in run.lines[-1]
    assert s["stages"][2]["metrics"]["train_loss"] == run(overrides=["fit.lr=0.25"], force=True)[
        "stages"][2]["metrics"]["train_loss"]


def test_a_replacement_given_up_is_cleared_when_the_old_options_come_back(run):
    run()
    with pytest.raises(KeyboardInterrupt):
        run(overrides=["fit.lr=0.25", "fit.stop_at=2"])
    assert (run.root / "fit" / "output.next").exists()
    assert statuses(run())["fit"] == "skipped"  # the previous options again: the kept output is current
    assert not (run.root / "fit" / "output.next").exists()
    assert "pending" not in json.loads((run.root / "fit" / "stage.json").read_text())


def test_a_kill_during_the_swap_is_put_in_order(run, calls, monkeypatch):
    run()
    real = os.replace

    def crash(src, dst):  # the old output went aside; the new one's rename never happens
        if str(src).endswith("output.next"):
            raise KeyboardInterrupt
        return real(src, dst)

    monkeypatch.setattr(rundir.os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        run(overrides=["fit.lr=0.25"])
    monkeypatch.setattr(rundir.os, "replace", real)
    fit = run.root / "fit"
    assert not (fit / "output").exists() and (fit / ".output.replaced").exists()
    s = run(overrides=["fit.lr=0.25"])  # recover: the old output back, then the replacement resumed
    assert statuses(s)["fit"] == "replaced" and not (fit / ".output.replaced").exists()


def test_only_more_steps_continues_from_the_previous_output(run, calls):
    run()
    s = run(overrides=["fit.steps=6"])
    assert statuses(s) == {"tokenizer": "skipped", "data": "skipped", "fit": "continued", "score": "replaced"}
    assert ("fit", True) in calls.runs and "(continued the output of" in run.lines[-1]
    continued = s["stages"][2]["metrics"]["train_loss"]
    assert continued == run(overrides=["fit.steps=6"], force=True)["stages"][2]["metrics"]["train_loss"]
    assert statuses(run(overrides=["fit.steps=3"]))["fit"] == "replaced"  # fewer steps: starts over
    assert statuses(run(overrides=["fit.steps=8", "fit.lr=0.3"]))["fit"] == "replaced"  # more changed: over


def test_an_output_folder_linked_out_of_the_run_dir_is_refused(run, tmp_path):
    run()
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "keep.me").write_text("x")
    os.rename(run.root / "fit" / "output", tmp_path / "fit-output")
    os.symlink(outside, run.root / "fit" / "output")
    with pytest.raises(RunDirError, match="link out of the run directory"):
        run(overrides=["fit.lr=0.3"])
    assert [p.name for p in outside.iterdir()] == ["keep.me"]


@pytest.mark.parametrize("crash_in", ["_write_metrics", "drop_replaced"])
def test_a_kill_after_the_swap_is_put_in_order(run, calls, monkeypatch, crash_in):
    """Killed after the new output was renamed in: before its state was written (the old output goes
    back, the replacement is resumed), or after (the old one is only deleted)."""
    run()
    target = Runner if crash_in == "_write_metrics" else rundir.StageDir

    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(target, crash_in, crash)
    with pytest.raises(KeyboardInterrupt):
        run(overrides=["fit.lr=0.25"])
    monkeypatch.undo()
    fit = run.root / "fit"
    assert (fit / "output").exists() and (fit / ".output.replaced").exists()
    s = run(overrides=["fit.lr=0.25"])
    assert not (fit / ".output.replaced").exists() and not (fit / "output.next").exists()
    assert statuses(s)["fit"] == ("replaced" if crash_in == "_write_metrics" else "skipped")
    assert s["stages"][2]["metrics"]["train_loss"] == run(overrides=["fit.lr=0.25"], force=True)[
        "stages"][2]["metrics"]["train_loss"]


def test_a_report_written_beside_a_model_is_not_a_change_of_the_model(tmp_path):
    from astrai.recipe.fingerprint import output_changes, output_stamp

    out = tmp_path / "output"
    (out / "final").mkdir(parents=True)
    (out / "final" / "model.safetensors").write_bytes(b"weights")
    (out / "metrics.jsonl").write_text("{}\n")  # outside the stamped part: may change freely
    rec = output_stamp(out, ("final",), ("eval.json",))
    assert list(rec) == ["final/model.safetensors"]
    (out / "final" / "eval.json").write_text("{}")  # astrai eval's default report
    (out / "metrics.jsonl").write_text("{}\n{}\n")
    assert output_changes(out, ("final",), rec, ("eval.json",)) is None
    assert output_changes(out, ("final",), rec) == "final/eval.json was added"
    (out / "final" / "model.safetensors").write_bytes(b"weightz")
    assert output_changes(out, ("final",), rec, ("eval.json",)) == "final/model.safetensors was changed"


@pytest.mark.parametrize("name", [".lock", "fit/log.txt", "fit/stage.json"])
def test_a_link_planted_at_the_lock_a_log_or_a_state_is_refused_naming_it(run, tmp_path, name):
    """RUN/.lock would get the pid, log.txt the stage's log, and a state read through a link could
    claim an output for the runner: all are opened without following links."""
    from astrai.runtime import LinkRefused

    run()
    outside = tmp_path / "outside.txt"
    outside.write_text("the user's file")
    (run.root / name).unlink()
    (run.root / name).symlink_to(outside)
    with pytest.raises(LinkRefused) as e:
        run(overrides=["fit.lr=0.3"])
    assert e.value.filename == str(run.root / name) and "symbolic link" in e.value.strerror
    assert outside.read_text() == "the user's file" and (run.root / name).is_symlink()


@pytest.mark.parametrize("name", ["summary.json", "loss.png", "fit/metrics.json", "fit/loss.png"])
def test_a_link_planted_at_a_state_file_is_replaced_never_written_through(run, tmp_path, name):
    """Files written atomically: the rename replaces the link itself; its target is never opened."""
    run()
    outside = tmp_path / "outside.txt"
    outside.write_text("the user's file")
    (run.root / name).unlink()
    (run.root / name).symlink_to(outside)
    run(overrides=["fit.lr=0.3"])
    assert outside.read_text() == "the user's file" and not (run.root / name).is_symlink()
    assert (run.root / name).stat().st_size > 0
