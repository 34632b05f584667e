"""`ember bench`: statistics and arrival times, datasets, and the three subcommands run
for real — `serve` against a real Ember server on the tiny model, `offline` on the
in-process engine, `compare` on the result files they wrote."""

from __future__ import annotations

import json
import math
import re
import socket
import statistics
import sys

import numpy as np
import pytest
from server_utils import running_server

from ember.api.bench.arrivals import arrival_times
from ember.api.bench.datasets import DatasetSpec, chat_requests, create_requests, jsonl_requests
from ember.api.bench.metrics import SCHEMA
from ember.api.bench.stats import percentile, summarize
from ember.api.cli import main

MAX_TOTAL_TOKENS = 128
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# -- statistics ---------------------------------------------------------------------------------
@pytest.mark.parametrize("q", [0, 1, 10, 25, 50, 90, 99, 100])
def test_percentile_matches_numpy_linear(q):
    rng = np.random.default_rng(3)
    for size in (1, 2, 5, 101):
        values = rng.exponential(size=size).tolist()
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12)


def test_percentile_hand_computed():
    assert percentile([4, 1, 3, 2], 50) == 2.5
    assert percentile([10, 20], 90) == pytest.approx(19.0)
    assert percentile([7], 99) == 7
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError, match="101"):
        percentile([1], 101)


def test_summarize_scales_and_handles_no_values():
    s = summarize([0.001, 0.002, 0.003], scale=1000)
    assert s["count"] == 3
    assert s["mean"] == pytest.approx(2.0) and s["p50"] == pytest.approx(2.0)
    assert s["min"] == pytest.approx(1.0) and s["max"] == pytest.approx(3.0)
    assert s["p90"] == pytest.approx(2.8) and s["p99"] == pytest.approx(2.98)
    empty = summarize([])
    assert empty["count"] == 0 and all(empty[k] is None for k in ("mean", "p50", "p90", "p99"))
    json.dumps(empty, allow_nan=False)  # valid JSON, no NaN


# -- arrival times -------------------------------------------------------------------------------
def test_all_at_once():
    assert arrival_times(5, math.inf) == [0.0] * 5
    assert arrival_times(0, 3.0) == []


def test_poisson_mean_rate_and_seed():
    times = arrival_times(20_000, rate=8.0, seed=1)
    assert times[0] == 0.0 and times == sorted(times)
    gaps = np.diff(times)
    assert 1 / gaps.mean() == pytest.approx(8.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV 1
    assert arrival_times(50, 8.0, seed=1) == times[:50]
    assert arrival_times(50, 8.0, seed=2) != times[:50]


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_burstiness_keeps_the_rate_and_sets_the_spread(burstiness):
    gaps = np.diff(arrival_times(20_000, rate=5.0, burstiness=burstiness, seed=0))
    assert 1 / gaps.mean() == pytest.approx(5.0, rel=0.05)
    # gamma(shape k): coefficient of variation 1/sqrt(k) -- 2 for bursts, 0.5 for steady
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.08)


@pytest.mark.parametrize("rate, burstiness, match", [(0, 1, "rate"), (-1, 1, "rate"), (math.nan, 1, "rate"),
                                                     (1, 0, "burstiness"), (1, math.inf, "burstiness")])
def test_arrival_parameters_are_checked(rate, burstiness, match):
    with pytest.raises(ValueError, match=match):
        arrival_times(3, rate, burstiness)


# -- datasets ------------------------------------------------------------------------------------
def test_random_dataset_is_seeded_and_within_range():
    spec = DatasetSpec("random", num_prompts=20, input_len=10, output_len=8, range_ratio=0.5, seed=7)
    first, again = create_requests(spec), create_requests(spec)
    assert first == again
    assert first != create_requests(DatasetSpec("random", num_prompts=20, input_len=10, output_len=8,
                                                range_ratio=0.5, seed=8))
    assert all(4 <= r.max_tokens <= 12 and 5 <= len(r.prompt.split()) <= 15 for r in first)


