"""Every bad input a user can hand the CLI, through `astrai.cli.main` as the command line runs it: exit
status 1, exactly one `error:` line on stderr naming the thing (file:line, key or value), and no
Python traceback anywhere. A few cases also run as a real process (`python -m astrai.cli`), and the
template bombs run there with their time and peak memory measured.

Each case is (id, argv built from the fixture's paths, words the error line must hold)."""

import errno
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from astrai.cli import main
from astrai.text.template import TEMPLATE_DIR

ROOT = Path(__file__).resolve().parents[1]
CHATML = (TEMPLATE_DIR / "chatml.jinja").read_text()


def _checkpoint(base: Path, name: str, tokenizer_config=None, files=None) -> Path:
    d = base / name
    shutil.copytree(base / "ckpt", d)
    if tokenizer_config is not None:
        (d / "tokenizer_config.json").write_text(tokenizer_config if isinstance(tokenizer_config, str)
                                                 else json.dumps(tokenizer_config))
    for fname, text in (files or {}).items():
        (d / fname).write_text(text)
    return d


@pytest.fixture(scope="module")
def env(tmp_path_factory, tiny_tokenizer):
    torch = pytest.importorskip("torch")
    from astrai.config import load_pipeline
    from astrai.data.preprocess import run_preprocess
    from astrai.model import CausalLM, ModelConfig, save_model

    t = tmp_path_factory.mktemp("bad")
    torch.manual_seed(0)
    ckpt = t / "ckpt"
    save_model(CausalLM(ModelConfig.preset("tiny", eos_token_id=None)), ckpt)
    shutil.copy(tiny_tokenizer / "tokenizer.json", ckpt / "tokenizer.json")
    tc = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHATML}
    (ckpt / "tokenizer_config.json").write_text(json.dumps(tc))
    p = {"ckpt": ckpt, "tmp": t}
    p["list_config"] = _checkpoint(t, "list_config", "[1, 2]")
    p["bad_template_key"] = _checkpoint(t, "bad_template_key", {**tc, "chat_template": 7})
    p["bad_decoder"] = _checkpoint(t, "bad_decoder", {**tc, "added_tokens_decoder": ["<x>"]})
    p["raising_template"] = _checkpoint(t, "raising_template", {**tc, "chat_template":
                                        "{{ raise_exception('roles must alternate') }}"})
    p["failing_template"] = _checkpoint(t, "failing_template", {**tc, "chat_template":
                                        "{{ messages[0].content.foo.bar() }}"})
    p["unsafe_template"] = _checkpoint(t, "unsafe_template", {**tc, "chat_template":
                                       "{{ messages.__class__.__mro__[1].__subclasses__() }}"})
    p["syntax_template"] = _checkpoint(t, "syntax_template", {**tc, "chat_template": "{% for m in messages %}"})
    p["gen_config"] = _checkpoint(t, "gen_config", files={"generation_config.json": '{"temperature": "hot"}'})
    p["gen_config_json"] = _checkpoint(t, "gen_config_json", files={"generation_config.json": '{"eos_token_id": '})

    def lines(name, *records, raw=None):
        f = t / name
        f.write_text(raw if raw is not None else "".join(json.dumps(r) + "\n" for r in records))
        return f

    p["no_role"] = lines("no_role.jsonl", [{"content": "hi"}])
    p["no_content"] = lines("no_content.jsonl", {"messages": [{"role": "user"}]})
    p["int_content"] = lines("int_content.jsonl", [{"role": "user", "content": 5}])
    p["ok_chat"] = lines("ok_chat.jsonl", [{"role": "user", "content": "hello"}])
    p["number"] = lines("number.jsonl", {"prompt": "hello"}, {"prompt": 5})
    p["null"] = lines("null.jsonl", {"prompt": None})
    p["dict_prompt"] = lines("dict_prompt.jsonl", {"prompt": {"text": "hi"}})
    p["mixed_ids"] = lines("mixed_ids.jsonl", {"prompt": [1, "two", 3]})
    p["negative_id"] = lines("negative_id.jsonl", {"prompt": [1, -2]})
    p["oov"] = lines("oov.jsonl", {"prompt": [1, 2]}, {"prompt": [5, 99999999]})
    p["typo"] = lines("typo.jsonl", {"prompt": "hi", "sampling": {"temprature": 0.5}})
    p["bad_value"] = lines("bad_value.jsonl", {"prompt": "hi", "sampling": {"top_p": 7}})
    p["beside"] = lines("beside.jsonl", {"prompt": "hi", "id": 7}, {"prompt": "hi", "max_tokens": 5})
    p["beside_typo"] = lines("beside_typo.jsonl", {"prompt": "hi", "temprature": 0})
    p["record_typo"] = lines("record_typo.jsonl", {"prompt": "hi", "samplng": {"top_p": 0.5}})
    p["inf_temp"] = lines("inf_temp.jsonl", raw='{"prompt": "hi", "sampling": {"temperature": 1e400}}\n')
    p["stop_oov"] = lines("stop_oov.jsonl", {"prompt": "hi", "sampling": {"stop_token_ids": [2, 10**9]}})
    p["not_object"] = lines("not_object.jsonl", {"prompt": "hi", "sampling": [1]})
    p["bad_json"] = lines("bad_json.jsonl", raw='{"prompt": "hi"}\n{oops\n')
    p["string_line"] = lines("string_line.jsonl", "hello")
    p["no_messages"] = lines("no_messages.jsonl", {"prompt": "hi"})
    p["empty"] = lines("empty.jsonl", raw="\n\n")
    p["a_dir"] = t / "a_dir"
    p["a_dir"].mkdir()
    p["fifo"] = t / "fifo.jsonl"
    os.mkfifo(p["fifo"])
    p["a_file"] = lines("a_file.txt", raw="x\n")

    # preprocessed data: a good one, and manifests damaged every way loading reads them
    src = lines("chats.jsonl", *[{"messages": [{"role": "user", "content": f"hello {i}"},
                                               {"role": "assistant", "content": "fine thanks"}]} for i in range(8)])
    good = t / "data"
    run_preprocess(load_pipeline(ROOT / "pipelines" / "chatml_sft.yaml"), [str(src)], str(good),
                   tokenizer=str(tiny_tokenizer), workers=1, log=lambda s: None)
    p["data"] = good
    p["chats"] = src
    for name, change in {"outside": lambda m: m.update(shards=["../../../etc/passwd"]),
                         "absolute": lambda m: m.update(shards=["/etc/hostname"]),
                         "shards_not_list": lambda m: m.update(shards="data/x.parquet"),
                         "missing_shard": lambda m: m.update(shards=["data/none.parquet"]),
                         "bad_mode": lambda m: m["pipeline"]["output"].update(position_ids_mode="zigzag"),
                         "no_tokenizer": lambda m: m.pop("tokenizer")}.items():
        d = t / f"data_{name}"
        shutil.copytree(good, d)
        man = json.loads((d / "manifest.json").read_text())
        change(man)
        if isinstance(man.get("shards"), list) and set(man["shards"]) != set(man["shard_checks"]):  # checks kept in step, so the shard itself is what is refused
            record = next(iter(man["shard_checks"].values()))
            man["shard_checks"] = {s: record for s in man["shards"]}
        (d / "manifest.json").write_text(json.dumps(man))
        p[f"data_{name}"] = d
    p["data_list"] = t / "data_list"
    shutil.copytree(good, p["data_list"])
    (p["data_list"] / "manifest.json").write_text("[1]")
    p["data_badjson"] = t / "data_badjson"
    shutil.copytree(good, p["data_badjson"])
    (p["data_badjson"] / "manifest.json").write_text('{"shards": [')
    p["data_cut_shard"] = t / "data_cut_shard"
    shutil.copytree(good, p["data_cut_shard"], ignore=shutil.ignore_patterns("cache"))
    shard = next((p["data_cut_shard"] / "data").glob("*.parquet"))
    shard.write_bytes(shard.read_bytes()[:50])

    def train_yaml(name, **kw):
        f = t / f"train_{name}.yaml"
        f.write_text(json.dumps({"data": str(good), "output": str(t / f"out_{name}"), "model": "tiny",
                                 "max_steps": 1, "batch_size": 1, "progress": False, **kw}))
        return f

    p["train_plain_dir"] = train_yaml("plain_dir", data=str(p["a_dir"]))
    p["train_outside"] = train_yaml("outside", data=str(p["data_outside"]))
    p["train_output_file"] = train_yaml("output_file", output=str(p["a_file"]))
    p["train_cuda"] = train_yaml("cuda", device="cuda")
    p["pipeline"] = ROOT / "pipelines" / "chatml_sft.yaml"
    p["big_template"] = lines("big.jinja", raw="{{ 'a' * 3000000000 }}")
    p["cut_weights"] = _checkpoint(t, "cut_weights")
    (p["cut_weights"] / "model.safetensors").write_bytes((ckpt / "model.safetensors").read_bytes()[:20])
    return p




