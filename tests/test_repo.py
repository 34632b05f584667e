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
