"""The lock that keeps two runs off one local output: a ``flock`` on ``files.LOCK_NAME`` in
the parts folder, held for the whole run."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import time
from pathlib import Path

from ..errors import OutputError
from .files import LOCK_NAME
from .parts import output_os_error

log = logging.getLogger("dsv4enc")

#: flock errors that mean "this file system does not lock", not "someone holds the lock".
_NO_LOCKING = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL}


class OutputLock:
    """An exclusive ``flock`` on ``LOCK_NAME`` in the parts folder for the whole run; the file
    names its holder's pid and host (for a second run's refusal). The holder unlinks it, still
    holding it, at the end; a run that locked the old file meanwhile then locks the new one."""

    def __init__(self, folder: Path, out: Path) -> None:
        self.path = folder / LOCK_NAME
        self.out = out
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        try:
            import fcntl
        except ImportError:  # no flock (Windows): nothing to lock with
            log.warning("cannot lock %s on this system: make sure no other dsv4enc run writes "
                        "it at the same time", self.out)
            return
        for _ in range(100):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except FileNotFoundError:  # a run that just ended removed its .partial folder
                self.path.parent.mkdir(parents=True, exist_ok=True)
                continue
            except OSError as exc:
                raise output_os_error(self.path, exc) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd)
                os.close(fd)
                raise OutputError(f"another dsv4enc run is writing {self.out}{holder}; wait for "
                                  "it to finish or choose another --out") from None
            except OSError as exc:
                if exc.errno not in _NO_LOCKING:
                    os.close(fd)
                    raise output_os_error(self.path, exc) from None
                log.warning("cannot lock %s (%s: file locking is off on this file system); make "
                            "sure no other dsv4enc run writes %s at the same time", self.path,
                            exc.strerror or exc, self.out)
            if _still_linked(fd, self.path):
                self._fd = fd
                _write_holder(fd)
                return
            os.close(fd)  # unlinked by a run that just ended: lock the file there now
        raise OutputError(f"cannot lock {self.path}: it keeps being replaced")

    def release(self) -> None:
        """Unlink the lock file (while still holding it), then let go."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        os.close(self._fd)
        self._fd = None


def _still_linked(fd: int, path: Path) -> bool:
    try:
        mine, now = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (mine.st_dev, mine.st_ino) == (now.st_dev, now.st_ino)


def _write_holder(fd: int) -> None:
    text = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                       "since": time.strftime("%Y-%m-%d %H:%M:%S %Z")})
    with contextlib.suppress(OSError):  # the lock works without it; the refusal names no pid
        os.ftruncate(fd, 0)
        os.pwrite(fd, text.encode() + b"\n", 0)


def _holder(fd: int) -> str:
    """`` (pid N on HOST since TIME)`` from a lock file, or "" when it says nothing usable."""
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f" (pid {int(data['pid'])} on {data['host']}, since {data['since']})"
    except (OSError, ValueError, KeyError, TypeError):
        return ""
