"""The tokenizer content digest (the manifest's `tokenizer.content`) and its cache: the same value
with and without the cache, keyed on what fixes it, and a broken cache costs time, not a result."""

import hashlib
import json

import pytest

from astrai.text import tokenizer as tk


def slow_digest(tok):
    """Independent of astrai's: the four sections of tokenizer.json, canonical JSON, sha256."""
    data = json.loads(tok.tok.to_str())
    canon = json.dumps({k: data.get(k) for k in ("model", "added_tokens", "normalizer", "pre_tokenizer")},
                       sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ASTRAI_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "tokenizer-content"


@pytest.fixture
def tok(tiny_tokenizer):
    return tk.load_tokenizer(str(tiny_tokenizer))


def test_cached_equals_computed_and_the_second_call_reads_it(tok, cache, monkeypatch):
    want = slow_digest(tok)
    assert tk.content_digest(tok) == want
    [entry] = cache.iterdir()
    assert entry.read_text() == want
    monkeypatch.setattr(tk, "_content_digest", lambda t: pytest.fail("computed again"))
    assert tk.content_digest(tok) == want


def test_added_tokens_and_files_change_the_key(tok, tiny_tokenizer, cache, tmp_path):
    base = tk.content_digest(tok)
    more = tk.with_added_tokens(tok, ["<|extra|>"])  # same files (fingerprint), one token more
    assert more.fingerprint == tok.fingerprint
    assert tk.content_digest(more) == slow_digest(more) != base
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
    assert tk.content_digest(tok) == slow_digest(tok)


def test_a_tokenizer_without_files_is_not_cached(tok, cache):
    from dataclasses import replace

    bare = replace(tok, fingerprint="")
    assert tk.content_digest(bare) == slow_digest(tok)
    assert not cache.exists()
