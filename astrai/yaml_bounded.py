"""YAML loading with bounded resources: safe tags only, alias expansion and nesting capped.

PyYAML shares one node for an anchor and all its aliases, so composing a "billion laughs"
document is cheap, but everything that walks the result as a tree (the line-marks pass, pydantic
validation, model dumps) expands every alias again: a 541-byte pipeline took 7.8 GB and 91 s.
So the document is composed once, its expanded size (values counted as a tree, aliases
included) is computed on the shared node graph in linear time, and a document whose tree would
hold more than MAX_VALUES values, or that refers to itself, is refused at the place where it
grows, before anything walks it. Real configs hold a few hundred values.

Errors are yaml.MarkedYAMLError, so callers that already report YAML errors with their line and
column report these the same way.
"""

from __future__ import annotations

from typing import Any, Optional

import yaml

MAX_VALUES = 100_000  # values in the alias-expanded tree
MAX_DEPTH = 100  # nesting levels (the composer recurses per level; deeper input is not a config)


class YAMLTooLarge(yaml.MarkedYAMLError):
    """A document over the limits, with the mark of the node where it exceeds them."""


def load(text: str) -> tuple[Any, Optional[yaml.Node]]:
    """(data, root node) of a single YAML document; raises yaml.YAMLError (marked where possible)."""
    loader = yaml.SafeLoader(text)
    try:
        try:
            node = loader.get_single_node()
        except RecursionError:
            raise YAMLTooLarge(problem=f"nested too deeply (more than {MAX_DEPTH} levels)",
                               problem_mark=loader.get_mark()) from None
        if node is None:
            return None, None
        check(node)
        return loader.construct_document(node), node
    finally:
        loader.dispose()


def check(root: yaml.Node) -> int:
    """The number of values in root's alias-expanded tree; raises YAMLTooLarge over the limits.

    Iterative post-order over the node graph with one size per distinct node, so the cost is the
    size of the document as written, whatever its aliases expand to.
    """
    size: dict[int, int] = {}
    on_path: set[int] = set()  # pre-visited, not yet sized: exactly the ancestors of the node on top
    stack: list[tuple[yaml.Node, int, bool]] = [(root, 1, False)]
    while stack:
        node, depth, sized_kids = stack.pop()
        nid = id(node)
        kids = _children(node)
        if sized_kids:
            on_path.discard(nid)
            total = 1 + sum(size[id(k)] for k in kids)
            if total > MAX_VALUES:
                raise YAMLTooLarge(problem=f"aliases expand this document to more than {MAX_VALUES} values (an "
                                           f"alias bomb?); write the values out or use fewer aliases",
                                   problem_mark=node.start_mark)
            size[nid] = total
            continue
        if nid in size:
            continue
        if depth > MAX_DEPTH:
            raise YAMLTooLarge(problem=f"nested too deeply (more than {MAX_DEPTH} levels)",
                               problem_mark=node.start_mark)
        on_path.add(nid)
        stack.append((node, depth, True))
        for kid in kids:
            if id(kid) in on_path:
                raise YAMLTooLarge(problem="an alias refers to a node that contains it (a recursive document "
                                           "has no finite expansion)", problem_mark=kid.start_mark)
            if id(kid) not in size:
                stack.append((kid, depth + 1, False))
    return size[id(root)]


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for kv in node.value for n in kv]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []
