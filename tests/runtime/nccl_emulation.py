"""NCCL's point-to-point semantics, made to bite on gloo (for the tests; no GPU needed).

Installed in a rank process (``with NcclSemantics(timeout):``), it replaces
``torch.distributed``'s ``isend``, ``irecv``, ``batch_isend_irecv`` and
``all_reduce`` (and zeropipe's own posts beneath ``isend`` / ``irecv``,
``_compat.p2p_send`` / ``p2p_recv``) with operations that behave as NCCL's do:

* **tags are ignored**: every message of a pair travels on one gloo tag, so
  messages are matched in issue order, whatever tag the caller gave;
* **one in-order worker per process**: each call (a single operation, or a
  whole ``batch_isend_irecv``) is queued and run after the previous one
  finished, as NCCL runs a communicator's operations on one stream;
* **a posted receive holds back everything after it** until its send arrives,
  and **a send completes only once its receive is posted** (rendezvous: the
  receiver's worker tells the sender, on a side tag, when it reached the
  receive);
* **a batch progresses together**: the operations of one ``batch_isend_irecv``
  run concurrently (each peer and direction in order), and the call completes
  when all of them have.

A protocol that relies on tags, or on a receive not blocking later sends,
deadlocks or mismatches here, as it would on NCCL.  Every blocking gloo call
is bounded (``timeout``), so a deadlock ends as an error, and the connection
it tears down frees the worker.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from queue import SimpleQueue
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from zeropipe.base import _compat

DATA_TAG, READY_TAG = 101, 102


@dataclass
class _Op:
    send: bool
    tensor: torch.Tensor
    peer: int  # world rank


class _Work:
    """What the emulated calls return: done when its whole call (batch) is done."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.error: BaseException | None = None

    def finish(self, error: BaseException | None) -> None:
        self.error = error
        self._done.set()

    def wait(self, timeout: Any = None) -> bool:
        self._done.wait()
        if self.error is not None:
            raise RuntimeError(f"emulated NCCL operation failed: {self.error}")
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()


class NcclSemantics:
    """Context manager: NCCL's matching, ordering and blocking over this process's gloo group."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timedelta(seconds=timeout)
        self._queue: SimpleQueue[tuple[Callable[[], None], _Work] | None] = SimpleQueue()
        self._worker = threading.Thread(target=self._run, name="nccl-emulation", daemon=True)
        self._saved: dict[tuple[Any, str], Any] = {}
        self.calls = 0  # calls queued (each batch counts once)
        self._closed = threading.Event()

    # -- install / uninstall -------------------------------------------------------------
    def __enter__(self) -> NcclSemantics:
        self._real_isend, self._real_irecv = c10d.isend, c10d.irecv
        self._real_all_reduce = c10d.all_reduce
        fakes = {
            "isend": self._isend,
            "irecv": self._irecv,
            "batch_isend_irecv": self._batch,
            "all_reduce": self._all_reduce,
        }
        for module in (dist, c10d):  # c10d's names too: P2POp checks its op against them
            for name, fake in fakes.items():
                self._saved[(module, name)] = getattr(module, name)
                setattr(module, name, fake)
        # zeropipe's gloo transport posts beneath dist.isend / irecv, on the group itself.
        for name, fake in (("p2p_send", self._group_send), ("p2p_recv", self._group_recv)):
            self._saved[(_compat, name)] = getattr(_compat, name)
            setattr(_compat, name, fake)
        self._worker.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for (module, name), real in self._saved.items():
            setattr(module, name, real)
        self._closed.set()  # what is still queued fails at once
        self._queue.put(None)
        self._worker.join(self.timeout.total_seconds() + 5)

    # -- the fakes -------------------------------------------------------------------------
    def _isend(self, tensor: torch.Tensor, dst: int | None = None, group: Any = None,
               tag: int = 0, group_dst: int | None = None) -> _Work:  # fmt: skip
        return self._submit([_Op(True, tensor, _peer(group, dst, group_dst))])

    def _irecv(self, tensor: torch.Tensor, src: int | None = None, group: Any = None,
               tag: int = 0, group_src: int | None = None) -> _Work:  # fmt: skip
        return self._submit([_Op(False, tensor, _peer(group, src, group_src))])

    def _group_send(self, group: Any, tensor: torch.Tensor, peer: int, tag: int) -> _Work:
        return self._isend(tensor, group=group, tag=tag, group_dst=peer)

    def _group_recv(self, group: Any, tensor: torch.Tensor, peer: int, tag: int) -> _Work:
        return self._irecv(tensor, group=group, tag=tag, group_src=peer)

    def _batch(self, ops: list[Any]) -> list[_Work]:
        batch = [_Op(op.op == self._isend, op.tensor, _peer(op.group, op.peer, None)) for op in ops]
        return [self._submit(batch)]

    def _all_reduce(self, tensor: torch.Tensor, op: Any = None, group: Any = None,
                    async_op: bool = False) -> _Work | None:  # fmt: skip
        def run() -> None:
            self._real_all_reduce(tensor, group=group, async_op=True).wait(self.timeout)

        work = _Work()
        self._queue.put((run, work))
        self.calls += 1
        if async_op:
            return work
        work.wait()
        return None

    # -- the worker ------------------------------------------------------------------------
    def _submit(self, ops: list[_Op]) -> _Work:
        work = _Work()
        self._queue.put((lambda: self._run_batch(ops), work))
        self.calls += 1
        return work

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            fn, work = job
            if self._closed.is_set():
                work.finish(RuntimeError("the emulation was uninstalled"))
                continue
            try:
                fn()
            except BaseException as exc:
                work.finish(exc)
            else:
                work.finish(None)

    def _run_batch(self, ops: list[_Op]) -> None:
        # Each (peer, direction) in issue order; different ones concurrently.
        lanes: dict[tuple[int, bool], list[_Op]] = {}
        for op in ops:
            lanes.setdefault((op.peer, op.send), []).append(op)
        errors: list[BaseException] = []

        def lane(todo: list[_Op]) -> None:
            try:
                for op in todo:
                    self._rendezvous(op)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=lane, args=(todo,)) for todo in lanes.values()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def _rendezvous(self, op: _Op) -> None:
        if op.send:  # wait until the receiver reached its receive, then send
            ready = torch.empty(1)
            self._real_irecv(ready, op.peer, tag=READY_TAG).wait(self.timeout)
            self._real_isend(op.tensor, op.peer, tag=DATA_TAG).wait(self.timeout)
        else:
            ready = torch.ones(1)
            told = self._real_isend(ready, op.peer, tag=READY_TAG)
            self._real_irecv(op.tensor, op.peer, tag=DATA_TAG).wait(self.timeout)
            told.wait(self.timeout)


def _peer(group: Any, peer: int | None, group_peer: int | None) -> int:
    """The world rank of a peer given as a world rank or as a rank of ``group``."""
    if peer is not None:
        return peer
    assert group_peer is not None
    return group_peer if group is None else dist.get_global_rank(group, group_peer)
