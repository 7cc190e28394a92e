"""`astrai generate` / `astrai eval` / Engine.from_checkpoint on a LoRA adapter directory: the base is found
from base_model_name_or_path (or --base), the adapters act (greedy tokens equal a slow reference that
runs the unmerged LoRA model on the whole sequence each step), and a base that does not fit is refused
with one line and exit 1, before any generation."""

import json

import pytest

torch = pytest.importorskip("torch")

from astrai.cli import main  # noqa: E402
from astrai.infer.engine import Engine, EngineOptions  # noqa: E402
from astrai.infer.request import SamplingParams  # noqa: E402
from astrai.model import CausalContext, CausalLM, ModelConfig, load_model, save_model  # noqa: E402
from astrai.model.adapter_files import save_adapter  # noqa: E402
from astrai.model.lora import LoraSpec, apply_lora, lora_layers  # noqa: E402
from astrai.text.tokenizer import load_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def adapter(checkpoint, tmp_path_factory):
    """(adapter dir without tokenizer files, the LoRA model it holds) on the tiny `checkpoint`."""
    model = load_model(checkpoint)
    torch.manual_seed(5)
    apply_lora(model, LoraSpec(4, 8.0), base=str(checkpoint))
    with torch.no_grad():
        for layer in lora_layers(model).values():
            layer.lora_B.weight.normal_(0, 0.2)
    path = tmp_path_factory.mktemp("adapter") / "final"
    save_adapter(model, path)
    return path, model.eval()


def slow_greedy(model, ids, n):
    ids = list(ids)
    for _ in range(n):
        with torch.no_grad():
            h = model(torch.tensor(ids), torch.arange(len(ids)), CausalContext())
            ids.append(int(model.logits(h[-1:]).argmax()))
    return ids[-n:]


def test_generate_on_an_adapter_equals_the_unmerged_lora_model(checkpoint, adapter, capsys, tmp_path):
    path, lora_model = adapter
    out_file = tmp_path / "out.jsonl"
    chats = tmp_path / "c.jsonl"
    chats.write_text(json.dumps([{"role": "user", "content": "how are you"}]) + "\n")
    rc = main(["generate", str(path), "--chat", str(chats), "--output", str(out_file), "--max-tokens", "6",
               "--temperature", "0", "--ignore-eos", "--device", "cpu"])
    assert rc == 0, capsys.readouterr().err
    rec = json.loads(out_file.read_text())
    prompt = Engine.from_checkpoint(checkpoint, EngineOptions(device="cpu", dtype="float32")).generate(
        [[{"role": "user", "content": "how are you"}]], SamplingParams(max_tokens=1))[0].prompt_token_ids
    assert rec["token_ids"] == slow_greedy(lora_model, prompt, 6)
    assert rec["token_ids"] != slow_greedy(load_model(checkpoint), prompt, 6)  # the adapter changed the answer


def _data(tmp_path, tokenizer):
    from astrai.config import Pipeline
    from astrai.data.preprocess import run_preprocess

    msgs = [{"role": "user", "content": "how are you"}, {"role": "assistant", "content": "fine"}]
    (tmp_path / "d.jsonl").write_text(json.dumps({"messages": msgs}) + "\n")
    pipe = Pipeline.model_validate({"version": 1, "chat_template": "chatml",
                                    "input": {"sections": [{"field": "messages", "action": "$role", "template": True}]}})
    run_preprocess(pipe, [str(tmp_path / "d.jsonl")], str(tmp_path / "data"), tokenizer=str(tokenizer), workers=1,
                   log=lambda s: None)
    return tmp_path / "data"


def test_base_override_and_one_line_refusals(checkpoint, adapter, capsys, tmp_path, tiny_tokenizer):
    path, lora_model = adapter
    # the adapter names a base that is gone: refused, and --base DIR fixes it
    moved = tmp_path / "moved"
    save_adapter(lora_model, moved)
    cfg = json.loads((moved / "adapter_config.json").read_text())
    (moved / "adapter_config.json").write_text(json.dumps({**cfg, "base_model_name_or_path": str(tmp_path / "gone")}))
    rc = main(["generate", str(moved), "--prompt", "hello", "--max-tokens", "2", "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 1 and "not found" in err and "--base DIR" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    rc = main(["generate", str(moved), "--base", str(checkpoint), "--prompt", "hello", "--max-tokens", "3",
               "--temperature", "0", "--ignore-eos", "--device", "cpu"])
    assert rc == 0 and "3 token(s)" in capsys.readouterr().err
    # a base of another shape
    torch.manual_seed(0)
    other = tmp_path / "other"
    save_model(CausalLM(ModelConfig.preset("tiny", hidden_size=96)), other)
    data = _data(tmp_path, tiny_tokenizer)  # real data: eval checks --data before it reads the model
    capsys.readouterr()
    for verb in (["generate", str(path), "--prompt", "hi"], ["eval", str(path), "--data", str(data)]):
        rc = main(verb + ["--base", str(other), "--device", "cpu"])
        err = capsys.readouterr().err
        assert rc == 1 and "but base" in err and "needs" in err and "Traceback" not in err, err
        assert len(err.strip().splitlines()) == 1


def test_engine_takes_the_adapter_dirs_tokenizer_else_the_base(checkpoint, adapter, tmp_path):
    path, _ = adapter
    engine = Engine.from_checkpoint(path, EngineOptions(device="cpu", dtype="float32"))
    assert engine.tokenizer is not None and engine.tokenizer.path == load_tokenizer(str(checkpoint)).path