def test_random_dataset_with_a_tokenizer_has_exact_lengths(tiny_llama_dir):
    from ember.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny_llama_dir)
    requests = create_requests(DatasetSpec("random", num_prompts=5, input_len=12, output_len=3), tokenizer)
    special = set(tokenizer.all_special_ids)
    for r in requests:
        assert len(r.prompt_token_ids) == 12 and r.max_tokens == 3
        assert not special & set(r.prompt_token_ids)
        assert r.prompt == tokenizer.decode(list(r.prompt_token_ids))


def test_chat_dataset_is_the_offline_benchmark_set():
    requests = chat_requests(70, max_tokens=9)
    assert len({r.as_prompt() for r in requests}) == 64  # 16 topics x 4 styles, then repeated
    assert requests[64] == requests[0]
    assert requests[0].as_messages() == [{"role": "user", "content": "Explain the water cycle in one sentence."}]


def test_jsonl_dataset(tmp_path):
    path = tmp_path / "requests.jsonl"
    path.write_text('{"prompt": "hello", "max_tokens": 3}\n\n'
                    '{"messages": [{"role": "user", "content": "hi"}]}\n')
    requests = jsonl_requests(path, None, default_max_tokens=5)
    assert [r.max_tokens for r in requests] == [3, 5]
    assert requests[0].as_messages() == [{"role": "user", "content": "hello"}]
    assert requests[1].as_prompt() == "hi"
    assert [r.max_tokens for r in jsonl_requests(path, 5, 5)] == [3, 5, 3, 5, 3]


@pytest.mark.parametrize("line, match", [
    ("{not json", r"requests.jsonl:2: not valid JSON"),
    ("[1, 2]", r"requests.jsonl:2: expected a JSON object"),
    ('{"prompt": "a", "messages": []}', "exactly one of prompt and messages"),
    ('{"prompt": "a", "max_tokens": 0}', "max_tokens must be an integer >= 1, got 0"),
    ('{"messages": [{"role": "user"}]}', r"messages\[0\]"),
    ('{"prompt": "a", "temperature": 1}', "unknown field.*temperature"),
])
def test_jsonl_bad_line_names_file_and_line(tmp_path, line, match):
    path = tmp_path / "requests.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(ValueError, match=match):
        jsonl_requests(path, None, 4)


def test_base_url_is_normalized():
    from ember.api.bench.client import normalize_base_url

    assert normalize_base_url("http://h:1/v1/") == "http://h:1"
    assert normalize_base_url("https://h/proxy/") == "https://h/proxy"
    for bad in ("h:1", "ftp://h", "http://"):
        with pytest.raises(ValueError, match="--base-url"):
            normalize_base_url(bad)


# -- ember bench serve, against a real server ---------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with running_server(tiny_llama_dir, max_total_tokens=MAX_TOTAL_TOKENS, served_model_name="tiny") as running:
        yield running


def bench(capsys, *argv) -> tuple[int, str, str]:
    status = main(["bench", *map(str, argv)])
    out, err = capsys.readouterr()
    return status, out, err


