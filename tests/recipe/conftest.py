"""Fake stage kinds for the recipe machinery: tiny, fast, and counting how often each one ran."""

import json
from pathlib import Path
from typing import Literal, Optional

import pytest
from pydantic import BaseModel, ConfigDict

from astrai.config import load_yaml
from astrai.recipe.kinds import StageKind
from astrai.recipe.spec import parse_recipe


class _Opts(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class MakeOptions(_Opts):
    inputs: list[str]
    flavor: Literal["sft", "dpo"] = "sft"
    packed: bool = True
    tokenizer: Optional[str] = None


class TokOptions(_Opts):
    size: int = 10


class FitOptions(_Opts):
    data: str
    lr: float = 0.1
    steps: int = 4
    stop_at: Optional[int] = None  # raise KeyboardInterrupt before this step (simulates Ctrl-C)
    fail_at: Optional[int] = None


class ScoreOptions(_Opts):
    model: str
    data: str


class Calls:
    def __init__(self):
        self.runs = []  # (stage name, resume flag)

    def names(self):
        return [n for n, _ in self.runs]


def make_kinds(calls: Calls) -> dict:
    def run_make(ctx):
        calls.runs.append((ctx.name, ctx.resume))
        text = "".join((ctx.base_dir / p).read_text() for p in ctx.options.inputs)
        (ctx.output / "data.txt").write_text(text)
        ctx.log(f"wrote {len(text)} chars")
        return {"records": len(text.splitlines()), "flavor": ctx.options.flavor}

    def run_tok(ctx):
        calls.runs.append((ctx.name, ctx.resume))
        (ctx.output / "tokenizer.json").write_text(json.dumps({"size": ctx.options.size}))
        return {"vocab_size": ctx.options.size}

    def run_fit(ctx):
        calls.runs.append((ctx.name, ctx.resume))
        data = (ctx.inputs["data"] / "data.txt").read_text()
        loss, curve = 4.0, []
        for step in range(ctx.options.steps):
            ckpt = ctx.output / f"step{step}.json"
            if ckpt.exists():  # resume: a finished step is never redone
                loss = json.loads(ckpt.read_text())["loss"]
            else:
                if ctx.options.stop_at == step:
                    raise KeyboardInterrupt
                if ctx.options.fail_at == step:
                    raise ValueError("boom")
                loss = loss * (1 - ctx.options.lr) + 0.001 * len(data)
                ckpt.write_text(json.dumps({"loss": loss}))
            curve.append([step, loss])
        return {"train_loss": loss, "loss_curve": {"train": curve, "val": curve[::2]}}

    def run_score(ctx):
        calls.runs.append((ctx.name, ctx.resume))
        return {"perplexity": 1.5}

    def describe_make(opts, base_dir, upstream):
        tok = upstream.get("tokenizer", {})
        return {"data_kind": opts.flavor, "packed": opts.packed, "tokenizer": tok.get("stage") or tok.get("path")}

    def check_fit(opts, base_dir, upstream):
        data = upstream.get("data", {})
        out = []
        if data.get("data_kind") != "sft":
            out.append(("data", f"fit trains on SFT data; '{opts.data}' makes {data.get('data_kind')} data"))
        if not data.get("packed"):
            out.append(("data", f"fit needs packed data; set packed: true in '{opts.data}'"))
        return out

    def check_score(opts, base_dir, upstream):
        a, b = upstream["model"].get("tokenizer"), upstream["data"].get("tokenizer")
        if a and b and a != b:  # unknown (the upstream stage has its own problem): nothing to compare
            return [("data", f"'{opts.data}' was made with another tokenizer than '{opts.model}'")]
        return []

    def describe_fit(opts, base_dir, upstream):
        return {"tokenizer": upstream["data"].get("tokenizer")}

    def describe_tok(opts, base_dir, upstream):
        return {}

    kinds = [
        StageKind("make", MakeOptions, run_make, "data", refs={"tokenizer": ("tokenizer",)},
                  path_refs=frozenset({"tokenizer"}), files=("inputs",), describe=describe_make,
                  figures=("records",)),
        StageKind("tok", TokOptions, run_tok, "tokenizer", describe=describe_tok, figures=("vocab_size",)),
        StageKind("fit", FitOptions, run_fit, "model", refs={"data": ("data",)}, check=check_fit,
                  describe=describe_fit, figures=("train_loss",), growable=("steps",),
                  continues=lambda old, new: new.steps > old.get("steps", new.steps)),
        StageKind("score", ScoreOptions, run_score, "report", refs={"model": ("model",), "data": ("data",)},
                  check=check_score, figures=("perplexity",)),
    ]
    # stage tokenizer identity: a stage reference is described by name
    return {k.name: k for k in kinds}


@pytest.fixture
def calls():
    return Calls()


@pytest.fixture
def kinds(calls):
    return make_kinds(calls)


@pytest.fixture
def recipe_file(tmp_path):
    """Write a recipe (YAML text) beside an input file; return a loader with optional overrides."""
    (tmp_path / "in.txt").write_text("a\nb\nc\n")

    def write(text: str, name: str = "r.yaml") -> Path:
        path = tmp_path / name
        path.write_text(text)
        return path

    return write


def load(path, kinds, overrides=()):
    from astrai.config import apply_overrides
    from astrai.recipe.spec import stage_overrides

    data, marks = load_yaml(path)
    if overrides:
        apply_overrides(data, stage_overrides(overrides, list((data.get("stages") or {}))))
    return parse_recipe(data, marks, str(path), kinds)


@pytest.fixture
def load_recipe():
    return load


def sft_pipeline_text(preprocessing: str) -> str:
    """The ChatML SFT pipeline the recipe tests write next to their recipes, with its preprocessing block."""
    return ("version: 1\nchat_template: chatml\ninput:\n  sections: [{field: messages, action: $role, template: true}]\n"
            f"mask: {{user: mask, assistant: train}}\nmask_default: mask\npreprocessing: {preprocessing}\n")


@pytest.fixture
def sft_pipeline():
    return sft_pipeline_text
