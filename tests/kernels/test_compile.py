"""Compile tier: every kernel and instantiation through NVRTC + ptxas for sm_80 and sm_90, no GPU.

NVRTC is called directly (cupy_backends.cuda.libs.nvrtc): CuPy's RawModule asks the driver for the
device architecture and so cannot run here. `--ptxas-options=-v` makes ptxas report per-entry
registers, stack frame and spills; the test fails on any error or warning, any spill or stack
frame, and any register count above the kernel's budget in astrai/kernels/catalog.py.
"""

from __future__ import annotations

import re
from collections import defaultdict

import pytest

nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")

from astrai.kernels.catalog import ARCHS, KERNELS, compile_options, cuda_include_dir, source_text  # noqa: E402

pytestmark = pytest.mark.skipif(cuda_include_dir() is None, reason="no cuda_fp16.h (install the test extra)")

_ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(sm_\d+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")


def _by_source():
    groups = defaultdict(list)
    for name, kernel in KERNELS.items():
        groups[kernel.source].append((name, kernel))
    return groups


def compile_source(source: str, name_exprs: list[str], arch: str) -> tuple[str, dict[str, str]]:
    """(ptxas log, name expression -> mangled name); raises with the log on a compile error."""
    prog = nvrtc.createProgram(source_text(KERNELS[_any_kernel(source)]), source, [], [])
    try:
        for expr in name_exprs:
            nvrtc.addNameExpression(prog, expr)
        try:
            nvrtc.compileProgram(prog, [f"-arch={arch}", "--ptxas-options=-v", *compile_options()])
        except nvrtc.NVRTCError as e:
            raise AssertionError(f"{source} ({arch}) failed to compile: {e}\n{nvrtc.getProgramLog(prog)}")
        return nvrtc.getProgramLog(prog), {e: nvrtc.getLoweredName(prog, e) for e in name_exprs}
    finally:
        nvrtc.destroyProgram(prog)


def _any_kernel(source: str) -> str:
    return next(n for n, k in KERNELS.items() if k.source == source)


def parse_ptxas(log: str) -> dict[str, dict[str, int]]:
    """mangled entry -> {registers, stack, spill_stores, spill_loads} from a `ptxas -v` log."""
    stats, current = {}, None
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            current = stats.setdefault(m.group(1), {})
        elif current is not None and (m := _FRAME.search(line)):
            current.update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        elif current is not None and (m := _REGS.search(line)):
            current["registers"] = int(m.group(1))
    return stats


def test_parse_ptxas_reads_a_report():
    log = (
        "ptxas info    : Compiling entry function '_Z1kPf' for 'sm_80'\n"
        "ptxas info    : Function properties for _Z1kPf\n"
        "ptxas         .     8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n"
        "ptxas info    : Used 71 registers, used 1 barriers, 364 bytes cmem[0]\n"
    )
    assert parse_ptxas(log) == {"_Z1kPf": {"stack": 8, "spill_stores": 4, "spill_loads": 12, "registers": 71}}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("source", sorted(_by_source()))
def test_kernels_compile_within_budget(source, arch):
    kernels = _by_source()[source]
    exprs = {expr: kernel for _, kernel in kernels for expr in kernel.name_expressions()}
    log, lowered = compile_source(source, list(exprs), arch)
    noise = [line for line in log.splitlines() if re.search(r"warning|error", line, re.IGNORECASE)]
    assert not noise, f"{source} ({arch}) compiled with diagnostics:\n" + "\n".join(noise)
    stats = parse_ptxas(log)
    problems = []
    for expr, kernel in exprs.items():
        entry = stats.get(lowered[expr])
        if entry is None or "registers" not in entry:
            problems.append(f"{expr}: no ptxas report (log:\n{log})")
            continue
        if entry.get("stack", 0) or entry.get("spill_stores", 0) or entry.get("spill_loads", 0):
            problems.append(f"{expr}: stack frame {entry['stack']} B, spills {entry['spill_stores']}/"
                            f"{entry['spill_loads']} B")
        if entry["registers"] > kernel.max_registers:
            problems.append(f"{expr}: {entry['registers']} registers > budget {kernel.max_registers}")
    assert not problems, f"{source} ({arch}):\n" + "\n".join(problems)

