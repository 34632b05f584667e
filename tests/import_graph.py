"""Ember's modules as one package tree, for tools that read a package from one folder.

pyproject's ``package-dir`` makes ``ember`` out of four folders (core/ is ``ember``,
plugins/ ``ember.plugins``, hardware/ ``ember.hardware``, api/ ``ember.api``), as the
wheel lays them out. import-linter (grimp) walks a package's one directory, so
`lay_out` builds that tree of links in a scratch folder, and `lint_imports` runs
import-linter on it with the contracts in pyproject.toml:

    python tests/import_graph.py            # lint-imports over the whole of ember
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def lay_out(target: Path) -> Path:
    """Link every .py file of the four folders into ``target/ember/...``; returns ``target``."""
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for package, folder in package_dir.items():
        dest = target.joinpath(*package.split("."))
        for source in (ROOT / folder).rglob("*.py"):
            link = dest / source.relative_to(ROOT / folder)
            link.parent.mkdir(parents=True, exist_ok=True)
            if not link.exists():
                link.symlink_to(source)
    return target


def lint_imports(*args: str, plant: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``lint-imports`` (this interpreter's) over the laid-out tree; output captured.
    ``plant`` maps a module to lines appended to its copy in the tree (tests plant
    a bad import to see the contracts fail)."""
    with tempfile.TemporaryDirectory() as scratch:
        tree = lay_out(Path(scratch))
        for module, lines in (plant or {}).items():
            path = tree.joinpath(*module.split(".")).with_suffix(".py")
            text = path.read_text()
            path.unlink()
            path.write_text(text + "\n" + lines + "\n")
        env = {**os.environ, "PYTHONPATH": str(tree)}
        lint = Path(sys.executable).with_name("lint-imports")
        return subprocess.run([str(lint), str(ROOT / "pyproject.toml"), "--no-cache", *args],
                              cwd=scratch, env=env, capture_output=True, text=True, timeout=300)


def import_graph():
    """grimp's graph of every ember module (all imports: module level, in functions, under TYPE_CHECKING)."""
    import grimp

    with tempfile.TemporaryDirectory() as scratch:
        sys.path.insert(0, str(lay_out(Path(scratch))))
        saved = {name: sys.modules.pop(name) for name in list(sys.modules) if name == "ember" or name.startswith("ember.")}
        try:
            return grimp.build_graph("ember", cache_dir=None)
        finally:
            sys.path.remove(str(Path(scratch)))
            for name in [n for n in sys.modules if n == "ember" or n.startswith("ember.")]:
                del sys.modules[name]
            sys.modules.update(saved)


def cycles(graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            successors = edges[node]
            if i < len(successors):
                work.append((node, i + 1))
                nxt = successors[i]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return found


if __name__ == "__main__":
    result = lint_imports(*sys.argv[1:])
    print(result.stdout + result.stderr, end="")
    sys.exit(result.returncode)
