"""Every family against transformers on the same random weights (float32, 1e-4): the training forward on
packed rows, the engine (prefill, chunked prefill, decode with radix sharing, past the sliding window),
greedy generation against transformers' `generate`, and astrai save -> transformers load."""

import json

import pytest
import torch

from families import CASES, SLIDING, WINDOW, hf_logits, hf_model

from astrai.model import CausalContext, CausalLM, load_model, save_model
from astrai.model.weights import expected_shapes

transformers = pytest.importorskip("transformers")

NEW = 12  # generated tokens: decode runs well past the window of 8


@pytest.fixture(scope="module", params=list(CASES))
def family(request, tmp_path_factory):
    """(family, transformers model, checkpoint directory written by transformers)."""
    name = request.param
    hf = hf_model(name, seed=list(CASES).index(name))
    path = tmp_path_factory.mktemp(name)
    hf.save_pretrained(path)
    return name, hf, path


def _doc(seed: int, n: int, vocab: int = 256) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def test_loads_as_its_family_with_every_feature(family):
    name, hf, path = family
    ours = load_model(path)
    c = ours.config
    assert c.family == name and c.architecture == type(hf).__name__
    assert (c.has_sliding_layers and c.sliding_window == WINDOW) == (name in SLIDING)
    if name in ("qwen2", "qwen3", "gemma3_text"):  # full and sliding layers both present
        assert 0 < sum(c.is_sliding_layer(i) for i in range(c.num_hidden_layers)) < c.num_hidden_layers
    shapes = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    if c.tie_word_embeddings:
        shapes.pop("lm_head.weight")
    assert shapes == expected_shapes(c)  # the arithmetic the file checks use is the module tree's


def test_training_forward_on_packed_rows_equals_each_document_alone(family):
    from astrai.train.packed_attention import packed_context

    name, hf, path = family
    ours = load_model(path).eval()
    docs = [_doc(1, 23), _doc(2, 5), _doc(3, 31)]  # longer and shorter than the window
    ids = torch.tensor([t for d in docs for t in d])
    pos = torch.cat([torch.arange(len(d)) for d in docs])
    cu = torch.tensor([0, 23, 28, 59])
    with torch.no_grad():
        got = ours.logits(ours(ids, pos, packed_context(cu)))
    for d, start in zip(docs, cu.tolist()):
        ref = hf_logits(hf, d)
        assert ref.abs().max() > 1.0  # weights big enough that a mistake would show
        torch.testing.assert_close(got[start:start + len(d)], ref, atol=1e-4, rtol=0)


