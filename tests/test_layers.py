"""The layers of docs/architecture.md hold: import-linter's contracts in pyproject.toml
pass (and fail on a planted upward import), and no two Ember modules import each
other, directly or round a longer loop (every import counts: module level, inside
functions, under ``if TYPE_CHECKING:``)."""

import tomllib

import grimp
import pytest
from import_graph import ROOT, cycles, import_graph, lint_imports

CONTRACTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_lint_imports_keeps_every_contract():
    result = lint_imports()
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"Contracts: {len(CONTRACTS)} kept, 0 broken." in result.stdout, result.stdout


@pytest.mark.parametrize("module, line, contract", [
    ("ember.sched.step", "import ember.engine.core", "layers"),  # the step contract is a leaf of sched
    ("ember.plugin.backend", "from ember.hardware import cpu", "core-finds-plugins"),  # core names a backend
    ("ember.hardware.cuda", "from ember.worker.model_runner import ModelRunner", "public-contracts"),
    ("ember.plugins.watermark.routes", "import ember.hardware.cpu", "layers"),  # plugins and hardware are independent
])
def test_lint_imports_fails_on_a_planted_import(module, line, contract):
    result = lint_imports("--contract", contract, plant={module: line})
    assert result.returncode == 1 and "0 kept, 1 broken" in result.stdout, result.stdout + result.stderr
    assert module in result.stdout, result.stdout


def test_every_room_of_core_sits_in_a_layer(graph):
    """A new module or folder directly under ember must be placed in the layers contract."""
    layers = next(c for c in CONTRACTS if c["id"] == "layers")["layers"]
    placed = {name.strip() for layer in layers for name in layer.split("|")}
    top = {m for m in graph.modules if m.count(".") == 1} - {"ember._moved"}  # the old names' aliases: nothing imports it but ember
    assert top - placed == set(), f"place these in pyproject's layers contract: {sorted(top - placed)}"


def test_no_import_cycle(graph):
    assert len(graph.modules) > 120, "the graph missed folders: " + ", ".join(sorted(graph.modules)[:20])
    assert graph.direct_import_exists(importer="ember.engine.core", imported="ember.sched.scheduler")
    assert cycles(graph) == []


def test_the_cycle_finder_finds_cycles():
    graph = grimp.ImportGraph()
    for a, b in [("x.a", "x.b"), ("x.b", "x.c"), ("x.c", "x.a"), ("x.c", "x.d"), ("x.d", "x.e"), ("x.e", "x.d"), ("x.f", "x.a")]:
        graph.add_import(importer=a, imported=b)
    assert sorted(cycles(graph)) == [["x.a", "x.b", "x.c"], ["x.d", "x.e"]]
