"""Ember's native libraries (``csrc/*.c``): compiled once per machine into the Ember
cache (`build`), and loaded only when they can be trusted.

Loading a library runs its code, so a cached one is trusted only as ssh trusts its
files: the directory must be this user's and writable by no one else (`make_private_dir`
creates it 0700 and refuses one that is not), and the library must be this user's,
writable by no one else, and hash to the sha256 recorded in ``<library>.sha256`` when
it was built (`check_library`). The one loaded is the very file that was hashed,
through its open descriptor (`load_checked`).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import stat
import subprocess
import tempfile
from importlib import resources
from pathlib import Path
from typing import BinaryIO

logger = logging.getLogger(__name__)

RECORD_SUFFIX = ".sha256"  # beside the library: its sha256 when built
# every library is built with these (the GGUF kernels add their instruction sets per
# function, as target attributes); no FMA contraction: explicit intrinsics choose
# where to fuse, and ember_rope's plain C then rounds as PyTorch does
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
LIBS = ("-lm",)


class UntrustedKernelError(RuntimeError):
    """A cached kernel library, or the directory holding it, fails the ownership or hash check."""


def check_library(f: BinaryIO, path: Path) -> str | None:
    """Why the library open as ``f`` (at ``path``) must not be loaded, or None: it and
    its sha256 record must belong to this user, be writable by no one else, and the
    content of ``f`` must hash to the recorded sha256."""
    problem = _untrusted(os.fstat(f.fileno()), "it")
    if problem:
        return problem
    record_file = record_path(path)
    try:
        with open(record_file, "rb") as record:
            problem = _untrusted(os.fstat(record.fileno()), f"its sha256 record {record_file}")
            recorded = (record.read(1024).split() or [b""])[0].decode("ascii", "replace")
    except FileNotFoundError:
        return f"it has no sha256 record ({record_file.name})"
    if problem:
        return problem
    f.seek(0)
    actual = hashlib.file_digest(f, "sha256").hexdigest()
    if actual != recorded:
        return f"its sha256 {actual} is not the {recorded or '(empty)'} recorded when it was built"
    return None


def _untrusted(st: os.stat_result, what: str) -> str | None:
    """Why ``what`` (a file or directory with status ``st``) is not to be trusted, or None:
    ssh's StrictModes rule."""
    uid = os.getuid()
    if st.st_uid != uid:
        return f"{what} is owned by uid {st.st_uid}, not by this user (uid {uid})"
    if st.st_mode & 0o022:
        return f"{what} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def record_path(library: Path) -> Path:
    return library.with_name(library.name + RECORD_SUFFIX)


def make_private_dir(directory: Path) -> None:
    """Create ``directory`` 0700 if missing; UntrustedKernelError unless it is this user's and
    writable by no one else (what is in it could then be swapped at any time)."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    try:
        directory.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = os.stat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise RuntimeError(f"{directory} is not a directory")
    problem = _untrusted(st, f"the kernel directory {directory}")
    if problem:
        raise UntrustedKernelError(f"{problem}; remove it, or make it yours and private (chmod 700)")


def load_checked(path: Path) -> ctypes.CDLL:
    """dlopen the library at ``path`` if `check_library` passes, through the same open
    file, so that what was hashed is what is loaded. UntrustedKernelError if it does not pass."""
    with open(path, "rb") as f:
        problem = check_library(f, path)
        if problem:
            raise UntrustedKernelError(f"{path}: {problem}")
        if not os.path.isdir("/proc/self/fd"):  # no procfs: the private directory must do
            return ctypes.CDLL(str(path))
        # Never closed once loaded: the loader knows the library by this /proc name, and
        # would hand the same library back for that name if the number were reused.
        fd = os.dup(f.fileno())
    try:
        return ctypes.CDLL(f"/proc/self/fd/{fd}")
    except OSError:
        os.close(fd)
        raise


def kernel_cache_dir() -> Path:
    from ember.weights.resolver import ember_cache_dir

    return ember_cache_dir() / "kernels"


def build(source: str, out_dir: Path) -> Path:
    """Compile ``source`` into ``out_dir`` (named by the source and flags' hash) and
    record its sha256 beside it; reuse an earlier build that passes `check_library`,
    rebuild one that does not (the reason logged). Raises RuntimeError naming the
    compiler's complaint, or why ``out_dir`` cannot be trusted."""
    text = (resources.files("ember.hardware") / "csrc" / source).read_bytes()
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise RuntimeError("no C compiler (set CC or install gcc)")
    digest = hashlib.sha256(text + " ".join(FLAGS + LIBS).encode() + compiler.encode()).hexdigest()[:16]
    target = out_dir / f"{Path(source).stem}-{digest}.so"
    make_private_dir(out_dir)
    if target.exists():
        with open(target, "rb") as f:
            problem = check_library(f, target)
        if problem is None:
            return target
        logger.warning("rebuilding the native library %s: %s", target, problem)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        src = Path(tmp) / source
        src.write_bytes(text)
        built = Path(tmp) / target.name
        # relative names: no temporary path in the output, so concurrent builds write the same bytes
        proc = subprocess.run(
            [compiler, *FLAGS, src.name, "-o", built.name, *LIBS], cwd=tmp, capture_output=True, text=True,
            timeout=120,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {proc.stderr.strip()[-500:]}")
        built.chmod(0o755)  # whatever the umask: writable by this user only
        sha256 = hashlib.sha256(built.read_bytes()).hexdigest()
        os.replace(built, target)  # atomic: concurrent builders leave one whole file
        record = Path(tmp) / "record"
        record.write_text(f"{sha256}  {target.name}\n")
        record.chmod(0o644)
        os.replace(record, record_path(target))  # after the library: a record never names a missing build
    return target
