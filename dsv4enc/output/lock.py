"""The lock that keeps two runs off one output, held for the whole run: a ``flock`` on
``files.LOCK_NAME`` in a local parts folder (``OutputLock``), a lock object of that name in a
bucket's (``BucketLock``)."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import secrets
import socket
import time
from pathlib import Path
from typing import Any

from .. import storage
from ..errors import OutputError, output_os_error
from ..pausepoints import pause
from .files import LOCK_NAME

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
            try:  # never through a link: the holder's text would overwrite its target
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0),
                             0o644)
            except FileNotFoundError:  # a run that just ended removed its .partial folder
                self.path.parent.mkdir(parents=True, exist_ok=True)
                continue
            except OSError as exc:
                if exc.errno == errno.ELOOP and self.path.is_symlink():
                    raise OutputError(f"{self.path} is a symbolic link (to "
                                      f"{os.readlink(self.path)}), not dsv4enc's lock; move it "
                                      "away") from None
                raise output_os_error(self.path, exc) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = holder_text(_holder(fd))
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


def holder_if_locked(path: Path) -> dict[str, Any] | None:
    """Whether a live run holds the lock file at ``path`` (another parts folder's: it is
    neither created nor kept here): None where none does (no such file, or no ``flock`` on
    this system), else its holder as data (``_holder``; ``holder_text`` words it)."""
    try:
        import fcntl
    except ImportError:
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # let go again as the file is closed
    except BlockingIOError:
        return _holder(fd)
    except OSError:  # file locking is off here (``acquire`` warned about it)
        return None
    finally:
        os.close(fd)
    return None


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


def _holder(fd: int) -> dict[str, Any]:
    """``{"pid", "host", "since"}`` from a lock file, all None when it says nothing usable
    (a run holds it all the same): data, for ``inspect --json``; ``holder_text`` words it."""
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return {"pid": int(data["pid"]), "host": str(data["host"]), "since": str(data["since"])}
    except (OSError, ValueError, KeyError, TypeError):
        return {"pid": None, "host": None, "since": None}


def holder_text(holder: dict[str, Any]) -> str:
    """`` (pid N on HOST, since TIME)`` of a lock file's holder (``_holder``), as a line
    names it after the output, or "" when the lock file said nothing usable."""
    if holder.get("pid") is None:
        return ""
    return f" (pid {holder['pid']} on {holder['host']}, since {holder['since']})"


#: A lock object not refreshed for this long belongs to a run that is gone.
STALE_S = 120.0
#: Seconds between a lock object's refreshes.
HEARTBEAT_S = 30.0
#: Conditional writes a run tries before it gives up taking a lock object that keeps changing.
TAKE_TRIES = 4


class BucketLock:
    """The lock object ``url`` of a bucket output: its holder's pid, host, time and a token of
    its own, rewritten every ``HEARTBEAT_S`` (``refresh``). A run refuses while another's is
    fresh and takes over a stale one (``stale``). On S3 the lock is created, refreshed and
    taken over by conditional writes (``storage.put_if``): of two runs that start at once one
    refuses, and a run whose lock another took over knows it (``lost``). Where the store
    cannot write conditionally, it is looked at, then written."""

    def __init__(self, url: str, out: str) -> None:
        self.url, self.out = url, out
        self.held = False
        self.lost: dict | None = None  # the holder that took this run's lock over
        self._token = secrets.token_hex(8)
        self._etag: str | None = None  # of the object this run wrote last (conditional stores)

    def take(self) -> None:
        """Create the lock object, or take over a stale one; refuse while another run's is
        fresh (raises ``OutputError``)."""
        replacing = None  # the ETag of the stale lock taken over; None: create
        for _ in range(TAKE_TRIES):
            try:
                self._etag = storage.put_if(self.url, self._holder(), replacing)
            except storage.Changed:  # there is one, or another run took the stale one first
                held, replacing = self._read()
                if held.get("token") != self._token:  # (ours: an answer lost on the way)
                    self._refuse_unless_gone(held)
                    pause("lock", pid=os.getpid())  # tests: another run may take it first
                    continue
                self._etag = replacing
            if self._etag is None:  # no conditional writes here: look, then write
                self._refuse_unless_gone(self._read()[0])
                storage.upload(self.url, self._holder())
            self.held = True
            return
        raise OutputError(f"--out {self.out}: the lock object {self.url} changed at every "
                          "try; if no other run is starting, try again")

    def refuse_if_held(self) -> None:
        """Refuse (``OutputError``) while another run holds this lock object, fresh."""
        self._refuse_unless_gone(self._read()[0])

    def refresh(self) -> None:
        """Rewrite the lock with the time if it is still this run's, else ``lost`` names the
        run that took it over ({} where the lock object is gone: that run has ended, or it was
        deleted), and the lock is this run's no more."""
        if not self.held:
            return
        try:
            if self._etag is None:  # no conditional writes here: look, then write
                if self._holder_now().get("token") != self._token:
                    raise storage.Changed(self.url)
                storage.upload(self.url, self._holder())
            else:
                self._etag = storage.put_if(self.url, self._holder(), self._etag)
        except (storage.Changed, FileNotFoundError):
            held, etag = self._read()
            if held.get("token") == self._token:  # this refresh's answer was lost on the way
                self._etag = etag
            else:
                self.lost, self.held = held, False

    def release(self) -> None:
        """Delete the lock object if it is still this run's."""
        if self.held:
            self.held = False
            if self._etag is None or self._read()[0].get("token") == self._token:
                storage.delete(self.url)

    def check(self) -> None:
        """Raise the line that ends a run whose lock another run took over (``refresh``)."""
        if self.lost is None:
            return
        if not self.lost:
            raise OutputError(
                f"--out {self.out}: the lock object {self.url} was removed while this run "
                "could not refresh it (another run took it over and ended, or it was deleted); "
                "this run stops, its committed parts stay")
        raise OutputError(
            f"--out {self.out}: another run (pid {self.lost.get('pid')} on host "
            f"{self.lost.get('host')}) took over the lock object {self.url} while this run "
            "could not refresh it; this run stops, its committed parts stay for that run")

    def _holder(self) -> bytes:
        return json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                           "time": time.time(), "token": self._token}).encode()

    def _holder_now(self) -> dict:
        """The lock object's holder ({} where it is unreadable); raises ``FileNotFoundError``
        where there is none, and the ``OSError`` of a store that does not answer."""
        try:
            held = json.loads(storage.read_bytes(self.url))
        except ValueError:
            return {}
        return held if isinstance(held, dict) else {}

    def _read(self) -> tuple[dict, str | None]:
        """The lock object's holder ({} where there is none, or it is unreadable) and ETag."""
        try:
            data, etag = storage.read_tagged(self.url)
            held = json.loads(data)
        except (OSError, ValueError):
            return {}, None
        return (held if isinstance(held, dict) else {}), etag

    def _refuse_unless_gone(self, held: dict) -> None:
        if held and not stale(held):
            age = time.time() - float(held.get("time", 0))
            raise OutputError(
                f"--out {self.out} is being written by pid {held.get('pid')} on host "
                f"{held.get('host')} (lock object {self.url}, refreshed {age:.0f} s ago); if no "
                "run is writing it, delete that object")


def stale(held: dict[str, Any]) -> bool:
    """Whether a lock object's holder is gone: this process, a dead one on this host, or
    stale ``STALE_S``."""
    pid = held.get("pid")
    return (time.time() - float(held.get("time", 0)) > STALE_S
            or held.get("host") == socket.gethostname()
            and (pid == os.getpid() or not process_alive(pid)))


def process_alive(pid: Any) -> bool:
    """Whether process ``pid`` of this host may still run (True when it cannot be told)."""
    if os.name != "posix" or not isinstance(pid, int) or pid <= 0:
        return True  # (os.kill ends a process on Windows: never asked there)
    try:
        os.kill(pid, 0)  # signal 0: only whether it exists
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # another user's process
        return True
    return True
