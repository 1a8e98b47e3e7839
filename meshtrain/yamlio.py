"""YAML that users hand in (config files, ``section.field=value`` overrides) and that the run writes
back: parsed by a safe loader that refuses duplicate keys, nesting deeper than ``MAX_DEPTH`` and
alias bombs (``loads``, raising ``Refused`` or ``yaml.YAMLError``; ``problem`` says the latter in one
line), and values written on one line (``one_line``). ``meshtrain.config`` turns each refusal into
its one-line ``ConfigError`` naming the file or the field."""

from __future__ import annotations

import math
from typing import Any

import yaml

from meshtrain.errors import shown


class _BoundedLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that rejects duplicate keys, nesting deeper than ``MAX_DEPTH`` and
    documents that expand (aliases counted in full, as the config's consumers would walk them) to
    more than ``MAX_NODES`` nodes: a "billion laughs" alias bomb is refused before it is expanded."""

    MAX_DEPTH = 64
    MAX_NODES = 100_000

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent, index):
        self._depth += 1
        try:
            if self._depth > self.MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise Refused(f"nested more than {self.MAX_DEPTH} levels deep (line {mark.line + 1})")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def get_single_node(self):
        node = super().get_single_node()
        if node is not None:
            sizes: dict[int, int] = {}

            def size(n) -> int:  # the node graph is a DAG (aliases share nodes): memoise by identity
                if id(n) not in sizes:
                    children = n.value if isinstance(n, yaml.SequenceNode) else (
                        [item for pair in n.value for item in pair] if isinstance(n, yaml.MappingNode) else [])
                    sizes[id(n)] = 1 + sum(size(child) for child in children)
                    if sizes[id(n)] > self.MAX_NODES:
                        raise Refused(f"expands to more than {self.MAX_NODES} values (aliases counted "
                                       "in full)")
                return sizes[id(n)]

            size(node)
        return node

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise Refused(f"key {shown(key)} appears twice in one mapping (line "
                               f"{key_node.start_mark.line + 1})")
            if isinstance(key, (str, int, float, bool)):
                seen.add(key)
        return super().construct_mapping(node, deep)


class Refused(Exception):
    """A YAML document ``_BoundedLoader`` will not load (the reason is the message)."""


def loads(text: str) -> Any:
    """``text`` parsed by ``_BoundedLoader``; raises ``Refused`` or ``yaml.YAMLError``."""
    try:
        return yaml.load(text, Loader=_BoundedLoader)  # noqa: S506 (a SafeLoader subclass)
    except RecursionError:
        raise Refused("nested too deeply") from None


def problem(err: yaml.YAMLError) -> str:
    """A one-line description of a YAML error (PyYAML's own text spans several lines)."""
    problem = getattr(err, "problem", None) or getattr(err, "context", None) or type(err).__name__
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return " ".join(f"{problem}{where}".split())


class _OneLineDumper(yaml.SafeDumper):
    """Writes a value on one line: strings with line breaks double-quoted (``\\n`` escaped)."""

    def represent_str(self, data: str):
        if any(char in data for char in "\n\r\x85\u2028\u2029"):
            return self.represent_scalar("tag:yaml.org,2002:str", data, style='"')
        return super().represent_str(data)


_OneLineDumper.add_representer(str, _OneLineDumper.represent_str)


def one_line(value: Any) -> str:
    """``value`` as YAML on one line (flow style)."""
    text = yaml.dump(value, Dumper=_OneLineDumper, default_flow_style=True, width=math.inf, sort_keys=False)
    return text.removesuffix("\n...\n").rstrip("\n")
