"""`astrai train CONFIG.yaml [--set key=value ...]`: the train stage on its own.

CONFIG is a TrainOptions mapping (astrai.config.train; the same keys as a recipe's `train:` block),
validated as every astrai YAML is: unknown keys with "did you mean", every problem at once with
its line. Paths in it are relative to the file.

It ends with a short report: steps, time, loss first -> last, the held-out figures, where final/
and the curves (OUTPUT/loss.png) are, and the next commands. Exit status: 0 done; 1 invalid config or data; 128 + signal when SIGTERM/SIGINT stopped training
after writing a checkpoint.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from astrai.config import ConfigError, Problem, apply_overrides, load_yaml, model_help, validate_data
from astrai.config.train import TrainOptions
from astrai.errors import InputError

_PATH_KEYS = ("data", "val_data", "output", "ref_model", "model")


def load_train_config(path, overrides=()) -> TrainOptions:
    data, marks = load_yaml(path)
    data = apply_overrides(data, list(overrides)) if overrides else data
    opts = validate_data(data, TrainOptions, str(path), marks)
    base = Path(path).resolve().parent
    fixed = {}
    for key in _PATH_KEYS:
        value = getattr(opts, key)
        if value is None or (key == "model" and "/" not in value and not value.endswith(".json")) \
                or Path(value).is_absolute():  # a bare model name is a size preset
            continue
        fixed[key] = str(base / value)
    return opts.model_copy(update=fixed).with_reward_files_under(base)


# finished units of work are kept (completion markers, checkpoints); what was half-written is redone
INTERRUPTED = "interrupted; rerun to resume"

def help_for(verb: str) -> str:
    return "train on preprocessed data (pretrain/SFT/DPO/GRPO)"


def add_arguments(p):
    p.epilog = "train keys (in CONFIG or --set KEY=VALUE):\n" + "\n".join(model_help(TrainOptions))
    p.add_argument("config", help="train YAML (the keys below; paths relative to it)")


def _check_before_work(config: str, opts: TrainOptions) -> None:
    """What can be refused before torch is imported or anything is written: a report_to tracker that
    is not installed, and data rendered with another chat template than the model serves with."""
    from astrai.train.data import TrainData, template_problem
    from astrai.train.report import check_reporters

    missing = check_reporters(opts.reporters)
    if missing:
        raise InputError(f"{config}: " + "; ".join(missing))
    if Path(opts.data).is_dir() and opts.model is not None:
        problem = template_problem(TrainData(opts.data), opts.model)
        if problem:
            raise InputError(f"{config}: {problem}")


def run(args) -> int:
    from astrai.train.run import TrainConfigError, run_train

    opts = load_train_config(args.config, args.overrides)  # a ConfigError is reported by astrai.cli.main
    if opts.data is None:
        raise ConfigError(args.config, [Problem("data", "data is required (a preprocessed directory)")])
    _check_before_work(args.config, opts)
    args.output = opts.output  # named by astrai.cli.main when the disk fills up there
    if opts.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise InputError(f"{args.config}: device: cuda, but " + ("this torch is built without CUDA"
                             if torch.version.cuda is None else "no CUDA device is visible") + "; use device: cpu or auto")
    if Path(opts.output).exists() and not Path(opts.output).is_dir():
        raise InputError(f"{args.config}: output {opts.output} is a file, not a directory; give a directory "
                         f"(checkpoints/ and final/ are written there)")
    try:
        if opts.rollout is not None:
            from astrai.rl.online import run_online_grpo

            result = run_online_grpo(opts)
        else:
            result = run_train(opts)
    except TrainConfigError as e:
        print(f"error: {args.config}: {e}", file=sys.stderr)
        return 1
    from astrai.train.summary import lines

    print("\n".join(lines(result)))
    return 128 + signal.Signals[result["stopped"]].value if result["stopped"] else 0
