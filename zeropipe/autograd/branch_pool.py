"""The threads that run parallel branches, and the errors a branch run reports.

:class:`BranchPool` owns a thread pool.  The calling thread also works: it
submits tasks ``1..n-1``, then runs every task nobody has started yet, then
waits only for tasks already running on other threads::

    caller:   submit 1..n-1 -> run 0 -> run any unclaimed k -> wait for the claimed
    workers:  claim k -> run k

Nested :func:`~zeropipe.autograd.parallel.parallel_map` calls on the same
pool therefore cannot deadlock, at any depth or pool size (a wait is always
for a running task).  Without an explicit pool, :func:`default_branch_pool`
is used: a process-wide pool that is created on first use under a lock --
the one piece of module state here.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from zeropipe.base import _compat
from zeropipe.core.errors import ZeropipeError

__all__ = ["BranchError", "BranchPool", "ParallelMapError", "default_branch_pool"]

T = TypeVar("T")


class ParallelMapError(ZeropipeError, ValueError):
    """A parallel_map request is malformed, or a branch broke the branch contract."""


class BranchError(ZeropipeError, RuntimeError):
    """A branch raised; ``branch`` is its index (None: all branches at once), ``phase`` when."""

    def __init__(self, message: str, *, branch: int | None, name: str, phase: str) -> None:
        self.branch = branch
        self.name = name
        self.phase = phase
        super().__init__(message)


# --- the pool ---------------------------------------------------------------


class BranchPool:
    """Threads that run branches; the calling thread always works too (see module docstring).

    ``max_workers`` defaults to one less than the number of cores, the caller
    being the extra thread.

    The executor and per-device side streams are created on first use and
    released by :meth:`close` (a later call creates them again).  Copying or
    pickling a pool gives a fresh, unstarted pool of the same size.
    """

    def __init__(self, max_workers: int | None = None) -> None:
        if max_workers is not None and max_workers < 1:
            raise ParallelMapError(f"max_workers must be >= 1, got {max_workers}")
        # The calling thread works too, so one core per worker is one too many.
        default = max(1, (os.cpu_count() or 2) - 1)
        self.max_workers = max_workers if max_workers is not None else default
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._streams: dict[torch.device, list[Any]] = {}

    def __reduce__(self) -> tuple[type[BranchPool], tuple[int]]:
        return (BranchPool, (self.max_workers,))

    def __enter__(self) -> BranchPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the threads (after queued work) and drop cached streams."""
        with self._lock:
            executor, self._executor = self._executor, None
            self._streams.clear()
        if executor is not None:
            executor.shutdown(wait=True)

    def _get_executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    max_workers=self.max_workers, thread_name_prefix="zeropipe-branch"
                )
            return self._executor

    def side_streams(self, device: torch.device, n: int) -> list[Any]:
        """``n`` side streams on ``device``, created once and reused by later calls."""
        with self._lock:
            streams = self._streams.setdefault(device, [])
            while len(streams) < n:
                streams.append(_compat.new_stream(device))
            return streams[:n]

    def run(
        self,
        tasks: Sequence[Callable[[], T]],
        *,
        names: Sequence[str] | None = None,
        phase: str = "run",
    ) -> list[T]:
        """Run ``tasks`` concurrently; results in task order.

        If tasks raise, tasks not yet started are skipped, the running ones
        finish, and :class:`BranchError` for the lowest failing index is raised.
        """
        n = len(tasks)
        results: list[Any] = [None] * n
        errors: list[BaseException | None] = [None] * n
        claimed = [False] * n
        done = [threading.Event() for _ in range(n)]
        claim_lock = threading.Lock()
        failed = threading.Event()

        def attempt(i: int) -> None:
            with claim_lock:
                if claimed[i]:
                    return
                claimed[i] = True
            try:
                if not failed.is_set():
                    results[i] = tasks[i]()
            except BaseException as exc:
                errors[i] = exc
                failed.set()
            finally:
                done[i].set()

        if n > 1:
            try:
                executor = self._get_executor()
                for i in range(1, n):
                    executor.submit(attempt, i)
            except RuntimeError:
                pass  # closed concurrently: whatever was not submitted runs below
        for i in range(n):
            attempt(i)
        for d in done:
            d.wait()
        for i, exc in enumerate(errors):
            if exc is not None:
                name = names[i] if names is not None else str(i)
                raise BranchError(
                    f"branch {i} ({name}) failed in {phase}: {type(exc).__name__}: {exc}",
                    branch=i,
                    name=name,
                    phase=phase,
                ) from exc
        return results


_default_pool: BranchPool | None = None
_default_pool_lock = threading.Lock()


def default_branch_pool() -> BranchPool:
    """The process-wide pool used when no pool is passed (``os.cpu_count() - 1`` workers).

    Created on first use under a lock; its idle threads are joined at exit.
    Pass an explicit :class:`BranchPool` to control size and lifetime.
    """
    global _default_pool
    with _default_pool_lock:
        if _default_pool is None:
            _default_pool = BranchPool()
        return _default_pool
