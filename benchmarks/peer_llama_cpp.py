"""llama.cpp's own HTTP server (``llama-server``) as a peer for Ember's served
benchmarks (issue 36 item 5): continuous batching over parallel slots, an
OpenAI-compatible ``/v1/chat/completions`` that streams, on the very GGUF file Ember's
default model comes from.

The server is built once from the llama.cpp that the ``llama-cpp-python`` sdist
vendors (the version ``bench_quant.py`` uses for its in-process arm, so both arms run
one llama.cpp; PyPI is the only source reachable here), for this CPU (the same CMake
ISA options as ``bench_quant.llama_cpp_cmake_args``: native, or every extension but
AMX where the CPU has AMX), without the web UI and without curl. It lives in
``$EMBER_BENCH_LLAMA_SERVER_DIR``, else ``<Ember cache>/bench/llama-server-<version>[-tag]``,
and a marker file records a finished build, so a second call returns at once. The
build takes about 10 minutes on 2 cores.

    from peer_llama_cpp import ensure_llama_server, start_llama_server

    binary, why = ensure_llama_server()     # (None, why) when it cannot be built here
    proc = start_llama_server(binary, gguf, port, slots=64, log_path=log)   # 64 parallel slots

``python benchmarks/peer_llama_cpp.py --smoke`` builds it, serves the default model's
GGUF and prints one chat reply.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_quant import LLAMA_CPP_VERSION, llama_cpp_build_dir, llama_cpp_cmake_args  # noqa: E402

# the server, without what it would download (UI assets, models by URL)
SERVER_CMAKE_ARGS = ("-DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF "
                     "-DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DCMAKE_BUILD_TYPE=Release")
CONTEXT_PER_SLOT = 512  # tokens: a chat prompt of the benchmark and its 128-256 new tokens


def server_dir() -> Path:
    return llama_cpp_build_dir("EMBER_BENCH_LLAMA_SERVER_DIR", "llama-server")


def _run(what: str, cmd: list[str], log: Callable[[str], None], **kwargs) -> str:
    """'' when `cmd` succeeds, else why (its output's tail)."""
    log(f"llama-server build: {what}")
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, **kwargs)
    if proc.returncode == 0:
        return ""
    return f"{what} failed (rc {proc.returncode}): {(proc.stderr or proc.stdout)[-800:]}"


def ensure_llama_server(log: Callable[[str], None] = print) -> tuple[Path | None, str]:
    """The path of a built ``llama-server``, or (None, why it could not be built)."""
    root = server_dir()
    binary, marker = root / "build" / "bin" / "llama-server", root / "ember-llama-server-ok"
    if marker.is_file() and binary.is_file():
        return binary, ""
    if shutil.which("cmake") is None:
        return None, "cmake is not installed (apt-get install cmake)"
    root.mkdir(parents=True, exist_ok=True)
    source = root / "llama.cpp"
    if not (source / "CMakeLists.txt").is_file():
        with tempfile.TemporaryDirectory() as tmp:
            why = _run(f"pip download llama-cpp-python=={LLAMA_CPP_VERSION} (sdist)",
                       [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={LLAMA_CPP_VERSION}", "-d", tmp], log)
            if why:
                return None, why
            sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"), None)
            if sdist is None:
                return None, f"pip downloaded no llama-cpp-python sdist into {tmp}"
            prefix = f"{sdist.name.removesuffix('.tar.gz')}/vendor/llama.cpp/"
            with tarfile.open(sdist) as tar:
                members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
                for member in members:
                    member.name = member.name[len(prefix):]
                tar.extractall(source, members=[m for m in members if m.name], filter="data")
    cmake_args, _ = llama_cpp_cmake_args()
    build = root / "build"
    why = _run("cmake configure", ["cmake", "-S", str(source), "-B", str(build),
                                   *f"{cmake_args} {SERVER_CMAKE_ARGS}".split()], log)
    if why:
        return None, why
    why = _run(f"cmake --build (target llama-server; minutes; CMAKE_ARGS {cmake_args})",
               ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(os.cpu_count() or 2)], log)
    if why:
        return None, why
    check = subprocess.run([str(binary), "--version"], capture_output=True, text=True, check=False,
                           env=_env(binary))
    if check.returncode != 0:
        return None, f"llama-server --version failed: {(check.stderr or check.stdout)[-800:]}"
    marker.write_text((check.stderr or check.stdout).strip() + "\n")
    return binary, ""


def _env(binary: Path) -> dict[str, str]:
    # the build's shared libraries (libllama, libggml*) lie beside the binary
    return {**os.environ, "LD_LIBRARY_PATH": f"{binary.parent}:{os.environ.get('LD_LIBRARY_PATH', '')}"}


def server_command(binary: Path, gguf: Path | str, port: int, slots: int, threads: int) -> list[str]:
    """``llama-server`` with ``slots`` parallel slots of ``CONTEXT_PER_SLOT`` tokens each
    (continuous batching is its default), computing with ``threads`` threads (decode and
    prompt), the GGUF's chat template. Each slot keeps its own KV cache (``-no-kvu``):
    with one unified cache every token attended over all slots' cells, masked, and 64
    streams ran at 67.6 tok/s against 190.0 (2-core EPYC, 2026-12-06)."""
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "-np", str(slots), "-no-kvu", "-c", str(slots * CONTEXT_PER_SLOT),
            "-t", str(threads), "-tb", str(threads), "--jinja", "--no-webui"]


def start_llama_server(binary: Path, gguf: Path | str, port: int, slots: int, log_path: Path,
                       threads: int | None = None) -> subprocess.Popen:
    """Start the server in a session of its own (its whole group is stopped with
    ``os.killpg``), its output in ``log_path``."""
    threads = threads or os.cpu_count() or 1
    with open(log_path, "wb") as log:
        return subprocess.Popen(server_command(binary, gguf, port, slots, threads), env=_env(binary), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)


def smoke() -> int:
    import socket

    from ember.weights.default_model import fetch_default_gguf

    binary, why = ensure_llama_server()
    if binary is None:
        print(f"llama-server can't be built here: {why}")
        return 1
    with tempfile.TemporaryDirectory() as work, socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        gguf = fetch_default_gguf(Path(work) / "gguf", progress=False)
        log = Path(work) / "server.log"
        proc = start_llama_server(binary, gguf, port, 4, log)
        try:
            started = time.perf_counter()
            while True:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
                        if resp.status == 200:
                            break
                except OSError:
                    pass
                if proc.poll() is not None or time.perf_counter() - started > 120:
                    print(log.read_text(errors="replace")[-2000:])
                    return 1
                time.sleep(0.3)
            body = json.dumps({"messages": [{"role": "user", "content": "Name three colors."}], "max_tokens": 24,
                               "temperature": 0}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as resp:
                reply = json.loads(resp.read())
            print(f"{binary}: {reply['choices'][0]['message']['content']!r} ({reply.get('timings', {})})")
        finally:
            os.killpg(proc.pid, 15)
            proc.wait(30)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="build, serve the default GGUF, one chat reply")
    if parser.parse_args().smoke:
        sys.exit(smoke())
    parser.print_help()