def gen(*extra, ckpt="{ckpt}"):
    return ["generate", ckpt, "--device", "cpu", "--kv-cache-tokens", "256", "--max-tokens", "2", *extra]


CASES = [
    # tokenizer files of a checkpoint
    ("tokenizer_config_is_a_list", gen("--prompt", "hi", ckpt="{list_config}"),
     ["tokenizer_config.json", "expected a JSON object", "list"]),
    ("tokenizer_config_template_is_a_number", gen("--prompt", "hi", ckpt="{bad_template_key}"),
     ["tokenizer_config.json", "chat_template"]),
    ("tokenizer_config_decoder_is_a_list", gen("--prompt", "hi", ckpt="{bad_decoder}"),
     ["tokenizer_config.json", "added_tokens_decoder"]),
    ("generation_config_bad_value", gen("--prompt", "hi", ckpt="{gen_config}"),
     ["generation_config.json", "temperature"]),
    ("generation_config_bad_json", gen("--prompt", "hi", ckpt="{gen_config_json}"),
     ["generation_config.json", "invalid JSON"]),
    # chat templates: refusals, runtime errors, sandbox refusals, syntax
    ("template_raises", gen("--chat", "{ok_chat}", ckpt="{raising_template}"),
     ["ok_chat.jsonl:1", "refuses this conversation", "roles must alternate"]),
    ("template_runtime_error", gen("--chat", "{ok_chat}", ckpt="{failing_template}"),
     ["ok_chat.jsonl:1", "failed on this conversation", "foo"]),
    ("template_sandbox_refusal", gen("--chat", "{ok_chat}", ckpt="{unsafe_template}"),
     ["ok_chat.jsonl:1", "unsafe"]),
    ("template_syntax_error", gen("--chat", "{ok_chat}", ckpt="{syntax_template}"),
     ["chat template", "syntax_template"]),
    ("chat_template_is_a_directory", gen("--chat", "{ok_chat}", "--chat-template", "{a_dir}"),
     ["chat_template", "a_dir", "is a directory"]),
    ("chat_template_missing_with_a_prompt", gen("--prompt", "hi", "--chat-template", "{tmp}/none.jinja"),
     ["chat_template", "none.jinja", "no such file"]),
    ("chat_template_is_a_directory_with_a_prompt", gen("--prompt", "hi", "--chat-template", "{a_dir}"),
     ["chat_template", "a_dir", "is a directory"]),
    ("chat_template_is_a_fifo", gen("--chat", "{ok_chat}", "--chat-template", "{fifo}"),
     ["chat_template", "FIFO"]),
    # prompt records
    ("message_without_role", gen("--chat", "{no_role}"), ["no_role.jsonl:1", "messages[0]", "no role"]),
    ("message_without_content", gen("--chat", "{no_content}"), ["no_content.jsonl:1", "messages[0]", "no content"]),
    ("message_content_a_number", gen("--chat", "{int_content}"), ["int_content.jsonl:1", "content", "int"]),
    ("prompt_a_number", gen("--input", "{number}"), ["number.jsonl:2", "prompt", "not int"]),
    ("prompt_null", gen("--input", "{null}"), ["null.jsonl:1", "not null"]),
    ("prompt_an_object", gen("--input", "{dict_prompt}"), ["dict_prompt.jsonl:1", "not dict"]),
    ("prompt_ids_mixed", gen("--input", "{mixed_ids}"), ["mixed_ids.jsonl:1", "item 1", "'two'"]),
    ("prompt_ids_negative", gen("--input", "{negative_id}"), ["negative_id.jsonl:1", "-2"]),
    ("prompt_ids_out_of_vocabulary", gen("--input", "{oov}"), ["oov.jsonl:2", "99999999", "vocabulary"]),
    ("sampling_key_typo", gen("--input", "{typo}"), ["typo.jsonl:1", "temprature", "did you mean 'temperature'"]),
    ("sampling_bad_value", gen("--input", "{bad_value}"), ["bad_value.jsonl:1", "sampling.top_p"]),
    ("sampling_key_beside_the_prompt", gen("--input", "{beside}"),
     ["beside.jsonl:2", "'max_tokens'", "under \"sampling\""]),
    ("sampling_key_typo_beside_the_prompt", gen("--input", "{beside_typo}"),
     ["beside_typo.jsonl:1", "'temprature'", "\"temperature\""]),
    ("record_key_typo", gen("--input", "{record_typo}"), ["record_typo.jsonl:1", "'samplng'", "did you mean 'sampling'"]),
    ("sampling_temperature_infinite", gen("--input", "{inf_temp}"), ["inf_temp.jsonl:1", "sampling.temperature"]),
    ("stop_token_id_negative", gen("--prompt", "hi", "--stop-token-id", "-4"), ["stop_token_ids"]),
    ("stop_token_id_out_of_vocabulary", gen("--input", "{stop_oov}"),
     ["stop_oov.jsonl:1", "stop token id 1000000000", "vocabulary"]),
    ("temperature_flag_infinite", gen("--prompt", "hi", "--temperature", "inf"), ["temperature"]),
    ("sampling_not_an_object", gen("--input", "{not_object}"), ["not_object.jsonl:1", "sampling must be an object"]),
    ("line_not_json", gen("--input", "{bad_json}"), ["bad_json.jsonl:2", "invalid JSON"]),
    ("line_a_string", gen("--input", "{string_line}"), ["string_line.jsonl:1", "got str"]),
    ("chat_line_without_messages", gen("--chat", "{no_messages}"), ["no_messages.jsonl:1", "messages", "'prompt'"]),
    ("no_records", gen("--input", "{empty}"), ["empty.jsonl", "no records"]),
    # flags
    ("logprobs_beyond_vocabulary", gen("--prompt", "hi", "--logprobs", "100000"), ["logprobs 100000"]),
    ("device_unknown", gen("--prompt", "hi", "--device", "foo"), ["device 'foo'"]),
    ("kv_cache_tokens_huge", gen("--prompt", "hi", "--kv-cache-tokens", "100000000000000"),
     ["--kv-cache-tokens", "free"]),
    ("page_size_huge", gen("--prompt", "hi", "--page-size", "100000000000"), ["--page-size", "free"]),
    ("max_running_huge", gen("--prompt", "hi", "--max-running", "2000000000", "--max-step-tokens", "2000000000"),
     ["--max-running", "free"]),
    ("two_sources", gen("--prompt", "hi", "--chat", "{ok_chat}"), ["exactly one of --prompt, --chat, --input"]),
    # paths
    ("input_is_a_directory", gen("--input", "{a_dir}"), ["a_dir", "is a directory"]),
    ("chat_is_a_fifo", gen("--chat", "{fifo}"), ["fifo.jsonl", "FIFO"]),
    ("input_is_a_device", gen("--input", "/dev/zero"), ["/dev/zero", "character device"]),
    ("input_missing", gen("--input", "{tmp}/nope.jsonl"), ["nope.jsonl", "no such file"]),
    ("output_is_a_directory", gen("--prompt", "hi", "--output", "{a_dir}"), ["--output", "a_dir", "is a directory"]),
    ("output_is_a_device", gen("--prompt", "hi", "--output", "/dev/full"), ["--output", "/dev/full", "not a regular"]),
    ("output_directory_missing", gen("--prompt", "hi", "--output", "{tmp}/no/such/out.jsonl"),
     ["--output", "does not exist"]),
    ("output_under_a_file", gen("--prompt", "hi", "--output", "{a_file}/out.jsonl"), ["--output", "not a directory"]),
    ("checkpoint_missing", gen("--prompt", "hi", ckpt="{tmp}/no_ckpt"), ["no_ckpt"]),
    ("checkpoint_weights_cut", gen("--prompt", "hi", ckpt="{cut_weights}"), ["safetensors"]),
    # data directories for eval and train
    ("eval_data_not_preprocessed", ["eval", "{ckpt}", "--data", "{a_dir}", "--device", "cpu"],
     ["a_dir", "no manifest.json"]),
    ("eval_data_checked_before_the_model", ["eval", "{tmp}/no_ckpt", "--data", "{a_dir}", "--device", "cpu"],
     ["a_dir", "no manifest.json"]),
    ("eval_output_is_a_directory", ["eval", "{tmp}/no_ckpt", "--data", "{data}", "--output", "{a_dir}"],
     ["eval output", "a_dir", "is a directory"]),
    ("eval_data_is_a_file", ["eval", "{ckpt}", "--data", "{a_file}", "--device", "cpu"], ["a_file.txt", "not a directory"]),
    ("manifest_shard_outside", ["eval", "{ckpt}", "--data", "{data_outside}", "--device", "cpu"],
     ["manifest.json", "../../../etc/passwd", "not a .parquet file in"]),
    ("manifest_shard_absolute", ["eval", "{ckpt}", "--data", "{data_absolute}", "--device", "cpu"],
     ["manifest.json", "/etc/hostname", "not a .parquet file in"]),
    ("manifest_shards_not_a_list", ["eval", "{ckpt}", "--data", "{data_shards_not_list}", "--device", "cpu"],
     ["manifest.json", "shards"]),
    ("manifest_shard_missing", ["eval", "{ckpt}", "--data", "{data_missing_shard}", "--device", "cpu"],
     ["none.parquet", "No such file", "incomplete"]),
    ("manifest_position_mode", ["eval", "{ckpt}", "--data", "{data_bad_mode}", "--device", "cpu"],
     ["manifest.json", "position_ids_mode", "zigzag"]),
    ("manifest_without_tokenizer", ["eval", "{ckpt}", "--data", "{data_no_tokenizer}", "--device", "cpu"],
     ["manifest.json", "tokenizer.path"]),
    ("manifest_a_list", ["eval", "{ckpt}", "--data", "{data_list}", "--device", "cpu"], ["manifest.json", "shards"]),
    ("manifest_not_json", ["eval", "{ckpt}", "--data", "{data_badjson}", "--device", "cpu"],
     ["manifest.json", "invalid JSON"]),
    ("shard_truncated", ["eval", "{ckpt}", "--data", "{data_cut_shard}", "--device", "cpu"],
     ["packed-00000.parquet", "the manifest records"]),
    ("train_data_not_preprocessed", ["train", "{train_plain_dir}"], ["a_dir", "no manifest.json"]),
    ("train_manifest_shard_outside", ["train", "{train_outside}"], ["manifest.json", "etc/passwd", "not a .parquet"]),
    ("train_output_is_a_file", ["train", "{train_output_file}"], ["a_file.txt", "is a file"]),
    # preprocess
    ("preprocess_template_is_a_directory", ["preprocess", "{pipeline}", "-i", "{chats}", "-o",
                                            "{tmp}/pre1", "--set", "chat_template={a_dir}", "--workers", "1"],
     ["chat_template", "a_dir", "is a directory"]),
    ("preprocess_template_bomb", ["preprocess", "{pipeline}", "-i", "{chats}", "-o", "{tmp}/pre4", "--set",
                                  "chat_template={big_template}", "--workers", "1"], ["big.jinja", "at most"]),
    ("preprocess_input_is_a_fifo", ["preprocess", "{pipeline}", "-i", "{fifo}", "-o", "{tmp}/pre2", "--workers", "1"],
     ["fifo.jsonl", "FIFO"]),
    ("preprocess_output_is_a_file", ["preprocess", "{pipeline}", "-i", "{chats}", "-o", "{a_file}"],
     ["a_file.txt", "is a file"]),
    ("preprocess_pipeline_is_a_fifo", ["preprocess", "{fifo}", "-i", "{chats}", "-o", "{tmp}/pre3"],
     ["fifo.jsonl", "FIFO"]),
]


