"""Run a recipe's stages in order: skip what is up to date, resume what was interrupted, record it all.

For each selected stage (all; or `from_stage` and every later one; or `only` one):
- its fingerprint (recipe/fingerprint.py) is computed from its options, code, input files and the
  outputs of the stages it reads, as recorded when those completed;
- up to date (RUN/<stage>/stage.json says done with this fingerprint) -> skipped, and says so;
- a previous run with the same fingerprint that stopped part way (killed, Ctrl-C, failed) ->
  rerun in the same output directory with `ctx.resume` set: preprocess skips its finished
  partitions, train continues from its last checkpoint;
- otherwise (new, changed, or --force) -> its old output is removed and it runs from scratch.
Stages outside the selection are never run; a selected stage that reads one of them needs it done
and current, which is checked before any work starts.

A stage's output is RUN/<stage>/output/, unless its metrics name another directory as `points_to`
(a checkpoint stage points at the checkpoint instead of copying it): later stages read that one.

The run writes RUN/summary.json and prints a table (stage, kind, status, time, key figures). A stage
reporting `loss_curve` ({"train": [[step, loss], ...], "val": [...]}) gets a loss.png.
"""

from __future__ import annotations

import difflib
import time
import uuid
from pathlib import Path
from typing import Callable, Mapping, Optional

from astrai.config import ConfigError, Problem
from astrai.recipe import fingerprint as fpr
from astrai.recipe.kinds import StageContext, StageKind
from astrai.recipe.rundir import RunDir, write_json
from astrai.recipe.spec import RecipeSpec, StageSpec
from astrai.recipe.table import figures_text, render_table

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

    def fingerprint(self, stage: StageSpec) -> str:
        """From the options and the recorded outputs of upstream stages (which must be done)."""
        kind = self.kinds[stage.kind]
        options = stage.options.model_dump(mode="json")
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
        elif not sd.is_current(self.fingerprint(stage)):
            problems.append(Problem(flag, f"'{stage.name}' is out of date (its options, code or inputs changed), "
                                          f"and it is not selected to run; run from '{stage.name}' "
                                          f"(--from {stage.name})"))

    # -- running --------------------------------------------------------------------------------

    def run(self, from_stage: Optional[str] = None, only: Optional[str] = None, force: bool = False) -> dict:
        selected = select_stages(self.recipe, from_stage, only)
        with self.run_dir.lock():
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
                    stopped = stage.index == first_missing and state.get("status") in ("failed", "interrupted")
                    rows.append(self._row(stage, state["status"] if stopped else "not run", state.get("seconds")
                                          if stopped else None))
                summary = self._summary(rows, time.time() - started)
                write_json(self.run_dir.summary_file, summary)
                self.log(render_table(rows))
            return summary

    def _run_stage(self, stage: StageSpec, force: bool) -> dict:
        kind = self.kinds[stage.kind]
        sd = self.run_dir.stage(stage.name)
        fp = self.fingerprint(stage)
        if not force and sd.is_current(fp):
            self.log(f"[{stage.name}] up to date (fingerprint {fp[:12]}): skipped")
            return self._row(stage, "skipped", None)
        state = sd.state()
        resume = bool(not force and state and state.get("fingerprint") == fp and state.get("status") != "done"
                      and sd.output.exists())
        if not resume:
            sd.clear_output()
        sd.output.mkdir(parents=True, exist_ok=True)
        began = time.time()
        base = {"name": stage.name, "kind": stage.kind, "fingerprint": fp, "started": began,
                "options": stage.options.model_dump(mode="json"), "refs": stage.refs, "paths": stage.paths}
        sd.write_state({**base, "status": "running"})
        self.log(f"[{stage.name}] {'resuming' if resume else 'running'} ({stage.kind})")
        with open(sd.log_file, "a", encoding="utf-8") as log_file:
            def log(message: str):
                log_file.write(f"{message}\n")
                log_file.flush()
                self.log(f"[{stage.name}] {message}")

            inputs = {f: self._output_of(up) for f, up in stage.refs.items()}
            inputs.update({f: self._path(v) for f, v in stage.paths.items()})
            ctx = StageContext(stage.name, stage.options, inputs, sd.output, self.recipe.base_dir, log, resume)
            try:
                metrics = dict(kind.run(ctx) or {})
            except KeyboardInterrupt:
                sd.write_state({**base, "status": "interrupted", "seconds": time.time() - began})
                log("interrupted: `astrai run` again resumes this stage")
                raise
            except BaseException as e:
                sd.write_state({**base, "status": "failed", "seconds": time.time() - began, "error": str(e)})
                log(f"failed: {type(e).__name__}: {e}")
                raise
        seconds = time.time() - began
        write_json(sd.metrics_file, metrics)
        if metrics.get(LOSS_CURVE):
            from astrai.recipe.plot import write_loss_png

            write_loss_png(sd.loss_png, metrics[LOSS_CURVE])
            write_loss_png(self.run_dir.loss_png, metrics[LOSS_CURVE])
        # Written last: this rename is what makes the stage done.
        sd.write_state({**base, "status": "done", "seconds": seconds, "finished": time.time(),
                        "output_id": uuid.uuid4().hex, "resumed": resume})
        return self._row(stage, "resumed" if resume else "ran", seconds)

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
