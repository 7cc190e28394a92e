"""astrai's CPU kernels (the .cpp files beside this module) as one torch C++ extension, built at first use.

`built()` builds or loads them once per process and says whether their operators (torch.ops.astrai.*) are
registered. torch.utils.cpp_extension compiles the sources once per (sources, torch version) into the user's
astrai cache (`kernels/cpu_gemv-<digest>`, a directory astrai makes and owns, never through a link; about 20 s
on two cores), and later processes load the built library in milliseconds. A failed build (no compiler, no
headers, a full disk) is said once on stderr with its first error line, and callers keep torch's operators.

Callers: astrai.infer.native (the engine's decode kernels) and astrai.model.cpu_ops (training's bf16 attention
backward, the gated MLP's activation).
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import torch

from astrai.cache import cache_root
from astrai.errors import InputError

HERE = Path(__file__).resolve().parent
# the few-row products; the decode step's norm, RoPE and attention; a whole decode layer; training's attention
# backward and gated activation
SOURCES = [HERE / name for name in ("cpu_gemv.cpp", "cpu_decode.cpp", "cpu_layer.cpp", "cpu_attention.cpp",
                                    "cpu_train.cpp")]
HEADER = HERE / "cpu_kernels.h"  # the entry points the files share
_STATE: dict = {}  # "built": the outcome, once decided in this process


def build_dir() -> Path:
    """Where the kernels of this source and torch version are built (inside astrai's cache)."""
    sources = b"".join(p.read_bytes() for p in [*SOURCES, HEADER])
    digest = hashlib.sha256(sources + torch.__version__.encode()).hexdigest()[:16]
    return cache_root() / "kernels" / f"cpu_gemv-{digest}"


def built() -> bool:
    """Whether the kernels' operators are registered in this process (building or loading them the first time)."""
    if "built" not in _STATE:
        try:
            _build()
            _STATE["built"] = True
        except Exception as e:  # no compiler, no headers, a full disk: torch's operators instead
            lines = str(e).splitlines() or [""]
            first = next((ln for ln in lines if " error: " in ln), lines[0])
            print(f"astrai: the CPU kernels did not build ({type(e).__name__}: {first.strip()[:200]}); "
                  "using torch's", file=sys.stderr)
            _STATE["built"] = False
    return _STATE["built"]


def _build() -> None:
    if hasattr(torch.ops.astrai, "gemv_bf16"):  # already registered in this process
        return
    from torch.utils.cpp_extension import load

    try:
        where = build_dir()
    except InputError as e:
        raise OSError(str(e)) from None
    where.parent.parent.mkdir(parents=True, exist_ok=True)  # the cache root (the user's choice of place)
    for d in (where.parent, where):  # never build through a link into somebody else's directory
        if d.is_symlink():
            raise OSError(f"{d} is not a directory astrai made (a link)")
        d.mkdir(exist_ok=True)
    if not (where / "astrai_cpu_gemv.so").exists():
        print(f"astrai: building the CPU kernels once, into {where} (about 20 s)", file=sys.stderr, flush=True)
    load(name="astrai_cpu_gemv", sources=[str(p) for p in SOURCES], extra_cflags=["-O3", "-fopenmp"],
         build_directory=str(where), is_python_module=False, verbose=False)

    # shapes for torch.compile's tracing (the compiled decode calls the operators inside its graph): the products
    # give x's rows by the weight's output rows (its first dimension, the int4 codes' too)
    for product in ("gemv_bf16", "gemv_f32", "gemv_int8", "gemv_int4"):
        torch.library.register_fake(f"astrai::{product}")(lambda x, w, *rest: x.new_empty((x.shape[0], w.shape[0])))

    @torch.library.register_fake("astrai::rms_norm_cast")
    def _(x, w, eps, to_bf16):
        return x.new_empty(x.shape, dtype=torch.bfloat16 if to_bf16 else torch.float32)
