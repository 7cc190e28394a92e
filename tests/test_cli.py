"""The CLI: validate output and exit codes."""

import os
import subprocess
import sys
import textwrap

import pytest

from astrai.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_validate_ok_and_errors(tmp_path, capsys):
    good = tmp_path / "good.yaml"
    good.write_text("version: 1\ninput: {sections: [{field: text}]}\n")
    assert main(["validate", str(good)]) == 0
    assert "OK" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text(textwrap.dedent("""\
        version: 1
        chat_template: chatml
        input:
          sections:
            - {field: messages, action: $role}
        preprocessing: {max_seq_lenn: 1, batch_size: x, packing_strategy: best}
        """))
    assert main(["validate", str(bad)]) == 1
    out = capsys.readouterr().out
    assert f"{bad}:5:" in out and f"{bad}:6:" in out
    for needle in ("max_seq_lenn", "batch_size", "packing_strategy", "template: true", "4 problem(s)"):
        assert needle in out


def test_validate_recipe_checks_its_pipeline(tmp_path, capsys):
    (tmp_path / "p.yaml").write_text("version: 1\ninput: {sections: [{field: text, acton: train}]}\n")
    r = tmp_path / "r.yaml"
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    r.write_text("version: 1\nstages:\n  preprocess: {pipeline: p.yaml, inputs: [a.jsonl], tokenizer: .}\n")
    assert main(["validate", str(r)]) == 1
    assert "did you mean 'action'" in capsys.readouterr().out


def test_missing_pipeline_or_file_is_reported_not_a_traceback(tmp_path, capsys):
    r = tmp_path / "r.yaml"
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    r.write_text("version: 1\nstages:\n  preprocess: {pipeline: nope.yaml, inputs: [a.jsonl], tokenizer: .}\n")
    assert main(["validate", str(r)]) == 1
    assert "nope.yaml" in capsys.readouterr().out
    assert main(["run", str(r)]) == 1
    assert "nope.yaml" in capsys.readouterr().err
    assert main(["validate", str(tmp_path / "missing.yaml")]) == 1
    assert "missing.yaml" in capsys.readouterr().out


def test_train_verb_reports_a_bad_config(tmp_path, capsys):
    bad = tmp_path / "t.yaml"
    bad.write_text("data: d\noutput: o\nlrr: 1\n")
    assert main(["train", str(bad)]) == 1
    assert "did you mean 'lr'" in capsys.readouterr().err


def test_help_lists_options_with_defaults():
    out = subprocess.run([sys.executable, "-m", "astrai.cli", "preprocess", "--help"], capture_output=True, text=True,
                         cwd=ROOT).stdout
    assert "preprocessing.max_seq_len" in out and "[default: None]" in out
    assert "packing_strategy" in out and "--workers" in out


def test_data_imports_without_torch(tmp_path):
    """astrai.data and pipeline loading work where torch cannot be imported."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "hello world"}\n')
    code = textwrap.dedent("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ImportError("torch is blocked in this test")
        sys.meta_path.insert(0, Block())
        import astrai.data, astrai.config
        import astrai.data.read, astrai.data.process, astrai.data.mask, astrai.text.template
        import astrai.data.preprocess, astrai.data.write, astrai.text.tokenizer
        p = astrai.config.Pipeline.model_validate({"version": 1, "input": {"sections": [{"field": "text"}]}})
        assert "torch" not in sys.modules
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_a_stage_kind_plugs_in_with_one_registry_entry(tmp_path, monkeypatch, capsys):
    # A new kind is one module (its StageKind) plus one registry entry; `astrai run` validates its
    # block with the kind's options model and runs it in recipe order, knowing nothing else about it.
    import types

    from astrai.config import STAGES, Stage, StrictModel
    from astrai.recipe.kinds import StageKind

    class EchoOptions(StrictModel):
        message: str
        times: int = 1

    calls = []

    def run_echo(ctx):
        calls.append((ctx.name, ctx.options))
        (ctx.output / "echo.txt").write_text(ctx.options.message * ctx.options.times)
        return {"said": ctx.options.times}

    fake = types.ModuleType("fake_stage_module")
    fake.ECHO = StageKind("echo", EchoOptions, run_echo, produces="report", figures=("said",))
    monkeypatch.setitem(sys.modules, "fake_stage_module", fake)
    monkeypatch.setitem(STAGES, "echo", Stage("echo", "say something", recipe_kind="fake_stage_module:ECHO"))
    r = tmp_path / "r.yaml"
    r.write_text(f"version: 1\nrun_dir: {tmp_path / 'run'}\nstages:\n  hello: {{kind: echo, message: hi, times: 2}}\n")
    assert main(["run", str(r)]) == 0
    assert [(n, o.times) for n, o in calls] == [("hello", 2)]
    assert (tmp_path / "run" / "hello" / "output" / "echo.txt").read_text() == "hihi"
    assert "said 2" in capsys.readouterr().out

    r.write_text("version: 1\nstages:\n  hello: {kind: echo, mesage: hi}\n")
    calls.clear()
    assert main(["run", str(r)]) == 1 and calls == []  # checked by the kind's model before anything runs
    assert "did you mean 'message'" in capsys.readouterr().err
