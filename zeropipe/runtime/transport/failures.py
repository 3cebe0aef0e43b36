"""How every rank of a distributed pipeline learns why a step died, in bounded time.

A rank that fails writes why to the rendezvous store; ranks waiting on it
look there between slices of their waits::

    rank r fails  -> Pipeline calls transport.fail(exc) -> PeerFailures.record:
                     the first failure of this pipeline is written under its key
    peers waiting -> PeerFailures.check: error key set?  launcher's FAILED_KEY set?
                     -> PipelineError("rank r failed: ...")

A dead peer surfaces as gloo's "Connection closed/reset by peer" on a
pending operation; :meth:`PeerFailures.error` turns that into "rank q stopped
responding (killed?) ...", and :mod:`zeropipe.runtime.launch` also writes a
dead or raising child's message to the store under :data:`FAILED_KEY`.

Errors relayed on a peer's behalf carry the rank the failure started on
(:func:`failure_origin`), so the launcher names the cause, not an echo.

A failed step leaves pool threads blocked in ``Work.wait()`` on transfers a
peer will never complete, and such a thread aborts the process ("terminate
called without an active exception", seen with torch 2.13 on Python 3.11)
if it wakes while the interpreter finalizes: on its way back from C++ it
re-takes the GIL, and a finalizing interpreter ends the thread there by
unwinding a stack that cannot be unwound.  It wakes when the peer's process
ends and its connections close.  So at exit (:func:`watch_at_exit`)::

    no wait blocked              -> a normal exit
    this rank failed on its own  -> flush, os._exit(1) at once: its error is printed,
                                    its peers learn of it from the store
    it relays a peer's failure   -> wait (bounded) for the failed peer's process to end,
                                    which fails the blocked waits, plus a moment, then
                                    exit normally: a supervisor polling the processes
                                    (torchrun) sees the cause end first and names it
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import sys
import time
import weakref
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

from zeropipe.core.errors import PipelineError

__all__ = ["FAILED_KEY", "PeerFailures", "failure_origin", "watch_at_exit"]

# Written by zeropipe.launch (which hosts the store) when a process raises or dies.
FAILED_KEY = "zeropipe/failed"

# What gloo says when the process at the other end of a socket went away.
_LOST_WORDS = ("closed by peer", "connection reset", "broken pipe", "connection refused", "EOF")


def failure_origin(error: BaseException) -> int | None:
    """The rank a failure started on, when ``error`` relays a peer's failure (else None)."""
    origin = getattr(error, "zeropipe_origin", None)
    return origin if isinstance(origin, int) else None


def _relay(message: str, origin: int) -> PipelineError:
    err = PipelineError(message)
    err.zeropipe_origin = origin  # type: ignore[attr-defined]
    return err


def _gist(text: str) -> str:
    """gloo's message without its source location and boilerplate advice."""
    lines = text.strip().splitlines()
    line = re.sub(r"^\[[^\]]*\]\s*", "", lines[0]) if lines else ""
    return line.split(". This is typically", 1)[0]


