"""Boundary tensors between processes: the :class:`Transport` over torch.distributed.

One boundary transfer (``SEND_F(s,i)`` on the producer's rank, ``RECV_F(s+1,i)``
on the consumer's; the same for gradients going back) is a set of
point-to-point messages, each with its own tag, so receives posted in any
order never match the wrong message::

    sender    SEND_F(s,i)  --[header]-->  (first use of the transfer only)
                           --[tensor 0]--> ... --[tensor n-1]-->
    receiver  RECV_F(s+1,i) posts irecv(header)      later: F(s+1,i) waits

The header (fixed size, int64: count, then dtype code, ndim, dims per tensor)
teaches both sides the transfer's shapes; later steps send the payload alone
and the *sender* checks its tensors against what was learnt, so a mismatch
fails with the stage and microbatch named instead of corrupting memory.
:meth:`DistributedTransport.reset` forgets it all (new batch size).

Failures.  Every wait is bounded, and every rank learns why the step died::

    rank r fails  -> Pipeline calls transport.fail(exc): the message goes to the
                     rendezvous store under this pipeline's error key
    peers waiting -> poll: data arrived?  error key set?  peer connection lost?
                     deadline passed?  -> PipelineError("rank r failed: ...")

A dead peer surfaces as gloo's "Connection closed/reset by peer" on a pending
operation, reported as "rank q stopped responding (killed?) ..."; zeropipe.launch
also writes a dead or raising child's message to the store (FAILED_KEY).

gloo's point-to-point works never report ``is_completed()`` and a timed-out
``wait(timeout)`` tears the connection down, so each pending receive, send or
collective is waited on by a (pooled) helper thread and the caller waits on
its event in slices, checking for failed peers in between.
Collectives run only after a barrier (point-to-point, see ``_barrier``) says
every rank finished its schedule, because a collective a peer never joins
cannot be cancelled.

gloo only, CPU tensors only: NCCL matches point-to-point messages in issue
order and ignores tags, which this protocol relies on (see the constructor).
"""

from __future__ import annotations

import json
import queue
import re
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from zeropipe import _compat
from zeropipe.deps import Dependencies
from zeropipe.errors import PipelineError
from zeropipe.ir import Action, Kind, Schedule
from zeropipe.runtime.transport import matching_recv

__all__ = ["FAILED_KEY", "DistributedTransport", "failure_origin"]

# Header: [count, (dtype code, ndim, d0, d1, ...) per tensor], zero padded.
_HEADER_LEN = 64
# Tags per transfer: the header, then one per tensor of the tuple.
_SLOTS = 32
# Tags start high: plain send/recv elsewhere (a profiler, user code) use small ones.
_TAG_BASE = 1 << 24
_MAX_TAG = 2**31 - 1
# How often a waiting rank looks at the store for a peer's failure (seconds).
_CHECK_EVERY = 0.02
# Written by zeropipe.launch (which hosts the store) when a process raises or dies.
FAILED_KEY = "zeropipe/failed"

_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.complex128,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
_CODE = {d: k for k, d in enumerate(_DTYPES)}
# What gloo says when the process at the other end of a socket went away.
_LOST_WORDS = ("closed by peer", "connection reset", "broken pipe", "connection refused", "EOF")

Meta = tuple[tuple[torch.dtype, tuple[int, ...]], ...]


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


def _describe(meta: Meta) -> str:
    return ", ".join(f"{str(d).removeprefix('torch.')}{list(s)}" for d, s in meta)


def _meta_of(tensors: Sequence[Tensor]) -> Meta:
    return tuple((t.dtype, tuple(t.shape)) for t in tensors)


def _encode(meta: Meta, action: Action, device: torch.device) -> Tensor:
    words = [len(meta)]
    for dtype, shape in meta:
        if dtype not in _CODE:
            raise PipelineError(f"{action}: cannot send a {dtype} tensor across ranks")
        words += [_CODE[dtype], len(shape), *shape]
    if len(meta) >= _SLOTS or len(words) > _HEADER_LEN:
        raise PipelineError(
            f"{action}: {len(meta)} boundary tensor(s) of {sum(len(s) for _, s in meta)} dims "
            f"exceed the transfer header ({_SLOTS - 1} tensors, {_HEADER_LEN} words); "
            f"pack the stage's outputs into fewer tensors"
        )
    header = torch.zeros(_HEADER_LEN, dtype=torch.int64)
    header[: len(words)] = torch.tensor(words, dtype=torch.int64)
    return header.to(device)


