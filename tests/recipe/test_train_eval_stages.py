"""tokenizer -> preprocess -> train -> eval through the runner, on a tiny model (skipped where the
train/infer packages are not installed). The checkpoint must load in transformers on its own."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("astrai.train")
pytest.importorskip("astrai.infer")

from astrai.config import ConfigError  # noqa: E402
from astrai.recipe.command import load_recipe_spec  # noqa: E402
from astrai.recipe.runner import Runner  # noqa: E402

DPO_PIPELINE = """\
version: 1
chat_template: chatml
input:
  sources:
    chosen: {sections: [{field: [prompt, chosen], action: $role, template: true}]}
    rejected: {sections: [{field: [prompt, rejected], action: $role, template: true}]}
preprocessing: {max_seq_len: 128}
"""

RECIPE = """\
version: 1
name: tiny
run_dir: run
stages:
  tokenizer: {inputs: [chat.jsonl], vocab_size: 320}
  preprocess: {pipeline: sft.yaml, inputs: [chat.jsonl], tokenizer: tokenizer, holdout: 0.2, workers: 1}
  train: {data: preprocess, model: tiny, epochs: 50, max_steps: 4, batch_size: 2, lr: 0.01, eval_every: 2, save_every: 1,
          progress: false}
  eval: {model: train, data: preprocess, samples: 1, sample_max_tokens: 4}
