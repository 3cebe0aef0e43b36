"""The transfer header and the step's stamp: what both ends of a transfer must agree on.

A boundary transfer is a tuple of tensors whose shapes and dtypes the
receiver cannot know in advance.  On its first use the sender sends a
fixed-size int64 header before the payload::

    [MAGIC, step, fingerprint, count, dtype code, ndim, d0, d1, ..., dtype code, ...]
     <------------------------------ HEADER_LEN words ---------------------->

Both sides remember the decoded :data:`Meta`; later steps send the payload
alone.  Each transfer owns :data:`SLOTS` consecutive tags: slot 0 for the
header, slot k + 1 for tensor k.

Every rank of a pipeline must be in the same step with the same batch.  A
:class:`Stamp` says which step and batch a rank is in: its step number and a
48-bit *fingerprint* of the batch's shapes and dtypes and of the step's kind
(training or evaluation).  The header carries it, so does the end-of-step
barrier (:func:`zeropipe.runtime.transport.endpoint.barrier`), and the receiver compares it
with its own.  Between them, payloads carry nothing extra: instead each
fingerprint picks a *lane* of tags (:func:`next_lane`), so a payload of one
batch never lands in a receive posted for another (gloo aborts a process
that receives more bytes than it posted for), and two ranks that disagree
both stall, which :class:`Agreement` turns into an error naming both.

:class:`Agreement` is each rank's side of it: the transport opens each step with
the rank's stamp; the messages that open and close a step are checked against
it; a wait stalled :data:`ASK_AFTER_S` compares stamps through the rendezvous
store.  A step that flows pays nothing: only stalled waits touch the store.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from zeropipe.core.errors import PipelineError
from zeropipe.core.ir import Action, Kind, Schedule
from zeropipe.runtime.transport.failures import PeerFailures

__all__ = [
    "ASK_AFTER_S",
    "DTYPES",
    "HEADER_LEN",
    "LANES",
    "MAX_TAG",
    "ORDERED_TAGS",
    "SLOTS",
    "TAGGED_TAGS",
    "Agreement",
    "Meta",
    "Stamp",
    "Stamper",
    "decode_header",
    "describe_batch",
    "describe_meta",
    "dtype_code",
    "encode_header",
    "fingerprint",
    "meta_of",
    "next_lane",
]

# Header: [MAGIC, step, fingerprint, count, (dtype code, ndim, d0, d1, ...) per tensor], zero
# padded.  MAGIC tells a header from a payload received in its place ("zphdr").
HEADER_LEN = 64
MAGIC = 0x7A_7068_6472
_STAMP_WORDS = 3
# Lanes of tags a pipeline's payloads move between as the fingerprint changes: a few
# suffice, since a change always moves to another lane than the last (next_lane).
LANES = 16
_BACKWARDS = frozenset({Kind.B, Kind.I, Kind.W})
# Tags per transfer: the header, then one per tensor of the tuple.
SLOTS = 32
# Tags start high (plain send/recv elsewhere, a profiler or user code, use small ones), the
# tagged protocol's from TAGGED_TAGS up, the ordered protocol's (one per pipeline) below it.
ORDERED_TAGS = 1 << 23
TAGGED_TAGS = 1 << 24
MAX_TAG = 2**31 - 1

# The dtypes a transfer can carry; a dtype's code is its index here.
DTYPES: tuple[torch.dtype, ...] = (
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
_CODE = {d: k for k, d in enumerate(DTYPES)}

Meta = tuple[tuple[torch.dtype, tuple[int, ...]], ...]
"""(dtype, shape) of each tensor of a transfer."""


def dtype_code(dtype: torch.dtype) -> int | None:
    """The header code of ``dtype``, or None if transfers cannot carry it."""
    return _CODE.get(dtype)


def describe_meta(meta: Meta) -> str:
    """``float32[4, 8], int64[4]``: a transfer's tensors, for messages."""
    return ", ".join(f"{str(d).removeprefix('torch.')}{list(s)}" for d, s in meta)


def meta_of(tensors: Sequence[Tensor]) -> Meta:
    """The (dtype, shape) of each tensor."""
    return tuple((t.dtype, tuple(t.shape)) for t in tensors)


