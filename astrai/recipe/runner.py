"""Run a recipe's stages in order: skip what is up to date, resume what was interrupted, record it all.

For each selected stage (all; or `from_stage` and every later one; or `only` one):
- its fingerprint (recipe/fingerprint.py) is computed from its options, code, input files and the
  outputs of the stages it reads, as recorded when those completed;
- up to date (RUN/<stage>/stage.json says done with this fingerprint, and its output still matches
  the stamp taken when it finished: a hand-edited output is not up to date) -> skipped, and says so;
- a previous run with the same fingerprint that stopped part way (killed, Ctrl-C, failed) ->
  rerun in the same output directory with `ctx.resume` set: preprocess skips its finished
  partitions, train continues from its last checkpoint;
- a finished output that must be replaced (new options, code or inputs, an edited output, --force)
  -> the replacement is made in RUN/<stage>/output.next while the finished output stays in place,
  and swapped in only when complete (rundir.StageDir.swap_in_next): a Ctrl-C keeps the last good
  model, and the next run resumes the replacement. When only a kind's `growable` options grew (a
  train stage's max_steps or epochs) the replacement starts from a copy of the previous output and
  continues it. The table says which output was replaced or continued;
- otherwise (new, or an unfinished output of other options) -> it runs from scratch in place.
Stages outside the selection are never run; a selected stage that reads one of them needs it done
and current, which is checked before any work starts. The run directory must be ours or empty
(rundir.RunDir.claim), and one run holds it at a time.

A stage's output is RUN/<stage>/output/, unless its metrics name another directory as `points_to`
(a checkpoint stage points at the checkpoint instead of copying it): later stages read that one.

The run writes RUN/summary.json and prints a table (stage, kind, status, time, key figures). A stage
reporting `loss_curve` (astrai.plot's panels: {"loss": {"train": [[step, loss], ...], "val": ...},
"learning rate": ..., reward panels}) gets a loss.png.
"""

from __future__ import annotations

import difflib
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Callable, Mapping, Optional

from astrai.config import ConfigError, Problem
from astrai.recipe import fingerprint as fpr
from astrai.recipe.kinds import StageContext, StageKind
from astrai.recipe.rundir import RunDir, StageDir, write_json
from astrai.recipe.spec import RecipeSpec, StageSpec
from astrai.recipe.table import figures_text, render_table
from astrai.runtime import open_nofollow, refuse_link

LOSS_CURVE = "loss_curve"
POINTS_TO = "points_to"


def select_stages(recipe: RecipeSpec, from_stage: Optional[str] = None, only: Optional[str] = None) -> list[str]:
    names = [s.name for s in recipe.stages]
    problems = []
    for flag, value in (("--from", from_stage), ("--only", only)):
        if value is not None and value not in names:
            guess = difflib.get_close_matches(value, names, n=1, cutoff=0.6)
            problems.append(Problem(flag, f"no stage '{value}'" + (f" (did you mean '{guess[0]}'?)" if guess else "")
                                    + f"; stages: {', '.join(names)}"))
    if from_stage is not None and only is not None:
        problems.append(Problem("--only", "give --from or --only, not both"))
    if problems:
        raise ConfigError(recipe.file, problems)
    if only is not None:
        return [only]
    if from_stage is not None:
        return names[names.index(from_stage):]
    return names


