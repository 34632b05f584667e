"""Publish a finished directory atomically: build it beside its final place, then rename.

A directory published this way is either absent or complete, even if the
process is killed midway; the completion marker, written last, lets readers
check that a directory is one of ours and finished. When two processes publish
the same directory at once, the first rename wins and the loser uses the
winner's directory.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

COMPLETE_MARKER = ".ember-complete.json"


def is_complete(directory: Path) -> bool:
    """True if `directory` was published by `publish_staging_dir` (its marker exists)."""
    return (Path(directory) / COMPLETE_MARKER).is_file()


def read_marker(directory: Path) -> dict | None:
    """The marker's contents of a published directory, or None if it is not complete."""
    marker = Path(directory) / COMPLETE_MARKER
    if not marker.is_file():
        return None
    return json.loads(marker.read_text())


@contextmanager
def staging_dir(final_dir: Path) -> Iterator[Path]:
    """Yield a new empty directory beside `final_dir` (same file system, so the rename is atomic).

    The caller fills it and calls `publish_staging_dir`. Whatever is still
    staged when the block exits (an error, or a lost race) is removed.
    """
    final_dir = Path(final_dir)
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = final_dir.parent / f".{final_dir.name}.{uuid.uuid4().hex[:12]}.partial"
    staging.mkdir()  # unlike mkdtemp's 0700, honours the umask so a shared cache stays readable
    try:
        yield staging
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def publish_staging_dir(staging: Path, final_dir: Path, marker: dict) -> Path:
    """Write `marker` into `staging`, then rename `staging` to `final_dir`; return `final_dir`.

    If `final_dir` already exists and is complete (another process won the
    race), `staging` is discarded and the existing directory is returned. If
    it exists and is not complete, `FileExistsError` names it.
    """
    staging, final_dir = Path(staging), Path(final_dir)
    file_mode = staging.stat().st_mode & 0o666
    for path in staging.rglob("*"):  # some writers create files 0600; give all the directory's permissions
        if path.is_file():
            path.chmod(file_mode)
    (staging / COMPLETE_MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")
    try:
        os.rename(staging, final_dir)  # replaces an empty directory; fails on a non-empty one
    except OSError as exc:
        if is_complete(final_dir):
            shutil.rmtree(staging, ignore_errors=True)
            return final_dir
        raise FileExistsError(
            f"Cannot publish into {str(final_dir)!r}: it already exists and is not a finished Ember directory "
            f"(no {COMPLETE_MARKER}). Remove it and retry."
        ) from exc
    return final_dir
