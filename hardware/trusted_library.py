"""Loading a cached native library only when it can be trusted.

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
import os
import stat
from pathlib import Path
from typing import BinaryIO

RECORD_SUFFIX = ".sha256"  # beside the library: its sha256 when built


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
