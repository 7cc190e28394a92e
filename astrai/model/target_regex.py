"""PEFT's `target_modules` given as a regular expression, matched in bounded time.

PEFT selects a module when `re.fullmatch(target_modules, name)`. Python's re backtracks and has no
timeout: `(.+)+x` against a 60-character module name that does not end in x tries every way of
splitting the name, which does not end in a lifetime. So the pattern is parsed by re's own parser
(its syntax, its error messages) and matched by simulating the automaton of that parse
(Thompson's construction, with the subsets met cached as in a lazy DFA): a name of n characters
takes n steps over at most MAX_STATES states, whatever the pattern, and the whole selection has a
budget of MAX_WORK state visits. A fullmatch asks only whether the name is in the pattern's
language, so greedy and lazy repeats are the same automaton; that is what makes this exact.

Refused with a message naming the construct (each is a ValueError; the caller adds the file and key):
a pattern over MAX_PATTERN characters, re's own syntax errors, what is not a regular language or
changes matching beyond it (back-references, look-around, conditionals, possessive repeats and
atomic groups, \\b and \\B, case-insensitive matching), and a pattern that expands to more than
MAX_STATES states (large {m,n} counts). Module names hold no newline (they are attribute names
joined by dots), so ^ and \\A match at the start, $ and \\Z at the end, with or without (?m).
"""

from __future__ import annotations

import re
from typing import Callable, Iterable

try:  # Python >= 3.11
    from re import _constants as C, _parser as sre_parse
except ImportError:  # Python 3.10
    import sre_constants as C  # type: ignore[no-redef]
    import sre_parse  # type: ignore[no-redef]

MAX_PATTERN = 1000  # characters
MAX_STATES = 5000   # automaton states after {m,n} expansion
MAX_WORK = 20_000_000  # state visits over all names of one selection (a few seconds at worst)
_CACHE = 50_000     # cached (state set, character) transitions

_STARTS = {C.AT_BEGINNING, C.AT_BEGINNING_STRING}
_ENDS = {C.AT_END, C.AT_END_STRING}
_REFUSED = {C.GROUPREF: "back-references", C.GROUPREF_EXISTS: "conditional groups",
            C.ASSERT: "look-ahead/look-behind", C.ASSERT_NOT: "negative look-ahead/look-behind"}
for _name, _what in (("POSSESSIVE_REPEAT", "possessive repeats"), ("ATOMIC_GROUP", "atomic groups")):
    if hasattr(C, _name):
        _REFUSED[getattr(C, _name)] = _what


def _category(cat, ascii_only: bool) -> Callable[[str], bool]:
    """re's character categories (\\d \\w \\s and their negations), in str (Unicode) or ASCII mode."""
    if ascii_only:
        def digit(c): return "0" <= c <= "9"
        def word(c): return c.isascii() and (c.isalnum() or c == "_")
        def space(c): return c in " \t\n\r\f\v"
    else:
        def digit(c): return c.isdecimal()
        def word(c): return c.isalnum() or c == "_"
        def space(c): return c.isspace()
    table = {C.CATEGORY_DIGIT: digit, C.CATEGORY_WORD: word, C.CATEGORY_SPACE: space,
             C.CATEGORY_NOT_DIGIT: lambda c: not digit(c), C.CATEGORY_NOT_WORD: lambda c: not word(c),
             C.CATEGORY_NOT_SPACE: lambda c: not space(c)}
    if cat not in table:
        raise ValueError(f"the character category {cat} is not supported")
    return table[cat]


def _char_class(items, ascii_only: bool) -> Callable[[str], bool]:
    negate, tests = False, []
    for op, av in items:
        if op is C.NEGATE:
            negate = True
        elif op is C.LITERAL:
            tests.append(lambda c, v=chr(av): c == v)
        elif op is C.NOT_LITERAL:
            tests.append(lambda c, v=chr(av): c != v)
        elif op is C.RANGE:
            tests.append(lambda c, lo=chr(av[0]), hi=chr(av[1]): lo <= c <= hi)
        elif op is C.CATEGORY:
            tests.append(_category(av, ascii_only))
        else:
            raise ValueError(f"the character-set item {op} is not supported")
    return lambda c: any(t(c) for t in tests) != negate


