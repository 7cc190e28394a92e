"""What the train stage needs to know about a preprocess output, and the checks made before work.

`TrainData(dir)` opens the shards (astrai.data.load.ShardDataset: memory-mapped, never loaded
whole), tells what kind of rows they are (single-output with or without labels, DPO pairs, GRPO
groups) and rebuilds the tokenizer the data was made with (the manifest's tokenizer plus the
pipeline's added tokens), so checkpoints carry exactly that tokenizer and the model's vocabulary
can be checked against it; a tokenizer directory whose files changed since preprocessing (its
fingerprint differs from the manifest's) is refused. `compat_problems` lists every invalid combination at once, each with
its fix.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from astrai.data.load import ShardDataset
from astrai.errors import InputError
from astrai.runtime import atomic_write_text
from astrai.schema import INPUT_IDS, LABELS


class TrainData:
    def __init__(self, directory):
        self.dir = Path(directory)
        self.dataset = ShardDataset(self.dir)
        cols = set(self.dataset.manifest.get("columns") or self.dataset.columns)
        if "chosen_input_ids" in cols:
            self.kind = "dpo"
        elif "completion_input_ids" in cols:
            self.kind = "grpo"
        else:
            self.kind = "labels" if LABELS in cols else "text"
        self.has_tokens = INPUT_IDS in cols or self.kind in ("dpo", "grpo")
        self._tok = None

    def __len__(self):
        return len(self.dataset)

    @property
    def tokenizer_fingerprint(self) -> str:
        return str((self.dataset.manifest.get("tokenizer") or {}).get("fingerprint", ""))

    @property
    def tokenizer(self):
        """The tokenizer the data was made with, refused when its files changed since (the manifest
        records their fingerprint): training must not ship another tokenizer than its data's."""
        if self._tok is None:
            from astrai.text.tokenizer import load_tokenizer, with_added_tokens

            man = self.dataset.manifest
            tok = load_tokenizer(man["tokenizer"]["path"])
            if tok.fingerprint != self.tokenizer_fingerprint:
                raise InputError(f"{self.dir}: the tokenizer it was made with, {tok.path}, changed since (fingerprint "
                                 f"{tok.fingerprint[:12]}, the manifest records {self.tokenizer_fingerprint[:12]}); "
                                 f"restore it, or preprocess the data again with the tokenizer as it is now")
            self._tok = with_added_tokens(tok, man["pipeline"].get("added_tokens") or [])
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.tok.get_vocab_size(with_added_tokens=True)

    @property
    def chat_template(self):
        """The template the data was rendered with (a ChatTemplate), or None: no template section."""
        from astrai.text.template import ChatTemplate

        man = self.dataset.manifest
        source = man.get("chat_template_source")
        if source is None:  # a manifest that records only the template's name
            spec = man["pipeline"].get("chat_template")
            if not spec:
                return None
            from astrai.text.template import resolve_template

            return resolve_template(spec, self.tokenizer)
        return ChatTemplate(source, str(man.get("chat_template") or "the data's template"))

    def write_tokenizer(self, out: Path):
        """tokenizer.json (with the added tokens), its config files, and the chat template the data was
        rendered with, as chat_template.jinja and (where the config holds one) in tokenizer_config.json:
        generate, chat and serve render with exactly the template training saw."""
        tok = self.tokenizer
        out = Path(out)
        tok.tok.save(str(out / "tokenizer.json"))
        for name in ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
            if (tok.path / name).exists():
                shutil.copyfile(tok.path / name, out / name)
        template = self.chat_template
        if template is None:
            return
        atomic_write_text(out / "chat_template.jinja", template.source)
        config = out / "tokenizer_config.json"
        if config.exists():
            data = json.loads(config.read_text(encoding="utf-8"))
            if "chat_template" in data:  # tools that read only the config must see the same template
                data["chat_template"] = template.source
                atomic_write_text(config, json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def compat_problems(strategy: str, data: TrainData, model_vocab: int, online: bool = False) -> list[str]:
    p = []
    if online:  # online grpo samples its completions: the data holds prompts (single-output rows)
        if data.kind in ("dpo", "grpo"):
            p.append(f"online grpo (rollout) trains on prompts, but {data.dir} holds {data.kind} records; preprocess "
                     f"prompts with add_generation_prompt: true (see pipelines/grpo_prompts.yaml)")
        strategy = "online"
    if strategy == "sft" and data.kind != "labels":
        p.append(f"strategy sft needs labels, but {data.dir} is {data.kind} data; use strategy: seq for plain "
                 f"text, or preprocess with mask rules" if data.kind == "text" else
                 f"strategy sft needs single-output rows with labels, but {data.dir} holds {data.kind} records; "
                 f"use strategy: {data.kind}")
    if strategy == "seq" and data.kind in ("dpo", "grpo"):
        p.append(f"strategy seq needs single-output rows, but {data.dir} holds {data.kind} records; "
                 f"use strategy: {data.kind}")
    if strategy in ("dpo", "grpo") and data.kind != strategy:
        p.append(f"strategy {strategy} needs the {strategy} output of a preprocess stage (a pipeline with "
                 f"sources, see pipelines/{strategy}_chatml.yaml), but {data.dir} is {data.kind} data")
    if data.vocab_size > model_vocab:
        p.append(f"the data's tokenizer has {data.vocab_size} tokens but the model's embedding only {model_vocab}; "
                 f"use a model with vocab_size >= {data.vocab_size} (a size preset takes the tokenizer's size)")
    return p


def template_problem(data: TrainData, model: str) -> str | None:
    """Why training checkpoint `model` on `data` would teach a format it never sees at inference: the
    data was rendered with another chat template than the one the checkpoint serves with (its
    tokenizer's), and the pipeline did not say `chat_template_mismatch: allow`. None when fine, or
    when `model` has no template of its own (a preset or a config.json: random weights)."""
    from astrai.text.drift import MISMATCH_FIX, template_difference
    from astrai.text.template import resolve_template
    from astrai.text.tokenizer import load_tokenizer

    template = data.chat_template
    if template is None or data.dataset.manifest["pipeline"].get("chat_template_mismatch") == "allow":
        return None
    d = Path(model)
    if not (d / "tokenizer.json").is_file():
        return None
    tok = load_tokenizer(str(d))
    if not tok.chat_template:
        return None
    kwargs = (data.dataset.manifest["pipeline"].get("input") or {}).get("template_kwargs") or {}
    diff = template_difference(template, resolve_template("tokenizer", tok), tok.special_tokens_map, kwargs)
    return f"{data.dir}: {diff}; {MISMATCH_FIX}" if diff else None
