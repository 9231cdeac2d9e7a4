"""The package's module graph has a ground floor: no two modules import each other, directly or
through others, counting imports inside functions (a deferred import hides a circle, not removes it)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).parent.parent / "src" / "trainkit"
ROOMS = ("models", "data", "tasks", "schedules")  # the fork's parts, mirroring conf/model, data, task, sched


def engine_modules() -> dict[str, Path]:
    """The engine's modules by dotted name under trainkit: its own files and its packages' (search,
    search.sweeper, ...), a package by its __init__.py (importing one of its modules runs that first)."""
    found = {p.stem: p for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    for init in PACKAGE.glob("*/__init__.py"):
        if (package := init.parent.name) not in ROOMS:
            found |= {package if p.stem == "__init__" else f"{package}.{p.stem}": p for p in init.parent.glob("*.py")}
    return found


def imports_of(path: Path, modules: set[str]) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "trainkit":
            base = node.module.partition(".")[2]
            found |= {f"{base}.{a.name}".lstrip(".") for a in node.names} | ({base} if base else set())
        elif isinstance(node, ast.Import):
            found |= {a.name.partition(".")[2] for a in node.names if a.name.startswith("trainkit.")}
    found |= {name.rpartition(".")[0] for name in found if "." in name}  # search.studies runs search first
    return found & modules


def test_no_module_of_the_package_imports_itself_through_others():
    files = engine_modules()
    assert {"search", "search.sweeper", "search.pruning"} <= set(files)
    graph = {m: imports_of(path, set(files)) for m, path in files.items()}
    assert graph["errors"] == set()  # the ground floor imports nothing of trainkit
    assert graph["search.sweeper"] >= {"checkpoint", "search.grammar", "search.pruning", "search.studies"}
    for start in sorted(files):  # a path from a module back to itself is a circle
        seen, frontier = set(), set(graph[start])
        while frontier:
            seen |= frontier
            frontier = {n for m in frontier for n in graph[m]} - seen
        assert start not in seen, f"{start} imports itself through {sorted(seen)}"


def room_imports(path: Path) -> set[str]:
    """The rooms a file imports by name, at module level or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "trainkit":
            parts = node.module.split(".")
            names = [parts[1]] if len(parts) > 1 else [alias.name for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name.split(".")[1] for a in node.names if a.name.startswith("trainkit.")]
        found |= set(names) & set(ROOMS)
    return found


def test_the_engine_imports_no_room():
    """Rooms depend on the engine, never the other way (torchtitan's rule): the engine finds a room's module
    through its yaml's _target_ (trainkit/options.py), as hydra.utils.instantiate does."""
    src = PACKAGE.parent
    engine = [*engine_modules().values(), *src.glob("*.py"), *(src / "hydra_plugins").rglob("*.py")]
    assert len(engine) > 40 and all((PACKAGE / room / "__init__.py").is_file() for room in ROOMS)
    offenders = {str(path.relative_to(src)): sorted(rooms) for path in engine if (rooms := room_imports(path))}
    assert offenders == {}, f"engine files import a room: {offenders}"


def test_the_room_check_sees_every_form_of_import(tmp_path):
    for line in ("from trainkit.models.mlp import mlp", "import trainkit.tasks.lm", "from trainkit import data"):
        (tmp_path / "m.py").write_text(f"def f():\n    {line}\n")
        assert room_imports(tmp_path / "m.py"), line
    (tmp_path / "m.py").write_text("from trainkit.loading import InMemory\nimport trainkit.dist\n")
    assert room_imports(tmp_path / "m.py") == set()
