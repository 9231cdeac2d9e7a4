"""The package's module graph has a ground floor: no two modules import each other, directly or
through others, counting imports inside functions (a deferred import hides a circle, not removes it)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).parent.parent / "src" / "trainkit"


def imports_of(path: Path, modules: set[str]) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "trainkit":
            parts = node.module.split(".")
            found |= {parts[1]} if len(parts) > 1 else {alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("trainkit.")}
    return found & modules


def test_no_module_of_the_package_imports_itself_through_others():
    modules = {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    graph = {m: imports_of(PACKAGE / f"{m}.py", modules) for m in modules}
    assert graph["errors"] == set()  # the ground floor imports nothing of trainkit
    for start in sorted(modules):  # a path from a module back to itself is a circle
        seen, frontier = set(), set(graph[start])
        while frontier:
            seen |= frontier
            frontier = {n for m in frontier for n in graph[m]} - seen
        assert start not in seen, f"{start} imports itself through {sorted(seen)}"
