"""Build something once per filesystem: the first process to take a lock file builds it, every
other process (on this host or another one sharing the filesystem) polls until it exists.

Why not `dist.barrier()`: its collective timeout (10 minutes by default under NCCL) would
kill a job whose first rank spends hours tokenizing a corpus, and it cannot coordinate two
jobs that share a cache. A lock file works across jobs and hosts, and costs nothing while
waiting.

The lock is `TARGET.lock`, created with O_CREAT | O_EXCL (atomic, also on NFS) and holding
its owner (host, pid, start time). The owner touches it every HEARTBEAT_S seconds. A lock
is stale when its owner is a dead process on this host, or when it has not been touched
for STALE_AFTER_S seconds (an owner on another host that died); a waiter then takes it over
with a warning. The lock only avoids duplicate work: builders publish their result with an
atomic rename, so even two builders (a takeover of a live but frozen owner) leave one
correct result.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable

from trainer.config import ConfigError

logger = logging.getLogger(__name__)

POLL_S = 1.0
HEARTBEAT_S = 10.0
STALE_AFTER_S = 300.0
REPORT_EVERY_S = 60.0


def _owner() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}


def _read_owner(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None  # vanished, or its owner is still writing it


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Heartbeat:
    """Touches the lock file while the build runs, so waiters can tell it is alive."""

    def __init__(self, path: str):
        self.path = path
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="weft-data-lock")

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                return

    def __enter__(self) -> _Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _try_lock(path: str) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump(_owner(), f)
    return True


def _stale_reason(path: str) -> str | None:
    """Why the lock at `path` is stale, or None when its owner may still be working."""
    owner = _read_owner(path)
    try:
        age = time.time() - os.stat(path).st_mtime
    except FileNotFoundError:
        return None
    if owner and owner.get("host") == socket.gethostname() and not _pid_alive(int(owner.get("pid", -1))):
        return f"its owner (pid {owner.get('pid')} on this host) is gone"
    if age > STALE_AFTER_S:
        return f"it has not been touched for {age:.0f} s"
    return None


def _take_over(path: str, reason: str) -> None:
    """Move a stale lock aside; if a live owner replaced it meanwhile, put that one back."""
    before = _read_owner(path)
    aside = f"{path}.stale-{socket.gethostname()}-{os.getpid()}"
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return
    if _read_owner(aside) != before:
        os.rename(aside, path)  # not the stale lock we judged: a new owner took it first
        return
    os.unlink(aside)
    logger.warning(f"took over the stale lock {path} ({reason}; held by {before})")


def build_once(target: str, build: Callable[[], None], *, what: str) -> None:
    """Make sure `target` exists: run `build()` (which must create it atomically) under the
    lock, or wait for the process that holds it.

    A `ConfigError` raised by the builder (bad data) is left in `TARGET.error`, and processes
    that were waiting raise it too instead of repeating the build; a later run retries.
    """
    lock, error_file = target + ".lock", target + ".error"
    waiting_since = time.time()
    last_report = waiting_since
    while not os.path.exists(target):
        if os.path.exists(error_file) and os.stat(error_file).st_mtime >= waiting_since:
            with open(error_file) as f:
                raise ConfigError(f.read())
        if _try_lock(lock):
            try:
                if os.path.exists(error_file):
                    os.unlink(error_file)
                if not os.path.exists(target):
                    with _Heartbeat(lock):
                        build()
            except ConfigError as e:
                with open(error_file, "w") as f:
                    f.write(str(e))
                raise
            finally:
                os.unlink(lock)
            return
        reason = _stale_reason(lock)
        if reason is not None:
            _take_over(lock, reason)
            continue
        if time.time() - last_report > REPORT_EVERY_S:
            last_report = time.time()
            logger.info(f"waiting {last_report - waiting_since:.0f} s for {_read_owner(lock)} to finish {what} "
                        f"(lock {lock}; delete it if that process is dead)")
        time.sleep(POLL_S)
