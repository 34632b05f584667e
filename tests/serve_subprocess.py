"""`ember serve` in a subprocess of its own, as an operator runs it: for tests that kill
its engine-core process or measure its memory (what a server in a thread of the test
process cannot show: its exit code, its own peak RSS).

    with served(tiny_llama_dir, "--max-total-tokens", "512") as server:
        httpx.get(f"{server.url}/health")
        server.core_pid()  # the engine-core child (--engine-mode process, the default)
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

STARTUP_TIMEOUT_S = 120.0  # two interpreters import torch on a loaded 2-core machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> list[int]:
    """The direct children of ``pid`` (Linux: /proc/PID/task/*/children)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


def peak_rss_bytes(pid: int) -> int:
    """The process's peak resident set (VmHWM); 0 once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@dataclass
class ServedProcess:
    url: str
    process: subprocess.Popen
    log_path: Path

    def core_pid(self) -> int:
        """The engine-core process: the server's child running `ember.engine.core_process`."""
        for pid in children(self.process.pid):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"spawn_main" in cmdline:  # not the resource tracker, also a multiprocessing child
                return pid
        found = children(self.process.pid)
        raise AssertionError(f"no engine-core child of server {self.process.pid}; children: {found}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def wait_healthy(url: str, process: subprocess.Popen, timeout: float = STARTUP_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode} before it was healthy")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"the server was not healthy within {timeout:.0f} s")


@contextmanager
def served(model_dir: Path | str, *args: str, env: dict[str, str] | None = None,
           preexec_fn: Callable[[], None] | None = None) -> Iterator[ServedProcess]:
    """Run ``python -m ember.api.cli serve --model-id MODEL_DIR --dtype float32 ARGS`` on a
    free port until it is healthy; stop it (SIGKILL if still running) on leaving."""
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="ember-serve-", suffix=".log", delete=False)
    command = [sys.executable, "-m", "ember.api.cli", "serve", "--model-id", str(model_dir), "--dtype", "float32",
               "--port", str(port), *args]
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                               preexec_fn=preexec_fn)
    server = ServedProcess(f"http://127.0.0.1:{port}", process, Path(log.name))
    try:
        try:
            wait_healthy(server.url, process)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}; its log:\n{server.log()[-4000:]}") from None
        yield server
    finally:
        if process.poll() is None:
            for pid in children(process.pid):
                try:
                    os.kill(pid, 9)
                except OSError:
                    pass
            process.kill()
        process.wait(30)
        log.close()
        os.unlink(log.name)
