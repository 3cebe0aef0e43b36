"""The compute device as the memory machinery sees it: copies to and from host, allocator peaks.

Offloading activations or weights means copying them to host memory after
they are produced and back before they are needed, without stalling the
computation.  On an accelerator that takes three things, all here::

    compute stream   F ... F  ......................  B
                          \\ event          wait event /
    copy stream            D2H -> pinned host  ...  H2D
                           (source kept alive by record_stream until the copy ran)

* a side **copy stream**, so a copy overlaps the kernels of the compute stream;
* **pinned** (page-locked) host buffers, without which a copy is synchronous;
* **events**: the consumer's stream waits for the copy's event, not the host.

On CPU there is no stream: a copy is an ordinary ``clone`` into a separate
buffer, done at once, so the same code runs (and is tested) everywhere and
the bytes that leave and come back are real.

This is the one module that names the CUDA device type (house rule 5); the
stream primitives themselves come from :mod:`zeropipe._compat`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from zeropipe._compat import current_stream, new_stream, record_stream, stream_context
from zeropipe._compat import streams_supported as _streams_supported

__all__ = [
    "Copier",
    "Transfer",
    "allocated_bytes",
    "is_accelerator",
    "peak_allocated_bytes",
    "reset_peak_bytes",
]

_CUDA = "cuda"


def is_accelerator(device: torch.device) -> bool:
    """Whether ``device`` is an accelerator with its own memory and streams (not CPU/meta)."""
    return _streams_supported(device)


@dataclass
class Transfer:
    """A copy in flight: ``tensor`` is its destination, valid once ``event`` has completed.

    ``event`` is ``None`` when the copy was synchronous (CPU) or has been waited for.
    """

    tensor: Tensor
    event: Any | None = None


class Copier:
    """Copies between ``device`` and host memory, on a side stream where the device has one.

    One per pipeline (no hidden global stream): the stream is created lazily on
    first use and lives as long as the copier.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.asynchronous = is_accelerator(device)
        self._stream: Any | None = None

    @property
    def stream(self) -> Any | None:
        """The copy stream (``None`` on CPU)."""
        if self.asynchronous and self._stream is None:
            self._stream = new_stream(self.device)
        return self._stream

    def to_host(self, src: Tensor) -> Transfer:
        """Start copying ``src`` (on the device) into a new host buffer.

        The caller may drop ``src`` at once: the allocator is told that the copy
        stream still reads it.  The host buffer may be read on the host only
        after :meth:`synchronize` (or through :meth:`to_device`, which is ordered
        after it on the same stream).
        """
        stream = self.stream
        if stream is None:
            return Transfer(src.detach().clone())
        # The producer ran on the compute stream: the copy must start after it.
        stream.wait_stream(current_stream(self.device))
        with stream_context(stream):
            host = torch.empty_like(src, device="cpu", pin_memory=True)
            host.copy_(src.detach(), non_blocking=True)
            event = stream.record_event()
        if src.device.type != "cpu":
            record_stream(src, stream)
        return Transfer(host, event)

    def to_device(self, src: Tensor) -> Transfer:
        """Start copying ``src`` (a host buffer) onto the device; :meth:`ready` before use."""
        stream = self.stream
        if stream is None:
            return Transfer(src.detach().clone())
        with stream_context(stream):
            dst = torch.empty_like(src, device=self.device)
            dst.copy_(src, non_blocking=True)
            event = stream.record_event()
        return Transfer(dst, event)

    def ready(self, transfer: Transfer) -> Tensor:
        """The destination of ``transfer``, usable on the current (compute) stream.

        The compute stream waits for the copy's event (the host does not), and
        the allocator learns that the compute stream uses a buffer that was
        allocated on the copy stream.
        """
        if transfer.event is not None:
            compute = current_stream(self.device)
            compute.wait_event(transfer.event)
            if transfer.tensor.device.type != "cpu":
                record_stream(transfer.tensor, compute)
            transfer.event = None
        return transfer.tensor

    def synchronize(self) -> None:
        """Wait, on the host, until every copy issued so far has finished."""
        if self._stream is not None:
            self._stream.synchronize()


def _memory_module(device: torch.device) -> Any | None:
    if not is_accelerator(device):
        return None
    accel = getattr(torch, "accelerator", None)
    if accel is not None and hasattr(accel, "max_memory_allocated"):
        return accel
    return torch.cuda if device.type == _CUDA else None


def peak_allocated_bytes(device: torch.device) -> int | None:
    """The allocator's peak of allocated bytes on ``device`` since the last reset (None on CPU)."""
    mod = _memory_module(device)
    return None if mod is None else int(mod.max_memory_allocated(device))


def allocated_bytes(device: torch.device) -> int | None:
    """Bytes the allocator has handed out on ``device`` now (None on CPU)."""
    mod = _memory_module(device)
    return None if mod is None else int(mod.memory_allocated(device))


def reset_peak_bytes(device: torch.device) -> None:
    """Start a new peak window on ``device`` (no-op on CPU)."""
    mod = _memory_module(device)
    if mod is not None:
        mod.reset_peak_memory_stats(device)
