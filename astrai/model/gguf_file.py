"""A llama.cpp GGUF file, checked before it is converted into a checkpoint (astrai.model.packaged).

What astrai reads: the Llama family (`general.architecture` llama or mistral: the layout astrai's
decoder computes, which transformers' GGUF reader maps to LlamaForCausalLM / MistralForCausalLM),
tensors stored as F32, F16, BF16, Q8_0, Q4_0 or Q4_1 (dequantized to float32 on conversion, by the
`gguf` package's own dequantizers through transformers), and the tokenizer (`tokenizer.ggml.*`: a
byte-level BPE or a SentencePiece vocabulary) and chat template (`tokenizer.chat_template`) the file
carries. Anything else is refused before any conversion, in one line naming the file and the key or
tensor: another architecture, another tensor type (the K-quants, IQ types: convert them with
llama.cpp's `llama-quantize` to Q8_0 first), a file cut short (a tensor whose bytes end past the end
of the file), a file that is not GGUF.
"""

from __future__ import annotations

from pathlib import Path

from astrai.errors import ModelFileError

ARCHITECTURES = ("llama", "mistral")
TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
TOKENIZERS = ("gpt2", "llama")  # byte-level BPE, SentencePiece: what transformers builds a tokenizer from


def _reader(path: Path):
    try:
        import gguf
    except ImportError as e:
        raise ModelFileError(f"{path}: reading GGUF files needs the gguf package (pip install gguf): {e}") from None

    class Reader(gguf.GGUFReader):
        """gguf's reader, with every tensor checked (its type, its bytes inside the file) before the
        reader builds a view on it, so a bad one is named rather than failing in numpy."""

        def _build_tensors(self, start_offs, fields):
            import numpy as np

            size = len(self.data)
            for field in fields:
                _, name_data, _, dims, raw_dtype, offset = field.parts
                name = bytes(name_data).decode("utf-8", "replace")
                try:
                    kind = gguf.GGMLQuantizationType(int(raw_dtype[0]))
                except ValueError:
                    raise ModelFileError(f"{path}: tensor {name!r} has tensor type {int(raw_dtype[0])}, which gguf "
                                         f"does not know") from None
                if kind.name not in TENSOR_TYPES:
                    raise ModelFileError(f"{path}: tensor {name!r} is stored as {kind.name}, which astrai does not "
                                         f"read; supported: {', '.join(TENSOR_TYPES)} (llama.cpp's llama-quantize "
                                         f"converts to Q8_0)")
                block, type_size = gguf.GGML_QUANT_SIZES[kind]
                end = int(start_offs + offset[0]) + int(np.prod(dims)) * type_size // block
                if end > size:
                    raise ModelFileError(f"{path}: tensor {name!r} ends at byte {end}, past the end of the file "
                                         f"({size} bytes): the file is truncated")
            return super()._build_tensors(start_offs, fields)

    return Reader


def _field(reader, key: str):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def check_gguf(path) -> dict:
    """Raise ModelFileError naming the file and the key or tensor unless astrai can convert `path`;
    returns its architecture and tensor count."""
    path = Path(path)
    Reader = _reader(path)
    try:
        reader = Reader(str(path))
    except ModelFileError:
        raise
    except (ValueError, IndexError, KeyError, OSError) as e:  # bad magic, version, a header cut short
        raise ModelFileError(f"{path}: not a readable GGUF file ({e})") from None
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelFileError(f"{path}: general.architecture is {arch!r}; astrai reads the Llama family: "
                             f"{', '.join(ARCHITECTURES)}")
    tok = _field(reader, "tokenizer.ggml.model")
    if tok not in TOKENIZERS:
        raise ModelFileError(f"{path}: tokenizer.ggml.model is {tok!r}; astrai builds the tokenizer from "
                             f"{' or '.join(TOKENIZERS)} vocabularies" if tok is not None else
                             f"{path}: no tokenizer.ggml.model: the file carries no tokenizer")
    for key in (f"{arch}.block_count", f"{arch}.embedding_length", f"{arch}.attention.head_count"):
        if _field(reader, key) is None:
            raise ModelFileError(f"{path}: {key} is missing")
    return {"architecture": arch, "tensors": len(reader.tensors)}
