"""astrai.runtime: tasks run with a context built once per process, errors stop the run, atomic files."""

import os
from functools import partial
from pathlib import Path

import pytest

from astrai.runtime import atomic_write_text, is_done, mark_done, read_marker, remove_stale_tmp, run_tasks, tmp_name


def _setup(folder):
    return {"folder": folder, "pid": os.getpid()}


def _record(ctx, task):
    # one file per task, naming the process that ran it and the process whose context it got
    Path(ctx["folder"], f"t{task}").write_text(f"{os.getpid()} {ctx['pid']}")


def _fail(ctx, task):
    if task == 3:
        raise ValueError("task 3 is bad")


@pytest.mark.parametrize("workers", [1, 2])
def test_every_task_runs_once_with_a_context(tmp_path, workers):
    run_tasks(_record, list(range(6)), workers=workers, setup=partial(_setup, str(tmp_path)), log=lambda s: None)
    seen = {p.name: p.read_text().split() for p in tmp_path.iterdir()}
    assert sorted(seen) == [f"t{i}" for i in range(6)]
    if workers == 1:  # in this process, context built here
        assert all(ran == str(os.getpid()) and ctx == ran for ran, ctx in seen.values())
    else:  # other processes, each with the context its pool initializer set
        assert all(ran != str(os.getpid()) and ctx == ran for ran, ctx in seen.values())


def test_a_context_built_here_is_inherited_by_forked_workers(tmp_path):
    ctx = _setup(str(tmp_path))
    run_tasks(_record, list(range(4)), workers=2, setup=partial(_setup, "/nonexistent"), context=ctx,
              log=lambda s: None)
    # workers wrote into the folder of the parent's context (setup, pointing elsewhere, never ran)
    assert len(list(tmp_path.iterdir())) == 4
    assert {p.read_text().split()[1] for p in tmp_path.iterdir()} == {str(os.getpid())}


@pytest.mark.parametrize("workers", [1, 2])
def test_the_first_error_stops_the_run(tmp_path, workers):
    with pytest.raises(ValueError, match="task 3 is bad"):
        run_tasks(_fail, list(range(5)), workers=workers, setup=partial(_setup, str(tmp_path)), log=lambda s: None)


def test_atomic_files_and_markers(tmp_path):
    target = tmp_path / "a.txt"
    atomic_write_text(target, "héllo\n")
    assert target.read_bytes() == "héllo\n".encode() and list(tmp_path.iterdir()) == [target]
    tmp_name(target).write_text("left by a killed run")
    remove_stale_tmp(tmp_path)
    assert list(tmp_path.iterdir()) == [target]
    marker = tmp_path / "p00000.json"
    assert not is_done(marker)
    mark_done(marker, {"read": 3, "kept": 2})
    assert is_done(marker) and read_marker(marker) == {"kept": 2, "read": 3}