def fill(argv, env):
    return [a.format(**{k: str(v) for k, v in env.items()}) for a in argv]


def one_error_line(rc, captured) -> str:
    text = captured.out + captured.err
    assert "Traceback" not in text, text[-3000:]
    errors = [line for line in captured.err.splitlines() if line.startswith(("error", "internal error"))]
    assert rc == 1 and len(errors) == 1, (rc, captured.err[-3000:])
    assert errors[0].startswith("error: "), errors[0]  # a user's problem, never "internal error"
    return errors[0]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_1(case, env, capsys, tiny_tokenizer):
    _, argv, words = case
    if "--tokenizer" not in argv and argv[0] == "preprocess":
        argv = argv + ["--tokenizer", str(tiny_tokenizer)]
    line = one_error_line(main(fill(argv, env)), capsys.readouterr())
    for w in words:
        assert w.format(**{k: str(v) for k, v in env.items()}) in line, (w, line)


def test_device_cuda_without_a_gpu(env, capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    line = one_error_line(main(fill(gen("--prompt", "hi", "--device", "cuda"), env)), capsys.readouterr())
    assert "--device cuda" in line and "--device cpu" in line
    line = one_error_line(main(["train", str(env["train_cuda"])]), capsys.readouterr())
    assert "device: cuda" in line and "device: cpu" in line


def test_a_disk_full_while_writing_shards_names_it(env, capsys, monkeypatch, tiny_tokenizer):
    """The Parquet writer fails as it does on a full disk (pyarrow raises OSError errno 28)."""
    import pyarrow.parquet as pq

    def full(self, *a, **kw):
        raise OSError(errno.ENOSPC, "Error writing bytes to file. Detail: [errno 28] No space left on device")

    monkeypatch.setattr(pq.ParquetWriter, "write_table", full)
    out = env["tmp"] / "pre_full"
    rc = main(fill(["preprocess", "{pipeline}", "-i", "{chats}", "-o", str(out), "--workers", "1",
                    "--tokenizer", str(tiny_tokenizer)], env))
    line = one_error_line(rc, capsys.readouterr())
    assert "No space left on device" in line and str(out) in line


def test_a_disk_full_while_writing_a_checkpoint_names_it(env, capsys, monkeypatch):
    """safetensors reports a full disk in its own words (an I/O error with os error 28)."""
    import safetensors.torch

    def full(*a, **kw):
        raise RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "serialize_file", full)  # what save_file writes with
    cfg = env["tmp"] / "train_full.yaml"
    out = env["tmp"] / "out_full"
    cfg.write_text(json.dumps({"data": str(env["data"]), "output": str(out), "model": "tiny", "max_steps": 1,
                               "batch_size": 1, "progress": False}))
    line = one_error_line(main(["train", str(cfg)]), capsys.readouterr())
    assert "No space left on device" in line and str(out) in line