"""


@pytest.fixture
def recipe(tmp_path, sft_pipeline):
    words = "red green blue cat dog sun moon tree river stone".split()
    with open(tmp_path / "chat.jsonl", "w") as fh, open(tmp_path / "pairs.jsonl", "w") as pf:
        for i in range(40):
            q = " ".join(words[(i + j) % 10] for j in range(4))
            user = {"role": "user", "content": f"say {q}"}
            fh.write(json.dumps({"messages": [user, {"role": "assistant", "content": q}]}) + "\n")
            pf.write(json.dumps({"prompt": [user], "chosen": [{"role": "assistant", "content": q}],
                                 "rejected": [{"role": "assistant", "content": q[::-1]}]}) + "\n")
    (tmp_path / "sft.yaml").write_text(sft_pipeline("{max_seq_len: 128, packing_strategy: bfd, max_packed_len: 128}"))
    (tmp_path / "dpo.yaml").write_text(DPO_PIPELINE)
    (tmp_path / "r.yaml").write_text(RECIPE)
    return tmp_path / "r.yaml"


def run(path, overrides=(), **flags):
    spec, kinds = load_recipe_spec(str(path), overrides)
    return Runner(spec, kinds, log=lambda m: None).run(**flags)


@pytest.mark.slow
def test_chain_skip_and_set_reruns_only_train_and_eval(recipe):
    s = run(recipe)
    assert [x["status"] for x in s["stages"]] == ["ran"] * 4
    train = s["stages"][2]["metrics"]
    assert train["steps"] == 4 and train["val_loss_start"] > train["val_loss"]  # lr 0.01: it falls within 4 steps
    assert s["stages"][3]["metrics"]["perplexity"] > 1
    root = recipe.parent / "run"
    assert (root / "loss.png").exists() and (root / "eval" / "output" / "eval.json").exists()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = root / "train" / "output" / "final"
    tok = AutoTokenizer.from_pretrained(str(final))
    model = AutoModelForCausalLM.from_pretrained(str(final))
    ids = tok.apply_chat_template([{"role": "user", "content": "say red"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    assert model(ids).logits.shape[-1] >= len(tok)
    # astrai generate needs the checkpoint alone, too
    import io

    from astrai.infer.generate import GenerateOptions, generate_main

    out = io.StringIO()
    assert generate_main(GenerateOptions(checkpoint=str(final), prompt="say red",
                                         sampling={"max_tokens": 3}), out=out, err=io.StringIO()) == 0
    assert out.getvalue()

    assert [x["status"] for x in run(recipe)["stages"]] == ["skipped"] * 4
    assert [x["status"] for x in run(recipe, ["train.lr=0.005"])["stages"]] == ["skipped", "skipped", "replaced",
                                                                                       "replaced"]


def test_bad_recipes_refused_before_work(recipe):
    text = recipe.read_text()
    recipe.write_text(text + "  pairs: {kind: preprocess, pipeline: dpo.yaml, inputs: [pairs.jsonl], "
                             "tokenizer: tokenizer}\n  sft2: {kind: train, data: pairs}\n")
    with pytest.raises(ConfigError) as e:
        run(recipe)
    [p] = e.value.problems
    assert p.path == "stages.sft2.data" and p.line == 11 and "makes dpo data; use strategy: dpo" in p.message

    recipe.write_text(text.replace("holdout: 0.2, ", ""))
    with pytest.raises(ConfigError) as e:
        run(recipe)
    assert {p.path for p in e.value.problems} == {"stages.train.eval_every", "stages.eval.data"}

    recipe.write_text(text + "  tok2: {kind: tokenizer, inputs: [chat.jsonl], vocab_size: 330}\n"
                             "  pre2: {kind: preprocess, pipeline: sft.yaml, inputs: [chat.jsonl], tokenizer: tok2,"
                             " holdout: 0.2}\n  eval2: {kind: eval, model: train, data: pre2}\n")
    with pytest.raises(ConfigError, match="was trained with tokenizer stage:tokenizer but 'pre2'"):
        run(recipe)
    assert not (recipe.parent / "run").exists()


@pytest.mark.slow
def test_kill_during_train_then_rerun_resumes_to_the_same_loss(recipe, tmp_path):
    slow = RECIPE.replace("max_steps: 4", "max_steps: 12")
    recipe.write_text(slow)
    straight = tmp_path / "straight.yaml"
    straight.write_text(slow.replace("run_dir: run", "run_dir: straight"))
    cmd = [sys.executable, "-m", "astrai.recipe.command"]
    proc = subprocess.Popen(cmd + [str(recipe)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckpts = recipe.parent / "run" / "train" / "output" / "checkpoints"
    deadline = time.time() + 120
    while time.time() < deadline and not (ckpts.exists() and len(list(ckpts.glob("step-*"))) >= 1):
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    state = json.loads((recipe.parent / "run" / "train" / "stage.json").read_text())
    assert state["status"] == "running"  # killed: no chance to say otherwise
    subprocess.run(cmd + [str(recipe)], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(cmd + [str(straight)], check=True, stdout=subprocess.DEVNULL)
    resumed = json.loads((recipe.parent / "run" / "summary.json").read_text())["stages"][2]
    clean = json.loads((tmp_path / "straight" / "summary.json").read_text())["stages"][2]
    assert resumed["status"] == "resumed" and clean["status"] == "ran"
    assert resumed["metrics"]["train_loss"] == clean["metrics"]["train_loss"]
    assert resumed["metrics"]["steps"] == 12


@pytest.mark.slow
def test_more_steps_continue_the_finished_model_and_equal_a_straight_run(recipe, tmp_path):
    const = ["train.scheduler=constant"]  # the same lr at every step whatever the run's length
    run(recipe, const)
    s = run(recipe, const + ["train.max_steps=6"])
    assert [x["status"] for x in s["stages"]] == ["skipped", "skipped", "continued", "replaced"]
    straight = tmp_path / "straight.yaml"
    straight.write_text(recipe.read_text().replace("run_dir: run", "run_dir: straight"))
    ref = run(straight, const + ["train.max_steps=6"])["stages"][2]["metrics"]
    got = s["stages"][2]["metrics"]
    assert got["steps"] == 6 and got["train_loss"] == ref["train_loss"] and got["val_loss"] == ref["val_loss"]
    assert got["checkpoint"] == str(recipe.parent / "run" / "train" / "output" / "final")
    curve = json.loads((recipe.parent / "run" / "train" / "metrics.json").read_text())["loss_curve"]["loss"]
    assert [p[0] for p in curve["train"]] == [1, 2, 3, 4, 5, 6]


@pytest.mark.slow
def test_ctrl_c_while_retraining_keeps_the_last_model(recipe):
    run(recipe)
    root = recipe.parent / "run" / "train"
    weights = (root / "output" / "final" / "model.safetensors").read_bytes()
    recipe.write_text(recipe.read_text().replace("max_steps: 4", "max_steps: 400").replace("lr: 0.01", "lr: 0.02"))
    proc = subprocess.Popen([sys.executable, "-m", "astrai.recipe.command", str(recipe)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    ckpts = root / "output.next" / "checkpoints"
    deadline = time.time() + 180
    while time.time() < deadline and not (ckpts.exists() and list(ckpts.glob("step-*"))):
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 130, err[-2000:]
    assert (root / "output" / "final" / "model.safetensors").read_bytes() == weights  # the last model is kept
    state = json.loads((root / "stage.json").read_text())
    assert state["status"] == "done" and state["pending"]["status"] == "interrupted"
    assert "previous output" in err or "interrupted" in err


@pytest.mark.slow
def test_without_eval_every_the_table_reports_the_final_validation_loss(recipe):
    s = run(recipe, ["train.eval_every=null", "train.max_steps=3"])
    m = s["stages"][2]["metrics"]
    curve = json.loads((recipe.parent / "run" / "train" / "metrics.json").read_text())["loss_curve"]["loss"]["val"]
    assert [p[0] for p in curve] == [0, 3]  # before the first step and once at the end
    assert m["val_loss"] == curve[-1][1] and m["val_loss_drop"] == pytest.approx(curve[0][1] - curve[-1][1])
    assert m["val_loss_drop"] != 0


def test_a_typo_in_a_train_stage_that_validates_on_its_data_stage_is_the_only_problem():
    # the bundled main job validates on the preprocess stage's val/ (no val_data key): a typo elsewhere in
    # its train stage was once reported with a second, false "eval_every needs val_data"
    from pathlib import Path

    from astrai.config import ConfigError
    from astrai.recipe.command import load_recipe_spec

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "sft.yaml"
    with pytest.raises(ConfigError) as e:
        load_recipe_spec(str(recipe), ("train.return_fred_memory=true",))
    [p] = e.value.problems
    # the problem is named by the --set that caused it; the message keeps the stage key it landed on
    assert p.path == "--set train.return_fred_memory=true"
    assert p.message.startswith("stages.train.return_fred_memory:") and "did you mean 'return_freed_memory'" in p.message


@pytest.mark.parametrize("override, key, message", [
    ("train.betas=[0.9,1.5]", "betas", "betas must be two numbers in [0, 1)"),
    ("train.rewards=[{name: format, pattern: x}]", "rewards", "add a rollout block"),
    ("train.output=elsewhere", "output", "output is decided by the recipe"),
])
def test_a_train_stage_gets_every_check_astrai_train_makes(override, key, message):
    # the stage's options once replaced TrainOptions' combination checks with a hand-kept subset:
    # betas of 1.5 and rewards without a rollout passed in a recipe while `astrai train` refused them
    from pathlib import Path

    from astrai.config import ConfigError
    from astrai.recipe.command import load_recipe_spec

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "sft.yaml"
    with pytest.raises(ConfigError) as e:
        load_recipe_spec(str(recipe), (override,))
    [p] = e.value.problems
    assert p.path == f"--set {override}" and p.message.startswith(f"stages.train.{key}:") and message in p.message, p


def test_train_figures_show_sampled_held_out_rewards_only_online(tmp_path):
    """Online GRPO's val_reward_mean is of completions sampled from the weights at each evaluation (it moves);
    offline GRPO's is the held-out data's own (the same every time): a key figure online only."""
    import json

    from astrai.recipe.train_stage import train_metrics

    f = tmp_path / "metrics.jsonl"
    recs = [{"step": 0, "val_reward_mean": 0.25, "val_policy_reward": 0.3}, {"step": 1, "loss": 1.0, "reward_mean": 0.2},
            {"step": 2, "loss": 0.5, "reward_mean": 0.6}, {"step": 2, "val_reward_mean": 0.75, "val_policy_reward": 0.4}]
    f.write_text("".join(json.dumps(r) + "\n" for r in recs))
    online = train_metrics({"steps": 2}, f, "grpo", online=True)
    assert (online["val_reward_mean_start"], online["val_reward_mean"]) == (0.25, 0.75)
    assert (online["reward_first"], online["reward_last"]) == (0.2, 0.6)
    offline = train_metrics({"steps": 2}, f, "grpo", online=False)
    assert "val_reward_mean" not in offline and "reward_first" not in offline and offline["val_policy_reward"] == 0.4