class Runner:
    def __init__(self, recipe: RecipeSpec, kinds: Mapping[str, StageKind], log: Callable[[str], None] = print):
        self.recipe = recipe
        self.kinds = kinds
        self.log = log
        self.run_dir = RunDir(recipe.run_dir)

    # -- fingerprints ---------------------------------------------------------------------------

    def fingerprint(self, stage: StageSpec, leave_out: tuple[str, ...] = ()) -> str:
        """From the options (but `leave_out`) and the recorded outputs of upstream stages (which must be done)."""
        kind = self.kinds[stage.kind]
        options = {k: v for k, v in stage.options.model_dump(mode="json").items() if k not in leave_out}
        files = {f: fpr.input_digests(_as_list(options.get(f)), self.recipe.base_dir) for f in kind.files}
        upstream = {}
        for f, name in sorted(stage.refs.items()):
            state = self.run_dir.stage(name).state() or {}
            upstream[f] = {"stage": name, "fingerprint": state.get("fingerprint"), "output_id": state.get("output_id")}
        for f, value in sorted(stage.paths.items()):
            upstream[f] = {"path": value, "digest": fpr.path_digest(self._path(value))}
        extra = kind.extra(stage.options, self.recipe.base_dir) if kind.extra else {}
        return fpr.stage_fingerprint(kind.name, fpr.code_version(tuple(kind.code)), options, files,
                                     {**upstream, **({"extra": extra} if extra else {})})

    def _output_of(self, name: str) -> Path:
        sd = self.run_dir.stage(name)
        pointed = _read_metrics(sd.metrics_file).get(POINTS_TO)
        return Path(pointed) if pointed else sd.output

    def _path(self, value: str) -> Path:
        if value.startswith("package:"):
            from astrai.text.tokenizer import resolve_tokenizer_path

            return resolve_tokenizer_path(value)
        p = Path(value).expanduser()
        return p if p.is_absolute() else self.recipe.base_dir / p

    def check_unselected_inputs(self, selected: list[str]) -> None:
        """Before any work: every stage a selected stage reads, and that will not run, is done and current."""
        problems = []
        needed = {up for s in self.recipe.stages if s.name in selected for up in s.refs.values()} - set(selected)
        for name in sorted(needed, key=lambda n: self.recipe.stage(n).index):
            self._require_current(self.recipe.stage(name), problems, selected)
        if problems:
            raise ConfigError(self.recipe.file, problems)

    def _require_current(self, stage: StageSpec, problems: list, selected: list[str]) -> None:
        for up in stage.refs.values():
            self._require_current(self.recipe.stage(up), problems, selected)
        sd = self.run_dir.stage(stage.name)
        state = sd.state()
        flag = f"stages.{stage.name}"
        if state is None or state.get("status") != "done":
            problems.append(Problem(flag, f"'{stage.name}' has no finished output in {sd.root}, and it is not "
                                          f"selected to run; run from '{stage.name}' (--from {stage.name})"))
        elif not sd.is_current(self.fingerprint(stage), _stamp(self.kinds[stage.kind])):
            problems.append(Problem(flag, f"'{stage.name}' is out of date (its options, code or inputs changed), "
                                          f"and it is not selected to run; run from '{stage.name}' "
                                          f"(--from {stage.name})"))

    # -- running --------------------------------------------------------------------------------

    def run(self, from_stage: Optional[str] = None, only: Optional[str] = None, force: bool = False) -> dict:
        selected = select_stages(self.recipe, from_stage, only)
        self.run_dir.claim(self.recipe.name)
        with self.run_dir.lock():
            for stage in self.recipe.stages:  # a swap a kill interrupted is put in order first
                self.run_dir.stage(stage.name).recover(_stamp(self.kinds[stage.kind]))
            self.check_unselected_inputs(selected)
            rows: list[dict] = []
            started = time.time()
            try:
                for stage in self.recipe.stages:
                    if stage.name in selected:
                        rows.append(self._run_stage(stage, force))
                    else:
                        rows.append(self._row(stage, "not selected", None))
            finally:  # also after a failure or Ctrl-C: the summary says where the run stopped
                first_missing = len(rows)
                for stage in self.recipe.stages[first_missing:]:
                    state = self.run_dir.stage(stage.name).state() or {}
                    pending = state.get("pending") or {}
                    if stage.index == first_missing and pending.get("status") in ("failed", "interrupted"):
                        rows.append(self._row(stage, f"{pending['status']} (previous output kept)",
                                              pending.get("seconds")))
                    elif stage.index == first_missing and state.get("status") in ("failed", "interrupted"):
                        rows.append(self._row(stage, state["status"], state.get("seconds")))
                    else:
                        rows.append(self._row(stage, "not run", None))
                summary = self._summary(rows, time.time() - started)
                write_json(self.run_dir.summary_file, summary)
                self.log(render_table(rows))
            return summary

    def _run_stage(self, stage: StageSpec, force: bool) -> dict:
        kind = self.kinds[stage.kind]
        sd = self.run_dir.stage(stage.name)
        fp = self.fingerprint(stage)
        state = sd.state() or {}
        done = state.get("status") == "done" and sd.output.exists()
        if not force and done and state.get("fingerprint") == fp:
            change = sd.changed(_stamp(kind))
            if change is None:
                if "pending" in state:  # a replacement for options given up since: no longer wanted
                    sd.clear_next()
                    sd.write_state({k: v for k, v in state.items() if k != "pending"})
                self.log(f"[{stage.name}] up to date (fingerprint {fp[:12]}): skipped")
                return self._row(stage, "skipped", None)
            self.log(f"[{stage.name}] its output changed since it was made ({change}): running it again")
        if done:
            return self._replace(stage, sd, fp, state, force)
        resume = bool(not force and state.get("fingerprint") == fp and state.get("status") != "done"
                      and sd.output.exists())
        if not resume:
            sd.clear_output()
        sd.output.mkdir(parents=True, exist_ok=True)
        began = time.time()
        base = self._base(stage, fp, began)
        sd.write_state({**base, "status": "running"})
        self.log(f"[{stage.name}] {'resuming' if resume else 'running'} ({stage.kind})")
        try:
            metrics = self._call(stage, sd, sd.output, resume)
        except BaseException as e:
            status = "interrupted" if isinstance(e, KeyboardInterrupt) else "failed"
            sd.write_state({**base, "status": status, "seconds": time.time() - began,
                            **({"error": str(e)} if status == "failed" else {})})
            raise
        seconds = time.time() - began
        self._write_metrics(sd, metrics)
        # Written last: this rename is what makes the stage done.
        sd.write_state(self._done(stage, base, sd.output, seconds, resumed=resume))
        return self._row(stage, "resumed" if resume else "ran", seconds)

    def _replace(self, stage: StageSpec, sd: StageDir, fp: str, state: dict, force: bool) -> dict:
        """Make the stage's new output beside its finished one, then swap; the finished output and its
        state stay valid (for this run's readers too) until the swap."""
        kind = self.kinds[stage.kind]
        pending = state.get("pending") or {}
        resume = bool(not force and pending.get("fingerprint") == fp and sd.next.exists())
        continued = pending.get("continues") if resume else None
        if not resume:
            sd.clear_next()
            base_fp = self.fingerprint(stage, kind.growable)
            if (not force and kind.continues and state.get("base_fingerprint") == base_fp
                    and kind.continues(state.get("options") or {}, stage.options)):
                _link_copy(sd.output, sd.next)
                continued = state.get("fingerprint")
        sd.next.mkdir(parents=True, exist_ok=True)
        began = time.time()
        pend = {"fingerprint": fp, "status": "running", "started": began, "continues": continued}
        sd.write_state({**state, "pending": pend})
        how = "resuming its replacement" if resume else "continuing it" if continued else "replacing it"
        self.log(f"[{stage.name}] {how} ({stage.kind}); the previous output stays in {sd.output} until the "
                 f"new one is complete")
        try:
            metrics = self._call(stage, sd, sd.next, resume or bool(continued))
        except BaseException as e:
            status = "interrupted" if isinstance(e, KeyboardInterrupt) else "failed"
            sd.write_state({**state, "pending": {**pend, "status": status, "seconds": time.time() - began,
                                                 **({"error": str(e)} if status == "failed" else {})}})
            self.log(f"[{stage.name}] {status}: the previous output is kept in {sd.output}; `astrai run` again "
                     f"resumes the replacement")
            raise
        seconds = time.time() - began
        metrics = _moved(metrics, str(sd.next), str(sd.output))
        new_state = self._done(stage, self._base(stage, fp, began), sd.next, seconds, resumed=resume)
        new_state["replaced"] = {"fingerprint": state.get("fingerprint"), "finished": state.get("finished"),
                                 "output_id": state.get("output_id"), "continued": bool(continued)}
        sd.swap_in_next()
        self._write_metrics(sd, metrics)
        sd.write_state(new_state)  # the new output is now the stage's; the old one can go
        sd.drop_replaced()
        row = self._row(stage, "continued" if continued else "replaced", seconds)
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(state["finished"])) if state.get("finished") else "?"
        row["figures"] = (row["figures"] + "  " if row["figures"] else "") + \
            f"({'continued' if continued else 'replaced'} the output of {when})"
        return row

    def _base(self, stage: StageSpec, fp: str, began: float) -> dict:
        return {"name": stage.name, "kind": stage.kind, "fingerprint": fp, "started": began,
                "options": stage.options.model_dump(mode="json"), "refs": stage.refs, "paths": stage.paths}

    def _done(self, stage: StageSpec, base: dict, output: Path, seconds: float, resumed: bool) -> dict:
        kind = self.kinds[stage.kind]
        return {**base, "status": "done", "seconds": seconds, "finished": time.time(),
                "output_id": uuid.uuid4().hex, "resumed": resumed,
                "base_fingerprint": self.fingerprint(stage, kind.growable),
                "output_stamp": fpr.output_stamp(output, kind.stamped, kind.unstamped)}

    def _call(self, stage: StageSpec, sd: StageDir, output: Path, resume: bool) -> dict:
        kind = self.kinds[stage.kind]
        with open_nofollow(sd.log_file, "a") as log_file:  # a link planted at log.txt is refused
            def log(message: str):
                log_file.write(f"{message}\n")
                log_file.flush()
                self.log(f"[{stage.name}] {message}")

            inputs = {f: self._output_of(up) for f, up in stage.refs.items()}
            inputs.update({f: self._path(v) for f, v in stage.paths.items()})
            ctx = StageContext(stage.name, stage.options, inputs, output, self.recipe.base_dir, log, resume)
            try:
                return dict(kind.run(ctx) or {})
            except KeyboardInterrupt:
                log("interrupted: `astrai run` again resumes this stage")
                raise
            except BaseException as e:
                log(f"failed: {type(e).__name__}: {e}")
                raise

    def _write_metrics(self, sd: StageDir, metrics: dict):
        write_json(sd.metrics_file, metrics)
        if metrics.get(LOSS_CURVE):
            from astrai.plot import write_plot

            title = f"{self.recipe.name}: {sd.root.name}"
            write_plot(sd.loss_png, metrics[LOSS_CURVE], title)
            write_plot(self.run_dir.loss_png, metrics[LOSS_CURVE], title)

    # -- reporting ------------------------------------------------------------------------------

    def _row(self, stage: StageSpec, status: str, seconds: Optional[float]) -> dict:
        sd = self.run_dir.stage(stage.name)
        state = sd.state() or {}
        metrics = _read_metrics(sd.metrics_file) if state.get("status") == "done" else {}
        shown = {k: v for k, v in metrics.items() if k != LOSS_CURVE}
        return {"name": stage.name, "kind": stage.kind, "status": status, "seconds": seconds,
                "fingerprint": state.get("fingerprint"), "state": state.get("status"),
                "output": str(sd.output), "log": str(sd.log_file), "metrics": shown,
                "figures": figures_text(shown, self.kinds[stage.kind].figures)}

    def _summary(self, rows: list[dict], seconds: float) -> dict:
        return {"recipe": self.recipe.file, "name": self.recipe.name, "run_dir": str(self.run_dir.root),
                "seconds": seconds, "stages": rows,
                "loss_png": str(self.run_dir.loss_png) if self.run_dir.loss_png.exists() else None}


def _read_metrics(path: Path) -> dict:
    from astrai.recipe.rundir import read_json

    return read_json(path) or {}


def _as_list(value) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def _stamp(kind: StageKind) -> tuple:
    return kind.stamped, kind.unstamped


def _link_copy(src: Path, dst: Path):
    """A copy of a finished output to continue from: safetensors files (never changed in place: new
    ones are written under new names and renamed) are hard-linked where the filesystem allows, every
    other file (appended logs, JSON) is copied, so continuing never alters the output it copies."""
    for f in sorted(src.rglob("*")):
        target = dst / f.relative_to(src)
        refuse_link(f, directory=f.is_dir())  # a link planted in the output is refused, never copied through
        if f.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        if f.suffix == ".safetensors":
            try:
                os.link(f, target)
                continue
            except OSError:
                pass
        shutil.copy2(f, target)


def _moved(value, old: str, new: str):
    """Metrics naming paths inside output.next name them inside output once it is swapped in."""
    if isinstance(value, str):
        return new + value[len(old):] if value == old or value.startswith(old + os.sep) else value
    if isinstance(value, dict):
        return {k: _moved(v, old, new) for k, v in value.items()}
    if isinstance(value, list):
        return [_moved(v, old, new) for v in value]
    return value
