"""Training precision: `precision: fp32 | bf16-mixed | auto` (TrainOptions) resolved for one run.

bf16-mixed is mixed precision as torch.autocast defines it: the parameters (the master weights),
their gradients and the AdamW state stay float32; each forward (the step's, the reference and
old-policy log-probs of DPO/GRPO, validation) runs under `torch.autocast(device, torch.bfloat16)`,
so matrix products (linear layers, attention, the LM head) take bf16 operands and accumulate in
fp32, and their backward products run in bf16 too; the loss itself (log-softmax, cross-entropy,
DPO/GRPO terms) is computed on logits widened to float32 (astrai.train.lm_loss). No loss scaling:
bf16 has float32's exponent range, so gradients do not underflow as fp16's do.

A bf16 result carries 8 significant bits (relative rounding up to 2^-9), so a bf16-mixed run follows
the fp32 run's loss curve closely but not bitwise (the tolerance tests/train/test_precision.py
derives, and the figure on the SmolLM2 job, are in bench/RESULTS.md). Where bf16 products are not
faster (a CPU without AVX-512 BF16 or AMX) it only costs time; `auto` picks bf16-mixed only where
they are (astrai.runtime.hardware.bf16_matmul_fast, the probe the engine's `dtype: auto` uses too).

The trained parameters must be float32 for bf16-mixed (TrainOptions checks it): dtype float32, or
with lora a bfloat16 base (frozen, never updated; the adapters are float32). `auto` resolves to
fp32 for any other dtype (float64 exactness runs, bf16/fp16 weights).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from astrai.config.train import bf16_mixed_allowed
from astrai.runtime.hardware import bf16_matmul_fast


@dataclass(frozen=True)
class Precision:
    name: str            # "fp32" or "bf16-mixed": what the run does
    reason: str          # why, in a few words (printed with it)
    device_type: str = "cpu"

    @property
    def mixed(self) -> bool:
        return self.name == "bf16-mixed"

    def autocast(self):
        """The context each forward runs in: torch.autocast to bf16 under bf16-mixed, nothing under fp32."""
        return torch.autocast(self.device_type, dtype=torch.bfloat16) if self.mixed else nullcontext()

    def line(self) -> str:
        return f"precision {self.name} ({self.reason})"

    @property
    def worth_saying(self) -> bool:
        """Whether the start of training prints the choice: for bf16-mixed and for auto's choice; not for fp32
        asked for (the default: a run's stderr stays its error line alone, on every machine)."""
        return not (self.name == "fp32" and self.reason.startswith("asked for"))


def resolve(option: str, dtype: str, device, lora: bool = False) -> Precision:
    """The precision a run with these options uses on `device` (auto asks the hardware probe); the
    reason says what the probe found, also when the option was explicit."""
    kind = torch.device(device).type
    allowed = bf16_mixed_allowed(dtype, lora)
    fast, why = bf16_matmul_fast(device) if allowed else (False, f"dtype {dtype}: bf16-mixed needs float32 "
                                                                 f"master weights")
    if option == "bf16-mixed":
        return Precision("bf16-mixed", f"asked for; {why}", kind)
    if option == "fp32":
        return Precision("fp32", f"asked for; precision: auto would pick bf16-mixed here, {why}" if fast
                         else "asked for", kind)
    return Precision("bf16-mixed" if fast else "fp32", f"auto: {why}", kind)
