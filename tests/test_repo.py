"""The repository keeps its promises: CI runs exactly the README's test command,
and the layout of the design card is there."""

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


MAX_LINES = 500


def test_no_module_over_500_lines():
    """One concept per file (docs/architecture.md): a module past 500 lines is split by concept."""
    sizes = {
        str(path.relative_to(ROOT)): len(path.read_text().splitlines())
        for folder in ("core", "plugins", "hardware", "api")
        for path in (ROOT / folder).rglob("*.py")
    }
    assert len(sizes) > 100
    assert {path: n for path, n in sizes.items() if n > MAX_LINES} == {}


def test_every_core_module_is_in_the_architecture_map():
    """docs/architecture.md's module maps name every module of core/, plugins/, hardware/ and api/."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    missing = []
    for folder in ("core", "hardware", "api"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.name == "__init__.py":
                continue
            rel = path.relative_to(ROOT / folder).as_posix()
            if f"`{rel}`" not in text and f"`{path.name}`" not in text:
                missing.append(f"{folder}/{rel}")
    assert missing == [], f"add a line for each to docs/architecture.md: {missing}"
