"""Incremental text and stop strings: streamed pieces add up to the full decode, no partial stop string."""

import pytest

from astrai.text.tokenizer import load_tokenizer
from astrai.infer.detokenize import OutputText


@pytest.fixture(scope="module")
def tok(tiny_tokenizer):
    return load_tokenizer(str(tiny_tokenizer)).tok


def stream(tok, prompt, out_ids, stop=()):
    text = OutputText(tok, prompt, stop)
    pieces = []
    for t in out_ids:
        pieces.append(text.push(t))
        if text.stop_string is not None:
            break
    pieces.append(text.flush())
    return pieces, text


def test_pieces_add_up_to_decoding_the_whole_output(tok):
    prompt = tok.encode("the quick brown").ids
    out = tok.encode(" fox jumps over the lazy dog héllo wörld ✓").ids  # multi-byte characters split over tokens
    pieces, text = stream(tok, prompt, out)
    assert "".join(pieces) == tok.decode(out) == text.text
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_cuts_text_and_never_streams_a_partial_stop(tok):
    prompt = tok.encode("hello").ids
    out = tok.encode(" how are you today the quick").ids
    full = tok.decode(out)
    pieces, text = stream(tok, prompt, out, stop=["you to"])
    assert text.stop_string == "you to"
    assert "".join(pieces) == full[:full.index("you to")]
    assert all("you" not in p for p in pieces)  # "you" was held back: it could have begun the stop string
    # a stop string that never completes: the held-back text is released at the end
    pieces, text = stream(tok, prompt, out, stop=["you tomorrow"])
    assert text.stop_string is None and "".join(pieces) == full


def test_earliest_stop_string_wins(tok):
    out = tok.encode(" one two three").ids
    pieces, text = stream(tok, [], out, stop=["three", "two"])
    assert text.stop_string == "two" and "".join(pieces) == " one "