class PeerFailures:
    """One rank's view of its pipeline's failures, kept in the rendezvous store.

    Building one numbers the pipeline: the n-th pipeline built on each rank is
    the same pipeline on every rank, so its store keys (and the transport's
    tags, from :attr:`number`) never collide with those of an earlier one that
    failed or finished.

    Args:
        rank: this process's rank in the pipeline's group.
        store: the rendezvous store every rank shares.
        group_name: the process group's name ("world" for the default group).
    """

    def __init__(
        self, rank: int, store: Any, group_name: str, world_rank: int | None = None
    ) -> None:
        self.rank = rank
        self.world_rank = rank if world_rank is None else world_rank
        self._store = store
        self.number: int = self.store_call(
            lambda: store.add(f"zeropipe/{group_name}/pipelines{rank}", 1)
        )
        self._key = f"zeropipe/{group_name}/pipeline{self.number}"
        # The n-th pipeline of every process, whatever its group: where a failure is seen
        # by processes of other pipeline groups (the same stage's tensor-parallel peers).
        self._world_key = f"zeropipe/world/pipeline{self.number}"
        self.broken: str | None = None  # why the transport can no longer be used
        self._relayed: BaseException | None = None  # raised on a peer's behalf
        self._lost: tuple[BaseException, dict[str, Any]] | None = None

    @property
    def peer_failed(self) -> bool:
        """True once this rank stopped because a peer failed or went away (not on its own)."""
        return self._relayed is not None or self._lost is not None

    def record(self, error: BaseException) -> None:
        """This rank failed with ``error``: mark the transport broken and tell the peers."""
        if self.broken is None:
            self.broken = f"{type(error).__name__}: {error}"
        if error is self._relayed:
            return  # a peer's failure: already in the store
        if self._lost is not None and self._lost[0] is error:
            record = self._lost[1]
        else:
            text = (
                str(error)
                if isinstance(error, PipelineError)
                else f"{type(error).__name__}: {error}"
            )
            record = {"rank": self.rank, "message": text, "lost": False}
        try:
            # The first failure recorded wins: it is the cause, later ones are echoes.
            if self._store.add(f"{self._key}/failures", 1) == 1:
                self._store.set(f"{self._key}/error", json.dumps(record))
            if not record["lost"] and self._store.add(f"{self._world_key}/failures", 1) == 1:
                mine = {**record, "rank": self.world_rank}
                self._store.set(f"{self._world_key}/error", json.dumps(mine))
        except Exception:
            pass  # the store is gone too: peers see their connections drop or time out

    def culprit(self, error: BaseException) -> PipelineError | None:
        """The failure of another process that ``error`` echoes, if any.

        A collective outside the pipeline's transport (tensor parallelism's, inside a
        stage's forward or backward) fails with a lost connection when a peer process
        fails and exits; the peer recorded why first, under the world-wide key.
        """
        if not any(w.lower() in str(error).lower() for w in _LOST_WORDS):
            return None
        key = f"{self._world_key}/error"
        try:
            if not self._store.check([key]):
                return None
            record = json.loads(self._store.get(key))
        except Exception:
            return None
        origin = int(record["rank"])
        if origin == self.world_rank:
            return None
        return _relay(f"process {origin} failed: {record['message']}", origin)

    def check(self) -> None:
        """Raise the failure a peer (or the launcher) recorded, if any."""
        record = None
        for key in (f"{self._key}/error", FAILED_KEY):
            if self.store_call(partial(self._store.check, [key])):
                record = json.loads(self.store_call(partial(self._store.get, key)))
                break
        if record is None:
            return
        origin, message = int(record["rank"]), str(record["message"])
        err = _relay(message if record.get("lost") else f"rank {origin} failed: {message}", origin)
        self._relayed = err
        self.broken = str(err)
        raise err

    def error(self, exc: BaseException, what: str, peer: int | None) -> PipelineError:
        """The error to raise for ``exc``, which torch.distributed raised during ``what``."""
        # A peer that failed cleanly recorded why before its connections closed.
        self.check()
        text = str(exc)
        first = _gist(text) or type(exc).__name__
        if any(w.lower() in text.lower() for w in _LOST_WORDS):
            who = f"rank {peer}" if peer is not None else "a peer rank"
            message = (
                f"{who} stopped responding (killed?) while rank {self.rank} waited for {what} "
                f"[{first}]"
            )
            err = _relay(message, peer) if peer is not None else PipelineError(message)
            self._lost = (
                err,
                {"rank": -1 if peer is None else peer, "message": str(err), "lost": True},
            )
            return err
        if "timed out" in text.lower():
            return PipelineError(
                f"rank {self.rank} timed out in torch.distributed waiting for {what} [{first}]; "
                f"raise the process group's timeout, or a peer is stuck"
            )
        return PipelineError(f"rank {self.rank}: {what} failed: {type(exc).__name__}: {text}")

    def store_call(self, fn: Callable[[], Any]) -> Any:
        """Run a store operation; a lost store becomes an error that says where it lived."""
        try:
            return fn()
        except Exception as exc:
            raise PipelineError(
                f"rank {self.rank} lost the rendezvous store ({type(exc).__name__}: {exc}); the "
                f"process hosting it (the launcher, or rank 0 under env://) may have died"
            ) from exc


# At exit, how long a rank relaying a peer's failure waits for that peer's process to
# end (it ends its own blocked waits), and how long it then stays: longer than
# torchrun's default 0.1 s poll, so that torchrun sees the cause end alone.
_EXIT_WAIT_S = 5.0
_EXIT_AFTER_PEER_S = 1.0
_EXIT_POLL_S = 0.02


class _Waits(Protocol):
    """What the exit asks of a pool of waiter threads (the endpoint's ``WaitPool``)."""

    failures: PeerFailures | None

    @property
    def busy(self) -> int: ...


# Every pool alive; a pool lives as long as one of its threads.
_POOLS: weakref.WeakSet[_Waits] = weakref.WeakSet()


def watch_at_exit(pool: _Waits) -> None:
    """Have the interpreter's exit look at ``pool``'s blocked waits (see the module's docstring)."""
    _POOLS.add(pool)


def _exit_with_blocked_waits() -> None:
    """At interpreter exit: make sure no pool thread wakes from a c10d wait during finalization."""
    blocked = [pool for pool in list(_POOLS) if pool.busy]
    if not blocked:
        return
    if all(pool.failures is not None and pool.failures.peer_failed for pool in blocked):
        deadline = time.monotonic() + _EXIT_WAIT_S
        while any(pool.busy for pool in blocked) and time.monotonic() < deadline:
            time.sleep(_EXIT_POLL_S)
        if not any(pool.busy for pool in blocked):
            time.sleep(_EXIT_AFTER_PEER_S)
            return
    # The error is already printed (an uncaught exception is, before atexit runs); the
    # status cannot be read here, and waits left blocked mean a step failed: 1.
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, OSError, ValueError):  # none, closed, broken
            stream.flush()
    os._exit(1)


atexit.register(_exit_with_blocked_waits)
