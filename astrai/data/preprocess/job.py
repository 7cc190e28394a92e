"""What a preprocess worker needs: the job description (picklable) and the per-process context.

`Job` is plain data, so workers can be processes or remote tasks. `Worker` is the context a
worker process holds (the job and its `Processor`); astrai.runtime builds it once per process
through `Worker.build`, or hands forked workers the one the parent already built.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from astrai.config.pipeline import Pipeline
from astrai.data.holdout import Holdout
from astrai.data.process import Processor

WORK = ".work"  # per-run scratch folder inside the output: markers, rejects, intermediates


@dataclass(frozen=True)
class Job:
    pipeline: Pipeline
    tokenizer: str  # resolved tokenizer directory
    base_dir: str  # where relative pipeline paths (a .jinja template) are resolved
    out: str
    holdout: Optional[Holdout] = None  # one side of a held-out split: the other side's records are skipped

    @property
    def global_pack(self) -> bool:
        """Packing over the whole dataset (two passes) rather than streamed per partition."""
        return self.pipeline.preprocessing.packing_strategy in ("bfd", "bfd_split")

    @property
    def work(self) -> Path:
        return Path(self.out) / WORK

    def marker(self, part_name: str) -> Path:
        """A partition's completion marker (holds its statistics)."""
        return self.work / f"{part_name}.json"


@dataclass(frozen=True)
class Worker:
    job: Job
    processor: Processor

    @staticmethod
    def build(job: Job) -> "Worker":
        from astrai.text.tokenizer import load_tokenizer

        return Worker(job, Processor(job.pipeline, load_tokenizer(job.tokenizer, added_tokens=job.pipeline.added_tokens),
                                     job.base_dir))