@dataclass(frozen=True)
class Stamp:
    """Which step, and which batch, a rank of a pipeline is in: what its peers must share.

    ``call`` counts this pipeline's steps of either kind on this rank (what
    records in the store are matched by); ``step`` is the step number the
    pipeline names (its training steps so far); ``signature`` the pipeline's
    signature of the batch's shapes, whose digest with the kind is ``fingerprint``.
    """

    call: int
    step: int
    training: bool
    fingerprint: int
    signature: Hashable = None

    def which(self) -> str:
        """``training step 3``, or ``an evaluation step (after 3 training steps)``."""
        if self.training:
            return f"training step {self.step}"
        return f"an evaluation step (after {self.step} training steps)"

    def describe(self) -> str:
        """``training step 3 on inputs float32[4, 8] per microbatch, target int64[8]``."""
        return f"{self.which()} on {describe_batch(self.signature)}"


def fingerprint(signature: Hashable, training: bool) -> int:
    """48 bits of a step's batch signature and kind, the same in every process.

    Not ``hash()``: Python salts it per process.  48 bits stay exact in the
    float64 words of the end-of-step barrier.
    """
    text = repr((signature, training)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=6).digest(), "big")


def next_lane(lane: int, fingerprint: int) -> int:
    """The lane of tags after a step whose fingerprint differs from the previous step's.

    Never ``lane`` itself: a rank whose batch changed while its peer's did not
    posts on another lane than the peer, so neither receives the other's
    payloads.  Ranks whose fingerprints change alike walk the same lanes.
    """
    return (lane + 1 + fingerprint % (LANES - 1)) % LANES


class Stamper:
    """One rank's :class:`Stamp` for each step it starts, and the lane of tags of each.

    Owned by a transport; every rank counts its own steps the same way, so
    ranks that make the same calls agree.
    """

    def __init__(self) -> None:
        self.lane = 0
        self._calls, self._trained = 0, 0
        self._last: tuple[Hashable, bool, int] | None = None  # signature, training, fingerprint
        self._kinds: list[tuple[Schedule, bool]] = []

    def begin(self, schedule: Schedule, signature: Hashable, step: int | None) -> Stamp:
        """The stamp of a step of ``schedule`` on a batch of ``signature``.

        ``step``: the step number the pipeline names, if it says (by default,
        the training steps this rank started before).
        """
        training = self._training(schedule)
        last = self._last
        if last is None or last[0] != signature or last[1] != training:
            digest = fingerprint(signature, training)
            if last is None or digest != last[2]:
                self.lane = next_lane(self.lane, digest)
            self._last = last = (signature, training, digest)
        number = self._trained if step is None else step
        stamp = Stamp(self._calls, number, training, last[2], signature)
        self._calls += 1
        self._trained += training
        return stamp

    def _training(self, schedule: Schedule) -> bool:
        """Whether ``schedule`` runs backwards (a training step), remembered per schedule object."""
        for known, training in self._kinds:
            if known is schedule:
                return training
        training = any(a.kind in _BACKWARDS for acts in schedule.actions for a in acts)
        self._kinds.append((schedule, training))
        return training


def describe_batch(signature: Hashable) -> str:
    """``inputs float32[4, 8] per microbatch, target int64[16]``: a step's batch, for messages.

    ``signature`` is :func:`zeropipe.runtime.step.stage.step_signature`'s (the first
    and the last microbatch's inputs, the target, and a dict batch's names), or
    :func:`~zeropipe.runtime.step.stage.given_signature`'s (every microbatch's); anything
    else is shown as it is.
    """
    if isinstance(signature, tuple) and signature[:1] == ("microbatches",):
        return _describe_given(signature)
    try:
        inputs: Meta
        target: tuple[torch.dtype, tuple[int, ...]] | None
        names: tuple[str, ...] | None
        inputs, target, names = signature  # type: ignore[misc]
        half = len(inputs) // 2
        first, last = describe_meta(inputs[:half]), describe_meta(inputs[half:])
        what = "inputs" if names is None else f"inputs ({', '.join(names)})"
        text = (
            f"{what} {first} per microbatch"
            if first == last
            else f"{what} {first} (first microbatch) to {last} (last)"
        )
        return text if target is None else f"{text}, target {describe_meta((target,))}"
    except (TypeError, ValueError, AttributeError):
        return "no batch yet" if signature is None else repr(signature)