def check_result(result: dict, num_requests: int) -> None:
    """Fields present and consistent with each other."""
    assert result["schema"] == SCHEMA
    for key in ("kind", "label", "started_at", "config", "duration_s", "num_requests", "num_completed", "num_failed",
                "errors", "total_input_tokens", "total_output_tokens", "output_tokens_source", "request_throughput",
                "output_throughput", "total_token_throughput", "ttft_ms", "tpot_ms", "itl_ms", "e2el_ms",
                "throughput_over_time", "requests"):
        assert key in result, key
    assert result["num_requests"] == num_requests == len(result["requests"])
    assert result["num_completed"] + result["num_failed"] == num_requests
    done = [r for r in result["requests"] if r["error"] is None]
    assert result["total_output_tokens"] == sum(r["output_tokens"] for r in done)
    assert result["output_throughput"] == pytest.approx(result["total_output_tokens"] / result["duration_s"])
    assert result["request_throughput"] == pytest.approx(len(done) / result["duration_s"])
    for r in done:
        assert 0 <= r["ttft_s"] <= r["e2el_s"]
        assert r["start_s"] + r["e2el_s"] <= result["duration_s"] + 1e-6
        assert r["chunk_times_s"] == sorted(r["chunk_times_s"]) and r["chunk_times_s"][0] == r["ttft_s"]
        if r["output_tokens"] > 1:
            assert r["tpot_s"] == pytest.approx((r["e2el_s"] - r["ttft_s"]) / (r["output_tokens"] - 1))
    assert result["itl_ms"]["count"] == sum(len(r["chunk_times_s"]) - 1 for r in done)
    if done:
        assert result["e2el_ms"]["mean"] == pytest.approx(1000 * statistics.mean(r["e2el_s"] for r in done))
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        s = result[metric]
        if s["count"]:
            assert s["min"] <= s["p50"] <= s["p90"] <= s["p99"] <= s["max"]
    assert result["ttft_ms"]["count"] == result["e2el_ms"]["count"] == len(done)
    assert result["ttft_ms"]["max"] <= result["e2el_ms"]["max"]
    series = result["throughput_over_time"]
    assert sum(series["output_tokens_per_s"]) * series["bin_s"] == pytest.approx(result["total_output_tokens"])


