"""Which project files one streaming chat completion runs code in, in both processes
of `ember serve --engine-mode process` (the default) or in thread mode.

Every function call in every thread is recorded while one request is served (after a
warm-up request) on a tiny random Llama; the engine-core process records its own
calls (a `sitecustomize` this script puts on its path, switched on and off by
SIGUSR1). Prints the files, which process ran each (P: API, C: engine core), and the
count; writes a JSON result. tests/test_request_path.py checks the thread-mode count.

    python benchmarks/request_path.py [--mode process|thread] [--out benchmarks/results/request_path.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DIRS = tuple(f"{ROOT / d}/" for d in ("core", "api", "plugins", "hardware"))
CHILD_HOOK = f"""
import os, sys
if os.environ.get("EMBER_REQUEST_PATH_OUT") and "--multiprocessing-fork" in sys.argv:
    import json, signal, threading
    _on, _seen, _out = [False], {{}}, os.environ["EMBER_REQUEST_PATH_OUT"]
    def _profile(frame, event, arg):
        if _on[0] and event == "call" and frame.f_code.co_filename.startswith({DIRS!r}):
            names = _seen.setdefault(frame.f_code.co_filename, set())
            if frame.f_code.co_name not in names:
                names.add(frame.f_code.co_name)
                with open(_out, "w") as f:
                    json.dump({{k: sorted(v) for k, v in _seen.items()}}, f)
    def _toggle(signum, frame):
        _on[0] = not _on[0]
    signal.signal(signal.SIGUSR1, _toggle)
    sys.setprofile(_profile)
    threading.setprofile(_profile)
"""


def _core_processes() -> list[int]:
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_text()
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if parent == os.getpid() and "spawn_main" in cmdline and "--multiprocessing-fork" in cmdline:
            pids.append(int(pid))
    return pids


def measure(mode: str, child_out: Path) -> dict[str, dict[str, list[str]]]:
    sys.path.insert(0, str(ROOT / "tests"))
    seen: dict[str, set[str]] = {}
    recording = threading.Event()

    def profile(frame, event, arg):
        if event == "call" and recording.is_set() and frame.f_code.co_filename.startswith(DIRS):
            seen.setdefault(frame.f_code.co_filename, set()).add(frame.f_code.co_name)

    threading.setprofile(profile)
    sys.setprofile(profile)
    import httpx
    from server_utils import running_server, wait_idle
    from tiny_models import make_tiny_model

    model_dir = Path(tempfile.mkdtemp()) / "tiny-llama"
    make_tiny_model("llama", model_dir)
    body = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, "stream": True}
    with running_server(model_dir, engine_mode=mode) as (url, app), httpx.Client(timeout=60) as client:
        client.post(f"{url}/v1/chat/completions", json=body).read()  # warm-up
        wait_idle(app)
        cores = _core_processes() if mode == "process" else []
        for pid in cores:
            os.kill(pid, signal.SIGUSR1)
        time.sleep(0.3)
        recording.set()
        client.post(f"{url}/v1/chat/completions", json=body).read()
        wait_idle(app)
        time.sleep(0.5)  # the core's last messages
        recording.clear()
        for pid in cores:
            os.kill(pid, signal.SIGUSR1)
    sys.setprofile(None)
    threading.setprofile(None)
    child = json.loads(child_out.read_text()) if mode == "process" else {}
    return {"api_process": {k: sorted(v) for k, v in seen.items()}, "core_process": child}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["process", "thread"], default="process")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "request_path.json"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not args.child:  # run again with the engine-core process's hook on the path
        with tempfile.TemporaryDirectory() as hook_dir:
            Path(hook_dir, "sitecustomize.py").write_text(CHILD_HOOK)
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([hook_dir, os.environ.get("PYTHONPATH", "")]),
                       EMBER_REQUEST_PATH_OUT=str(Path(hook_dir) / "core.json"))
            return subprocess.call([sys.executable, __file__, "--child", *sys.argv[1:]], env=env)
    result = measure(args.mode, Path(os.environ["EMBER_REQUEST_PATH_OUT"]))
    api, core = result["api_process"], result["core_process"]
    files = sorted(set(api) | set(core))
    for f in files:
        where = ("P" if f in api else "-") + ("C" if f in core else "-")
        print(f"{where} {Path(f).relative_to(ROOT)}")
    print(f"{len(files)} project files on a streaming chat completion's path ({args.mode} mode)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "mode": args.mode, "num_files": len(files), "files": [str(Path(f).relative_to(ROOT)) for f in files],
        "functions": {str(Path(f).relative_to(ROOT)): sorted(set(api.get(f, [])) | set(core.get(f, []))) for f in files},
    }, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
