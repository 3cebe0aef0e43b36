"""Boundary tensors between processes in one agreed order: the transport NCCL can run.

NCCL ignores tags, runs a process's point-to-point operations on one stream
in issue order, matches each pair's messages in that order, and a posted
receive holds back everything issued after it.  The tagged protocol of
:mod:`zeropipe.runtime.transport.tagged` relies on none of that being true, so
this one issues every message in the order :func:`zeropipe.core.message_order.message_order`
derives from the lowered schedule, the same on both ends of each transfer::

    schedule:  F(0,0) SEND_F(0,0) RECV_B(0,0) F(0,1) SEND_F(0,1) ... B(0,0)
    issued:           [send F(0,0) + recv B(0,0)]    [send F(0,1) ...]
                       one batch_isend_irecv group    (a group ends at a receive)

A message is issued when the order reaches it: a send once its data exists
(the SEND action ran), a receive as soon as every message before it went
out, which may be before the schedule's RECV action.  Each group is one
``batch_isend_irecv`` (one NCCL group), so a send and the receive after it
progress together.  A group ends at a receive, so waiting for a receive never
waits for a message later in the order.

Shapes travel in the same order as the data.  The first step with a new
*signature* (the shapes and dtypes of the step's inputs and target, the same
on every rank) sends a header before each payload and the receiver reads it
before posting the payload; later steps with that signature send the payload
alone.  A new batch size or sequence length is a new signature: nothing has
to be reset, and alternating between a few costs nothing after the first
step of each.

Every rank must be in the same step with the same batch: each header and
each end-of-step barrier token carries the sender's step number and batch
fingerprint, checked on arrival.  On gloo, payloads travel on the tag of
their fingerprint's lane, so ranks whose batches disagree never read each
other's data as their own (gloo aborts a process that receives more bytes
than it posted for); they stall, and learn it from the store
(:class:`~zeropipe.runtime.transport.wire.Agreement`).  NCCL ignores tags: there
only the headers and the barrier check.

On an accelerator a wait is a stream wait (the compute stream waits for the
receive; the host does not), and the end of the step polls the step's
operations, bounded by the timeout, aborting the communicator when a peer
failed so that no rank hangs in NCCL.  On CPU (gloo) waits are those of
:class:`~zeropipe.runtime.transport.endpoint.Endpoint`: bounded, watching for failed peers.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from zeropipe.base.device import is_accelerator
from zeropipe.core.errors import PipelineError
from zeropipe.core.ir import Action, Kind, Schedule
from zeropipe.core.message_order import message_order, receiver_of
from zeropipe.runtime.transport.endpoint import Label, all_reduce, barrier, connect
from zeropipe.runtime.transport.wire import (
    HEADER_LEN,
    LANES,
    ORDERED_TAGS,
    TAGGED_TAGS,
    Agreement,
    Meta,
    Stamper,
    decode_header,
    describe_meta,
    dtype_code,
    encode_header,
    meta_of,
)

__all__ = ["OrderedTransport"]

# Signatures whose boundary shapes are remembered (a few sequence-length buckets).
_SIGNATURES = 16
_SENDS = (Kind.SEND_F, Kind.SEND_B)


@dataclass
class _Plan:
    """One schedule's messages on this rank, in the agreed order, and each one's peer."""

    sequence: list[Action]
    peer: dict[Action, int]


@dataclass
class _Shapes:
    """What this rank learnt of each transfer's tensors under one signature."""

    sent: dict[Action, Meta] = field(default_factory=dict)  # keyed by the receiving RECV
    received: dict[Action, Meta] = field(default_factory=dict)


@dataclass
class _Received:
    buffers: tuple[Tensor, ...]
    works: list[Any]
    labels: list[Label]


