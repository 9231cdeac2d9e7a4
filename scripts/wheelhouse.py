"""The filtering half of scripts/wheelhouse.sh: which of pip's resolved packages a GPU node that has its own torch
still needs as wheels.

pip resolves (`pip install --dry-run --report`, for the node's Python and platform) and downloads; what pip cannot
say is "everything but torch and what only torch needs, and nothing the node already has". That is this file, and
only that: no resolution, no version choice.

    python scripts/wheelhouse.py roots pyproject.toml                  # the dependencies to resolve (not torch's)
    python scripts/wheelhouse.py select REPORT.json [--freeze FILE]    # name==version lines to download

A package is kept when a root reaches it through requirements that apply on the node (markers evaluated for its
Python) without passing through torch or torchvision (so nvidia-*, triton, sympy, networkx, ... drop out unless
another package needs them too) and without passing through a package the node already has at a version that
satisfies every kept requirement on it (the node's own dependencies of that package are its business).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.version import InvalidVersion, Version
except ImportError:  # a bare interpreter: pip's own copy
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
    from pip._vendor.packaging.version import InvalidVersion, Version  # type: ignore[no-redef]

# What a node with its own torch has: torch and torchvision are never brought, nor what only they need.
NODE_TORCH = ("torch", "torchvision")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def roots(pyproject: Path) -> list[str]:
    """pyproject's [project] dependencies, torch and torchvision left out."""
    try:
        import tomllib
    except ImportError:  # Python 3.10: the dependency list is plain enough to read without a TOML parser
        text = pyproject.read_text().partition("dependencies = [")[2].partition("\n]")[0]
        deps = re.findall(r'^\s*"([^"]+)"', text, re.MULTILINE)
    else:
        deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return [d for d in deps if canonical(Requirement(d).name) not in NODE_TORCH]


def parse_freeze(text: str) -> dict[str, str]:
    """`pip freeze` output: {canonical name: version} for its `name==version` lines (editable and URL lines have no
    version to compare and are left out)."""
    found = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line and not line.startswith("-"):
            name, _, version = line.partition("==")
            found[canonical(name.split("[", 1)[0])] = version.strip()
    return found


def _satisfies(version: str, specifiers: list) -> bool:
    try:
        v = Version(version)
    except InvalidVersion:
        return False
    # A local build (2.11.0+cu130) satisfies what its public version satisfies; prereleases count as what they are.
    return all(spec.contains(v, prereleases=True) for spec in specifiers)


def select(
    report: dict, root_requirements: list[str], freeze: dict[str, str] | None = None, python_version: str | None = None
) -> tuple[list[str], dict[str, str]]:
    """(the `name==version` pins to download, {name: why it was left out}) for pip's install report."""
    freeze = freeze or {}
    resolved = {canonical(item["metadata"]["name"]): item["metadata"] for item in report["install"]}
    environment = dict(report.get("environment") or {})
    if python_version:  # pip ran on another interpreter: its markers are evaluated for the node's Python
        environment["python_version"] = ".".join(python_version.split(".")[:2])
        environment["python_full_version"] = python_version if python_version.count(".") == 2 else python_version + ".0"

    def applies(req: Requirement, extras: set[str]) -> bool:
        if req.marker is None:
            return True
        return any(req.marker.evaluate({**environment, "extra": extra}) for extra in (extras or {""}))

    # Walk the requirements from the roots; collect the specifiers on each package from the kept packages.
    wanted: dict[str, list] = {}
    extras_of: dict[str, set[str]] = {}
    queue = [(Requirement(r), set()) for r in root_requirements]
    while queue:
        req, parent_extras = queue.pop()
        if not applies(req, parent_extras):
            continue
        name = canonical(req.name)
        if name in NODE_TORCH:
            continue
        new_extras = set(req.extras) - extras_of.get(name, set())
        first = name not in wanted
        wanted.setdefault(name, []).append(req.specifier)
        extras_of.setdefault(name, set()).update(req.extras)
        if not (first or new_extras) or name not in resolved:
            continue
        for dep in resolved[name].get("requires_dist") or []:
            queue.append((Requirement(dep), extras_of[name]))

    # A package the node has at a satisfying version is left out, and so is what only it needed: walk again,
    # stopping at those.
    on_node = {n for n, specs in wanted.items() if n in freeze and _satisfies(freeze[n], specs)}
    keep: set[str] = set()
    queue = [(Requirement(r), set()) for r in root_requirements]
    while queue:
        req, parent_extras = queue.pop()
        name = canonical(req.name)
        if not applies(req, parent_extras) or name in NODE_TORCH or name in on_node or name in keep:
            continue
        keep.add(name)
        for dep in resolved.get(name, {}).get("requires_dist") or []:
            queue.append((Requirement(dep), extras_of.get(name, set())))

    why = {n: "torch's (the node has its own)" for n in resolved if n not in wanted}
    why |= {n: f"on the node ({freeze[n]})" for n in on_node}
    why |= {n: "only needed by a package on the node" for n in wanted if n not in keep and n not in why}
    missing = sorted(keep - set(resolved))
    if missing:
        raise SystemExit(f"error: pip's report lacks {', '.join(missing)} (resolved for another environment?)")
    pins = sorted(f"{resolved[n]['name']}=={resolved[n]['version']}" for n in keep)
    return pins, dict(sorted(why.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("roots").add_argument("pyproject", type=Path)
    sel = sub.add_parser("select")
    sel.add_argument("report", type=Path, help="pip install --dry-run --report's JSON")
    sel.add_argument("--pyproject", type=Path, default=Path(__file__).resolve().parent.parent / "pyproject.toml")
    sel.add_argument("--freeze", type=Path, help="the node's `pip freeze` output")
    sel.add_argument("--python-version", help="the node's Python, when pip ran on another one")
    args = parser.parse_args()
    if args.command == "roots":
        print("\n".join(roots(args.pyproject)))
        return
    freeze = parse_freeze(args.freeze.read_text()) if args.freeze else {}
    if args.freeze:
        torch = freeze.get("torch")
        if torch is None or not _satisfies(torch, [Requirement("torch>=2.11").specifier]):
            print(f"warning: the freeze's torch ({torch}) is not trainkit's floor (>=2.11)", file=sys.stderr)
    pins, why = select(json.loads(args.report.read_text()), roots(args.pyproject), freeze, args.python_version)
    for name, reason in why.items():
        print(f"left out {name}: {reason}", file=sys.stderr)
    print("\n".join(pins))


if __name__ == "__main__":
    main()
