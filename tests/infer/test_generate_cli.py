"""`astrai generate`: streaming one prompt, JSONL in/out for batches, text on a terminal, stdin, the
checkpoint's generation_config.json under the flags, outputs checked before work and written as
requests finish, options and input errors."""

import io
import json
import shutil

import pytest

from astrai.cli import main
from astrai.infer.engine import Engine, EngineOptions
from astrai.infer.generate import GenerateOptions, generate_main
from astrai.infer.request import SamplingParams


def reference(checkpoint, prompts, params):
    engine = Engine.from_checkpoint(checkpoint, EngineOptions(device="cpu", dtype="float32"))
    return engine.generate(prompts, params)


def test_prompt_streams_the_continuation(checkpoint, capsys):
    rc = main(["generate", str(checkpoint), "--prompt", "hello world", "--max-tokens", "7", "--temperature", "0",
               "--ignore-eos", "--device", "cpu", "--dtype", "float32"])
    out, err = capsys.readouterr()
    assert rc == 0
    ref = reference(checkpoint, "hello world", SamplingParams(max_tokens=7, temperature=0, ignore_eos=True))[0]
    assert out == ref.text + "\n"
    assert "[generate] 1 request(s), 7 tokens" in err
    assert "[generate] finished after 7 token(s): max_tokens reached" in err


def test_prompt_says_which_token_stopped_it(checkpoint, capsys):
    """An answer cut short by a stop token names the token, so an empty answer is not a mystery."""
    ref = reference(checkpoint, "hello world", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    stop = ref.token_ids[1]
    rc = main(["generate", str(checkpoint), "--prompt", "hello world", "--max-tokens", "3", "--temperature", "0",
               "--ignore-eos", "--stop-token-ids", str(stop), "--device", "cpu", "--dtype", "float32"])
    err = capsys.readouterr().err
    assert rc == 0 and f"finished after 2 token(s): stop token {stop} (" in err


def test_chat_and_input_jsonl(checkpoint, tmp_path, capsys):
    chats = tmp_path / "chats.jsonl"
    convs = [[{"role": "user", "content": "how are you"}],
             {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]}]
    chats.write_text("".join(json.dumps(c) + "\n" for c in convs))
    out_file = tmp_path / "out.jsonl"
    rc = main(["generate", str(checkpoint), "--chat", str(chats), "--output", str(out_file), "--max-tokens", "6",
               "--seed", "3", "--ignore-eos", "--set", "engine.page_size=4", "--device", "cpu", "--dtype", "float32"])
    assert rc == 0
    recs = [json.loads(line) for line in out_file.read_text().splitlines()]
    params = SamplingParams(max_tokens=6, seed=3, ignore_eos=True)
    ref = reference(checkpoint, [convs[0], convs[1]["messages"]], params)
    assert [r["token_ids"] for r in recs] == [c.token_ids for c in ref]
    assert [r["index"] for r in recs] == [0, 1] and recs[1]["messages"][0]["role"] == "system"

    batch = tmp_path / "batch.jsonl"
    batch.write_text(json.dumps({"prompt": "hello", "sampling": {"max_tokens": 2}}) + "\n"
                     + json.dumps({"messages": convs[0]}) + "\n")
    rc = main(["generate", str(checkpoint), "--input", str(batch), "--max-tokens", "5", "--temperature", "0",
               "--ignore-eos", "--device", "cpu", "--dtype", "float32"])
    out, _ = capsys.readouterr()
    recs = [json.loads(line) for line in out.splitlines()]
    assert rc == 0 and [len(r["token_ids"]) for r in recs] == [2, 5] and recs[0]["prompt"] == "hello"