def _describe_given(signature: tuple[Any, ...]) -> str:
    """``3 microbatches: inputs int64[2, 12] to int64[1, 40]``: microbatches given made."""
    try:
        _, inputs, targets, names = signature
        what = "inputs" if names is None else f"inputs ({', '.join(names)})"
        first, last = describe_meta(inputs[0]), describe_meta(inputs[-1])
        text = f"{len(inputs)} microbatches: {what} {first} to {last}"
        if targets is not None:
            text += f", targets {describe_meta(targets[:1])} to {describe_meta(targets[-1:])}"
        return text
    except (TypeError, ValueError, AttributeError, IndexError):
        return repr(signature)


def encode_header(meta: Meta, action: Action, device: torch.device, stamp: Stamp) -> Tensor:
    """The header tensor describing ``meta`` in ``stamp``'s step (``action`` names the transfer)."""
    words = [MAGIC, stamp.step, stamp.fingerprint, len(meta)]
    for dtype, shape in meta:
        if dtype not in _CODE:
            raise PipelineError(f"{action}: cannot send a {dtype} tensor across ranks")
        words += [_CODE[dtype], len(shape), *shape]
    if len(meta) >= SLOTS or len(words) > HEADER_LEN:
        raise PipelineError(
            f"{action}: {len(meta)} boundary tensor(s) of {sum(len(s) for _, s in meta)} dims "
            f"exceed the transfer header ({SLOTS - 1} tensors, {HEADER_LEN - _STAMP_WORDS} "
            f"words); pack the stage's outputs into fewer tensors"
        )
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[: len(words)] = torch.tensor(words, dtype=torch.int64)
    return header.to(device)


def decode_header(header: Tensor, action: Action) -> tuple[Meta, tuple[int, int] | None]:
    """The :data:`Meta` a received header describes, and its sender's (step, fingerprint).

    The pair is None when what arrived is no header (a payload of another
    step): the sender and the receiver are not in the same step.
    """
    words = header.cpu().tolist()
    if words[0] != MAGIC:
        return (), None
    try:
        count, k, meta = words[_STAMP_WORDS], _STAMP_WORDS + 1, []
        for _ in range(count):
            dtype, ndim = DTYPES[words[k]], words[k + 1]
            meta.append((dtype, tuple(words[k + 2 : k + 2 + ndim])))
            k += 2 + ndim
    except IndexError:
        raise PipelineError(f"{action}: malformed transfer header {words}") from None
    return tuple(meta), (words[1], words[2])


# --- step agreement ----------------------------------------------------------------------

# A wait stalled this long asks the store whether the awaited peer is in another step (and
# then every _ASK_EVERY_S): ranks that disagree both stall, ranks that agree rarely do.
ASK_AFTER_S = 0.2
_ASK_EVERY_S = 0.1
# How long an error about a peer in another step waits for that peer's record (its batch),
# reading the store this often.
_DESCRIBE_WAIT_S = 1.0
_DESCRIBE_POLL_S = 0.02


