"""The repository keeps its promises: CI runs exactly the README's test command,
and the layout of the design card is there."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip()]


def test_ci_runs_the_readme_test_command():
    test_commands = [c for c in readme_commands() if "pytest" in c]
    assert len(test_commands) == 1, test_commands
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_commands[0] in ci_lines


def test_readme_install_commands_pin_torch():
    for command in readme_commands():
        if "pip install" in command:
            assert "torch==2.13.0" in command, command


def test_design_card_layout():
    for folder in ("core", "plugins", "hardware", "api", "tests", "docs"):
        assert (ROOT / folder).is_dir(), folder
    assert (ROOT / "pyproject.toml").is_file()


def test_core_names_no_vendor():
    forbidden = re.compile(r"\b(cuda|rocm|hip|xpu|habana|gaudi|nvidia)\b", re.I)
    offenders = []
    for path in (ROOT / "core").rglob("*.py"):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if forbidden.search(code) and not code.lstrip().startswith(('"', "'")):
                offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


# folder -> (its import name, the ember packages it must not import)
LAYERS = {
    "core": ("ember", ("ember.plugins", "ember.hardware", "ember.api")),
    "plugins": ("ember.plugins", ("ember.api",)),
    "hardware": ("ember.hardware", ("ember.plugins", "ember.api")),
    "api": ("ember.api", ()),
}


def module_name(path: Path, root: Path = ROOT) -> tuple[str, bool]:
    """``path``'s dotted module name, and whether it is a package's ``__init__``."""
    folder, *parts = path.relative_to(root).with_suffix("").parts
    is_package = parts[-1] == "__init__"
    if is_package:
        parts = parts[:-1]
    return ".".join([LAYERS[folder][0], *parts]), is_package


def imported_names(tree: ast.AST, module: str, is_package: bool):
    """(line, dotted name) of every import anywhere in ``tree`` (functions and
    ``if TYPE_CHECKING:`` blocks too); ``from a import b`` yields ``a`` and ``a.b``,
    relative imports are resolved against ``module``."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            yield node.lineno, base
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}"


def import_boundary_violations(root: Path = ROOT) -> list[str]:
    """One line per offending import statement: ``file:line: what it imports``."""
    offenders: dict[tuple[str, int], str] = {}
    for folder, (_, forbidden) in LAYERS.items():
        for path in sorted((root / folder).rglob("*.py")):
            module, is_package = module_name(path, root)
            tree = ast.parse(path.read_text(), str(path))
            for line, name in imported_names(tree, module, is_package):
                bad = next((f for f in forbidden if name == f or name.startswith(f + ".")), None)
                where = (str(path.relative_to(root)), line)
                if bad is not None and where not in offenders:
                    offenders[where] = f"{module} imports {name} ({folder}/ must not import {bad})"
    return [f"{file}:{line}: {what}" for (file, line), what in sorted(offenders.items())]


def test_layers_import_only_inward():
    """core imports no plugin, hardware or API module; plugins no API module; hardware
    neither plugins nor the API (docs/DESIGN: they find each other through the plugin manager)."""
    offenders = import_boundary_violations()
    assert not offenders, "\n".join(offenders)


def test_the_import_boundary_check_sees_every_kind_of_import():
    source = (
        "from __future__ import annotations\n"
        "from typing import TYPE_CHECKING\n"
        "import ember.api.errors\n"
        "from ember import api\n"
        "if TYPE_CHECKING:\n"
        "    from ember.api.service import GenerationService\n"
        "def f():\n"
        "    from ..api import http\n"
        "    import ember.plugins.watermark as w\n"
        "from ember.engine_client import EngineClient\n"
    )
    names = list(imported_names(ast.parse(source), "ember.plugin.hookspecs", False))
    assert (3, "ember.api.errors") in names and (4, "ember.api") in names
    assert (6, "ember.api.service") in names and (8, "ember.api") in names and (9, "ember.plugins.watermark") in names
    assert not any(name.startswith(("ember.api", "ember.plugins")) for line, name in names if line == 10)
