"""The package has no import cycle, counting imports inside functions and TYPE_CHECKING blocks.

Edges are read from the source with `ast`, so an import that only runs at call time (or only
for a type checker) still counts: such imports are how cycles hide. `from a.b import c` is an
edge to the module `a.b.c` when that is a module, else to `a.b`. The implicit import of a
module's parent packages is not an edge (every module would then cycle through
`batchgen/__init__.py`, which re-exports the public API).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Source folder -> package name (kernels/ is installed as batchgen.kernels).
SOURCES = {ROOT / "batchgen": "batchgen", ROOT / "kernels": "batchgen.kernels"}


def module_files() -> dict[str, Path]:
    mods = {}
    for folder, package in SOURCES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join([package, *parts])] = path
    return mods


def imports_of(name: str, path: Path, modules: set[str]) -> set[str]:
    """Every batchgen module `name` imports, wherever the import statement sits."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names
            ]
        else:
            continue
        out.update(t for t in targets if t in modules and t != name)
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a list of modules (first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def build_graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: imports_of(name, path, set(files)) for name, path in files.items()}


def test_no_import_cycle():
    cycle = find_cycle(build_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_check_sees_function_level_and_type_checking_imports(tmp_path):
    src = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from batchgen.b import X\n"
        "def f():\n    from batchgen import c\n"
    )
    path = tmp_path / "a.py"
    path.write_text(src)
    found = imports_of("batchgen.a", path, {"batchgen.a", "batchgen.b", "batchgen.c"})
    assert found == {"batchgen.b", "batchgen.c"}
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
