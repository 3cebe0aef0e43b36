"""Step agreement: whether a rank's peers are in the step it is in, with the same batch.

Every rank opens each step with its :class:`~zeropipe.runtime.transport.wire.Stamp` (step
number and a fingerprint of the batch's shapes).  The messages that open and close a step
carry the sender's stamp and are checked against this rank's; payloads travel on a lane of
tags chosen by the fingerprint, so ranks that disagree both stall, and a wait stalled
:data:`ASK_AFTER_S` compares stamps through the rendezvous store.  A step that flows pays
nothing: only stalled waits touch the store.
"""

from __future__ import annotations

import json
import time
from typing import Any

from zeropipe.core.errors import PipelineError
from zeropipe.runtime.transport.failures import PeerFailures
from zeropipe.runtime.transport.wire import Stamp, fingerprint

__all__ = ["ASK_AFTER_S", "Agreement"]

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