def test_serve_random_all_at_once_with_result_and_plots(server, capsys, tmp_path):
    result_file, plot_dir = tmp_path / "random.json", tmp_path / "plots"
    status, out, err = bench(
        capsys, "serve", "--base-url", server.url, "--model", "tiny", "--endpoint", "completions",
        "--dataset", "random", "--num-prompts", 6, "--random-input-len", 8, "--random-output-len", 6,
        "--random-range-ratio", 0.5, "--seed", 3, "--result-file", result_file, "--plot-dir", plot_dir,
    )
    assert status == 0, out + err
    result = json.loads(result_file.read_text())
    check_result(result, 6)
    assert result["num_failed"] == 0 and result["errors"] == []
    expected = [r.max_tokens for r in create_requests(
        DatasetSpec("random", num_prompts=6, input_len=8, output_len=6, range_ratio=0.5, seed=3))]
    assert len(set(expected)) > 1  # the range ratio varies them
    # ignore_eos: every request yields exactly its max_tokens, as the server's usage reports
    assert [r["output_tokens"] for r in result["requests"]] == expected
    assert result["total_output_tokens"] == sum(expected)
    assert result["output_tokens_source"] == "usage" and result["total_input_tokens"] > 0
    assert result["config"]["request_rate"] == "inf" and result["config"]["endpoint"] == "completions"
    for name in ("latency_cdf.png", "throughput.png"):
        data = (plot_dir / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000
    assert "output throughput (tok/s)" in out and "TTFT" in out and str(result_file) in out
    assert "requests: 100%" in err  # the progress bar


def test_serve_chat_poisson_with_concurrency_cap_and_model_from_the_server(server, capsys, tmp_path):
    result_file = tmp_path / "chat.json"
    status, out, err = bench(
        capsys, "serve", "--base-url", server.url + "/v1/", "--dataset", "chat", "--num-prompts", 2,
        "--max-tokens", 5, "--request-rate", 20, "--max-concurrency", 1, "--result-file", result_file, "--no-progress",
    )
    assert status == 0, out + err
    result = json.loads(result_file.read_text())
    check_result(result, 2)
    assert result["config"]["model"] == "tiny"  # from GET /v1/models
    assert result["config"]["base_url"] == server.url
    assert result["total_output_tokens"] == 10
    first, second = result["requests"]
    assert first["scheduled_s"] == 0 and second["scheduled_s"] > 0
    assert second["start_s"] >= first["start_s"] + first["e2el_s"] - 1e-3  # one in flight at a time
    assert result["tpot_ms"]["count"] == 2 and result["itl_ms"]["count"] >= 2
    assert "requests:" not in err  # --no-progress (the in-process server's access log may be there)


def test_serve_jsonl(server, capsys, tmp_path):
    data = tmp_path / "mine.jsonl"
    data.write_text('{"prompt": "hello there", "max_tokens": 3}\n'
                    '{"messages": [{"role": "user", "content": "hello"}], "max_tokens": 7}\n'
                    '{"prompt": "hello hello"}\n')
    result_file = tmp_path / "jsonl.json"
    status, out, err = bench(
        capsys, "serve", "--base-url", server.url, "--model", "tiny", "--dataset", "jsonl", "--dataset-path", data,
        "--max-tokens", 4, "--request-rate", 50, "--burstiness", 0.5, "--result-file", result_file, "--no-progress",
    )
    assert status == 0, out + err
    result = json.loads(result_file.read_text())
    check_result(result, 3)
    assert [r["output_tokens"] for r in result["requests"]] == [3, 7, 4]


def test_serve_counts_with_the_tokenizer_when_the_server_sends_no_usage(server, capsys, tmp_path, tiny_llama_dir):
    result_file = tmp_path / "nousage.json"
    status, out, err = bench(
        capsys, "serve", "--base-url", server.url, "--model", "tiny", "--dataset", "random", "--num-prompts", 2,
        "--random-input-len", 6, "--random-output-len", 4, "--tokenizer", tiny_llama_dir, "--endpoint", "completions",
        "--extra-body", '{"stream_options": {"include_usage": false}}', "--result-file", result_file, "--no-progress",
    )
    assert status == 0, out + err
    result = json.loads(result_file.read_text())
    check_result(result, 2)
    assert result["output_tokens_source"] == "tokenizer"
    assert all(r["input_tokens"] == 6 for r in result["requests"])  # the random prompts' own ids
    assert result["total_output_tokens"] > 0


def test_serve_reports_requests_the_server_refuses(server, capsys, tmp_path):
    """The chat set's long prompts overflow the server's 128-token limit: failures, not a crash."""
    result_file = tmp_path / "overflow.json"
    status, out, err = bench(
        capsys, "serve", "--base-url", server.url, "--model", "tiny", "--dataset", "chat", "--num-prompts", 4,
        "--max-tokens", 4, "--result-file", result_file, "--no-progress",
    )
    assert status == 1, out + err
    result = json.loads(result_file.read_text())
    check_result(result, 4)
    assert result["num_failed"] >= 1 and result["num_completed"] >= 1
    assert sum(e["count"] for e in result["errors"]) == result["num_failed"]
    assert all(e["message"].startswith("HTTP 4") for e in result["errors"])
    assert f"failed x{result['errors'][0]['count']}: HTTP 4" in out


def test_serve_reports_a_closed_port(capsys, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again when the block ends: nothing listens
    result_file = tmp_path / "closed.json"
    status, out, err = bench(
        capsys, "serve", "--base-url", f"http://127.0.0.1:{port}", "--model", "m", "--num-prompts", 3,
        "--result-file", result_file, "--no-progress",
    )
    assert status == 1
    result = json.loads(result_file.read_text())
    assert result["num_failed"] == 3 and result["num_completed"] == 0
    assert result["errors"][0]["message"].startswith("ConnectError") and result["errors"][0]["count"] == 3
    assert result["ttft_ms"]["mean"] is None and result["output_throughput"] == 0


@pytest.mark.parametrize("argv, match", [
    (["--base-url", "localhost:3000"], "--base-url 'localhost:3000' is not an http"),
    (["--base-url", "http://x", "--dataset", "jsonl", "--dataset-path", "/nonexistent.jsonl"],
     "--dataset-path '/nonexistent.jsonl': no such file"),
    (["--base-url", "http://x", "--dataset", "jsonl"], "--dataset jsonl needs --dataset-path"),
    (["--base-url", "http://x", "--max-concurrency", "0"], "--max-concurrency must be >= 1, got 0"),
    (["--base-url", "http://x", "--result-file", "/nonexistent-dir/r.json"], "folder '/nonexistent-dir' does not exist"),
    (["--base-url", "http://127.0.0.1:9"], r"could not read the model name from http://127.0.0.1:9/v1/models"),
])
def test_serve_bad_input_is_a_clear_error(capsys, argv, match):
    status, out, err = bench(capsys, "serve", *argv, "--no-progress")
    assert status == 2
    assert err.startswith("ember: error: ") and "Traceback" not in err
    assert re.search(match, err), err


def test_serve_bad_jsonl_line_is_a_clear_error(capsys, tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "ok"}\n{"prompt": 5}\n')
    status, out, err = bench(capsys, "serve", "--base-url", "http://x", "--dataset", "jsonl", "--dataset-path", data)
    assert status == 2
    assert f"{data}:2: prompt must be a non-empty string, got 5" in err


def test_bad_argument_values_are_usage_errors(capsys):
    status, out, err = bench(capsys, "serve", "--base-url", "http://x", "--request-rate", "fast")
    assert status == 2 and "--request-rate" in err
    status, out, err = bench(capsys, "serve", "--base-url", "http://x", "--extra-body", "[1]")
    assert status == 2 and "expected a JSON object" in err


def test_plots_without_matplotlib_name_the_extra(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now fails
    status, out, err = bench(capsys, "serve", "--base-url", "http://x", "--plot-dir", "plots")
    assert status == 2
    assert 'pip install "ember-serve[bench]"' in err


# -- ember bench offline, and compare -----------------------------------------------------------
def test_offline_then_compare_with_serve(server, tiny_llama_dir, capsys, tmp_path):
    offline_file, serve_file = tmp_path / "offline.json", tmp_path / "serve.json"
    common = ["--dataset", "chat", "--num-prompts", 2, "--max-tokens", 6, "--no-progress"]
    status, out, err = bench(
        capsys, "offline", "--model", tiny_llama_dir, "--dtype", "float32", "--engine-arg", "num_kv_blocks=64",
        "--engine-arg", "block_size=8", "--request-rate", 100, "--result-file", offline_file, *common,
    )
    assert status == 0, out + err
    offline = json.loads(offline_file.read_text())
    check_result(offline, 2)
    assert offline["kind"] == "offline" and offline["output_tokens_source"] == "engine"
    assert offline["total_output_tokens"] == 12
    assert all(len(r["chunk_times_s"]) == 6 for r in offline["requests"])  # one step, one token
    assert offline["config"]["engine_args"] == {"num_kv_blocks": 64, "block_size": 8}

    status, out, err = bench(capsys, "serve", "--base-url", server.url, "--label", "http", "--result-file", serve_file,
                             *common)
    assert status == 0, out + err
    served = json.loads(serve_file.read_text())
    # the same requests: the server's chat route and the engine see the same prompt tokens
    assert [r["input_tokens"] for r in served["requests"]] == [r["input_tokens"] for r in offline["requests"]]

    status, out, err = bench(capsys, "compare", offline_file, serve_file, "--plot-dir", tmp_path / "cmp")
    assert status == 0, err
    lines = out.splitlines()
    assert lines[0].split() == ["metric", offline["label"], "http", f"http/{offline['label']}", "better"]
    row = next(line for line in lines if line.startswith("output throughput"))
    ratio = served["output_throughput"] / offline["output_throughput"]
    assert row.split()[-2] == f"{ratio:.2f}x" and row.split()[-1] == "higher"
    assert next(line for line in lines if line.startswith("TTFT p99")).split()[-1] == "lower"
    assert (tmp_path / "cmp" / "latency_cdf.png").read_bytes().startswith(PNG_MAGIC)


def test_offline_refused_request_is_a_failure(tiny_llama_dir, capsys):
    status, out, err = bench(
        capsys, "offline", "--model", tiny_llama_dir, "--dtype", "float32", "--dataset", "random", "--num-prompts", 2,
        "--random-input-len", 300, "--random-output-len", 2, "--no-progress",
    )
    assert status == 1
    assert "failed x2: refused:" in out


def test_offline_unknown_engine_arg(tiny_llama_dir, capsys):
    status, out, err = bench(capsys, "offline", "--model", tiny_llama_dir, "--engine-arg", "warp_drive=1")
    assert status == 2 and "--engine-arg" in err and "warp_drive" in err


def test_compare_bad_input(capsys, tmp_path):
    not_result = tmp_path / "x.json"
    not_result.write_text('{"a": 1}')
    status, out, err = bench(capsys, "compare", not_result, not_result)
    assert status == 2 and "is not an ember bench result" in err
    status, out, err = bench(capsys, "compare", tmp_path / "missing.json", not_result)
    assert status == 2 and "missing.json': no such file" in err
    status, out, err = bench(capsys, "compare", not_result)
    assert status == 2 and "at least two" in err


# -- python -m ember.api.bench.core_step (issue 13's benchmark), end to end ----------------------
def test_core_step_writes_every_figure(tiny_llama_dir, tmp_path):
    """Offline, served at two concurrencies (`ember serve` in a subprocess), batch-1 decode
    after and "before" (this same install as the baseline): every figure is in the JSON.
    No assertion on timings."""
    import subprocess

    out = tmp_path / "core_step.json"
    argv = [
        sys.executable, "-m", "ember.api.bench.core_step", "--model", str(tiny_llama_dir), "--dtype", "float32",
        "--num-prompts", "2", "--max-tokens", "4", "--concurrency", "1,2", "--num-warmups", "1",
        "--decode-tokens", "4", "--decode-runs", "1", "--baseline-python", sys.executable,
        "--engine-arg", "num_kv_blocks=64", "--engine-arg", "block_size=8",
        "--serve-args", "--max-total-tokens 256 --max-batch-total-tokens 4096", "--no-progress", "--out", str(out),
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "served@1 / offline" in proc.stdout and f"result written to {out}" in proc.stdout
    result = json.loads(out.read_text())
    assert result["schema"] == "ember-core-step/1" and result["warnings"] == []
    machine = result["machine"]
    assert machine["cores"] >= 1 and machine["usable_cores"] >= 1 and "cpu_model" in machine
    assert set(machine["flags"]) == {"avx2", "avx512f", "avx512_bf16", "amx_bf16"}
    assert all(isinstance(v, bool) for v in machine["flags"].values())

    figures = result["figures"]
    assert figures["offline_tok_s"] > 0
    assert set(figures["served"]) == {"1", "2"}
    for served in figures["served"].values():
        assert served["tok_s"] > 0
        for key in ("ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99"):
            assert served[key] is not None and served[key] >= 0, key
    ratio = figures["served_over_offline"]
    assert ratio["concurrency"] == 1 and ratio["ratio"] > 0 and ratio["bar"] == 0.95 and isinstance(ratio["met"], bool)
    for key in ("decode_tok_s", "step_overhead_ms_mean", "step_overhead_ms_p50"):
        value = figures[key]
        assert value["before"] is not None and value["after"] is not None and value["after_over_before"] is not None, key
    assert figures["decode_tok_s"]["after"] > 0 and figures["decode_tok_s"]["before"] > 0

    # the same requests and token counts offline and served
    offline = result["offline"]["result"]
    assert result["offline"]["concurrency"] == 1
    assert offline["num_completed"] == 2 and offline["total_output_tokens"] == 8
    for concurrency, served in result["served"]["results"].items():
        assert served["num_completed"] == 2 and served["total_output_tokens"] == 8
        assert served["config"]["max_concurrency"] == int(concurrency) and served["config"]["ignore_eos"] is True
    for which in ("after", "before"):
        decode = result["decode"][which]
        assert decode["python"] == sys.executable and decode["timed_methods"]
        assert decode["model_ms_mean"] > 0 and decode["num_decode_steps"] == 3  # 4 tokens: 1 prefill + 3 decode steps
        assert [run["output_tokens"] for run in decode["runs"]] == [4]