class Agreement:
    """Whether this rank's peers are in the step it is in, with the same batch.

    The transport :meth:`begin` s each step with this rank's :class:`Stamp`.
    The messages that open and close a step (a transfer's header, the
    end-of-step barrier) carry the sender's step number and fingerprint,
    which :meth:`check` compares with this rank's.  Ranks that disagree post
    their payloads on different lanes of tags, so both of them stall; a
    stalled wait calls :meth:`stalled`, which writes this rank's stamp to the
    store (once per step) and reads the awaited peer's.  Only waits that
    already stalled touch the store: a step that flows pays nothing.

    Args:
        rank: this process's rank in the pipeline's group.
        store: the rendezvous store every rank shares.
        key: the pipeline's prefix of keys in the store.
        failures: the pipeline's failures (store calls go through it).
    """

    def __init__(self, rank: int, store: Any, key: str, failures: PeerFailures) -> None:
        self.rank = rank
        self._store, self._key, self._failures = store, key, failures
        self.stamp = Stamp(call=0, step=0, training=True, fingerprint=0)
        self._published = False
        self._next_read = 0.0

    def begin(self, stamp: Stamp) -> None:
        """A step starts on this rank, in ``stamp``."""
        self.stamp = stamp
        self._published = False
        self._next_read = 0.0

    def check(self, peer: int, step: int, digest: int) -> None:
        """Raise if a message from ``peer`` was sent in another step (``step``), or for another
        batch or kind of step (``digest``, its fingerprint)."""
        stamp = self.stamp
        if step == stamp.step and digest == stamp.fingerprint:
            return
        # The peer's own words come from the store; what the message says is the fallback.
        guess = f"step {step} on a batch of other shapes or dtypes"
        for training in (stamp.training, not stamp.training):
            if digest == fingerprint(stamp.signature, training):
                guess = Stamp(stamp.call, step, training, digest, stamp.signature).describe()
        raise self._out_of_step(peer, self._described(peer) or guess)

    def not_a_header(self, peer: int, what: str) -> PipelineError:
        """The error for data from ``peer`` that arrived where ``what`` (a header) was due."""
        theirs = self._described(peer) or "another step (it sent data where a header was due)"
        return self._out_of_step(peer, theirs, f" ({what})")

    def lost_note(self, peer: int) -> str:
        """What to add when ``peer`` went away in this step: that it may have stopped calling."""
        stamp = self.stamp
        if stamp.call == 0:
            return ""  # it may have died starting: nothing says more than "stopped responding"
        return (
            f"; rank {self.rank} was in {stamp.which()}, and rank {peer} had ended the step before it: if "
            f"rank {peer}'s program ended there, it called step() or eval_step() fewer times; "
            f"every rank of a pipeline must call them alike, once per step, with the same batch"
        )

    def stalled(self, peer: int | None) -> None:
        """A wait on ``peer`` stalled: raise if the store says that it is in another step."""
        if peer is None or peer == self.rank:
            return  # a collective: no one peer to ask
        if not self._published:
            self._publish()
        now = time.monotonic()
        if now < self._next_read:
            return
        self._next_read = now + _ASK_EVERY_S
        record = self._record(peer)
        stamp = self.stamp
        if (
            record is not None
            and record["call"] == stamp.call
            and (record["step"], record["fingerprint"]) != (stamp.step, stamp.fingerprint)
        ):
            raise self._out_of_step(peer, str(record["describe"]))

    # -- the store's records -------------------------------------------------------
    def _out_of_step(self, peer: int, theirs: str, what: str = "") -> PipelineError:
        return PipelineError(
            f"rank {self.rank} and rank {peer} are not in the same step{what}: rank {self.rank} "
            f"is in {self.stamp.describe()}, rank {peer} in {theirs}; every rank of a pipeline "
            f"must call step() and eval_step() alike, once per step, with the same batch"
        )

    def _publish(self) -> None:
        stamp = self.stamp
        record = {
            "call": stamp.call,
            "step": stamp.step,
            "fingerprint": stamp.fingerprint,
            "describe": stamp.describe(),
        }
        self._published = True
        key, text = f"{self._key}/stamp{self.rank}", json.dumps(record)
        self._failures.store_call(lambda: self._store.set(key, text))

    def _record(self, peer: int) -> dict[str, Any] | None:
        key = f"{self._key}/stamp{peer}"
        if not self._failures.store_call(lambda: self._store.check([key])):
            return None
        record: dict[str, Any] = json.loads(self._failures.store_call(lambda: self._store.get(key)))
        return record

    def _described(self, peer: int) -> str | None:
        """``peer``'s step as it wrote it to the store, if it does within a moment (an error's
        path: the peer, which stalls once this rank stops, writes its own then)."""
        if not self._published:
            self._publish()
        deadline = time.monotonic() + _DESCRIBE_WAIT_S
        while True:
            record = self._record(peer)
            if record is not None and record["call"] == self.stamp.call:
                return str(record["describe"])
            if time.monotonic() >= deadline:
                return None
            time.sleep(_DESCRIBE_POLL_S)
