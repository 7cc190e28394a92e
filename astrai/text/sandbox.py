"""The Jinja sandbox chat templates run in, bounded in time and memory.

A chat template comes with a checkpoint or a tokenizer someone hands you: it is code in a
sandboxed language that cannot reach Python internals (jinja2's immutable sandbox), but a sandbox
alone bounds neither time nor memory: `{{ 'a' * 3000000000 }}` takes 6 GB, and two nested
`range(100000)` loops never end. Here every way a template can make something big in one step is
checked before it is made, and rendering has a deadline:

- values: what a template builds with `*`, `+`, `~`, `%`, a filter, a function or a method
  (`center`, `ljust`, `replace`, `join`, `format`, ...) may weigh at most MAX_VALUE: characters of
  its strings plus items of its lists and dicts, nested ones included (a list of a thousand
  references to one big string weighs a thousand times it, as its text would). The weight is
  predicted from the operands and refused before anything is allocated; what a call returns is
  weighed too. Every `{{ expression }}` is weighed before it is turned into text (finalize), and
  the buffers of macros, filter blocks and `{% set %}` blocks before they are joined (concat).
  Numbers: `**` and `*` on integers may not make one over MAX_INT_BITS bits; widths and counts
  passed to filters and str methods are at most MAX_VALUE. `range` keeps jinja2's own bound
  (100,000 items), `lipsum` is bounded the same way;
- output: a render may write at most MAX_OUTPUT characters (checked as it streams);
- time: a render that runs past its deadline (5 s, ASTRAI_TEMPLATE_TIMEOUT_S) is stopped by the
  watchdog of astrai.text.deadline, so a loop that allocates nothing is stopped too.

Any of these raises TemplateLimit (an InputError: the template is at fault, not a record, so a
preprocessing run stops instead of rejecting every record), named by the template. Real templates
are far inside every bound (tests/text/test_sandbox.py renders the public ones and compares with
jinja2's own sandbox).
"""

from __future__ import annotations

import math
import re
from string import Formatter
from typing import Any, Iterable

from astrai.errors import InputError
from astrai.text.deadline import TIMEOUT_ENV, Stop, WATCHDOG, render_seconds

MAX_VALUE = 1 << 24  # characters of one string / items of one list (16 Mi)
MAX_OUTPUT = 1 << 25  # characters of one render (32 Mi: far beyond any context length)
MAX_INT_BITS = 1 << 16  # bits of an integer a template computes
MAX_LIPSUM_WORDS = 100_000
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?")
_DIGITS = re.compile(r"\d+")


class TemplateLimit(InputError):
    """A template went past a bound (size, output, time)."""


# ---------------------------------------------------------------------------------------------
# size checks


def weight(value: Any, limit: int = MAX_VALUE) -> int:
    """Characters and items a value holds, nested containers included (what str(value) or
    tojson would have to write, up to escaping); counting stops once past `limit`."""
    if value.__class__ is str:
        return len(value)
    total, stack = 0, [value]
    while stack and total <= limit:
        v = stack.pop()
        if isinstance(v, (str, bytes)):
            total += len(v)
        elif isinstance(v, (list, tuple, set, frozenset)):
            total += len(v)
            stack.extend(v)
        elif isinstance(v, dict):
            total += len(v)
            stack.extend(v.keys())
            stack.extend(v.values())
    return total


def check_size(n: int, what: str) -> None:
    if n > MAX_VALUE:
        raise TemplateLimit(f"{what} would hold {n:,} characters or items; a chat template may make at most "
                            f"{MAX_VALUE:,} in one value")


def _check_int(x: Any, what: str) -> None:
    if isinstance(x, int) and not isinstance(x, bool) and abs(x) > MAX_VALUE:
        raise TemplateLimit(f"{what}: {x:,} is larger than the {MAX_VALUE:,} a chat template may pass as a width "
                            f"or count")


def _binop(op: str, a: Any, b: Any) -> None:
    if op == "*":
        for seq, n in ((a, b), (b, a)):
            if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                check_size(max(weight(seq), 1) * max(n, 0), f"'{type(seq).__name__}' * {n}")
        if isinstance(a, int) and isinstance(b, int) and a.bit_length() + b.bit_length() > MAX_INT_BITS:
            raise TemplateLimit(f"a product of integers of {a.bit_length() + b.bit_length():,} bits is too large")
    elif op == "**":
        if isinstance(a, int) and isinstance(b, int) and abs(a) > 1 and b > 0:
            if b * math.log2(abs(a)) > MAX_INT_BITS:
                raise TemplateLimit(f"{a} ** {b} is too large a number for a chat template")
    elif op == "+":
        if isinstance(a, (str, list, tuple)) and isinstance(b, (str, list, tuple)):
            check_size(weight(a) + weight(b), "a sum")
    elif op == "%" and isinstance(a, str):
        _check_percent_format(a, b)


