"""Boundary tensors between processes: the :class:`Transport` over torch.distributed.

One boundary transfer (``SEND_F(s,i)`` on the producer's rank, ``RECV_F(s+1,i)``
on the consumer's; the same for gradients going back) is a set of
point-to-point messages, each with its own tag, so receives posted in any
order never match the wrong message::

    sender    SEND_F(s,i)  --[header]-->  (first use of the transfer only)
                           --[tensor 0]--> ... --[tensor n-1]-->
    receiver  RECV_F(s+1,i) posts irecv(header)      later: F(s+1,i) waits

The header (:mod:`zeropipe.runtime.transport.wire`) teaches both sides the transfer's
shapes; later steps send the payload alone and the *sender* checks its
tensors against what was learnt, so a mismatch fails with the stage and
microbatch named instead of corrupting memory.
:meth:`DistributedTransport.reset` forgets it all (new batch size).

Every rank must be in the same step with the same batch: the header and the
end-of-step barrier carry each rank's step number and batch fingerprint, and
payloads travel on the tags of their fingerprint's lane, so ranks that
disagree never mix their data; they stall, and learn it from the store
(:class:`~zeropipe.runtime.transport.wire.Agreement`).

The rest lives beside it: every wait is bounded and watches for failed
peers, and the step ends with the endpoint's barrier that carries the loss (its
receives posted as the step starts), then the all-reduce of shared parameters'
gradients (:mod:`zeropipe.runtime.transport.endpoint`); a failure reaches every rank
through the rendezvous store (:mod:`zeropipe.runtime.transport.failures`).

gloo only, CPU tensors only: NCCL matches point-to-point messages in issue
order and ignores tags, which this protocol relies on (see the constructor).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from zeropipe.base import _compat
from zeropipe.core.deps import Dependencies
from zeropipe.core.errors import PipelineError
from zeropipe.core.ir import Action, Kind, Schedule
from zeropipe.core.message_order import receiver_of
from zeropipe.runtime.transport.endpoint import (
    Heard,
    Label,
    Pending,
    all_reduce,
    barrier,
    connect,
    post_barrier,
)
from zeropipe.runtime.transport.wire import (
    HEADER_LEN,
    LANES,
    MAX_TAG,
    SLOTS,
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

__all__ = ["DistributedTransport"]

# What a failed step left posted (receives, sends, the barrier's receives), kept until the
# process ends.  A wait starts only when the consumer waits, so nothing else holds these
# works, and gloo receives destroyed before they complete can keep a later pipeline on the
# same group from getting its messages.
_FAILED_STEPS: list[object] = []


@dataclass
class _Recv:
    action: Action
    peer: int
    header: Tensor | None = None
    header_pending: Pending | None = None
    buffers: tuple[Tensor, ...] = ()
    payload: Pending | None = None
    landing: int | None = None  # where the last buffer's arrival shows (_compat.landed)


@dataclass
class _Sent:
    works: list[Any]
    labels: list[Label]
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
        self.rank = rank
        self._placement = schedule.placement
        backend = str(dist.get_backend(group))
        if backend != "gloo":
            # NCCL ignores tags and matches point-to-point messages in issue order per
            # pair, and a posted receive blocks that pair's stream: the header protocol
            # and out-of-order posts here need gloo's tagged, independent messages.
            raise PipelineError(
                f"DistributedTransport (p2p='tagged') runs over gloo, but the process group "
                f"uses {backend!r}; use OrderedTransport (RuntimeOptions(p2p='ordered'), the "
                f"default on {backend})"
            )
        self._device = torch.device("cpu")
        transfers = [
            Dependencies.comm_pair(d, src, dst, i)[1]
            for d, src, dst, i in Dependencies(schedule).transfers()
        ]
        self._transfer = {recv: t for t, recv in enumerate(transfers)}
        self._endpoint = connect(rank, group, timeout, agree=True)
        self._failures = self._endpoint.failures
        assert self._endpoint.agreement is not None  # connect(agree=True) made it
        self._agreement: Agreement = self._endpoint.agreement
        # Tags: SLOTS per transfer per lane, then SLOTS for the end-of-step barrier's rounds
        # (on no lane: ranks in different steps meet there and compare them).  The n-th
        # pipeline built on each rank is the same pipeline: the tags of a failed or
        # finished one never collide with a later one's.
        n = self._failures.number
        self._transfers = len(transfers)
        self._barrier_tags = LANES * len(transfers)
        self._tag0 = ((n - 1) * (self._barrier_tags + 1) * SLOTS) % (MAX_TAG // 2)
        self._stamper = Stamper()  # this rank's steps, and the lane of tags of each
        self._lane_tag0 = self._lane_tag(0)
        self._meta_send: dict[Action, Meta] = {}
        self._meta_recv: dict[Action, Meta] = {}
        self._recvs: dict[Action, _Recv] = {}
        self._sends: list[_Sent] = []
        self._signature: Hashable = None
        self._heard: Heard | None = None  # the barrier's receives, once posted

    @property
    def timeout(self) -> float:
        """Seconds any single wait may last before the step fails (settable between steps)."""
        return self._endpoint.timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self._endpoint.timeout = float(seconds)

    # -- the Transport protocol ------------------------------------------------------
    def start_step(self, schedule: Schedule, signature: Hashable, step: int | None = None) -> None:
        # Shapes are learnt per transfer, not per signature: a new one learns them again.
        if signature != self._signature:
            self._signature = signature
            self.reset()
        self._agreement.begin(self._stamper.begin(schedule, signature, step))
        self._lane_tag0 = self._lane_tag(self._stamper.lane)
        if self._heard is None:
            self._endpoint.usable()
            self._heard = post_barrier(self._endpoint, self._barrier_tag, self._device)

    def send(self, action: Action, tensors: tuple[Tensor, ...]) -> None:
        self._endpoint.usable()
        recv = receiver_of(action)
        t = self._transfer_of(recv)
        peer = self._placement[recv.stage]
        got = meta_of(tensors)
        known = self._meta_send.get(recv)
        if known is not None and got != known:
            raise PipelineError(
                f"stage {action.stage} microbatch {action.microbatch}: {action} to rank {peer}: "
                f"boundary tensors changed: expected {describe_meta(known)}, got {describe_meta(got)} "
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
        labels: list[Label] = []
        keep = list(payload)
        what = f"{action} to be received by rank {peer}"
        if known is None:
            header = encode_header(got, action, self._device, self._agreement.stamp)
            works.append(self._endpoint.send(header, peer, self._tag(t, 0), what))
            labels.append((what, peer))
            keep.append(header)
            self._meta_send[recv] = got
        for k, x in enumerate(payload):
            works.append(self._endpoint.send(x, peer, self._tag(t, k + 1), what))
            labels.append((what, peer))
        # Not waited on here: handing each send to a waiter thread costs more
        # than the send; all of a step's sends are awaited together at the end-of-step
        # barrier, with its first receive.
        self._sends.append(_Sent(works, labels, tuple(keep)))

    def post_recv(self, action: Action) -> None:
        self._endpoint.usable()
        if action in self._recvs:
            raise PipelineError(f"{action} was posted twice in one step")
        t = self._transfer_of(action)
        src = action.stage - 1 if action.kind is Kind.RECV_F else action.stage + 1
        rec = _Recv(action, self._placement[src])
        meta = self._meta_recv.get(action)
        if meta is None:
            rec.header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self._device)
            what = f"{action} (its shape header) from rank {rec.peer}"
            work = self._endpoint.recv(rec.header, rec.peer, self._tag(t, 0), what)
            rec.header_pending = self._endpoint.pending([work], [(what, rec.peer)])
        else:
            self._post_payload(rec, meta)
        self._recvs[action] = rec

    def wait_recv(self, action: Action) -> tuple[Tensor, ...]:
        self._endpoint.usable()
        rec = self._recvs.pop(action, None)
        if rec is None:
            raise PipelineError(f"{action} was waited on before it was posted")
        if rec.payload is None:
            assert rec.header_pending is not None and rec.header is not None
            self._endpoint.wait(rec.header_pending)
            meta, stamp = decode_header(rec.header, action)
            if stamp is None:
                raise self._agreement.not_a_header(rec.peer, f"{action}'s shape header")
            self._agreement.check(rec.peer, *stamp)
            self._meta_recv[action] = meta
            self._post_payload(rec, meta)
        assert rec.payload is not None
        self._endpoint.wait(rec.payload, landing=rec.landing)
        return rec.buffers

    def finish_step(self, loss: Tensor | None = None) -> Tensor | None:
        self._endpoint.usable()
        if loss is not None and dtype_code(loss.dtype) is None:
            raise PipelineError(f"the loss has dtype {loss.dtype}, which cannot be shared")
        if self._recvs:
            left = ", ".join(sorted(str(a) for a in self._recvs)[:6])
            raise PipelineError(
                f"rank {self.rank}: step ended with receives never consumed: {left}"
            )
        works = [w for sent in self._sends for w in sent.works]
        labels = [lab for sent in self._sends for lab in sent.labels]
        # Kept until the barrier returns: a failed step's transfers stay alive (see fail).
        loss = barrier(
            self._endpoint,
            loss,
            self._barrier_tag,
            self._device,
            heard=self._heard,
            sent=(works, labels),
        )
        self._sends, self._heard = [], None
        return loss

    def reset(self) -> None:
        self._meta_send.clear()
        self._meta_recv.clear()

    def reduce_shared(self, grads: Sequence[Tensor]) -> None:
        self._endpoint.usable()
        all_reduce(self._endpoint, grads)

    def culprit(self, error: BaseException) -> BaseException | None:
        return self._failures.culprit(error)

    def fail(self, error: BaseException) -> None:
        self._failures.record(error)
        _FAILED_STEPS.append((self._recvs, self._sends, self._heard))

    # -- helpers -----------------------------------------------------------------
    def _transfer_of(self, recv: Action) -> int:
        t = self._transfer.get(recv)
        if t is None:
            raise PipelineError(f"{recv} is not a cross-rank transfer of this pipeline's schedule")
        return t

    def _tag(self, transfer: int, slot: int) -> int:
        return self._lane_tag0 + transfer * SLOTS + slot

    def _lane_tag(self, lane: int) -> int:
        """The first tag of ``lane``'s transfers."""
        return TAGGED_TAGS + self._tag0 + lane * self._transfers * SLOTS

    def _barrier_tag(self, round_: int) -> int:
        return TAGGED_TAGS + self._tag0 + self._barrier_tags * SLOTS + round_

    def _post_payload(self, rec: _Recv, meta: Meta) -> None:
        t = self._transfer_of(rec.action)
        rec.buffers = tuple(torch.empty(s, dtype=d, device=self._device) for d, s in meta)
        # Marked before it is posted; the transfer's tensors arrive in order, the last last.
        rec.landing = _compat.mark_landing(rec.buffers[-1]) if rec.buffers else None
        what = f"{rec.action} from rank {rec.peer}"
        works = [
            self._endpoint.recv(b, rec.peer, self._tag(t, k + 1), what)
            for k, b in enumerate(rec.buffers)
        ]
        rec.payload = self._endpoint.pending(works, [(what, rec.peer)] * len(works))
