"""The job file's YAML loader: yaml.safe_load's values, refusing what only hides mistakes.

A key given twice in one mapping (YAML keeps the last silently), a list or mapping used as a
key (`? [a, b]`) and aliases that expand a small file into a vast value (`&a [...]`, `*a` many
times over, or an alias inside its own anchor) are each a JobYAMLError naming the line.
"""

from __future__ import annotations

import yaml

# Most values (scalars, lists, mappings) a document may expand to once its aliases are followed.
# A real job holds a few hundred; a 600-byte alias bomb expands to millions.
MAX_EXPANDED_VALUES = 10_000


class JobYAMLError(yaml.YAMLError):
    """Valid YAML that cannot be a job file.

    Attributes:
        message: what is wrong, naming the key where there is one.
        line: 1-based line of the problem in the document.
    """

    def __init__(self, message: str, mark: yaml.Mark) -> None:
        super().__init__(message)
        self.message = message
        self.line = mark.line + 1


class JobLoader(yaml.SafeLoader):
    """yaml.SafeLoader (plain values only, no tags that build objects) plus the checks above."""

    def __init__(self, stream) -> None:
        super().__init__(stream)
        self.aliased = False

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            self.aliased = True
        return super().compose_node(parent, index)

    def compose_mapping_node(self, anchor):
        # Checked on the composed node, before construction: merge keys (`<<: *base`) have not
        # been flattened in yet, so a key that overrides a merged one is no duplicate.
        node = super().compose_mapping_node(anchor)
        first: dict[tuple[str, str], int] = {}
        for key_node, _ in node.value:
            line = key_node.start_mark.line + 1
            if not isinstance(key_node, yaml.ScalarNode):
                kind = "list" if isinstance(key_node, yaml.SequenceNode) else "mapping"
                raise JobYAMLError(
                    f"a {kind} used as a mapping key (`? ...`); keys are plain names such as "
                    "model or max_tokens",
                    key_node.start_mark,
                )
            key = (key_node.tag, key_node.value)
            if key in first:
                raise JobYAMLError(
                    f"key {key_node.value[:80]!r} given twice in one mapping (first on line "
                    f"{first[key]}); YAML would keep only the last, so remove one",
                    key_node.start_mark,
                )
            first[key] = line
        return node

    def compose_document(self):
        node = super().compose_document()
        if self.aliased:
            _check_expansion(node, {}, "")
        return node


def _check_expansion(node: yaml.Node, sizes: dict[int, int | None], path: str) -> int:
    """Number of values `node` stands for with every alias followed; raises past the limit.

    Args:
        node: a composed node (an alias is the anchored node itself, so nodes are shared).
        sizes: id(node) -> its expanded size, None while being counted (a cycle). Each node is
            counted once, so this takes time in the size of the file, not of the expansion.
        path: key path of `node` for the message, e.g. "sampling.stop[4]".
    Returns:
        The expanded size, at most MAX_EXPANDED_VALUES.
    """
    where = f"{path}: " if path else ""
    key = id(node)
    if key in sizes:
        if sizes[key] is None:
            raise JobYAMLError(
                f"{where}an alias refers to a value that contains it (`&a [*a]`); a job file "
                "holds plain, finite values",
                node.start_mark,
            )
        return sizes[key]
    sizes[key] = None
    if isinstance(node, yaml.SequenceNode):
        children = [(child, f"{path}[{i}]") for i, child in enumerate(node.value)]
    elif isinstance(node, yaml.MappingNode):
        children = []
        for k, v in node.value:
            name = k.value[:40] if isinstance(k, yaml.ScalarNode) else "?"
            children += [(k, path), (v, f"{path}.{name}" if path else name)]
    else:
        children = []
    total = 1
    for child, child_path in children:
        total += _check_expansion(child, sizes, child_path)
        if total > MAX_EXPANDED_VALUES:
            raise JobYAMLError(
                f"{where}YAML aliases (*name) expand this value to more than "
                f"{MAX_EXPANDED_VALUES} values; write the values out instead",
                node.start_mark,
            )
    sizes[key] = total
    return total


def load_yaml(text: str):
    """yaml.safe_load(text) with the checks of JobLoader; JobYAMLError or yaml.YAMLError."""
    loader = JobLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()