def test_errors_are_for_people(checkpoint, tmp_path, capsys):
    assert main(["generate", str(checkpoint), "--device", "cpu"]) == 1
    assert "give exactly one of --prompt, --chat, --input" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "x"}]}) + "\n{oops\n")
    assert main(["generate", str(checkpoint), "--chat", str(bad), "--device", "cpu"]) == 1
    assert f"{bad}:2: invalid JSON" in capsys.readouterr().err
    assert main(["generate", str(checkpoint), "--prompt", "x", "--top-p", "0", "--device", "cpu"]) == 1
    assert "sampling.top_p" in capsys.readouterr().err
    assert main(["generate", str(checkpoint), "--prompt", "x", "--set", "engine.pagesize=3"]) == 1
    assert "engine.pagesize" in capsys.readouterr().err
    assert main(["generate", str(checkpoint), "--prompt", "x", "--max-tokens", "5000", "--device", "cpu",
                 "--kv-cache-tokens", "64"]) == 1
    assert "lower max_tokens" in capsys.readouterr().err
    assert main(["generate", str(tmp_path / "no-such-model"), "--prompt", "x", "--device", "cpu"]) == 1
    assert f"{tmp_path / 'no-such-model'}: no such file or directory" in capsys.readouterr().err
    assert main(["generate", str(bad), "--prompt", "x", "--device", "cpu"]) == 1  # a file: not a directory
    assert f"{bad}: not a checkpoint directory" in capsys.readouterr().err


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_chat_on_a_terminal_prints_the_conversation_and_the_answer(checkpoint):
    """On a terminal --chat shows text (one conversation streamed), not JSON; --json asks for JSONL."""
    conv = [{"role": "user", "content": "how are you"}]
    ref = reference(checkpoint, [conv], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    opts = dict(checkpoint=str(checkpoint), chat="-", sampling={"max_tokens": 4, "temperature": 0, "ignore_eos": True},
                engine={"device": "cpu"})
    out = Terminal()
    assert generate_main(GenerateOptions(**opts), out=out, err=io.StringIO(),
                         stdin=io.StringIO(json.dumps(conv) + "\n")) == 0  # a bare list of messages, from stdin
    assert out.getvalue() == f"user: how are you\nassistant: {ref.text}\n"
    out = Terminal()
    generate_main(GenerateOptions(**opts, as_json=True), out=out, err=io.StringIO(),
                  stdin=io.StringIO(json.dumps({"messages": conv}) + "\n"))
    assert json.loads(out.getvalue())["token_ids"] == ref.token_ids

    two = Terminal()  # several: each printed whole as it finishes, with the line it came from
    generate_main(GenerateOptions(**opts), out=two, err=io.StringIO(),
                  stdin=io.StringIO(json.dumps(conv) + "\n" + json.dumps(conv) + "\n"))
    assert two.getvalue().count(f"user: how are you\nassistant: {ref.text}\n") == 2
    assert "--- <stdin>:1" in two.getvalue() and "--- <stdin>:2" in two.getvalue()


def test_generation_config_is_honoured_and_flags_win(checkpoint, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoint, ckpt)
    (ckpt / "generation_config.json").write_text(json.dumps({"do_sample": False, "top_k": 5, "eos_token_id": 7}))
    greedy = reference(checkpoint, "hello", SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    assert main(["generate", str(ckpt), "--prompt", "hello", "--max-tokens", "5", "--ignore-eos", "--json",
                 "--device", "cpu", "--dtype", "float32"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == greedy.token_ids  # do_sample: false = greedy
    sampled = reference(checkpoint, "hello", SamplingParams(max_tokens=5, temperature=1.5, top_k=5, seed=4,
                                                            ignore_eos=True))[0]
    assert main(["generate", str(ckpt), "--prompt", "hello", "--max-tokens", "5", "--ignore-eos", "--json",
                 "--temperature", "1.5", "--seed", "4", "--device", "cpu", "--dtype", "float32"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == sampled.token_ids  # the flag wins, top_k stays
    assert sampled.token_ids != greedy.token_ids


def test_help_says_which_sampling_wins(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "generation_config.json" in " ".join(capsys.readouterr().out.split())


def test_output_is_checked_before_the_model_loads_and_written_as_requests_finish(checkpoint, tmp_path, capsys,
                                                                                 monkeypatch):
    # a missing --output directory is found although the checkpoint does not even exist
    assert main(["generate", str(tmp_path / "no-model"), "--prompt", "x", "--output",
                 str(tmp_path / "no" / "dir" / "out.jsonl")]) == 1
    assert "does not exist" in capsys.readouterr().err

    # three requests; the batch is interrupted after the short one finished: its line is kept
    batch = tmp_path / "batch.jsonl"
    batch.write_text("".join(json.dumps({"prompt": p, "sampling": {"max_tokens": n}}) + "\n"
                             for p, n in (("hello", 40), ("world", 1), ("today", 40))))
    out_file = tmp_path / "out.jsonl"
    out_file.write_text("old results\n")
    real_step, steps = Engine.step, []

    def step(self):
        steps.append(1)
        if len(steps) == 4:
            raise KeyboardInterrupt
        return real_step(self)

    monkeypatch.setattr(Engine, "step", step)
    rc = main(["generate", str(checkpoint), "--input", str(batch), "--output", str(out_file), "--ignore-eos",
               "--device", "cpu", "--dtype", "float32"])
    err = capsys.readouterr().err
    recs = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert rc == 130 and [r["index"] for r in recs] == [1] and len(recs[0]["token_ids"]) == 1
    assert f"1 of 3 result(s) were written to {out_file}" in err and "rerun" not in err


def test_a_bare_list_of_messages_on_the_real_model(smollm2):
    """The line a new user writes first: a JSON list of messages, piped in, answered as text."""
    line = json.dumps([{"role": "user", "content": "What is the capital of France?"}]) + "\n"
    out = Terminal()
    opts = GenerateOptions(checkpoint=str(smollm2), chat="-", sampling={"max_tokens": 12, "temperature": 0},
                           engine={"device": "cpu", "kv_cache_tokens": 256})
    assert generate_main(opts, out=out, err=io.StringIO(), stdin=io.StringIO(line)) == 0
    text = out.getvalue()
    assert text.startswith("user: What is the capital of France?\nassistant: ") and "Paris" in text
