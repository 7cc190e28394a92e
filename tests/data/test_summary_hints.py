"""The end-of-run summary names the cure that applies to each kind of truncation."""

from astrai.data.preprocess.summary import summary_lines


def _stats(**kw):
    base = dict(records_read=10, records_kept=10, records_rejected=0, records_filtered=0, rows=3, tokens=1000,
                tokens_written=1000, trained_tokens=400, truncated_tokens=0, truncated_docs=0,
                pack_truncated_tokens=0, pack_truncated_docs=0)
    return {**base, **kw}


def test_max_seq_len_cut_does_not_suggest_bfd_split():
    (line,) = [x for x in summary_lines(_stats(truncated_tokens=77, truncated_docs=1), "OUT", 1) if "truncated" in x]
    assert "77 tokens lost" in line and "raise max_seq_len (77 tokens over it)" in line and "bfd_split" not in line


def test_packing_cut_suggests_bfd_split():
    lines = summary_lines(_stats(pack_truncated_tokens=30, pack_truncated_docs=2, tokens_written=970), "OUT", 1)
    (line,) = [x for x in lines if "truncated" in x]
    assert "2 document(s): 30 tokens lost" in line and "bfd_split (30 tokens over max_packed_len)" in line
    assert "max_seq_len" not in line