def test_fewer_collections_restores_the_collector():
    import gc

    from astrai.runtime import fewer_collections

    before = gc.get_threshold()
    assert gc.get_freeze_count() == 0
    kept = [[i] for i in range(1000)]  # alive before: frozen out of collections meanwhile
    with fewer_collections(first=12_345):
        assert gc.get_threshold() == (max(before[0], 12_345), *before[1:])
        assert gc.get_freeze_count() >= len(kept)
        garbage = []
        garbage.append(garbage)  # a cycle made inside is still collected
        del garbage
        assert gc.collect() >= 1
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0
    try:  # a collector switched off stays off; what a caller froze stays frozen
        gc.set_threshold(0)
        gc.freeze()
        # the frozen count itself drifts down as frozen objects die (other threads, finalizers), so
        # what is checked is that one object the caller froze is still out of the collector's reach
        assert not any(o is kept for o in gc.get_objects())
        with fewer_collections():
            assert gc.get_threshold()[0] == 0
        assert gc.get_threshold()[0] == 0 and gc.get_freeze_count() > 0
        assert not any(o is kept for o in gc.get_objects())
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_overlapping_fewer_collections_restore_the_collector_once_all_leave():
    # two threads' uses interleave (enter A, enter B, leave A, leave B): each restoring what it saw on entry
    # would leave B's raised threshold behind, and A's unfreeze would thaw objects while B still runs
    import gc
    import threading

    from astrai.runtime import fewer_collections

    before = gc.get_threshold()
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def a():
        with fewer_collections(first=23_456):
            a_in.set()
            b_in.wait(10)
        a_out.set()

    def b():
        a_in.wait(10)
        with fewer_collections(first=34_567):
            b_in.set()
            a_out.wait(10)
            seen["while b runs"] = (gc.get_threshold()[0], gc.get_freeze_count() > 0)

    threads = [threading.Thread(target=f) for f in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert seen["while b runs"] == (max(before[0], 23_456), True)
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0


@pytest.mark.parametrize("workers, tasks, streamed", [(1, [0, 1, 2], True), (2, [0], True), (2, [0, 1, 2], False)])
def test_in_process_runs_the_tasks_only_when_they_run_here(tmp_path, workers, tasks, streamed):
    calls, done = [], []

    def stream(ctx, ts, on_done):  # as a stage that streams its tasks: all at once, each reported done
        calls.append((ctx["pid"], list(ts)))
        for t in ts:
            on_done(t)

    run_tasks(_record, tasks, workers=workers, setup=partial(_setup, str(tmp_path)), log=lambda s: None,
              on_done=done.append, in_process=stream)
    assert sorted(done) == tasks
    assert calls == ([(os.getpid(), tasks)] if streamed else [])
    assert sorted(p.name for p in tmp_path.iterdir()) == ([] if streamed else [f"t{i}" for i in tasks])


# ---- files: never through a link ------------------------------------------------------------

def _planted(tmp_path, name="metrics.jsonl"):
    """A link named like a file astrai writes, pointing at a file of the user's outside the directory."""
    outside = tmp_path / "outside.txt"
    outside.write_text("the user's file\n")
    inside = tmp_path / "out"
    inside.mkdir()
    (inside / name).symlink_to(outside)
    return inside / name, outside


@pytest.mark.parametrize("mode", ["a", "w", "wb", "r+b", "x"])
def test_open_nofollow_refuses_a_planted_link_and_leaves_its_target(tmp_path, mode):
    from astrai.errors import os_error_line
    from astrai.runtime import LinkRefused, open_nofollow

    link, outside = _planted(tmp_path)
    with pytest.raises(OSError) as e:
        open_nofollow(link, mode)
    assert isinstance(e.value, LinkRefused) or mode == "x"  # x: exists, whatever it is
    assert outside.read_text() == "the user's file\n" and link.is_symlink()
    if mode != "x":
        line = os_error_line(e.value)  # what the CLI prints after "error: "
        assert line.startswith(f"{link}: is a symbolic link") and "\n" not in line


def test_open_nofollow_refuses_a_fifo_without_blocking(tmp_path):
    import time

    from astrai.runtime import LinkRefused, open_nofollow

    fifo = tmp_path / "log.txt"
    os.mkfifo(fifo)
    t = time.perf_counter()
    for mode in ("a", "w", "r"):
        with pytest.raises(LinkRefused, match="FIFO"):
            open_nofollow(fifo, mode)
    assert time.perf_counter() - t < 2


def test_open_nofollow_writes_appends_and_truncates_a_regular_file(tmp_path):
    from astrai.runtime import open_nofollow

    f = tmp_path / "log.txt"
    with open_nofollow(f, "a") as fh:
        fh.write("one\n")
    with open_nofollow(f, "a") as fh:
        fh.write("two\n")
    assert f.read_text() == "one\ntwo\n"
    with open_nofollow(f, "w") as fh:
        fh.write("new\n")
    assert f.read_text() == "new\n"
    with open_nofollow(f, "r+b") as fh:
        assert fh.read() == b"new\n"


def test_atomic_writes_never_write_through_a_planted_link(tmp_path):
    from astrai.runtime import fresh_tmp, open_nofollow

    # at the final name: the rename replaces the link itself
    link, outside = _planted(tmp_path, "stage.json")
    atomic_write_text(link, "{}\n")
    assert not link.is_symlink() and link.read_text() == "{}\n" and outside.read_text() == "the user's file\n"
    # at the temporary name (predictable: the pid), for every writer that goes through fresh_tmp
    target = link.parent / "summary.json"
    tmp_name(target).symlink_to(outside)
    atomic_write_text(target, "{}\n")
    assert target.read_text() == "{}\n" and outside.read_text() == "the user's file\n"
    assert not tmp_name(target).exists() and not tmp_name(target).is_symlink()
    tmp_name(target).symlink_to(outside)
    tmp = fresh_tmp(target)
    assert tmp.is_file() and not tmp.is_symlink() and tmp.stat().st_size == 0
    with open_nofollow(tmp, "w") as fh:
        fh.write("x")
    assert outside.read_text() == "the user's file\n"


def test_a_marker_that_is_a_link_proves_nothing(tmp_path):
    from astrai.runtime import OUTPUT_MARKER, is_ours

    elsewhere = tmp_path / "theirs.json"
    elsewhere.write_text('{"written_by": "astrai"}')
    out = tmp_path / "out"
    out.mkdir()
    (out / OUTPUT_MARKER).symlink_to(elsewhere)
    assert not is_ours(out)
    (out / OUTPUT_MARKER).unlink()
    (out / OUTPUT_MARKER).write_text('{"written_by": "astrai"}')
    assert is_ours(out)