def _check_percent_format(fmt: str, args: Any) -> None:
    values = list(args) if isinstance(args, tuple) else [args]
    for m in _PERCENT_SPEC.finditer(fmt):
        for part in m.groups():
            if part and part != "*":
                _check_int(int(part), f"format width in {fmt[:40]!r}")
    if "*" in fmt:
        for v in values:
            _check_int(v, f"format width in {fmt[:40]!r}")


def _check_brace_format(fmt: str, args: Iterable, kwargs: dict) -> None:
    try:
        fields = list(Formatter().parse(fmt))
    except ValueError:
        return  # str.format raises its own error
    for _, _, spec, _ in fields:
        for digits in _DIGITS.findall(spec or ""):
            _check_int(int(digits), f"format spec {spec!r}")
        if spec and "{" in spec:  # a nested width comes from the arguments
            for v in [*args, *kwargs.values()]:
                _check_int(v, f"format spec {spec!r}")


def _check_str_method(s: str, name: str, args: tuple, kwargs: dict) -> None:
    """Predict the size of what a str method returns, before it runs."""
    given = list(args) + list(kwargs.values())
    if name in ("center", "ljust", "rjust", "zfill"):
        for v in given:
            _check_int(v, f"str.{name}")
    elif name == "expandtabs":
        size = int(given[0]) if given and isinstance(given[0], int) else 8
        check_size(len(s) + s.count("\t") * max(size, 0), "str.expandtabs")
    elif name == "replace" and len(given) >= 2 and isinstance(given[0], str) and isinstance(given[1], str):
        old, new = given[0], given[1]
        count = s.count(old) if old else len(s) + 1
        if len(given) > 2 and isinstance(given[2], int) and given[2] >= 0:
            count = min(count, given[2])
        check_size(len(s) + count * (len(new) - len(old)), "str.replace")
    elif name == "join" and given and isinstance(given[0], (list, tuple)):
        items = given[0]
        check_size(sum(weight(x) for x in items) + len(s) * max(len(items) - 1, 0), "str.join")


def _check_filter(name: str, args: tuple, kwargs: dict) -> None:
    value = args[0] if args else None
    rest = list(args[1:]) + list(kwargs.values())
    for v in args + tuple(kwargs.values()):  # converting filters (string, tojson, join) write all of it
        check_size(weight(v), f"the argument of filter {name}")
    if name == "format" and isinstance(value, str):
        _check_percent_format(value, tuple(rest))
        return
    for v in rest:
        _check_int(v, f"filter {name}")
    if name == "indent" and isinstance(value, str):
        width = kwargs.get("width", args[1] if len(args) > 1 else 4)
        lines = value.count("\n") + 1
        check_size(len(value) + lines * (weight(width) if isinstance(width, str) else max(int(width or 0), 0)),
                   "filter indent")
    elif name == "replace" and isinstance(value, str):
        _check_str_method(value, "replace", tuple(args[1:]), kwargs)
    elif name == "join" and isinstance(value, (list, tuple)):
        sep = kwargs.get("d", args[1] if len(args) > 1 else "")
        check_size(sum(weight(x) for x in value) + weight(sep) * max(len(value) - 1, 0), "filter join")
    elif name == "tojson":
        indent = kwargs.get("indent", args[2] if len(args) > 2 else None)
        if isinstance(indent, int) and indent > 64:
            raise TemplateLimit(f"filter tojson: indent {indent} (at most 64)")


def bounded_filters(filters: dict) -> dict:
    """Every filter wrapped with the checks above (jinja2 calls filters directly, not through the
    sandbox's `call`, and folds them on constants at compile time: the wrapper runs there too)."""
    out = {}
    for name, f in filters.items():
        passes = hasattr(f, "jinja_pass_arg")  # pass_context / pass_environment ...: first argument is not the value

        def checked(*args, __f=f, __name=name, __passes=passes, **kwargs):
            _check_filter(__name, args[1:] if __passes else args, kwargs)
            result = __f(*args, **kwargs)
            check_size(weight(result), f"filter {__name}")
            return result

        if passes:
            checked.jinja_pass_arg = f.jinja_pass_arg
        out[name] = checked
    return out


def bounded_lipsum(lipsum):
    def checked(n=5, html=True, min=20, max=100):
        if not all(isinstance(v, int) for v in (n, min, max)) or n * max > MAX_LIPSUM_WORDS:
            raise TemplateLimit(f"lipsum(n={n}, max={max}): at most {MAX_LIPSUM_WORDS:,} words")
        return lipsum(n=n, html=html, min=min, max=max)
    return checked


def check_call(obj: Any, args: tuple, kwargs: dict) -> None:
    """A function or method called from a template: the sizes of its arguments, and for str methods
    the size of what they would return."""
    for v in (*args, *kwargs.values()):
        check_size(weight(v), "an argument")
    owner = getattr(obj, "__self__", None)
    if isinstance(owner, str):
        _check_str_method(owner, getattr(obj, "__name__", ""), args, kwargs)


