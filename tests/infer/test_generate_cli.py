"""`astrai generate`: streaming one prompt, JSONL in/out for batches, options and input errors."""

import json

import pytest

from astrai.cli import main
from astrai.infer.engine import Engine, EngineOptions
from astrai.infer.request import SamplingParams


def reference(checkpoint, prompts, params):
    engine = Engine.from_checkpoint(checkpoint, EngineOptions(device="cpu"))
    return engine.generate(prompts, params)


def test_prompt_streams_the_continuation(checkpoint, capsys):
    rc = main(["generate", str(checkpoint), "--prompt", "hello world", "--max-tokens", "7", "--temperature", "0",
               "--ignore-eos", "--device", "cpu"])
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
               "--ignore-eos", "--stop-token-ids", str(stop), "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 0 and f"finished after 2 token(s): stop token {stop} (" in err


def test_chat_and_input_jsonl(checkpoint, tmp_path, capsys):
    chats = tmp_path / "chats.jsonl"
    convs = [[{"role": "user", "content": "how are you"}],
             {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]}]
    chats.write_text("".join(json.dumps(c) + "\n" for c in convs))
    out_file = tmp_path / "out.jsonl"
    rc = main(["generate", str(checkpoint), "--chat", str(chats), "--output", str(out_file), "--max-tokens", "6",
               "--seed", "3", "--ignore-eos", "--set", "engine.page_size=4", "--device", "cpu"])
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
               "--ignore-eos", "--device", "cpu"])
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
