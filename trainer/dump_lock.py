"""One run per dump folder: an exclusive lock file taken before anything is written there.

Two runs writing one `job.dump_folder` corrupt each other (checkpoint folders renamed under
the other's feet, interleaved metrics, a second start "resuming" from a live run), so rank 0
takes `<dump_folder>/.weft.lock` before the process group starts and removes it at exit.

The lock is a file created with O_CREAT | O_EXCL holding the owner's host, pid and start
time, rather than `flock`, because dump folders often sit on network file systems where
advisory locks are not shared between hosts. The price is a stale file after a hard kill,
handled so: a lock left by a dead process of this host is taken over with a warning; one
from another host cannot be checked from here, so the run is refused with the command that
clears it.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import time

from trainer.errors import ConfigError, DumpFolderInUse

logger = logging.getLogger(__name__)

LOCK_NAME = ".weft.lock"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


class DumpFolderLock:
    """`acquire()` at start (rank 0), `release()` at exit; also a context manager."""

    def __init__(self, dump_folder: str) -> None:
        self.folder = dump_folder
        self.path = os.path.join(dump_folder, LOCK_NAME)
        self.held = False

    def acquire(self) -> None:
        """Take the lock or raise DumpFolderInUse (another live run) / ConfigError (not writable)."""
        try:
            os.makedirs(self.folder, exist_ok=True)
        except OSError as e:
            raise ConfigError(
                f"job.dump_folder '{self.folder}' cannot be created ({e.strerror}); choose a folder you can write."
            ) from None
        for _ in range(2):  # a second try after taking over a stale lock
            if self._create():
                self.held = True
                return
            owner = self._read_owner()
            if owner is None:
                continue  # removed between our create and read: try again
            if owner.get("host") != socket.gethostname():
                raise DumpFolderInUse(
                    f"job.dump_folder '{self.folder}' is in use by pid {owner.get('pid')} on host "
                    f"{owner.get('host')} (since {owner.get('started', '?')}). Use another job.dump_folder, or if "
                    f"that run is gone: rm {self.path}"
                )
            if _pid_alive(int(owner.get("pid", -1))):
                raise DumpFolderInUse(
                    f"job.dump_folder '{self.folder}' is in use by pid {owner.get('pid')} on this host "
                    f"(since {owner.get('started', '?')}). Wait for that run or use another job.dump_folder."
                )
            logger.warning(
                f"taking over the lock of {self.folder}: its owner, pid {owner.get('pid')} on this host, is no longer running"
            )
            self._remove_if_owned_by(owner)
        raise DumpFolderInUse(f"job.dump_folder '{self.folder}' is being locked by another run starting right now.")

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        except OSError as e:
            if e.errno in (errno.EACCES, errno.EROFS, errno.EPERM):
                raise ConfigError(
                    f"job.dump_folder '{self.folder}' is not writable ({e.strerror}); choose a folder you can write."
                ) from None
            raise
        owner = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        with os.fdopen(fd, "w") as f:
            json.dump(owner, f)
        return True

    def _read_owner(self) -> dict | None:
        try:
            with open(self.path) as f:
                return json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {"host": "?", "pid": -1}  # torn or foreign file: treat as held elsewhere

    def _remove_if_owned_by(self, owner: dict) -> None:
        """Remove the stale lock only if it still names the dead owner (another starter may have
        taken it over already)."""
        if self._read_owner() == owner:
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass

    def release(self) -> None:
        if self.held:
            self.held = False
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass

    def __enter__(self) -> "DumpFolderLock":
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