class OrderedTransport:
    """Point-to-point transfers for one rank, issued in one order every rank agrees on.

    Args:
        schedule: the lowered schedule every rank runs.
        rank: this process's rank in ``group``.
        group: the process group (default: the world); any backend.
        timeout: seconds any single wait may last before the step fails.
        device: where received tensors are placed (the rank's compute device).
    """

    def __init__(
        self,
        schedule: Schedule,
        rank: int,
        group: Any | None = None,
        timeout: float = 300.0,
        device: torch.device | None = None,
    ) -> None:
        self.rank = rank
        self._device = torch.device("cpu") if device is None else torch.device(device)
        backend = str(dist.get_backend(group)) if dist.is_initialized() else ""
        if backend == "nccl" and not is_accelerator(self._device):
            raise PipelineError(
                f"the process group uses NCCL, which carries GPU tensors, but this rank computes "
                f"on {self._device}; pass the rank's GPU as device (the one numbered LOCAL_RANK "
                f"under torchrun), or use a gloo group for a CPU pipeline"
            )
        self._endpoint = connect(rank, group, timeout, agree=True)
        self._failures = self._endpoint.failures
        assert self._endpoint.agreement is not None  # connect(agree=True) made it
        self._agreement: Agreement = self._endpoint.agreement
        self._stamper = Stamper()  # this rank's steps, and the lane of tags of each
        self._group = group
        self._on_device = is_accelerator(self._device)
        # A tag for the barrier and one per lane for the payloads (NCCL ignores them; on gloo
        # they keep a pipeline's messages apart from other traffic and from other
        # pipelines, tagged ones included, and payloads of different batches apart).
        span = LANES + 1
        number = (self._failures.number - 1) % ((TAGGED_TAGS - ORDERED_TAGS) // span)
        self._tag = ORDERED_TAGS + number * span
        self._data_tag = self._tag + 1
        self._plans: list[tuple[Schedule, _Plan]] = []
        self._plan = self._plan_for(schedule)
        self._shapes_by_signature: OrderedDict[Hashable, _Shapes] = OrderedDict()
        self._shapes = _Shapes()
        self._signature: Hashable = None
        # Per step: the position in the plan, data waiting to be sent, receives issued
        # and not yet consumed, what the program has posted, and everything in flight.
        self._cursor = 0
        self._ready: dict[Action, tuple[Tensor, ...]] = {}
        self._received: dict[Action, _Received] = {}
        self._posted: set[Action] = set()
        # Operations issued and not yet waited on, by id: a gloo work must be waited on
        # exactly once (a second wait on a completed receive blocks).
        self._in_flight: dict[int, tuple[Any, Label]] = {}
        self._keep: list[Tensor] = []

    @property
    def timeout(self) -> float:
        """Seconds any single wait may last before the step fails (settable between steps)."""
        return self._endpoint.timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self._endpoint.timeout = float(seconds)

    # -- the Transport protocol ------------------------------------------------------
    def start_step(self, schedule: Schedule, signature: Hashable, step: int | None = None) -> None:
        self._endpoint.usable()
        self._plan = self._plan_for(schedule)
        self._agreement.begin(self._stamper.begin(schedule, signature, step))
        self._data_tag = self._tag + 1 + self._stamper.lane
        if signature != self._signature:
            shapes = self._shapes_by_signature.pop(signature, None) or _Shapes()
            self._shapes_by_signature[signature] = shapes  # most recent last
            while len(self._shapes_by_signature) > _SIGNATURES:
                self._shapes_by_signature.popitem(last=False)
            self._shapes, self._signature = shapes, signature

    def send(self, action: Action, tensors: tuple[Tensor, ...]) -> None:
        self._endpoint.usable()
        if action in self._ready or action not in self._plan.peer:
            raise PipelineError(
                f"{action} is not a cross-rank send of this rank's schedule, or ran twice"
            )
        if any(x.device != self._device for x in tensors):
            where = sorted({str(x.device) for x in tensors})
            raise PipelineError(
                f"{action}: boundary tensors are on {', '.join(where)}, but this rank's "
                f"transfers use {self._device}; keep each stage's outputs on its device"
            )
        self._ready[action] = tuple(x.detach().contiguous() for x in tensors)
        self._advance()

    def post_recv(self, action: Action) -> None:
        self._endpoint.usable()
        if action in self._posted:
            raise PipelineError(f"{action} was posted twice in one step")
        if action not in self._plan.peer:
            raise PipelineError(f"{action} is not a cross-rank receive of this rank's schedule")
        self._posted.add(action)
        self._advance()

    def wait_recv(self, action: Action) -> tuple[Tensor, ...]:
        self._endpoint.usable()
        if action not in self._posted:
            raise PipelineError(f"{action} was waited on before it was posted")
        self._advance()
        got = self._received.pop(action, None)
        if got is None:
            blocked = self._plan.sequence[self._cursor]
            raise PipelineError(
                f"rank {self.rank}: {action} is needed before {blocked}, which comes first in "
                f"the order of messages, could be issued; the schedule's order of actions and "
                f"its message order disagree (a schedule changed after the pipeline was built?)"
            )
        self._posted.discard(action)
        if self._on_device:
            for work in got.works:
                work.wait()  # the current stream waits; the host does not
        else:
            self._endpoint.wait(self._endpoint.pending(got.works, got.labels))
            self._waited(got.works)
        return got.buffers

    def finish_step(self, loss: Tensor | None = None) -> Tensor | None:
        self._endpoint.usable()
        if loss is not None and dtype_code(loss.dtype) is None:
            raise PipelineError(f"the loss has dtype {loss.dtype}, which cannot be shared")
        try:
            self._check_step_complete()
            works = [w for w, _ in self._in_flight.values()]
            labels = [lab for _, lab in self._in_flight.values()]
            if works:
                if self._on_device:
                    self._endpoint.wait_polled(works, labels)
                else:
                    self._endpoint.wait(self._endpoint.pending(works, labels))
            return barrier(self._endpoint, loss, lambda k: self._tag, self._device, batched=True)
        finally:
            self._clear_step()

    def reset(self) -> None:
        self._shapes_by_signature.clear()
        self._shapes, self._signature = _Shapes(), None

    def reduce_shared(self, grads: Sequence[Tensor]) -> None:
        self._endpoint.usable()
        all_reduce(self._endpoint, grads)

    def culprit(self, error: BaseException) -> BaseException | None:
        return self._failures.culprit(error)

    def fail(self, error: BaseException) -> None:
        self._failures.record(error)
        self._clear_step()

    # -- issuing in order ------------------------------------------------------------
    def _plan_for(self, schedule: Schedule) -> _Plan:
        for known, plan in self._plans:
            if known is schedule:
                return plan
        sequence = message_order(schedule)[self.rank]
        peer = {}
        for a in sequence:
            other = receiver_of(a).stage if a.kind in _SENDS else _sender_stage(a)
            peer[a] = schedule.placement[other]
        plan = _Plan(sequence, peer)
        self._plans.append((schedule, plan))
        return plan

    def _advance(self) -> None:
        """Issue every message the order allows now, in groups that end at a receive."""
        seq = self._plan.sequence
        ops: list[Any] = []
        labels: list[Label] = []
        while self._cursor < len(seq):
            action = seq[self._cursor]
            peer = self._plan.peer[action]
            if action.kind in _SENDS:
                payload = self._ready.pop(action, None)
                if payload is None:
                    break  # its data does not exist yet: nothing after it may go first
                sends = self._send_ops(action, payload, peer)
                ops += sends
                labels += [(f"{action} to be received by rank {peer}", peer)] * len(sends)
            else:
                meta = self._shapes.received.get(action)
                what = f"{action} from rank {peer}"
                if meta is None:  # learn the shapes: the header is read before the payload
                    header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self._device)
                    ops.append(self._op(dist.irecv, header, peer))
                    labels.append((f"{action} (its shape header) from rank {peer}", peer))
                    works = self._issue(ops, labels)
                    self._wait_now(works, labels)
                    ops, labels = [], []
                    meta, stamp = decode_header(header, action)
                    if stamp is None:
                        raise self._agreement.not_a_header(peer, f"{action}'s shape header")
                    self._agreement.check(peer, *stamp)
                    self._shapes.received[action] = meta
                buffers = tuple(torch.empty(s, dtype=d, device=self._device) for d, s in meta)
                first = len(ops)
                ops += [self._op(dist.irecv, b, peer) for b in buffers]
                labels += [(what, peer)] * len(buffers)
                works = self._issue(ops, labels)
                mine = works[first:] if len(works) == len(ops) else works
                self._received[action] = _Received(buffers, mine, labels[first:] or labels)
                ops, labels = [], []
            self._cursor += 1
        if ops:
            self._issue(ops, labels)

    def _send_ops(self, action: Action, payload: tuple[Tensor, ...], peer: int) -> list[Any]:
        recv = receiver_of(action)
        got = meta_of(payload)
        known = self._shapes.sent.get(recv)
        ops = []
        if known is None:
            header = encode_header(got, action, self._device, self._agreement.stamp)
            ops.append(self._op(dist.isend, header, peer))
            self._shapes.sent[recv] = got
        elif got != known:
            raise PipelineError(
                f"stage {action.stage} microbatch {action.microbatch}: {action} to rank {peer}: "
                f"boundary tensors changed: expected {describe_meta(known)}, got "
                f"{describe_meta(got)}, though the step's inputs have the shapes of an earlier "
                f"step that sent them (a stage whose output shapes depend on the data, not only "
                f"on the input shapes, cannot cross ranks)"
            )
        return ops + [self._op(dist.isend, x, peer) for x in payload]

    def _op(self, fn: Any, tensor: Tensor, peer: int) -> Any:
        self._keep.append(tensor)  # alive until the step's operations completed
        return dist.P2POp(fn, tensor, self._endpoint.global_rank(peer), self._group, self._data_tag)

    def _issue(self, ops: list[Any], labels: list[Label]) -> list[Any]:
        what, peer = labels[0]
        works = self._endpoint.call(lambda: dist.batch_isend_irecv(ops), what, peer)
        works = [w for w in works if w is not None]
        per_op = len(works) == len(labels)
        for k, work in enumerate(works):
            self._in_flight[id(work)] = (work, labels[k] if per_op else labels[0])
        return works

    def _wait_now(self, works: list[Any], labels: list[Label]) -> None:
        """The host waits (a header must be read before the payload can be received)."""
        if self._on_device:
            self._endpoint.wait_polled(works, labels[-1:] * len(works))
        else:
            self._endpoint.wait(self._endpoint.pending(works, labels[-1:] * len(works)))
        self._waited(works)

    def _waited(self, works: list[Any]) -> None:
        for work in works:
            self._in_flight.pop(id(work), None)

    def _check_step_complete(self) -> None:
        if self._cursor < len(self._plan.sequence):
            missing = self._plan.sequence[self._cursor]
            raise PipelineError(
                f"rank {self.rank}: the step ended before {missing} was issued; its SEND "
                f"never ran (the schedule and the pipeline's order of messages disagree)"
            )
        if self._received or self._posted:
            left = ", ".join(sorted(str(a) for a in (*self._received, *self._posted))[:6])
            raise PipelineError(
                f"rank {self.rank}: step ended with receives never consumed: {left}"
            )

    def _clear_step(self) -> None:
        self._cursor = 0
        self._ready.clear()
        self._received.clear()
        self._posted.clear()
        self._in_flight, self._keep = {}, []


def _sender_stage(recv: Action) -> int:
    return recv.stage - 1 if recv.kind is Kind.RECV_F else recv.stage + 1
