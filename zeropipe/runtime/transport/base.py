"""How boundary tensors move between ranks: the interface, and the in-process transport.

The action handlers never talk to torch.distributed directly; they call a
:class:`Transport`.  ``SEND_*`` posts a send and returns at once, ``RECV_*``
posts a receive, and the consumer waits for the data only when it needs it.
The one-process version (every rank in one process) is
:class:`~zeropipe.runtime.step.executor.LocalTransport`, beside the executor that
plays every rank: a send drops the tensors in the matching receive's mailbox.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Protocol

from torch import Tensor

from zeropipe.core.ir import Action, Schedule

__all__ = ["Transport"]


class Transport(Protocol):
    """What the runtime needs from a communication backend."""

    def start_step(self, schedule: Schedule, signature: Hashable, step: int | None = None) -> None:
        """A step of ``schedule`` begins; ``signature`` names the shapes of its inputs.

        Boundary shapes follow from the signature: a transport may learn them
        on the first step of a signature and rely on them on later ones.
        Every rank must start the same steps with the same signature: a
        distributed transport checks that its peers did, and fails the step
        naming both ranks if not.  ``step``: the step number the pipeline
        names (its training steps so far, restored on resume); by default the
        transport counts the training steps it started.
        """

    def send(self, action: Action, tensors: tuple[Tensor, ...]) -> None:
        """Post ``action`` (a SEND_F/SEND_B) without waiting for it to complete."""

    def post_recv(self, action: Action) -> None:
        """Post ``action`` (a RECV_F/RECV_B); the data is awaited in :meth:`wait_recv`."""

    def wait_recv(self, action: Action) -> tuple[Tensor, ...]:
        """Block until the data of a posted receive has arrived; return it."""

    def finish_step(self, loss: Tensor | None = None) -> Tensor | None:
        """Wait for every send of the step and for every rank to end it; raise if a transfer failed.

        ``loss``: the step's loss on the rank that computed it, ``None`` on the
        others.  Returns it on every rank (``None`` if no rank had one).
        """

    def reset(self) -> None:
        """Forget learnt boundary shapes (the batch size changed): learn them again."""

    def reduce_shared(self, grads: Sequence[Tensor]) -> None:
        """Sum, in place, the gradients of parameters shared across ranks."""

    def fail(self, error: BaseException) -> None:
        """This rank's step raised ``error``: tell the peers so that they stop waiting.

        Called by the pipeline before it re-raises; must not raise itself.
        """

    def culprit(self, error: BaseException) -> BaseException | None:
        """The failure of another process that ``error`` only echoes (a lost connection in a
        collective outside the transport, such as tensor parallelism's), if one was recorded."""
