"""YAML resource bombs and invalid YAML are located errors, found fast."""

import time

import pytest

from astrai.cli import main
from astrai.config import ConfigError, load_any, load_pipeline, parse_set

GOOD = "version: 1\ninput:\n  sections:\n    - {field: text, action: train}\n"


def laughs(levels=9, width=9):
    """A billion-laughs document: level k is a list of `width` aliases of level k-1 (width**levels leaves)."""
    lines = ['a0: &a0 ["lol"]']
    for k in range(1, levels + 1):
        lines.append(f"a{k}: &a{k} [" + ", ".join([f"*a{k - 1}"] * width) + "]")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("extra", [laughs(), "input_x:\n  " + laughs().replace("\n", "\n  ").rstrip() + "\n"])
def test_billion_laughs_fails_fast_with_a_location(tmp_path, extra):
    f = tmp_path / "bomb.yaml"
    f.write_text(GOOD + extra)
    t0 = time.time()
    with pytest.raises(ConfigError) as e:
        load_pipeline(f)
    assert time.time() - t0 < 5
    msg = str(e.value)
    assert "alias" in msg and f"{f}:" in msg and any(f"{f}:{n}:" in msg for n in range(5, 20))


def test_recursive_alias_is_refused(tmp_path):
    f = tmp_path / "loop.yaml"
    f.write_text(GOOD + "extra: &x [1, *x]\n")
    with pytest.raises(ConfigError, match="refers to a node that contains it"):
        load_pipeline(f)


def test_deep_nesting_is_a_located_error_not_a_recursion_error(tmp_path):
    f = tmp_path / "deep.yaml"
    f.write_text(GOOD + "extra: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ConfigError, match="nested too deeply"):
        load_pipeline(f)


def test_modest_aliases_still_work(tmp_path):
    f = tmp_path / "ok.yaml"
    f.write_text("version: 1\nsec: &s {field: text, action: train}\ninput:\n  sections: [*s]\n")
    with pytest.raises(ConfigError) as e:  # `sec` is an unknown key, but the alias itself loads
        load_pipeline(f)
    assert "unknown key 'sec'" in str(e.value) and "expand" not in str(e.value)


@pytest.mark.parametrize("text", ["version: [1\n", "a: b: c\n", "\tversion: 1\n", "key: 'unterminated\n"])
def test_invalid_yaml_file_is_located(tmp_path, text, capsys):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_any(f)
    assert "invalid YAML" in str(e.value) and f"{f}:" in str(e.value)
    assert main(["validate", str(f)]) == 1
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("value", ["[1,", "{a: 1", "'x", "@x", "[&a [1,1], *a, *b]"])
def test_invalid_set_value_is_an_error_naming_set(tmp_path, value, capsys):
    with pytest.raises(ValueError, match="--set preprocessing.max_seq_len"):
        parse_set(f"preprocessing.max_seq_len={value}")
    f = tmp_path / "p.yaml"
    f.write_text(GOOD)
    assert main(["validate", str(f), "--set", f"preprocessing.max_seq_len={value}"]) == 1
    out = capsys.readouterr()
    assert "--set" in out.out + out.err and "Traceback" not in out.err


def test_set_value_alias_bomb_is_refused():
    bomb = "[" + ", ".join(["&a0 [lol]"] + [f"&a{k} [" + ", ".join([f"*a{k - 1}"] * 9) + "]" for k in range(1, 9)]) + "]"
    t0 = time.time()
    with pytest.raises(ValueError, match="alias"):
        parse_set(f"input.x={bomb}")
    assert time.time() - t0 < 5
