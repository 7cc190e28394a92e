"""Run orchestration: fingerprint, output-directory lifecycle, the passes in order, stats and manifest.

A run: resolve the tokenizer and template; plan input partitions; fingerprint everything the
output depends on; if manifest.json carries that fingerprint, stop ("up to date"); otherwise
prepare the directory (an output of another fingerprint is removed, markers first), run the
tokenize pass over the partitions not yet done, the global packing pass when packing is bfd or
bfd_split, then merge statistics and rejects and write stats.json and, last, manifest.json.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Callable, Optional

from astrai import __version__
from astrai.config.pipeline import Pipeline
from astrai.errors import InputError
from astrai.data.holdout import Holdout
from astrai.data.preprocess.job import WORK, Job, Worker
from astrai.data.preflight import check_model_template, check_reject_share, check_template_markers
from astrai.data.preprocess.pack import pack_globally
from astrai.data.preprocess.summary import summary_lines
from astrai.data.preprocess.tokenize import PartitionTask, tokenize_partition, tokenize_partitions
from astrai.data.process import Processor
from astrai.data.read import Partition, expand_inputs, file_fingerprint, plan_partitions
from astrai.data.shard_check import shard_record, verify_cheap
from astrai.data.stats import dataset_stats
from astrai.text.template import resolve_template
from astrai.text.tokenizer import content_digest, load_tokenizer
from astrai.runtime import (OUTPUT_MARKER, OutputBusy, Progress, atomic_write_text, claim_output, file_identity,
                            is_done, is_ours, marker_info, output_lock, read_marker, refuse_link, remove_stale_tmp,
                            run_tasks)

FORMAT_VERSION = 1


def run_preprocess(pipeline: Pipeline, inputs: list[str], out: str, tokenizer: Optional[str] = None,
                   workers: Optional[int] = None, base_dir: Optional[str] = None,
                   log: Callable[[str], None] = print, executor: str = "local",
                   ray_address: Optional[str] = None, holdout: Optional[Holdout] = None) -> dict:
    """executor "local": a process pool of `workers`; "ray": the same tasks on the Ray cluster at
    `ray_address` (astrai.runtime_ray), byte-identical output. The options are declared once, by a
    recipe's preprocess stage (astrai.recipe.preprocess_stage); `astrai preprocess` reads its flags there.
    The output directory is locked for the whole run (astrai.runtime.output_lock): one writer at a time.
    `holdout`: process one side of a held-out split only (astrai.data.holdout), reading the inputs in place."""
    if executor == "ray":
        from astrai.runtime_ray import import_ray

        import_ray()  # without the extra, say so before any work
    elif executor != "local":
        raise InputError(f"executor '{executor}': use local or ray")
    if workers is not None and workers < 1:
        raise InputError(f"--workers {workers}: give 1 or more worker processes (or leave it out: one per core)")
    existed = Path(out).exists()
    try:
        lock = output_lock(Path(out))
        lock.__enter__()
    except (OutputBusy, NotADirectoryError) as e:
        raise InputError(str(e)) from None
    except OSError as e:
        raise InputError(f"output {out}: {e.strerror or e}; choose another -o") from None
    try:  # the lock goes with this process on any exit
        return _run_locked(pipeline, inputs, out, tokenizer, workers, base_dir, log, executor, ray_address, holdout)
    except InputError:
        if not existed and Path(out).is_dir() and not any(Path(out).iterdir()):
            Path(out).rmdir()  # refused before any work (a tokenizer, a template): leave no trace
        raise
    finally:
        lock.__exit__(None, None, None)


def _run_locked(pipeline: Pipeline, inputs: list[str], out: str, tokenizer: Optional[str], workers: Optional[int],
                base_dir: Optional[str], log: Callable[[str], None], executor: str,
                ray_address: Optional[str], holdout: Optional[Holdout]) -> dict:
    base_dir = str(base_dir or os.getcwd())
    tok_spec = tokenizer or pipeline.tokenizer
    if not tok_spec:
        raise InputError("no tokenizer: set `tokenizer:` in the pipeline, the recipe, or pass --tokenizer DIR")
    tok = load_tokenizer(tok_spec, base_dir, pipeline.added_tokens)  # Processor then needs no copy
    template = resolve_template(pipeline.template_spec, tok, base_dir) if pipeline.template_spec else None
    check_model_template(pipeline, tok, template)  # before any work: data rendered unlike at serve time
    outp = Path(out)
    warnings: list[str] = []  # skipped or empty inputs, ignored settings: said, not ignored
    pp = pipeline.preprocessing
    if pp.max_packed_len is not None and pp.packing_strategy == "none":
        # a warning, not an error: `--set preprocessing.packing_strategy=none` on a packing pipeline is common
        warnings.append(f"preprocessing.max_packed_len ({pp.max_packed_len}) is ignored with packing_strategy: none "
                        f"(one document per row); set a packing_strategy to pack")
    # relative to the working directory (recipes join their base); never our own output
    files = expand_inputs(inputs, exclude=outp, warnings=warnings)
    for w in warnings:
        log(f"warning: {w}")
    identity = file_identity(files)  # before the digests: a change after it is seen at the end
    digests: dict = {}  # JSONL hashes taken while planning partitions: one read of each input
    parts = plan_partitions(files, partition_bytes(files, pipeline.preprocessing.partition_bytes), digests)
    holdout = holdout.with_offsets(parts) if holdout is not None else None
    fp = fingerprint(pipeline, tok.fingerprint, template.source if template else "", files, digests, holdout)
    manifest = outp / "manifest.json"
    if is_ours(outp) and manifest.exists() and _current(outp, manifest, fp, log):
        shutil.rmtree(outp / WORK, ignore_errors=True)  # left if a run died right after its manifest
        log(f"{out}: up to date (fingerprint {fp[:12]}), nothing to do")
        return json.loads((outp / "stats.json").read_text())
    job = Job(pipeline, str(tok.path), base_dir, str(outp), holdout)
    workers = max(1, workers or os.cpu_count() or 1)
    # built once here (no encoding yet) from the tokenizer and template already loaded; forked
    # workers inherit it, spawned ones (and Ray workers) build their own from the job
    worker = Worker(job, Processor(pipeline, tok, base_dir, template))
    # before any work (and before an old output is replaced): a missing marker token rejects every record
    check_template_markers(worker.processor)
    prepare_output_dir(outp, fp, log)
    tok_content: list[str] = []  # the manifest's tokenizer content digest, once taken

    def take_digest(_task=None):  # 1-2 s of CPU: taken here while workers go on, not alone after them
        if not tok_content:
            tok_content.append(content_digest(worker.processor.tok))
    with _task_runner(executor, ray_address, log) as (run, cluster):
        if cluster is not None:
            cluster.check_nodes(_needed_paths(files, job, template), outp)
        todo = [p for p in parts if not is_done(job.marker(p.name))]
        if len(todo) < len(parts):
            log(f"resuming: {len(parts) - len(todo)} of {len(parts)} partitions already done")
        if pipeline.preprocessing.max_items is not None:
            _tokenize_in_order(worker, parts, run)
        else:
            progress = Progress(len(todo), "partitions")

            def done(task):  # counts from the partition's completion marker
                summary = read_marker(job.marker(task.part.name))
                progress.update(1, records=summary.get("read", 0), tokens=summary.get("tokens", 0))
                finished.append(task)
                if len(finished) < len(todo):  # partitions still in work (the last one's wait is the pack's)
                    take_digest()

            finished: list = []

            # in this process (one worker or one partition) the partitions go as one stream
            run(tokenize_partition, [PartitionTask(p) for p in todo], workers=workers,
                setup=partial(Worker.build, job), context=worker, what="partitions", log=log,
                **({"on_done": done, "in_process": tokenize_partitions} if cluster is None else {}))
            progress.close()
        _check_unchanged(outp, files, identity)
        summaries = [read_marker(job.marker(p.name)) for p in parts]
        packing = (pack_globally(job, parts, workers, worker, log, run, take_digest if cluster is None else None)
                   if job.global_pack else None)
    stats = dataset_stats(pipeline, summaries, packing)
    shards = sorted(str(p.relative_to(outp)) for p in _our_shards(outp))
    _merge_rejects(outp, parts)
    atomic_write_text(outp / "stats.json", json.dumps(stats, indent=2) + "\n")  # keys in reading order
    # no manifest when too much was rejected: a rerun must fail again, not say "up to date"
    check_reject_share(stats, pipeline.preprocessing.max_reject_share, str(outp / "rejects.jsonl"))
    man = {
        "format_version": FORMAT_VERSION,
        "fingerprint": fp,
        "pipeline": json.loads(pipeline.model_dump_json()),
        "tokenizer": {"path": str(tok.path), "fingerprint": tok.fingerprint,
                      "content": tok_content[0] if tok_content else content_digest(worker.processor.tok)},
        "chat_template": template.name if template else None,
        "chat_template_source": template.source if template else None,  # what final/chat_template.jinja gets
        "inputs": [str(f) for f in files],
        **({"holdout": holdout.describe()} if holdout is not None else {}),
        "shards": shards,
        "shard_checks": {sh: shard_record(outp / sh) for sh in shards},  # verified by every reader
        "columns": _columns(outp, shards),
        "counts": {k: stats[k] for k in ("records_read", "records_kept", "records_filtered", "records_rejected",
                                         "rows", "tokens")},
    }
    atomic_write_text(manifest, json.dumps(man, indent=2, sort_keys=True) + "\n")  # the run's completion marker
    shutil.rmtree(outp / WORK, ignore_errors=True)
    for line in summary_lines(stats, out, len(shards)):
        log(line)
    return stats


def _current(outp: Path, manifest: Path, fp: str, log: Callable[[str], None]) -> bool:
    """The output of fingerprint `fp` is on disk as its manifest recorded it (shard sizes and row
    counts: astrai.data.shard_check); shards changed by hand are made again."""
    try:
        man = json.loads(manifest.read_text())
    except ValueError:
        return False
    if man.get("fingerprint") != fp:
        return False
    if not verify_cheap(outp, man):
        log(f"{outp}: its shards differ from what its manifest recorded (changed by hand?): making them again")
        (outp / WORK / "fingerprint").unlink(missing_ok=True)  # nothing of the old run is resumed
        return False
    return True


def fingerprint(pipeline: Pipeline, tok_fp: str, template_src: str, files: list[Path],
                digests: Optional[dict] = None, holdout: Optional[Holdout] = None) -> str:
    h = hashlib.sha256()
    # partition_bytes changes partitions, hence shard names: it is part of the pipeline dump
    # the astrai version is in: a release that changes how records are tokenized must not reuse old output
    what = {"format": FORMAT_VERSION, "astrai": __version__, "pipeline": json.loads(pipeline.model_dump_json()),
            "tokenizer": tok_fp, "template": template_src}
    if holdout is not None:
        what["holdout"] = holdout.describe()
    h.update(json.dumps(what, sort_keys=True).encode())
    for f in files:
        h.update(f.name.encode() + b"\0")
        if f.is_dir():
            for sub in sorted(f.rglob("*")):
                if sub.is_file():
                    h.update(sub.name.encode() + file_fingerprint(str(sub)).encode())
        else:
            h.update(((digests or {}).get(str(f)) or file_fingerprint(str(f))).encode())
    return h.hexdigest()


AUTO_PARTITIONS, AUTO_MIN, AUTO_MAX = 64, 1 << 20, 32 << 20


def partition_bytes(files: list[Path], setting) -> int:
    """`preprocessing.partition_bytes` resolved: `auto` is the inputs' total size over 64, kept
    within 1-32 MiB. It depends on the inputs only (never on the workers), so a rerun, a resume or
    a Ray run plans the same partitions; a 24 MiB input makes 24 partitions, not one that a single
    process tokenizes while the other cores wait (2 workers: 1.2-1.3x faster whole process)."""
    if setting != "auto":
        return setting
    total = sum(f.stat().st_size for f in files if f.is_file())
    return min(max(-(-total // AUTO_PARTITIONS), AUTO_MIN), AUTO_MAX)


SHARD_NAME = re.compile(r"(part-\d{5}-\d{4}|packed-\d{5})\.parquet")  # what the passes write under data/


def _our_shards(outp: Path) -> list[Path]:
    data = outp / "data"
    return sorted(f for f in data.iterdir() if SHARD_NAME.fullmatch(f.name)) if data.is_dir() else []


def prepare_output_dir(outp: Path, fp: str, log: Callable[[str], None] = print):
    """Make `outp` ready for a run of fingerprint `fp`: keep a resumable run of the same fingerprint,
    replace an output of another one, refuse a directory astrai did not write (its ownership
    marker, astrai.runtime.OUTPUT_MARKER, is the only proof: nothing in another directory is touched)."""
    work = outp / WORK
    if not is_ours(outp):
        if outp.exists() and any(outp.iterdir()):
            raise InputError(f"output {outp} exists, is not empty and is not an astrai output (no {OUTPUT_MARKER} "
                             f"marker); nothing in it was touched: choose another -o, or an empty directory")
        claim_output(outp, {"fingerprint": fp})
    for name in (WORK, "data", "cache"):  # a link planted at one is refused, never written through
        refuse_link(outp / name, directory=True)
    stale = not (work / "fingerprint").exists() or (work / "fingerprint").read_text() != fp
    if stale:  # another pipeline/input/tokenizer: the old output is invalid
        old = marker_info(outp).get("fingerprint")
        if (outp / "manifest.json").exists() or _our_shards(outp):
            log(f"{outp}: replacing an existing output of another fingerprint ({str(old)[:12]}) with {fp[:12]}")
        _wipe(outp)
    claim_output(outp, {"fingerprint": fp})
    work.mkdir(parents=True, exist_ok=True)
    (outp / "data").mkdir(exist_ok=True)
    remove_stale_tmp(outp)  # stats.json, manifest.json and rejects.jsonl are written under temporary names too
    remove_stale_tmp(outp / "data")
    remove_stale_tmp(work)
    if not (work / "fingerprint").exists():
        atomic_write_text(work / "fingerprint", fp)


def _wipe(outp: Path):
    """Remove a previous output of ours: only what astrai writes (the manifest's shards, shards by our
    naming rule from an unfinished run, .work, stats.json, rejects.jsonl); anything else stays.
    Markers go first, shards after: killed half-way, the leftovers must never read as done (a
    manifest saying "up to date", or .work/fingerprint resuming into partitions whose shards are gone)."""
    manifest = outp / "manifest.json"
    listed: list[Path] = []
    if manifest.exists():
        try:
            listed = [outp / s for s in json.loads(manifest.read_text()).get("shards", [])]
        except ValueError:
            listed = []
        manifest.unlink()
    (outp / WORK / "fingerprint").unlink(missing_ok=True)
    data = (outp / "data").resolve()
    for f in sorted(set(listed) | set(_our_shards(outp))):
        if f.resolve().parent == data and f.is_file():  # a manifest cannot point outside data/
            os.unlink(f)
    shutil.rmtree(outp / WORK, ignore_errors=True)  # our scratch folder: markers, intermediates
    for name in ("stats.json", "rejects.jsonl"):
        (outp / name).unlink(missing_ok=True)


def _check_unchanged(outp: Path, files: list[Path], identity: dict):
    """Fail when an input changed while it was read. The partitions read from it are not trusted
    either: .work/fingerprint goes, so the rerun starts over instead of resuming into them."""
    now = file_identity(files)
    changed = sorted(f for f in identity.keys() | now.keys() if identity.get(f) != now.get(f))
    if changed:
        (outp / WORK / "fingerprint").unlink(missing_ok=True)
        raise InputError(f"input {changed[0]}" + (f" (and {len(changed) - 1} more)" if len(changed) > 1 else "")
                         + " changed while it was being read; nothing was marked done: rerun once it is complete")


@contextmanager
def _task_runner(executor: str, ray_address: Optional[str], log: Callable[[str], None]):
    """(run_tasks, cluster): the local pool's astrai.runtime.run_tasks, or a Ray executor's method of
    the same signature (and the executor, for its node check), connected for the run's duration."""
    if executor == "local":
        yield run_tasks, None
        return
    from astrai.runtime_ray import RayExecutor

    with RayExecutor(ray_address, log) as cluster:
        yield cluster.run_tasks, cluster