class _Builder:
    """Thompson's construction, built back to front: each piece is compiled knowing the state that
    follows it. States: ("char", test, next), ("split", [next...]), ("at", "start"|"end", next), ("match",)."""

    def __init__(self, flags: int):
        self.states: list = [("match",)]
        self.flags = flags

    def add(self, state) -> int:
        if len(self.states) >= MAX_STATES:
            raise ValueError(f"it expands to more than {MAX_STATES} automaton states (large {{m,n}} repeat counts); "
                             f"write it with fewer repeats, or list the module names")
        self.states.append(state)
        return len(self.states) - 1

    def seq(self, items, nxt: int, flags: int) -> int:
        for op, av in reversed(list(items)):
            nxt = self.item(op, av, nxt, flags)
        return nxt

    def item(self, op, av, nxt: int, flags: int) -> int:
        ascii_only = bool(flags & C.SRE_FLAG_ASCII)
        if op in _REFUSED:
            raise ValueError(f"{_REFUSED[op]} are not supported (only regular expressions that re and a finite "
                             f"automaton agree on)")
        if op is C.LITERAL:
            return self.add(("char", lambda c, v=chr(av): c == v, nxt))
        if op is C.NOT_LITERAL:
            return self.add(("char", lambda c, v=chr(av): c != v, nxt))
        if op is C.ANY:
            dotall = bool(flags & C.SRE_FLAG_DOTALL)
            return self.add(("char", (lambda c: True) if dotall else (lambda c: c != "\n"), nxt))
        if op is C.IN:
            return self.add(("char", _char_class(av, ascii_only), nxt))
        if op is C.SUBPATTERN:
            _group, add, remove, body = av
            if add & C.SRE_FLAG_IGNORECASE:
                raise ValueError("case-insensitive matching (?i) is not supported; module names are lower case")
            return self.seq(body, nxt, (flags | add) & ~remove)
        if op is C.BRANCH:
            return self.add(("split", [self.seq(alt, nxt, flags) for alt in av[1]]))
        if op in (C.MAX_REPEAT, C.MIN_REPEAT):  # greedy or lazy: the same language
            low, high, body = av
            cont = nxt
            if high == C.MAXREPEAT:
                loop = self.add(("split", None))
                self.states[loop] = ("split", [self.seq(body, loop, flags), nxt])
                cont = loop
            else:
                for _ in range(high - low):
                    cont = self.add(("split", [self.seq(body, cont, flags), nxt]))
            for _ in range(low):
                cont = self.seq(body, cont, flags)
            return cont
        if op is C.AT:
            if av in _STARTS:
                return self.add(("at", "start", nxt))
            if av in _ENDS:
                return self.add(("at", "end", nxt))
            raise ValueError("word boundaries (\\b, \\B) are not supported")
        raise ValueError(f"the construct {op} is not supported")


class TargetPattern:
    """A compiled `target_modules` pattern: `select(names)` is [n for n in names if re.fullmatch(pattern, n)]."""

    def __init__(self, pattern: str):
        if not isinstance(pattern, str):
            raise ValueError(f"must be a regular expression (a string), got {pattern!r}")
        if len(pattern) > MAX_PATTERN:
            raise ValueError(f"a pattern of {len(pattern):,} characters; at most {MAX_PATTERN} are matched "
                             f"(list the module names instead)")
        try:
            parsed = sre_parse.parse(pattern)
        except re.error as e:
            raise ValueError(f"{pattern!r} is not a valid regular expression: {e}") from None
        except RecursionError:
            raise ValueError(f"{pattern!r} nests groups too deeply") from None
        flags = parsed.state.flags
        if flags & C.SRE_FLAG_IGNORECASE:
            raise ValueError("case-insensitive matching (?i) is not supported; module names are lower case")
        b = _Builder(flags)
        try:
            self.start = b.seq(parsed, 0, flags)
        except RecursionError:
            raise ValueError(f"{pattern!r} nests groups too deeply") from None
        self.states = b.states
        self.pattern = pattern
        self._step: dict = {}
        self.work = 0

    def _spend(self, n: int):
        self.work += n
        if self.work > MAX_WORK:
            raise ValueError(f"{self.pattern!r} costs more than {MAX_WORK:,} automaton steps to match against "
                             f"the model's module names; simplify it, or list the module names")

    def _closure(self, todo: Iterable[int], at_start: bool, at_end: bool) -> frozenset:
        """The states reachable without consuming a character; an anchor that does not hold here is
        kept (an end anchor may hold once the name ends)."""
        seen, stack = set(), list(todo)
        while stack:
            s = stack.pop()
            if s in seen:
                continue
            seen.add(s)
            st = self.states[s]
            if st[0] == "split":
                stack.extend(st[1])
            elif st[0] == "at" and (at_start if st[1] == "start" else at_end):
                stack.append(st[2])
        self._spend(len(seen))
        return frozenset(seen)

    def fullmatch(self, name: str) -> bool:
        if "\n" in name:
            raise ValueError(f"module name {name!r} holds a newline")
        current = self._closure([self.start], True, not name)
        for c in name:
            key = (current, c)
            nxt = self._step.get(key)
            if nxt is None:
                moved = [st[2] for st in map(self.states.__getitem__, current) if st[0] == "char" and st[1](c)]
                self._spend(len(current))
                nxt = self._closure(moved, False, False)
                if len(self._step) < _CACHE:
                    self._step[key] = nxt
            else:
                self._spend(1)
            if not nxt:
                return False
            current = nxt
        return 0 in self._closure(current, not name, True)

    def select(self, names: Iterable[str]) -> list[str]:
        return [n for n in names if self.fullmatch(n)]
