"""A checkpoint directory's files read as untrusted input: what is opened, and how far it is believed.

- Only regular files are opened (astrai.errors.open_regular, raising ModelFileError): a FIFO or a
  device named model.safetensors is refused at once instead of blocking or streaming forever (the
  open itself does not block).
- JSON files (config.json, model.safetensors.index.json) are read up to MAX_JSON_BYTES, and nested at
  most astrai.json_bounded.MAX_DEPTH levels (the safetensors header too).
- A safetensors header is parsed and checked before any tensor is read (`read_header`): its
  length against the file size, valid JSON, each entry's dtype, shape and offsets, the offsets
  tiling the data area exactly (what the safetensors library itself requires), so a truncated or
  forged file gets a message naming the file and the tensor, never a library traceback.
- `weight_files(dir)` lists the safetensors files of a checkpoint: model.safetensors, or the files
  a model.safetensors.index.json names, each a plain file name inside the directory (no path
  separators, no ".."): an index cannot point outside the checkpoint. A directory with pickle
  weights only (pytorch_model.bin, *.pt, *.pth, *.ckpt) is refused: they are never unpickled.
  (A symlink named in the directory is followed: that is the user's own filesystem layout, as in
  the Hugging Face cache.)

Every refusal is a ModelFileError (astrai.errors) naming the file.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from astrai import json_bounded
from astrai.errors import ModelFileError, open_regular

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
MAX_JSON_BYTES = 64 * 2 ** 20
MAX_HEADER_BYTES = 100 * 2 ** 20  # the safetensors library's own limit
PICKLES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.bin", "training_args.bin")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
# safetensors dtype -> bytes per element; the float ones are what a model's weights may be
ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4,
              "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "C64": 8}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


def read_json(path: os.PathLike | str, what: str = "JSON file") -> Any:
    return json_bounded.read_json(path, what, MAX_JSON_BYTES, error=ModelFileError)


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str          # safetensors dtype code (F32, BF16, ...)
    shape: tuple
    file: Path
    offset: int = 0     # where its bytes start in the file

    @property
    def nbytes(self) -> int:
        return self.numel * ITEM_BYTES[self.dtype]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def read_header(path: os.PathLike | str) -> dict[str, TensorInfo]:
    """The tensors a safetensors file declares, checked against the file's size; no data is read."""
    return read_header_and_metadata(path)[0]


def read_header_and_metadata(path: os.PathLike | str) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """read_header's tensors, and the file's __metadata__ (string keys and values, as the format says)."""
    path = Path(path)
    with open_regular(path, "rb", "weights file", error=ModelFileError) as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise ModelFileError(f"{path}: {size} bytes: truncated (a safetensors file starts with an 8-byte "
                                 f"header length)")
        n = int.from_bytes(f.read(8), "little")
        if n > size - 8 or n > MAX_HEADER_BYTES:
            raise ModelFileError(f"{path}: header length {n:,} is larger than the file ({size:,} bytes): "
                                 f"truncated or not a safetensors file")
        raw = f.read(n)
    header = json_bounded.loads(raw, f"{path}: the safetensors header", "safetensors header", ModelFileError)
    if not isinstance(header, dict):
        raise ModelFileError(f"{path}: the safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or \
            not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise ModelFileError(f"{path}: the safetensors header's __metadata__ must map strings to strings")
    data = size - 8 - n
    infos, spans = {}, []
    for name, e in header.items():
        where = f"{path}: tensor {name!r}"
        if not isinstance(e, dict) or e.get("dtype") not in ITEM_BYTES:
            raise ModelFileError(f"{where}: unknown dtype {e.get('dtype') if isinstance(e, dict) else e!r}")
        shape, offsets = e.get("shape"), e.get("data_offsets")
        if not isinstance(shape, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                                  for s in shape):
            raise ModelFileError(f"{where}: malformed shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
                and 0 <= offsets[0] <= offsets[1] <= data):
            raise ModelFileError(f"{where}: data offsets {offsets!r} fall outside the file's {data:,} data bytes "
                                 f"(truncated or forged)")
        if offsets[1] - offsets[0] != math.prod(shape) * ITEM_BYTES[e["dtype"]]:
            raise ModelFileError(f"{where}: shape {shape} of {e['dtype']} does not fill its "
                                 f"{offsets[1] - offsets[0]:,} bytes")
        infos[name] = TensorInfo(name, e["dtype"], tuple(shape), path, 8 + n + offsets[0])
        spans.append((offsets[0], offsets[1], name))
    end = 0
    for begin, stop, name in sorted(spans):
        if begin != end:
            raise ModelFileError(f"{path}: tensor {name!r} starts at byte {begin:,} of the data, expected {end:,} "
                                 f"(overlapping or gapped offsets)")
        end = stop
    if end != data:
        raise ModelFileError(f"{path}: the tensors cover {end:,} of the file's {data:,} data bytes")
    return infos, metadata


def _refuse_without_safetensors(d: Path):
    names = sorted(p.name for p in d.iterdir()) if d.is_dir() else []
    pickles = [n for n in names if n in PICKLES or n.endswith(PICKLE_SUFFIXES)]
    if pickles:
        raise ModelFileError(
            f"{d}: holds {', '.join(pickles[:3])} but no {WEIGHTS}: pickle files can run code when loaded, so "
            f"astrai never opens them; convert the checkpoint to safetensors where you trust it (transformers: "
            f"AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out))")
    others = [n for n in names if n.endswith(".safetensors")]
    hint = f" (found {', '.join(others[:3])} without {INDEX})" if others else ""
    raise ModelFileError(f"{d}: neither {WEIGHTS} nor {INDEX}{hint}; expected a Hugging Face model directory")


def weight_files(directory: os.PathLike | str) -> tuple[list[Path], dict[str, str]]:
    """(safetensors files, tensor name -> file name from the index, empty without an index)."""
    d = Path(directory)
    if not d.is_dir():
        raise ModelFileError(f"{d}: not a checkpoint directory")
    if (d / INDEX).exists():
        index = read_json(d / INDEX, "weight index")
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map or \
                not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
            raise ModelFileError(f"{d / INDEX}: weight_map must map tensor names to file names")
        for name, file in weight_map.items():
            if not file or file in (".", "..") or "/" in file or "\\" in file or os.path.isabs(file):
                raise ModelFileError(f"{d / INDEX}: weight_map[{name!r}] = {file!r} points outside the checkpoint "
                                     f"directory; only plain file names inside it are read")
        return [d / f for f in sorted(set(weight_map.values()))], weight_map
    if (d / WEIGHTS).exists() or (d / WEIGHTS).is_symlink():
        return [d / WEIGHTS], {}
    _refuse_without_safetensors(d)


def read_headers(directory: os.PathLike | str) -> dict[str, TensorInfo]:
    """Every tensor of a checkpoint (header facts only), each checked against the index when there is one."""
    files, weight_map = weight_files(directory)
    out: dict[str, TensorInfo] = {}
    for path in files:
        for name, info in read_header(path).items():
            if weight_map and weight_map.get(name) != path.name:
                continue  # the index decides which file a tensor is read from
            out[name] = info
    for name, file in weight_map.items():
        if name not in out:
            raise ModelFileError(f"{Path(directory) / INDEX}: tensor {name!r} is listed in {file} but that file "
                                 f"does not hold it")
    return out
