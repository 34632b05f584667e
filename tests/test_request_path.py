"""The request path stays narrow: one streaming chat completion runs code in at most
23 project files (API, core, model, hardware and plugins together), and only in the
rooms that serve a request: the API, the engine, the scheduler, the worker, the
models, the plain values and the backend. A plain request calls nothing of the plugin
machinery (contracts, manager, registries), the weights loaders, the parallel ranks or
the built-in plugins: those are resolved once at start-up (docs/architecture.md).

Every function call in every thread is recorded while one request is served (after a
warm-up request), and the project files those functions live in are counted. The
server runs its engine core in a thread here; `benchmarks/request_path.py` counts both
processes of `--engine-mode process` (24 files: these 23 and the engine process's loop,
core/engine/core_process.py). It was 20 until a float32 model's decode steps went
through the few-row GEMV and CPU graphs (issue 36: batch-1 decode x1.72), which put the
graph replay (core/worker/graphs.py, hardware/cpu_graphs.py) and the linear ops
(hardware/cpu_linear.py) on its path, as on a bf16 model's (a Q4_1 model's replays
graphs too).
"""

import sys
import threading
from pathlib import Path

import httpx
from server_utils import running_server, wait_idle

ROOT = Path(__file__).resolve().parents[1]
PROJECT_DIRS = tuple(f"{ROOT / d}/" for d in ("core", "api", "plugins", "hardware"))
MAX_FILES = 23
# where a plain request's code may run (core/*.py, the plain values, too)
SERVING_ROOMS = ("api/", "core/engine/", "core/sched/", "core/worker/", "core/models/", "hardware/")


def test_a_streaming_chat_completion_crosses_at_most_23_project_files(tiny_llama_dir):
    recording = threading.Event()
    seen: dict[str, set[str]] = {}

    def profile(frame, event, arg):
        if event == "call" and recording.is_set():
            filename = frame.f_code.co_filename
            if filename.startswith(PROJECT_DIRS):
                seen.setdefault(filename, set()).add(frame.f_code.co_name)

    body = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, "stream": True}
    threading.setprofile(profile)  # threads started from now on: the server's and the engine's
    sys.setprofile(profile)
    try:
        with running_server(tiny_llama_dir) as (url, app), httpx.Client(timeout=60) as client:
            client.post(f"{url}/v1/chat/completions", json=body).read()  # warm-up
            wait_idle(app)
            recording.set()
            response = client.post(f"{url}/v1/chat/completions", json=body)
            response.read()
            wait_idle(app)
            recording.clear()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    assert response.status_code == 200 and b"data: [DONE]" in response.content
    files = sorted(str(Path(f).relative_to(ROOT)) for f in seen)
    # the path reaches every layer: a test that recorded nothing would pass vacuously
    assert any(f.startswith("api/routes/") for f in files) and "core/sched/scheduler.py" in files, files
    assert any(f.startswith("hardware/") for f in files) and any(f.startswith("core/models/") for f in files), files
    assert len(files) <= MAX_FILES, f"{len(files)} files on the request path: {files}"
    outside = [f for f in files if not f.startswith(SERVING_ROOMS) and f.count("/") > 1]
    assert outside == [], f"a plain request runs code outside the serving rooms: {outside}"