def test_an_unwritable_run_dir_is_one_line(tmp_path, capsys, monkeypatch):
    recipe = tmp_path / "r.yaml"
    text = (ROOT / "recipes" / "sft.yaml").read_text().replace("../", str(ROOT) + "/")
    recipe.write_text(text.replace("run_dir: " + str(ROOT) + "/runs/sft", f"run_dir: {tmp_path / 'locked'}"))
    real_mkdir = Path.mkdir

    def refuse(self, *a, **kw):
        if "locked" in str(self):
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_mkdir(self, *a, **kw)

    monkeypatch.setattr(Path, "mkdir", refuse)
    line = one_error_line(main(["run", str(recipe)]), capsys.readouterr())
    assert "locked" in line and "Permission denied" in line


_MEASURE = ("import resource, subprocess, sys; r = subprocess.run([sys.executable, '-m', 'astrai.cli'] + sys.argv[1:], "
            "stdout=subprocess.DEVNULL, stderr=subprocess.PIPE); sys.stderr.buffer.write(r.stderr); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(r.returncode)")


def _run_cli(args, env_vars=None, timeout=600):
    """(exit status, stderr, seconds, peak RSS in MiB) of `python -m astrai.cli ARGS` as its own process
    (measured by a parent of its own, whose only child it is)."""
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", _MEASURE, *args], capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, **(env_vars or {})}, cwd=ROOT)
    return r.returncode, r.stderr, time.monotonic() - t0, int(r.stdout.strip() or 0) / 1024