def test_eval_perplexity_equals_transformers_loss_on_each_document_alone(family):
    """`astrai eval`'s perplexity on packed rows (windows, Gemma's scale and soft-capping included): the
    mean loss over trained labels equals transformers' over the same labels with each document alone."""
    from astrai.infer.perplexity import perplexity
    from astrai.schema import IGNORE_INDEX

    name, hf, path = family
    docs = [[_doc(21, 17), _doc(22, 26)], [_doc(23, 9), _doc(24, 4), _doc(25, 20)]]  # two packed rows
    rows, nll, count = [], 0.0, 0
    for row in docs:
        labels = [[IGNORE_INDEX] * (len(d) // 3) + d[len(d) // 3:] for d in row]  # a masked prompt, then trained
        rows.append({"input_ids": torch.tensor([t for d in row for t in d]),
                     "position_ids": torch.cat([torch.arange(len(d)) for d in row]),
                     "labels": torch.tensor([t for lab in labels for t in lab]),
                     "seq_lens": torch.tensor([len(d) for d in row])})
        for d, lab in zip(row, labels):
            lp = hf_logits(hf, d)[:-1].double().log_softmax(-1)
            trained = [(i, t) for i, t in enumerate(lab[1:]) if t != IGNORE_INDEX]
            nll -= sum(lp[i, t].item() for i, t in trained)
            count += len(trained)
    got = perplexity(load_model(path).eval(), rows, batch_tokens=40)  # two batches: one row each
    assert got["documents"] == 5 and got["rows"] == 2 and got["trained_tokens"] == count
    assert got["loss"] == pytest.approx(nll / count, abs=1e-5)


def _recording(engine):
    """Wrap the runner: every sampled row's logits with the tokens they were computed from."""
    seen = []
    forward = engine.runner.forward

    def record(batch):
        logits = forward(batch)
        rows = [(r, r.kv_len + n) for i, (r, n) in enumerate(zip(batch.reqs, batch.q_lens)) if batch.samples(i)]
        seen.extend((list(r.tokens[:upto]), row.clone()) for (r, upto), row in zip(rows, logits))
        return logits

    engine.runner.forward = record
    return seen


@pytest.mark.parametrize("chunked", [False, True], ids=["prefill", "chunked"])
def test_engine_logits_and_greedy_equal_transformers(family, chunked):
    from astrai.infer.engine import Engine, EngineOptions
    from astrai.infer.request import SamplingParams

    name, hf, path = family
    shared = _doc(7, 19)
    prompts = [shared + _doc(8, 6), shared + _doc(9, 10)]  # the second finds the first's prefix cached
    opts = dict(page_size=4, max_step_tokens=16, max_running=4) if chunked else dict(page_size=16)
    engine = Engine(load_model(path), options=EngineOptions(device="cpu", dtype="float32", **opts))
    seen = _recording(engine)
    params = SamplingParams(max_tokens=NEW, temperature=0.0)
    outs = [engine.generate([p], params)[0] for p in prompts]  # one after the other: radix sharing
    assert outs[1].cached_tokens >= 16
    for p, out in zip(prompts, outs):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                          use_cache=True)[0, len(p):].tolist()
        assert out.token_ids == ref
    assert len(seen) == 2 * NEW
    fulls = [p + o.token_ids for p, o in zip(prompts, outs)]
    refs = [hf_logits(hf, f) for f in fulls]  # causal: position i's logits see tokens <= i only
    for tokens, row in seen:
        i = next(i for i, f in enumerate(fulls) if f[:len(tokens)] == tokens)
        torch.testing.assert_close(row, refs[i][len(tokens) - 1], atol=1e-4, rtol=0)


def test_saved_by_astrai_loads_in_transformers_as_the_same_family(family, tmp_path):
    name, hf, path = family
    ours = load_model(path)
    save_model(ours, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["architectures"] == [type(hf).__name__] and written["model_type"] == name
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(back) is type(hf) and type(back.config) is type(hf.config)
    if hasattr(hf.config, "layer_types"):
        assert back.config.layer_types == hf.config.layer_types
    assert getattr(back.config, "sliding_window", None) == getattr(hf.config, "sliding_window", None)
    ids = _doc(11, 30)
    torch.testing.assert_close(hf_logits(back, ids), hf_logits(hf, ids), atol=1e-5, rtol=0)
    assert load_model(tmp_path).config == ours.config  # and back again, unchanged


def test_fresh_model_of_each_family_round_trips(family, tmp_path):
    name, hf, path = family
    config = load_model(path).config
    torch.manual_seed(5)
    fresh = CausalLM(config).eval()
    save_model(fresh, tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.tensor(_doc(12, 20))
    with torch.no_grad():
        got = fresh.logits(fresh(ids, torch.arange(20), CausalContext()))
    torch.testing.assert_close(got, hf_logits(back, ids.tolist()), atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory, tiny_tokenizer):
    from pathlib import Path

    from astrai.config import load_pipeline
    from astrai.data.preprocess import run_preprocess

    tmp = tmp_path_factory.mktemp("family-sft")
    chats = [{"messages": [{"role": "user", "content": f"how are you today number {i}"},
                           {"role": "assistant", "content": "fine thanks " * (3 + i % 5)}]} for i in range(12)]
    (tmp / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    pipeline = load_pipeline(Path(__file__).resolve().parents[2] / "pipelines" / "chatml_sft.yaml")
    run_preprocess(pipeline, [str(tmp / "chats.jsonl")], str(tmp / "data"), tokenizer=str(tiny_tokenizer), workers=1,
                   log=lambda s: None)
    return tmp / "data"


@pytest.mark.parametrize("name", ["gemma3_text", "qwen3_moe"])
def test_sft_from_a_family_checkpoint_stays_that_family(name, sft_data, tmp_path):
    """Fine-tuning a transformers checkpoint: windows, Gemma's scale and soft-capped loss, MoE routing train;
    the result is still the same architecture and loads in transformers with equal logits."""
    from astrai.config.train import TrainOptions
    from astrai.train.run import run_train

    hf = hf_model(name, vocab_size=512)
    hf.save_pretrained(tmp_path / "base")
    res = run_train(TrainOptions(data=str(sft_data), output=str(tmp_path / "run"), model=str(tmp_path / "base"),
                                 batch_size=1, max_steps=6, epochs=20, lr=3e-3, progress=False, strategy="sft"))
    assert res["steps"] == 6 and res["stopped"] is None
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in metrics if "loss" in m]
    assert losses[-1] < losses[0]
    final = tmp_path / "run" / "final"
    assert json.loads((final / "config.json").read_text())["architectures"] == [type(hf).__name__]
    back = transformers.AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).eval()
    ours = load_model(final).eval()
    ids = _doc(13, 24, vocab=512)
    with torch.no_grad():
        got = ours.logits(ours(torch.tensor(ids), torch.arange(24), CausalContext()))
    torch.testing.assert_close(got, hf_logits(back, ids), atol=1e-4, rtol=0)
    assert not torch.allclose(hf_logits(back, ids), hf_logits(hf, ids), atol=1e-3)  # it did train


@pytest.mark.parametrize("name", list(CASES))
def test_astrai_generate_cli_token_ids_equal_transformers(name, tiny_tokenizer, tmp_path):
    """The user's path: a transformers-written checkpoint with a tokenizer, `astrai generate --prompt
    --temperature 0 --output FILE`: the token ids written equal transformers' greedy `generate`."""
    import shutil

    from tokenizers import Tokenizer

    from astrai.cli import main

    hf = hf_model(name, seed=30, vocab_size=400)
    hf.save_pretrained(tmp_path / "ckpt")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_tokenizer / f, tmp_path / "ckpt" / f)
    prompt = "the quick brown fox jumps over the lazy dog, then how are you today number one two three"
    ids = Tokenizer.from_file(str(tiny_tokenizer / "tokenizer.json")).encode(prompt).ids
    assert len(ids) > 2 * WINDOW
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                      use_cache=True)[0, len(ids):].tolist()
    out = tmp_path / "out.jsonl"
    assert main(["generate", str(tmp_path / "ckpt"), "--prompt", prompt, "--temperature", "0", "--max-tokens",
                 str(NEW), "--ignore-eos", "--output", str(out), "--device", "cpu", "--dtype", "float32", "--page-size", "4"]) == 0
    (rec,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert rec["prompt_tokens"] == len(ids) and rec["token_ids"] == ref