def _decode(header: Tensor, action: Action) -> Meta:
    words = header.cpu().tolist()
    try:
        count, k, meta = words[0], 1, []
        for _ in range(count):
            dtype, ndim = _DTYPES[words[k]], words[k + 1]
            meta.append((dtype, tuple(words[k + 2 : k + 2 + ndim])))
            k += 2 + ndim
    except IndexError:
        raise PipelineError(f"{action}: malformed transfer header {words}") from None
    return tuple(meta)


class _WaitPool:
    """Daemon threads that block in ``Work.wait()`` for the polling thread, reused.

    A job goes to an idle thread or, when none is idle, to a new one, so a wait
    that completes late never delays another.  Reusing threads matters: starting
    one per operation costs milliseconds of latency per transfer on a busy host.
    Daemon threads, because one may stay blocked on a transfer that a failed
    peer never completes.  Idle threads end after a while, and all of them on
    :meth:`close` (the transport's finalizer, also run at interpreter exit): a
    thread that has waited on a c10d work and is still alive when the process
    exits makes it abort (torch 2.13).

    Invariant: jobs queued + ``_idle`` == threads blocked in ``get``.
    """

    _IDLE_EXIT_S = 10.0

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._threads: set[threading.Thread] = set()

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            if self._idle:
                self._idle -= 1  # a thread blocked in get() takes this job
                self._jobs.put(job)
                return
            thread = threading.Thread(
                target=self._work, args=(job,), name="zeropipe-wait", daemon=True
            )
            self._threads.add(thread)
        thread.start()

    def _work(self, job: Callable[[], None] | None) -> None:
        try:
            while job is not None:
                job()
                # Drop the finished job (and the works it holds) before idling.
                job = None
                with self._lock:
                    self._idle += 1
                while job is None:
                    try:
                        job = self._jobs.get(timeout=self._IDLE_EXIT_S)
                        break  # a job, or None from close()
                    except queue.Empty:
                        with self._lock:
                            if self._idle:  # nothing is queued for this thread
                                self._idle -= 1
                                return
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())

    def close(self) -> None:
        """End the idle threads now (busy ones end once their wait returns)."""
        with self._lock:
            count, self._idle = self._idle, 0
            threads = list(self._threads)
        for _ in range(count):
            self._jobs.put(None)
        deadline = time.monotonic() + 1.0
        for thread in threads:
            if thread is not threading.current_thread():  # a finalizer may run anywhere
                thread.join(max(0.0, deadline - time.monotonic()))


class _Pending:
    """Works in flight, waited on without blocking the caller past a slice.

    A pool thread calls ``wait()`` on each work in turn (gloo point-to-point
    works never report completion otherwise, and for collectives it wakes the
    caller sooner than polling ``is_completed()`` with backoff) and sets an
    event the caller waits on in slices.  ``labels`` say, per work, what it is
    and which peer it involves.
    """

    def __init__(
        self, works: list[Any], labels: list[tuple[str, int | None]], pool: _WaitPool
    ) -> None:
        self.works, self.labels = works, labels
        self.error: BaseException | None = None
        self.at = 0  # index of the work being waited on
        self._done = threading.Event()
        if works:
            pool.submit(self._wait_all)
        else:
            self._done.set()

    def _wait_all(self) -> None:
        try:
            for k, work in enumerate(self.works):
                self.at = k
                work.wait()
        except BaseException as exc:  # handed to the waiting thread
            self.error = exc
        finally:
            self._done.set()

    def finished(self, slice_s: float) -> bool:
        """Wait at most ``slice_s`` seconds; True once every work is done (or one failed)."""
        return self._done.wait(slice_s)

    def label(self) -> tuple[str, int | None]:
        return self.labels[min(self.at, len(self.labels) - 1)]


@dataclass
class _Recv:
    action: Action
    peer: int
    header: Tensor | None = None
    header_pending: _Pending | None = None
    buffers: tuple[Tensor, ...] = ()
    payload: _Pending | None = None


@dataclass
class _Sent:
    works: list[Any]
    labels: list[tuple[str, int | None]]
    keep: tuple[Tensor, ...]  # alive until the sends complete


