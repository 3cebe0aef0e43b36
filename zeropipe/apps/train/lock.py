"""The lock that makes a run folder one run's own: ``zeropipe train --out DIR`` holds it for
the whole run, from before anything is read or written in DIR.

    claim_run_dir(out)   a context manager: DIR/.zeropipe.lock taken, or a one-line refusal
                         naming the process that holds it; released (and the file removed)
                         when the run ends, however it ends
    lock_holder(out)     who holds DIR's lock now, as words, or None

The lock is an ``flock`` on DIR/.zeropipe.lock, which the kernel drops when its process
dies, so a lock left by a killed run is never mistaken for a live one: the file's
contents (pid, host, start time) only name the holder.  A file found whose lock is free
was left by a process that is gone; it is taken over with a line saying so.  Only the
launching process holds the lock (under torchrun: the process of RANK 0); the ranks it
spawns write into the folder under it.

Where ``flock`` does not work (some NFS mounts) the lock cannot protect the folder; the
claim says so in one line and the run goes on, as it did before locks existed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from zeropipe.core.errors import ZeropipeError

__all__ = ["LOCK_FILE", "claim_run_dir", "lock_holder"]

LOCK_FILE = ".zeropipe.lock"


def _describe(text: str) -> str:
    """The holder's words from the lock file's ``pid host started`` line."""
    parts = text.split()
    if len(parts) < 3:
        return "another process"
    pid, host, started = parts[0], parts[1], parts[2]
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(started)))
    return f"process {pid} on {host}, started {when}"


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _try_lock(fd: int) -> bool:
    """Take the lock without waiting: False when another process holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def lock_holder(out: str | Path) -> str | None:
    """Who holds ``out``'s run lock now ("process 12 on host, started ..."), or None."""
    path = Path(out) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        if _try_lock(fd):
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        return _describe(_read(path))
    except OSError:
        return None
    finally:
        os.close(fd)


def _open_locked(path: Path, out: str | Path) -> tuple[int, str]:
    """The lock file's descriptor, locked, and what an earlier holder left in it.

    The file may be removed by the holder that is ending between our open and
    our lock; a lock on a removed file guards nothing, so the path is checked to
    be still the file locked, and opened again if not.
    """
    for _ in range(100):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        if not _try_lock(fd):
            os.close(fd)
            raise ZeropipeError(
                f"--out {out} is in use by another zeropipe train ({_describe(_read(path))}); "
                f"wait for it to end, or give another --out"
            )
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            with os.fdopen(os.dup(fd), "r") as fh:
                return fd, fh.read()
        os.close(fd)
    raise ZeropipeError(f"--out {out}: its lock file keeps changing; is another run starting?")


@contextlib.contextmanager
def claim_run_dir(out: str | Path) -> Iterator[None]:
    """Hold ``out``'s run lock for the body (``out`` must exist); see the module."""
    path = Path(out) / LOCK_FILE
    try:
        fd, left = _open_locked(path, out)
    except OSError as exc:
        if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            print(
                f"zeropipe train: --out {out} cannot be locked on this filesystem "
                f"({exc.strerror}); make sure no other run uses it",
                file=sys.stderr,
            )
            yield
            return
        raise ZeropipeError(
            f"--out {out}: cannot take its lock {path} ({exc.strerror or exc}); "
            f"give a folder you can write"
        ) from None
    try:
        if left.strip():
            print(
                f"zeropipe train: --out {out} was locked by {_describe(left)}, which is no "
                f"longer running; taking it over",
                file=sys.stderr,
            )
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()} {time.time():.0f}\n".encode(), 0)
        yield
    finally:
        # Removed while still held, so no run can find it free and still see our line.
        with contextlib.suppress(OSError):
            path.unlink()
        os.close(fd)
