"""Chat templates rendered exactly as transformers' `apply_chat_template(..., tokenize=False)`.

Same Jinja environment behaviour as transformers (facts taken from its documented behaviour):
an immutable sandbox, trim_blocks and lstrip_blocks on, the loopcontrols extension, a `tojson`
filter that does not HTML-escape (ensure_ascii False, optional indent/separators/sort_keys),
`raise_exception`, `strftime_now`, and the special tokens (bos_token, eos_token, ...) passed as
variables, overridable by extra template kwargs. Messages are normalized the same way: keys whose
value is None are dropped, and reasoning given under `reasoning_content`, `thinking` or `reasoning`
is visible to the template under both `reasoning_content` and `thinking`.

A `{% generation %}` block is accepted (and renders its body) so templates written for
`return_assistant_tokens_mask` work; astrai does not depend on it for masks.

Templates run sandboxed: a template can read its inputs and nothing else.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

from astrai.errors import InputError, read_text_regular
from astrai.text.sandbox import (TemplateLimit, bounded_environment_class, bounded_filters, check_size, render_bounded,
                                 weight)

__all__ = ["ChatTemplate", "TemplateLimit", "TemplateRaised", "resolve_template", "bundled_templates"]
MAX_TEMPLATE_BYTES = 1 << 20  # a chat template file (real ones are a few KB)

TEMPLATE_DIR = Path(__file__).resolve().parents[1] / "templates"  # package data: ships in the wheel
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class TemplateRaised(Exception):
    """The template called raise_exception (e.g. roles out of order)."""


def _make_environment():
    import jinja2
    import jinja2.ext
    import jinja2.nodes

    class GenerationBlock(jinja2.ext.Extension):
        # `{% generation %}...{% endgeneration %}` renders its body unchanged.
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise TemplateRaised(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    class SafeNamespace(jinja2.utils.Namespace):
        # Namespaces may not hold underscore names: no route to Python internals.
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                SafeNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            SafeNamespace._check(name)
            check_size(weight(value), f"namespace value {name!r}")
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"templates cannot set underscore attribute {name!r} on a namespace")

    class SafeDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    env = bounded_environment_class()(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters.update(bounded_filters({"tojson": tojson}))
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = SafeDict()
    env.globals["namespace"] = SafeNamespace
    return env


@lru_cache(maxsize=None)
def _environment():
    return _make_environment()


@lru_cache(maxsize=64)
def _compile(source: str):
    return _environment().from_string(source)


def normalize_messages(messages: list[dict]) -> list[dict]:
    """What the template sees: None-valued keys dropped, reasoning aliased (as transformers does)."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


class ChatTemplate:
    def __init__(self, source: str, name: str):
        self.source = source
        self.name = name
        try:
            self._compiled = _compile(source)
        except TemplateLimit as e:  # a constant expression folded at compile time went past a bound
            raise TemplateLimit(f"chat template {name}: {e}") from None
        except Exception as e:  # jinja2.TemplateSyntaxError: report where
            line = getattr(e, "lineno", None)
            raise InputError(f"chat template {name}" + (f":{line}" if line else "") + f": {e}") from None

    def reads(self, name: str) -> bool:
        """Whether the template reads variable `name` at all (e.g. `tools`: a template that never does cannot show
        tools to the model)."""
        import jinja2.meta

        if not hasattr(self, "_reads"):
            self._reads = jinja2.meta.find_undeclared_variables(_environment().parse(self.source))
        return name in self._reads

    def render(self, messages: list[dict], *, add_generation_prompt: bool = False, tools: Optional[list] = None,
               special_tokens: Optional[dict] = None, **kwargs: Any) -> str:
        """Render like apply_chat_template(messages, tokenize=False, ...). Raises TemplateRaised."""
        variables = {**(special_tokens or {}), **kwargs}
        return render_bounded(self._compiled, self.name, dict(
            variables, messages=normalize_messages(messages), tools=tools, documents=None,
            add_generation_prompt=add_generation_prompt))


def bundled_templates() -> dict[str, Path]:
    return {p.stem: p for p in sorted(TEMPLATE_DIR.glob("*.jinja"))}


def resolve_template(spec: str, tokenizer=None, base_dir: Optional[str | Path] = None) -> ChatTemplate:
    """`tokenizer` | a .jinja path (relative to base_dir) | a bundled name (chatml, llama3, ...)."""
    if spec == "tokenizer":
        if tokenizer is None or not tokenizer.chat_template:
            where = tokenizer.path if tokenizer is not None else "the tokenizer"
            raise InputError(f"chat_template: tokenizer, but {where} has no chat_template "
                             f"(tokenizer_config.json or chat_template.jinja); use a bundled name: "
                             f"{', '.join(bundled_templates())}")
        return ChatTemplate(tokenizer.chat_template, f"tokenizer:{tokenizer.path}")
    bundled = bundled_templates()
    if spec in bundled:
        return ChatTemplate(bundled[spec].read_text(encoding="utf-8"), spec)
    path = Path(spec).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    if not path.exists() and (TEMPLATE_DIR.parent / spec).exists():  # e.g. templates/chatml.jinja
        path = TEMPLATE_DIR.parent / spec
    if path.exists():
        return ChatTemplate(read_text_regular(path, "chat_template", MAX_TEMPLATE_BYTES), str(path))
    raise InputError(f"chat_template '{spec}': not 'tokenizer', not a bundled template "
                     f"({', '.join(bundled)}) and no such file {path}")
