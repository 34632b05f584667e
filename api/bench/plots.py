"""PNG plots of one or more results: latency CDFs and throughput over time.

matplotlib is optional (``pip install "ember-serve[bench]"``); `require_matplotlib`
checks for it before a run starts, so that a long benchmark does not end in an
ImportError. The plots use matplotlib's object API (no pyplot, no global backend).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

INSTALL_HINT = 'pip install "ember-serve[bench]"'
LATENCY_FILE = "latency_cdf.png"
THROUGHPUT_FILE = "throughput.png"
_PANELS = (
    ("ttft_s", "TTFT (ms)"),
    ("tpot_s", "TPOT (ms)"),
    ("itl_s", "inter-token latency (ms)"),
    ("e2el_s", "end-to-end latency (ms)"),
)


def require_matplotlib() -> None:
    """Raise ValueError naming the install command when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError(f"plots need matplotlib, which is not installed: {INSTALL_HINT}") from None


def write_plots(results: list[dict[str, Any]], plot_dir: Path | str) -> list[Path]:
    """Write `LATENCY_FILE` and `THROUGHPUT_FILE` into `plot_dir` (created if needed),
    one curve per result; return their paths."""
    require_matplotlib()
    from matplotlib.figure import Figure

    plot_dir = Path(plot_dir)
    try:
        plot_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--plot-dir {str(plot_dir)!r} could not be created: {exc}") from None

    latency = Figure(figsize=(11, 8), layout="constrained")
    axes = latency.subplots(2, 2).flatten()
    for ax, (key, title) in zip(axes, _PANELS):
        for result in results:
            values = sorted(v * 1000 for v in _samples(result, key))
            if values:  # the empirical CDF: 0 before the smallest value, 1 from the largest
                fractions = [0.0, *((i + 1) / len(values) for i in range(len(values)))]
                ax.step([values[0], *values], fractions, where="post", label=result.get("label", "?"))
        ax.set_title(title)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of samples")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize="small")
    latency.suptitle("latency CDFs")

    throughput = Figure(figsize=(11, 6), layout="constrained")
    tokens_ax, flight_ax = throughput.subplots(2, 1, sharex=True)
    for result in results:
        series = result["throughput_over_time"]
        bin_s = series["bin_s"]
        tokens, in_flight = series["output_tokens_per_s"], series["requests_in_flight"]
        edges = [i * bin_s for i in range(len(tokens) + 1)]  # each bin drawn over its whole width
        tokens_ax.step(edges, [*tokens, tokens[-1]], where="post", label=result.get("label", "?"))
        flight_ax.step(edges, [*in_flight, in_flight[-1]], where="post", label=result.get("label", "?"))
    tokens_ax.set_ylabel("output tokens/s")
    tokens_ax.set_title("throughput over time")
    flight_ax.set_ylabel("requests in flight")
    flight_ax.set_xlabel("seconds since the first request")
    for ax in (tokens_ax, flight_ax):
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize="small")

    paths = [plot_dir / LATENCY_FILE, plot_dir / THROUGHPUT_FILE]
    latency.savefig(paths[0], dpi=100)
    throughput.savefig(paths[1], dpi=100)
    return paths


def _samples(result: dict[str, Any], key: str) -> list[float]:
    """Per-request values of `key` over successful requests (ITL: every gap)."""
    values: list[float] = []
    for request in result.get("requests", ()):
        if request.get("error") is not None:
            continue
        if key == "itl_s":
            times = request.get("chunk_times_s") or []
            values.extend(later - earlier for earlier, later in zip(times, times[1:]))
        elif request.get(key) is not None:
            values.append(request[key])
    return values
