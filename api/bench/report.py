"""Text output: the summary of one result, and a side-by-side table of several."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ember.api.bench.metrics import LATENCY_METRICS, SCHEMA

_NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2E latency"}
# (label, how to read it, higher is better)
_THROUGHPUTS = (
    ("request throughput (req/s)", lambda r: r.get("request_throughput"), True),
    ("output throughput (tok/s)", lambda r: r.get("output_throughput"), True),
    ("total token throughput (tok/s)", lambda r: r.get("total_token_throughput"), True),
)


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def format_summary(result: dict[str, Any]) -> str:
    """A human-readable block of one result's figures."""
    config = result.get("config", {})
    lines = [
        f"============ ember bench {result['kind']}: {result.get('label', '')} ============",
        f"{'requests (completed / failed)':<36}{result['num_completed']} / {result['num_failed']}",
        f"{'request rate, max concurrency':<36}{config.get('request_rate')}, {_fmt(config.get('max_concurrency'))}",
        f"{'duration (s)':<36}{_fmt(result['duration_s'])}",
        f"{'input tokens':<36}{_fmt(result['total_input_tokens'])}",
        f"{'output tokens (counted by)':<36}{_fmt(result['total_output_tokens'])} ({result['output_tokens_source']})",
    ]
    for label, read, _ in _THROUGHPUTS:
        lines.append(f"{label:<36}{_fmt(read(result))}")
    lines.append(f"{'latency (ms)':<16}{'mean':>12}{'p50':>12}{'p90':>12}{'p99':>12}")
    for metric in LATENCY_METRICS:
        figures = result[f"{metric}_ms"]
        lines.append(f"{_NAMES[metric]:<16}" + "".join(f"{_fmt(figures[k]):>12}" for k in ("mean", "p50", "p90", "p99")))
    for error in result["errors"]:
        lines.append(f"failed x{error['count']}: {error['message']}")
    return "\n".join(lines)


def load_result(path: str | Path) -> dict[str, Any]:
    """Read a result file written by `ember bench serve|offline --result-file`."""
    try:
        result = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"result file {str(path)!r}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"result file {str(path)!r} could not be read: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"result file {str(path)!r} is not JSON: {exc}") from None
    if not isinstance(result, dict) or result.get("schema") != SCHEMA:
        raise ValueError(f"result file {str(path)!r} is not an ember bench result (schema {SCHEMA!r})")
    return result


def comparison_rows(results: list[dict[str, Any]]) -> list[tuple[str, list[Any], bool]]:
    """(metric, value per result, higher is better) for the comparison table."""
    rows: list[tuple[str, list[Any], bool]] = [
        (label, [read(r) for r in results], higher) for label, read, higher in _THROUGHPUTS
    ]
    for metric in LATENCY_METRICS:
        for stat in ("mean", "p50", "p99"):
            rows.append((f"{_NAMES[metric]} {stat} (ms)", [r[f"{metric}_ms"][stat] for r in results], False))
    rows.append(("completed requests", [r["num_completed"] for r in results], True))
    rows.append(("failed requests", [r["num_failed"] for r in results], False))
    rows.append(("output tokens", [r["total_output_tokens"] for r in results], True))
    return rows


def format_comparison(results: list[dict[str, Any]], labels: list[str]) -> str:
    """A table with one column per result and, per later result, its ratio to the first
    (``B/A``); the legend says which direction is better for each row."""
    base = labels[0]
    header = ["metric", *labels, *(f"{label}/{base}" for label in labels[1:]), "better"]
    table = []
    for metric, values, higher in comparison_rows(results):
        ratios = []
        for value in values[1:]:
            first = values[0]
            ok = isinstance(first, (int, float)) and isinstance(value, (int, float)) and first
            ratios.append(f"{value / first:.2f}x" if ok else "-")
        table.append([metric, *(_fmt(v) for v in values), *ratios, "higher" if higher else "lower"])
    widths = [max(len(row[i]) for row in [header, *table]) for i in range(len(header))]

    def line(row: list[str]) -> str:
        return "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))

    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(row) for row in table)])
