"""The on-disk cache of fetched and converted models: where it lives, and how a write into it
stays whole (a temporary folder renamed at the end; one left by a killed process is swept) and
happens once (a lock per entry: a second process waits for the first and reuses its result)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

TEMP_PREFIX = ".fetch-"


STALE_TEMP_S = 3600.0
"""A fetch folder this old was left by a killed process (SIGKILL leaves no chance to clean)."""


def cache_dir() -> Path:
    return cache_root() / "models"


def cache_root() -> Path:
    return Path(os.environ.get("SPECKERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "speckernel"))


def remove_stale_temps(folder: Path) -> None:
    for tmp in folder.glob(f"{TEMP_PREFIX}*"):
        with contextlib.suppress(OSError):
            if time.time() - tmp.stat().st_mtime > STALE_TEMP_S:
                shutil.rmtree(tmp, ignore_errors=True)


def lock_path(entry: Path) -> Path:
    return entry.with_name(f".{entry.name}.lock")


@contextlib.contextmanager
def entry_lock(entry: Path) -> Iterator[None]:
    """Held while one process checks and writes the cache entry `entry`; others wait. An flock,
    so the kernel drops it when its holder dies, however it dies: a crashed writer leaves its
    lock file (empty, harmless) but never a lock held."""
    lock = lock_path(entry)
    lock.parent.mkdir(parents=True, exist_ok=True)
    with lock.open("a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C while a fetch runs, so its cleanup runs (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
