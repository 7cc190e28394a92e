"""`python -m astrai.train CONFIG.yaml [--set key=value ...]`: the train stage from a YAML file.

The YAML is a TrainOptions mapping, validated as every astrai YAML is (astrai.config: unknown keys
with "did you mean", every problem at once with its line). Paths in it are relative to the file.
The `astrai train` verb and a recipe `train` stage will call `load_train_config` + `run_train`
(they wait for the config/CLI packages of the structure refactor).

Exit status: 0 done; 1 invalid config or data; 128 + signal when SIGTERM/SIGINT stopped training
after writing a checkpoint.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

from astrai.config import ConfigError, apply_overrides, load_yaml, validate_data
from astrai.model.config import PRESETS
from astrai.train.options import TrainOptions

_PATH_KEYS = ("data", "val_data", "output", "ref_model", "model")


def load_train_config(path, overrides=()) -> TrainOptions:
    data, marks = load_yaml(path)
    data = apply_overrides(data, list(overrides)) if overrides else data
    opts = validate_data(data, TrainOptions, str(path), marks)
    base = Path(path).resolve().parent
    fixed = {}
    for key in _PATH_KEYS:
        value = getattr(opts, key)
        if value is None or (key == "model" and value in PRESETS) or Path(value).is_absolute():
            continue
        fixed[key] = str(base / value)
    return opts.model_copy(update=fixed)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="astrai train", description="train on preprocessed data (see TrainOptions)")
    p.add_argument("config", help="train YAML (TrainOptions keys)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    a = p.parse_args(argv)
    from astrai.train.run import TrainConfigError, run_train

    try:
        opts = load_train_config(a.config, a.overrides)
        result = run_train(opts)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 1
    except TrainConfigError as e:
        print(f"{a.config}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result))
    return 128 + signal.Signals[result["stopped"]].value if result["stopped"] else 0
