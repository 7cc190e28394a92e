"""Held-out preference figures: each answer's summed log-prob equals transformers on the document
alone; DPO figures against a reference and group figures by hand; `astrai eval` on DPO pairs and
scored groups writes them to eval.json (and refuses DPO pairs without a reference)."""

import json
import math
import shutil

import pytest
import torch

from astrai.cli import main
from astrai.config import load_pipeline
from astrai.data.load import ShardDataset
from astrai.data.preprocess import run_preprocess
from astrai.infer.preference import doc_logps, dpo_eval, groups_eval, preference_prompts
from astrai.model import CausalLM, ModelConfig, load_model, save_model
from astrai.schema import IGNORE_INDEX

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _ckpt(path, tok, seed):
    torch.manual_seed(seed)
    save_model(CausalLM(ModelConfig.preset("tiny", eos_token_id=None, initializer_range=0.1)), path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok / f, path / f)
    return path


@pytest.fixture(scope="module")
def prefs(tmp_path_factory, tiny_tokenizer):
    tmp = tmp_path_factory.mktemp("prefs")
    dpo = [{"prompt": [{"role": "user", "content": f"question {i} how are you"}],
            "chosen": [{"role": "assistant", "content": "fine thanks " * (1 + i % 3)}],
            "rejected": [{"role": "assistant", "content": "no"}]} for i in range(6)]
    grpo = [{"prompt": [{"role": "user", "content": f"say yes {i}"}],
             "completions": [{"text": "yes", "reward": 1.0}, {"text": "no maybe", "reward": 0.2},
                             {"text": "yes yes", "reward": 0.2 if i % 2 else 1.0}]} for i in range(5)]
    out = {}
    for name, records, pipe in (("dpo", dpo, "dpo_chatml.yaml"), ("grpo", grpo, "grpo_chatml.yaml")):
        (tmp / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        run_preprocess(load_pipeline(ROOT / "pipelines" / pipe), [str(tmp / f"{name}.jsonl")], str(tmp / name),
                       tokenizer=str(tiny_tokenizer), workers=1, log=lambda s: None)
        out[name] = tmp / name
    out["policy"] = _ckpt(tmp / "policy", tiny_tokenizer, 0)
    out["ref"] = _ckpt(tmp / "ref", tiny_tokenizer, 1)
    return out


def hf_logp(hf, ids, labels) -> float:
    """The document alone through transformers: sum of log p(labels[t+1] | ids[:t+1]) where trained."""
    ids, labels = torch.as_tensor(ids), torch.as_tensor(labels)
    with torch.no_grad():
        lp = torch.log_softmax(hf(ids[None]).logits[0].double(), -1)
    return sum(float(lp[t, labels[t + 1]]) for t in range(len(ids) - 1) if labels[t + 1] != IGNORE_INDEX)


def test_doc_logps_equal_each_document_alone_in_transformers(prefs):
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(prefs["policy"]).eval()
    ds = ShardDataset(prefs["dpo"])
    docs = [(ds[i][f"{s}_input_ids"], ds[i][f"{s}_labels"]) for i in range(len(ds)) for s in ("chosen", "rejected")]
    ours = doc_logps(load_model(prefs["policy"]).eval(), docs, batch_tokens=64)  # several forwards, several docs each
    ref = torch.tensor([hf_logp(hf, i, lab) for i, lab in docs], dtype=torch.float64)
    torch.testing.assert_close(ours, ref, atol=1e-3, rtol=1e-5)  # float32 model, sums of ~10 log-probs


def test_dpo_figures_by_hand(prefs):
    model, ref = load_model(prefs["policy"]).eval(), load_model(prefs["ref"]).eval()
    ds = ShardDataset(prefs["dpo"])
    same = dpo_eval(model, model, ds, beta=0.5)
    assert same["reward_accuracy"] == 0.0 and same["reward_margin"] == 0.0 and same["pairs"] == 6
    f = dpo_eval(model, ref, ds, beta=0.5)
    docs = [(ds[i][f"{s}_input_ids"], ds[i][f"{s}_labels"]) for i in range(6) for s in ("chosen", "rejected")]
    pi, pr = doc_logps(model, docs), doc_logps(ref, docs)
    rc, rr = 0.5 * (pi[0::2] - pr[0::2]), 0.5 * (pi[1::2] - pr[1::2])
    assert f["reward_accuracy"] == pytest.approx(float((rc > rr).double().mean()))
    assert f["reward_margin"] == pytest.approx(float((rc - rr).mean()))
    assert f["reward_chosen"] == pytest.approx(float(rc.mean())) and f["logp_rejected"] == pytest.approx(float(pi[1::2].mean()))


def test_group_figures_by_hand(prefs):
    model = load_model(prefs["policy"]).eval()
    ds = ShardDataset(prefs["grpo"])
    f = groups_eval(model, ds)
    reward_sum = right = decided = 0.0
    for i in range(len(ds)):
        r = ds[i]
        prompt = list(r["prompt_input_ids"])
        lp = doc_logps(model, [(prompt + list(c), [IGNORE_INDEX] * len(prompt) + list(lab))
                               for c, lab in zip(r["completion_input_ids"], r["completion_labels"])])
        w = [math.exp(x) / sum(math.exp(y) for y in lp.tolist()) for x in lp.tolist()]
        reward_sum += sum(wi * ri for wi, ri in zip(w, r["rewards"]))
        if max(r["rewards"]) > min(r["rewards"]):
            decided += 1
            right += r["rewards"][int(lp.argmax())] == max(r["rewards"])
    assert f["groups"] == 5 and f["policy_reward"] == pytest.approx(reward_sum / 5)
    assert f["policy_accuracy"] == pytest.approx(right / decided)
    assert f["reward_mean"] == pytest.approx(sum(sum(ds[i]["rewards"]) for i in range(5)) / 15, rel=1e-6)
    assert preference_prompts(ds, 0) == [] and len(preference_prompts(ds, 9)) == 5
    prompts = preference_prompts(ds, 2)
    assert prompts[0][0] == list(ds[0]["prompt_input_ids"]) and prompts[0][1] == list(ds[0]["completion_labels"][0])


def test_astrai_eval_on_pairs_and_groups(prefs, tmp_path, capsys):
    assert main(["eval", str(prefs["policy"]), "--data", str(prefs["dpo"]), "--samples", "1"]) == 1
    assert "--ref-model" in capsys.readouterr().err
    out = tmp_path / "dpo.json"
    assert main(["eval", str(prefs["policy"]), "--data", str(prefs["dpo"]), "--ref-model", str(prefs["ref"]),
                 "--beta", "0.5", "--samples", "1", "--sample-max-tokens", "4", "--output", str(out),
                 "--dtype", "float32"]) == 0
    r = json.loads(out.read_text())
    want = dpo_eval(load_model(prefs["policy"]).eval(), load_model(prefs["ref"]).eval(), ShardDataset(prefs["dpo"]), 0.5)
    assert r["data_kind"] == "dpo" and r["reward_margin"] == pytest.approx(want["reward_margin"])
    assert len(r["samples"]) == 1 and "held-out reward accuracy" in capsys.readouterr().out
    out = tmp_path / "grpo.json"
    assert main(["eval", str(prefs["policy"]), "--data", str(prefs["grpo"]), "--samples", "1",
                 "--sample-max-tokens", "4", "--output", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["data_kind"] == "groups" and 0 <= r["policy_reward"] <= 1 and r["groups"] == 5
