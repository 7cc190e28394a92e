"""The global-packing intermediate: what IntermediateSink writes, Intermediate reads back piece by piece."""

from types import SimpleNamespace

import numpy as np
import pytest

from astrai.data.preprocess.shards import Intermediate, IntermediateSink, token_file
from astrai.data.process import TokenSeq
from astrai.schema import IGNORE_INDEX, INPUT_IDS, LABELS


def _docs(rng, n, labelled):
    docs = []
    for _ in range(n):
        ids = rng.integers(0, 500, size=int(rng.integers(0, 40))).astype(np.int64)
        labels = np.where(rng.random(len(ids)) < 0.5, IGNORE_INDEX, ids) if labelled else None
        docs.append(TokenSeq(ids, labels, np.zeros(len(ids), np.int64), []))
    return docs


def _write(tmp_path, docs):
    sink = IntermediateSink(SimpleNamespace(work=tmp_path), SimpleNamespace(name="00003"))
    for d in docs:  # 2,500 documents: several flushes of 1,024
        sink.add(SimpleNamespace(seq=lambda d=d: d))
    assert sink.finish() == {"docs": len(docs)}
    return Intermediate(tmp_path, "00003")


@pytest.mark.parametrize("labelled", [True, False])
def test_pieces_read_back(tmp_path, labelled):
    rng = np.random.default_rng(0)
    docs = _docs(rng, 2500, labelled)
    part = _write(tmp_path, docs)
    try:
        assert part.has_labels == labelled
        assert not list(tmp_path.glob(".*tmp*"))  # temporaries renamed into place
        for row in [0, 1, 1023, 1024, 2047, 2499] + rng.integers(0, 2500, 50).tolist():
            d = docs[row]
            start = int(rng.integers(0, len(d) + 1))
            n = int(rng.integers(0, len(d) - start + 1))
            got = part.read(INPUT_IDS, row, start, n)
            assert got.dtype == np.int32 and got.tolist() == d.input_ids[start:start + n].tolist()
            if labelled:
                assert part.read(LABELS, row, start, n).tolist() == d.labels[start:start + n].tolist()
    finally:
        part.close()


def test_short_file_is_an_error(tmp_path):
    docs = _docs(np.random.default_rng(1), 10, False)
    docs[-1] = TokenSeq(np.arange(5), None, np.zeros(5, np.int64), [])
    part = _write(tmp_path, docs)
    path = token_file(tmp_path, "00003", INPUT_IDS)
    try:
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size - 4)  # the last document loses its last token
        assert part.read(INPUT_IDS, 9, 0, 4).tolist() == [0, 1, 2, 3]
        with pytest.raises(EOFError):
            part.read(INPUT_IDS, 9, 0, 5)
    finally:
        part.close()