def check_format(fmt: str, args: tuple, kwargs: dict) -> None:
    _check_brace_format(fmt, args, kwargs)


def render_bounded(compiled, name: str, variables: dict) -> str:
    """compiled.render(**variables) within MAX_OUTPUT characters and render_seconds()."""
    seconds = render_seconds()
    tid = WATCHDOG.start(seconds)
    # The watchdog's exception can arrive at any bytecode until stop() has cancelled it, the inner
    # `finally` included: the outer handler catches it wherever it lands.
    try:
        try:
            text = _collect(compiled.generate(**variables), name)
        finally:
            fired = WATCHDOG.stop(tid)
    except Stop:
        WATCHDOG.stop(tid)
        fired = True
    except TemplateLimit as e:
        if str(e).startswith("chat template "):
            raise
        raise TemplateLimit(f"chat template {name}: {e}") from None
    if fired:
        raise TemplateLimit(f"chat template {name}: rendering took more than {seconds:g} s (a loop without bound?); "
                            f"real templates take milliseconds ({TIMEOUT_ENV} sets the limit)")
    return text


def _collect(chunks, name: str) -> str:
    parts, total = [], 0
    for chunk in chunks:
        total += len(chunk)
        if total > MAX_OUTPUT:
            raise TemplateLimit(f"chat template {name}: its output passed {MAX_OUTPUT:,} characters; a chat "
                                f"template this large is a bug or an attack")
        parts.append(chunk)
    return "".join(parts)


# ---------------------------------------------------------------------------------------------
# the environment


def _finalize(value):
    # every {{ expression }} is converted to text in one step: refuse one that would be too big
    if value.__class__ is not str:
        check_size(weight(value), "an output expression")
    return value


def bounded_environment_class():
    """jinja2's ImmutableSandboxedEnvironment with the checks above wired in (imported lazily)."""
    from jinja2 import nodes
    from jinja2.compiler import CodeGenerator, optimizeconst

    plain_add = CodeGenerator.visit_Add
    from jinja2.runtime import markup_join, str_join
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedCodeGenerator(CodeGenerator):
        # `a + b`: the commonest operator of chat templates, so not routed through call_binop. With
        # a constant on either side it can only grow by the template's own text (additive, never
        # doubling): plain Python `+`. Otherwise one function call, strings checked inline.
        @optimizeconst
        def visit_Add(self, node, frame):
            if isinstance(node.left, nodes.Const) or isinstance(node.right, nodes.Const):
                return plain_add(self, node, frame)
            self.write("environment.bounded_add(")
            self.visit(node.left, frame)
            self.write(", ")
            self.visit(node.right, frame)
            self.write(")")

        # `a ~ b ~ c` joins in one C call: its size is checked first (environment.bounded_concat)
        @optimizeconst
        def visit_Concat(self, node, frame):
            self.write("environment.bounded_concat(context, (")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        code_generator_class = BoundedCodeGenerator
        intercepted_binops = frozenset({"*", "**", "%"})  # and "+" (visit_Add)

        def __init__(self, *args, **kwargs):
            super().__init__(*args, finalize=_finalize, **kwargs)
            self.filters = bounded_filters(self.filters)
            self.globals["lipsum"] = bounded_lipsum(self.globals["lipsum"])

        def call_binop(self, context, operator, left, right):
            _binop(operator, left, right)
            return super().call_binop(context, operator, left, right)

        @staticmethod
        def bounded_add(left, right):
            if left.__class__ is str and right.__class__ is str and len(left) + len(right) <= MAX_VALUE:
                return left + right
            _binop("+", left, right)
            result = left + right
            check_size(weight(result), "a sum")
            return result

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's signature)
            check_call(__obj, args, kwargs)
            result = super().call(__context, __obj, *args, **kwargs)
            check_size(weight(result), f"what {getattr(__obj, '__name__', 'a call')}() returned")
            return result

        @staticmethod
        def concat(parts):
            # the buffers of macros, filter blocks and block sets are joined here (the render itself
            # streams through _collect)
            parts = parts if isinstance(parts, list) else list(parts)
            check_size(sum(map(len, parts)), "a macro or block's output")
            return "".join(parts)

        def wrap_str_format(self, value):
            wrapped = super().wrap_str_format(value)
            if wrapped is None:
                return None
            fmt = value.__self__

            def checked(*args, **kwargs):
                if value.__name__ == "format_map":
                    mapping = args[0] if args and isinstance(args[0], dict) else {}
                    check_format(fmt, (), mapping)
                else:
                    check_format(fmt, args, kwargs)
                result = wrapped(*args, **kwargs)
                check_size(len(result), "str.format")
                return result
            return checked

        @staticmethod
        def bounded_concat(context, parts):
            check_size(sum(weight(p) for p in parts), "a '~' join")
            return markup_join(parts) if context.eval_ctx.autoescape else str_join(parts)

    return BoundedSandbox
