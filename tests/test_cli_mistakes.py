"""Every known user mistake gives one line naming what to do, a non-zero exit, and no traceback."""

import json
import textwrap

import pytest

from astrai.cli import main


@pytest.fixture
def project(tmp_path, tiny_tokenizer):
    pipe = tmp_path / "pipe.yaml"
    pipe.write_text(textwrap.dedent(f"""\
        version: 1
        tokenizer: {tiny_tokenizer}
        chat_template: chatml
        input:
          sections:
            - {{field: messages, action: $role, template: true}}
        """))
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"hello {i}"},
                                                      {"role": "assistant", "content": "good fine"}]}) + "\n"
                            for i in range(6)))
    return tmp_path, pipe, data


def one_line_error(capsys, rc, expected_rc=1):
    err = capsys.readouterr().err
    assert rc == expected_rc, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_output_is_an_existing_file(project, capsys):
    tmp, pipe, data = project
    (tmp / "taken.txt").write_text("mine")
    rc = main(["preprocess", str(pipe), "-i", str(data), "-o", str(tmp / "taken.txt")])
    assert "is a file, not a directory" in one_line_error(capsys, rc)
    assert (tmp / "taken.txt").read_text() == "mine"


def test_output_is_a_foreign_directory(project, capsys):
    tmp, pipe, data = project
    (tmp / "mine").mkdir()
    (tmp / "mine" / "stats.json").write_text("{}")
    rc = main(["preprocess", str(pipe), "-i", str(data), "-o", str(tmp / "mine")])
    assert "choose another -o" in one_line_error(capsys, rc)


@pytest.mark.parametrize("n", ["0", "-3"])
def test_workers_not_positive(project, capsys, n):
    tmp, pipe, data = project
    rc = main(["preprocess", str(pipe), "-i", str(data), "-o", str(tmp / "o"), "--workers", n])
    assert "--workers" in one_line_error(capsys, rc, 2)
    assert not (tmp / "o").exists()


def test_inspect_a_shard(project, capsys):
    tmp, pipe, data = project
    assert main(["preprocess", str(pipe), "-i", str(data), "-o", str(tmp / "o"), "--workers", "1"]) == 0
    capsys.readouterr()
    shard = sorted((tmp / "o" / "data").glob("*.parquet"))[0]
    assert main(["inspect", str(shard), "-n", "1", "--color", "never"]) == 0  # its output is shown
    assert "hello 0" in capsys.readouterr().out
    lone = tmp / "lone.parquet"
    lone.write_bytes(shard.read_bytes())
    rc = main(["inspect", str(lone)])
    assert "give the preprocessed output directory" in one_line_error(capsys, rc)
    rc = main(["inspect", str(data)])  # a data file where a YAML is expected
    assert "not a YAML file" in one_line_error(capsys, rc)


def test_ctrl_c(project, capsys, monkeypatch):
    import astrai.data.preprocess as pre

    tmp, pipe, data = project

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(pre, "run_preprocess", interrupted)
    rc = main(["preprocess", str(pipe), "-i", str(data), "-o", str(tmp / "o")])
    assert one_line_error(capsys, rc, 130) == "interrupted; rerun to resume"


def test_inspect_html_goes_next_to_the_data(project, capsys, monkeypatch):
    tmp, pipe, data = project
    assert main(["preprocess", str(pipe), "-i", str(data), "-o", str(tmp / "o"), "--workers", "1"]) == 0
    cwd = tmp / "elsewhere"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    assert main(["inspect", str(tmp / "o"), "--format", "html"]) == 0
    page = (tmp / "o" / "inspect.html").read_text()
    assert page.startswith("<!")
    # a table of contents: a jump link for the statistics and for each row shown, each with its target
    import re

    links = re.findall(r'href="#([\w-]+)"', page)
    assert "stats" in links and len(links) >= 2
    assert all(f'id="{anchor}"' in page for anchor in links)
    assert main(["inspect", str(pipe), "-i", str(data), "--format", "html"]) == 0
    assert (tmp / "pipe.inspect.html").exists() and not list(cwd.iterdir())