@pytest.mark.parametrize("case", ["prompt_a_number", "template_sandbox_refusal", "manifest_shard_outside",
                                  "input_is_a_device"])
def test_as_a_real_process(case, env):
    _, argv, words = next(c for c in CASES if c[0] == case)
    rc, err, _, _ = _run_cli(fill(argv, env))
    assert rc == 1 and "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and all(w in errors[0] for w in words), err[-2000:]


def test_template_bombs_are_bounded_in_time_and_memory(env):
    """A checkpoint's chat template that would take 6 GB, or never finish: refused within the template
    time limit and far below the memory it asks for, and never rendered at all for --prompt."""
    tc = json.loads((env["ckpt"] / "tokenizer_config.json").read_text())
    big = _checkpoint(env["tmp"], "bomb_big", {**tc, "chat_template": "{{ 'a' * 3000000000 }}"})
    slow = _checkpoint(env["tmp"], "bomb_slow", {**tc, "chat_template": "{% for i in range(100000) %}{% for j in "
                                                 "range(100000) %}{{ i }}{% endfor %}{% endfor %}"})
    quick = {"ASTRAI_TEMPLATE_TIMEOUT_S": "2"}
    rc, err, seconds, peak = _run_cli(fill(gen("--chat", "{ok_chat}", ckpt=str(big)), env), quick)
    assert rc == 1 and "Traceback" not in err and "at most 16,777,216" in err and peak < 1500, (err[-1000:], peak)
    rc, err, seconds, peak = _run_cli(fill(gen("--chat", "{ok_chat}", ckpt=str(slow)), env), quick)
    assert rc == 1 and "rendering took more than 2 s" in err and peak < 1500, (err[-1000:], peak)
    rc, err, _, _ = _run_cli(fill(gen("--prompt", "hi", ckpt=str(slow)), env), quick)
    assert rc == 0, err[-1000:]  # text is continued without the template