class DistributedTransport:
    """Point-to-point transfers for one rank of a distributed pipeline.

    Args:
        schedule: the lowered schedule every rank runs (tags and peers come from it).
        rank: this process's rank in ``group``.
        group: the process group (default: the world).
        timeout: seconds any single wait may last before the step fails.
    """

    def __init__(
        self, schedule: Schedule, rank: int, group: Any | None = None, timeout: float = 300.0
    ) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise PipelineError("DistributedTransport needs torch.distributed initialised")
        if timeout <= 0:
            raise PipelineError(f"timeout must be positive, got {timeout}")
        self.rank, self.timeout, self._group = rank, float(timeout), group
        self._world = dist.get_world_size(group)
        self._placement = schedule.placement
        backend = str(dist.get_backend(group))
        if backend != "gloo":
            # NCCL ignores tags and matches point-to-point messages in issue order per
            # pair, and a posted receive blocks that pair's stream: the header protocol
            # and out-of-order posts here need gloo's tagged, independent messages.
            raise PipelineError(
                f"DistributedTransport runs over gloo, but the process group uses {backend!r}; "
                f"pass process_group=torch.distributed.new_group(backend='gloo') (NCCL "
                f"point-to-point needs ordered, batched transfers, not implemented yet)"
            )
        self._pool = _WaitPool()  # gloo p2p works only complete through wait()
        weakref.finalize(self, self._pool.close)
        self._device = torch.device("cpu")
        self._global = [
            r if group is None else dist.get_global_rank(group, r) for r in range(self._world)
        ]
        transfers = [
            Dependencies.comm_pair(d, src, dst, i)[1]
            for d, src, dst, i in Dependencies(schedule).transfers()
        ]
        self._transfer = {recv: t for t, recv in enumerate(transfers)}
        self._store = _compat.rendezvous_store()
        name = str(getattr(group, "group_name", "world")) if group is not None else "world"
        # The n-th pipeline built on each rank is the same pipeline: the keys and
        # tags of a failed or finished one never collide with a later one's.
        n = self._store_call(lambda: self._store.add(f"zeropipe/{name}/pipelines{rank}", 1))
        self._key = f"zeropipe/{name}/pipeline{n}"
        # Tags: _SLOTS per transfer, then _SLOTS for the end-of-step barrier's rounds.
        self._barrier_tags = len(transfers)
        self._tag0 = ((n - 1) * (len(transfers) + 1) * _SLOTS) % (_MAX_TAG // 2)
        self._meta_send: dict[Action, Meta] = {}
        self._meta_recv: dict[Action, Meta] = {}
        self._recvs: dict[Action, _Recv] = {}
        self._sends: list[_Sent] = []
        self._broken: str | None = None  # why this transport can no longer be used
        self._relayed: BaseException | None = None  # raised on a peer's behalf
        self._lost: tuple[BaseException, dict[str, Any]] | None = None

    # -- the Transport protocol ------------------------------------------------------
    def send(self, action: Action, tensors: tuple[Tensor, ...]) -> None:
        self._usable()
        recv = matching_recv(action)
        t = self._transfer_of(recv)
        peer = self._placement[recv.stage]
        got = _meta_of(tensors)
        known = self._meta_send.get(recv)
        if known is not None and got != known:
            raise PipelineError(
                f"stage {action.stage} microbatch {action.microbatch}: {action} to rank {peer}: "
                f"boundary tensors changed: expected {_describe(known)}, got {_describe(got)} "
                f"(shapes and dtypes crossing ranks are learnt on the first step and may change "
                f"only with the batch size)"
            )
        if any(x.device != self._device for x in tensors):
            where = sorted({str(x.device) for x in tensors})
            raise PipelineError(
                f"{action}: boundary tensors are on {', '.join(where)}; the gloo transport "
                f"carries CPU tensors only"
            )
        payload = tuple(x.detach().contiguous() for x in tensors)
        works: list[Any] = []
        labels: list[tuple[str, int | None]] = []
        keep = list(payload)
        what = f"{action} to be received by rank {peer}"
        if known is None:
            header = _encode(got, action, self._device)
            works.append(self._p2p(dist.isend, header, peer, self._tag(t, 0), what))
            labels.append((what, peer))
            keep.append(header)
            self._meta_send[recv] = got
        for k, x in enumerate(payload):
            works.append(self._p2p(dist.isend, x, peer, self._tag(t, k + 1), what))
            labels.append((what, peer))
        # Not waited on here: handing each send to a waiter thread costs more
        # than the send; all of a step's sends are awaited together in finish_step.
        self._sends.append(_Sent(works, labels, tuple(keep)))

    def post_recv(self, action: Action) -> None:
        self._usable()
        if action in self._recvs:
            raise PipelineError(f"{action} was posted twice in one step")
        t = self._transfer_of(action)
        src = action.stage - 1 if action.kind is Kind.RECV_F else action.stage + 1
        rec = _Recv(action, self._placement[src])
        meta = self._meta_recv.get(action)
        if meta is None:
            rec.header = torch.empty(_HEADER_LEN, dtype=torch.int64, device=self._device)
            what = f"{action} (its shape header) from rank {rec.peer}"
            work = self._p2p(dist.irecv, rec.header, rec.peer, self._tag(t, 0), what)
            rec.header_pending = _Pending([work], [(what, rec.peer)], self._pool)
        else:
            self._post_payload(rec, meta)
        self._recvs[action] = rec

    def wait_recv(self, action: Action) -> tuple[Tensor, ...]:
        self._usable()
        rec = self._recvs.pop(action, None)
        if rec is None:
            raise PipelineError(f"{action} was waited on before it was posted")
        if rec.payload is None:
            assert rec.header_pending is not None and rec.header is not None
            self._await(rec.header_pending)
            meta = _decode(rec.header, action)
            self._meta_recv[action] = meta
            self._post_payload(rec, meta)
        assert rec.payload is not None
        self._await(rec.payload)
        return rec.buffers

    def finish_step(self, loss: Tensor | None = None) -> Tensor | None:
        self._usable()
        if loss is not None and loss.dtype not in _CODE:
            raise PipelineError(f"the loss has dtype {loss.dtype}, which cannot be shared")
        if self._recvs:
            left = ", ".join(sorted(str(a) for a in self._recvs)[:6])
            raise PipelineError(
                f"rank {self.rank}: step ended with receives never consumed: {left}"
            )
        sends, self._sends = self._sends, []
        if sends:
            works = [w for sent in sends for w in sent.works]
            labels = [lab for sent in sends for lab in sent.labels]
            self._await(_Pending(works, labels, self._pool))
        return self._barrier(loss)

    def reset(self) -> None:
        self._meta_send.clear()
        self._meta_recv.clear()

    def reduce_shared(self, grads: Sequence[Tensor]) -> None:
        self._usable()
        groups: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
        for g in grads:
            groups.setdefault((g.dtype, g.device), []).append(g)
        for gs in groups.values():
            flat = torch.cat([g.reshape(-1) for g in gs])
            what = "the all-reduce of shared parameters' gradients"
            work = self._call(
                partial(dist.all_reduce, flat, group=self._group, async_op=True), what
            )
            self._await(_Pending([work], [(what, None)], self._pool))
            offset = 0
            for g in gs:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    def fail(self, error: BaseException) -> None:
        if self._broken is None:
            self._broken = f"{type(error).__name__}: {error}"
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
        except Exception:
            pass  # the store is gone too: peers see their connections drop or time out

    # -- waiting -----------------------------------------------------------------
    def _await(self, pending: _Pending) -> None:
        """Wait for ``pending``, failing on a peer's error, a lost peer, or the timeout."""
        start = time.monotonic()
        deadline = start + self.timeout
        next_check = start + _CHECK_EVERY
        while not pending.finished(min(_CHECK_EVERY, max(0.0, deadline - time.monotonic()))):
            now = time.monotonic()
            if now >= next_check:
                self._check_peers()
                next_check = now + _CHECK_EVERY
            if now >= deadline:
                self._check_peers()
                what, peer = pending.label()
                source = f" from rank {peer}" if peer is not None and " from " not in what else ""
                raise PipelineError(
                    f"rank {self.rank} waited {self.timeout:g} s for {what}{source} (timeout); "
                    f"a peer is stuck or slow, or the ranks run different schedules"
                )
        if pending.error is not None:
            what, peer = pending.label()
            raise self._comm_error(pending.error, what, peer)

    def _barrier(self, loss: Tensor | None) -> Tensor | None:
        """Every rank finished this step's schedule (so the collectives after it will be joined).

        A dissemination barrier of point-to-point messages: in round k each rank
        tells rank r + 2^k what it knows and hears from rank r - 2^k, so after
        ceil(log2 W) rounds each has heard, through the others, from all.  What
        travels is the step's loss, known at first only to the rank that owns
        the last stage, so the loss reaches every rank with no collective of its
        own.  The receives are waited on by the pool's threads like any other:
        they wake the caller as soon as the message lands (a barrier polled
        through the store woke up to a poll interval late, on the step's
        critical path), and a peer that dies leaves only a daemon thread
        behind, where a collective could not be given up.
        """
        w = self._world
        rounds = (w - 1).bit_length()
        # [loss known?, loss as float64 (exact for every floating dtype), dtype code]
        known = torch.zeros(3, dtype=torch.float64, device=self._device)
        if loss is not None:
            known[0], known[1], known[2] = (
                1.0,
                loss.detach().double().reshape(()),
                _CODE[loss.dtype],
            )
        heard: list[tuple[Tensor, _Pending]] = []
        for k in range(rounds):
            src = (self.rank - (1 << k)) % w
            what = f"the end-of-step barrier (round {k}) from rank {src}"
            buf = torch.empty(3, dtype=torch.float64, device=self._device)
            work = self._p2p(dist.irecv, buf, src, self._tag(self._barrier_tags, k), what)
            heard.append((buf, _Pending([work], [(what, src)], self._pool)))
        told: list[Any] = []
        labels: list[tuple[str, int | None]] = []
        for k, (buf, pending) in enumerate(heard):
            dst = (self.rank + (1 << k)) % w
            what = f"the end-of-step barrier (round {k}) to rank {dst}"
            token = known.clone()  # in flight while ``known`` may still change
            told.append(self._p2p(dist.isend, token, dst, self._tag(self._barrier_tags, k), what))
            labels.append((what, dst))
            self._await(pending)
            if buf[0] > 0 and known[0] == 0:
                known = buf
        if told:
            self._await(_Pending(told, labels, self._pool))
        if loss is not None or known[0] == 0:
            return loss
        return known[1].to(_DTYPES[int(known[2].item())])

    def _check_peers(self) -> None:
        record = None
        for key in (f"{self._key}/error", FAILED_KEY):
            if self._store_call(partial(self._store.check, [key])):
                record = json.loads(self._store_call(partial(self._store.get, key)))
                break
        if record is None:
            return
        origin, message = int(record["rank"]), str(record["message"])
        err = _relay(message if record.get("lost") else f"rank {origin} failed: {message}", origin)
        self._relayed = err
        self._broken = str(err)
        raise err

    def _comm_error(self, exc: BaseException, what: str, peer: int | None) -> PipelineError:
        # A peer that failed cleanly recorded why before its connections closed.
        self._check_peers()
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

    # -- helpers -----------------------------------------------------------------
    def _usable(self) -> None:
        if self._broken is not None:
            raise PipelineError(
                f"this pipeline's distributed transport failed earlier ({self._broken}); its "
                f"ranks are out of step: build a new Pipeline"
            )

    def _transfer_of(self, recv: Action) -> int:
        t = self._transfer.get(recv)
        if t is None:
            raise PipelineError(f"{recv} is not a cross-rank transfer of this pipeline's schedule")
        return t

    def _tag(self, transfer: int, slot: int) -> int:
        return _TAG_BASE + self._tag0 + transfer * _SLOTS + slot

    def _post_payload(self, rec: _Recv, meta: Meta) -> None:
        t = self._transfer_of(rec.action)
        rec.buffers = tuple(torch.empty(s, dtype=d, device=self._device) for d, s in meta)
        what = f"{rec.action} from rank {rec.peer}"
        works = [
            self._p2p(dist.irecv, b, rec.peer, self._tag(t, k + 1), what)
            for k, b in enumerate(rec.buffers)
        ]
        rec.payload = _Pending(works, [(what, rec.peer)] * len(works), self._pool)

    def _p2p(self, op: Callable[..., Any], tensor: Tensor, peer: int, tag: int, what: str) -> Any:
        return self._call(
            lambda: op(tensor, self._global[peer], group=self._group, tag=tag), what, peer
        )

    def _call(self, fn: Callable[[], Any], what: str, peer: int | None = None) -> Any:
        """Post an operation; a dead peer makes gloo refuse at once: say who and why."""
        try:
            return fn()
        except PipelineError:
            raise
        except Exception as exc:
            raise self._comm_error(exc, what, peer) from exc

    def _store_call(self, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as exc:
            raise PipelineError(
                f"rank {self.rank} lost the rendezvous store ({type(exc).__name__}: {exc}); the "
                f"process hosting it (the launcher, or rank 0 under env://) may have died"
            ) from exc