def _needed_paths(files: list[Path], job: Job, template) -> list[tuple[str, str]]:
    """What every Ray node must see besides the output: inputs, the tokenizer, a template file."""
    needed = [("input", str(f)) for f in files] + [("tokenizer", job.tokenizer)]
    if template is not None and Path(template.name).is_file():
        needed.append(("chat template", template.name))
    return needed


def _tokenize_in_order(worker: Worker, parts: list[Partition], run=run_tasks):
    """max_items counts records in input order, so a partition's limit needs the counts of the
    earlier ones: partitions run one after another (here, or one Ray task at a time)."""
    job = worker.job
    budget = job.pipeline.preprocessing.max_items
    for p in parts:
        marker = job.marker(p.name)
        if not is_done(marker):
            run(tokenize_partition, [PartitionTask(p, limit=budget)], workers=1, setup=partial(Worker.build, job),
                context=worker, what="partitions", log=lambda s: None)
        # a partition that read nothing (budget already spent, or only blank lines) has no "read" count
        budget = max(budget - read_marker(marker).get("read", 0), 0)


def _merge_rejects(outp: Path, parts: list[Partition]):
    files = [outp / WORK / f"{p.name}.rejects.jsonl" for p in parts]
    files = [f for f in files if f.exists()]
    target = outp / "rejects.jsonl"
    if not files:
        target.unlink(missing_ok=True)
        return
    atomic_write_text(target, "".join(f.read_text(encoding="utf-8") for f in files))


def _columns(outp: Path, shards: list[str]) -> list[str]:
    """The columns as written (read from the first shard's schema, not declared a second time)."""
    import pyarrow.parquet as pq

    return pq.read_schema(outp / shards[0]).names if shards else []
