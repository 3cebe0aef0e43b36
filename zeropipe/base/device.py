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

Also here, because each names the device type: which device a process
computes on (:func:`resolve_device`: ``cuda:LOCAL_RANK`` under an NCCL group,
with errors that say how to fix a launch that cannot work), that a stage's
parameters share one device (:func:`single_device`), and the autocast
context a stage's forward runs in (:func:`autocast`).

This is the one module that names the CUDA device type (house rule 5); the
stream primitives themselves come from :mod:`zeropipe.base._compat`.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from zeropipe.base._compat import current_stream, new_stream, record_stream, stream_context
from zeropipe.base._compat import streams_supported as _streams_supported
from zeropipe.core.errors import PipelineError

__all__ = [
    "Copier",
    "Transfer",
    "accelerator_count",
    "allocated_bytes",
    "autocast",
    "check_autocast",
    "is_accelerator",
    "make_current",
    "peak_allocated_bytes",
    "reset_peak_bytes",
    "resolve_device",
    "single_device",
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


# --- which device a process computes on ---------------------------------------------------


def accelerator_count(device_type: str = _CUDA) -> int:
    """How many devices of ``device_type`` this process sees (0 when there are none)."""
    if device_type in ("cpu", "meta"):
        return 0
    accel = getattr(torch, "accelerator", None)
    if accel is not None:
        current = accel.current_accelerator() if accel.is_available() else None
        return (
            int(accel.device_count()) if current is not None and current.type == device_type else 0
        )
    if device_type == _CUDA:
        return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
    return 0


def _local_rank(env: dict[str, str] | None) -> int:
    value = (os.environ if env is None else env).get("LOCAL_RANK", "0")
    try:
        rank = int(value)
    except ValueError:
        rank = -1
    if rank < 0:
        raise PipelineError(
            f"LOCAL_RANK={value!r} is not a process index on this node; launch with torchrun "
            f"(which sets it) or pass device= explicitly"
        )
    return rank


def resolve_device(
    requested: torch.device | str | None,
    backend: str | None = None,
    *,
    device_count: int | None = None,
    env: dict[str, str] | None = None,
) -> torch.device | None:
    """The device this process should compute on, or ``None`` for "where the parameters are".

    * ``backend`` names NCCL (the process group's backend, e.g. ``"nccl"`` or
      ``"cpu:gloo,cuda:nccl"``) and no device is given: ``cuda:LOCAL_RANK``
      (torchrun sets ``LOCAL_RANK``; 0 when unset) -- NCCL moves GPU tensors only.
    * A device type without an index (``"cuda"``): index ``LOCAL_RANK`` likewise.
    * A full device (``"cuda:1"``, ``"cpu"``): that device, checked.
    * Nothing given and no NCCL: ``None``.

    ``device_count`` (default: the GPUs this process sees) and ``env`` (default:
    ``os.environ``) are parameters so that the decision can be checked without
    a GPU.  A launch that cannot work raises :class:`PipelineError` naming the fix.
    """
    nccl = backend is not None and "nccl" in backend.lower()
    if requested is None:
        if not nccl:
            return None
        dev = torch.device(_CUDA)
    else:
        try:
            dev = torch.device(requested)
        except (RuntimeError, TypeError) as exc:
            raise PipelineError(f"device={requested!r} is not a device: {exc}") from None
    if dev.type in ("cpu", "meta"):
        if nccl:
            raise PipelineError(
                f"device={str(dev)!r} with an NCCL process group: NCCL moves GPU tensors only; "
                f"drop device= (rank r then computes on cuda:LOCAL_RANK) or initialise the "
                f"group with backend='gloo' to run on CPU"
            )
        return dev
    if nccl and dev.type != _CUDA:
        raise PipelineError(
            f"device={str(dev)!r} with an NCCL process group: NCCL runs on CUDA GPUs; "
            f"use a {_CUDA} device or a backend for {dev.type}"
        )
    count = accelerator_count(dev.type) if device_count is None else device_count
    why = "an NCCL process group" if requested is None else f"device={str(requested)!r}"
    if count == 0:
        raise PipelineError(
            f"{why} needs a {dev.type} device, but this process sees none "
            f"(is this a GPU build of torch? is CUDA_VISIBLE_DEVICES empty?); "
            f"on a machine without GPUs use backend='gloo' and device='cpu'"
        )
    if dev.index is not None:
        if dev.index >= count:
            raise PipelineError(
                f"device={str(dev)!r} does not exist: this process sees {count} {dev.type} "
                f"device(s), numbered 0 to {count - 1}"
            )
        return dev
    index = _local_rank(env)
    if index >= count:
        raise PipelineError(
            f"LOCAL_RANK={index} but this process sees only {count} {dev.type} device(s): "
            f"launch at most {count} process(es) per node (torchrun --nproc-per-node={count}), "
            f"make more GPUs visible (CUDA_VISIBLE_DEVICES), or pass device= explicitly "
            f"(e.g. '{dev.type}:0' when each process is given a GPU of its own)"
        )
    return torch.device(dev.type, index)


def single_device(devices: Iterable[torch.device], what: str) -> torch.device | None:
    """The one device ``devices`` share (None if empty); mixed devices are an error.

    ``what`` says whose devices they are (e.g. "the parameters of stages 0 and 1").
    """
    seen = sorted({str(d) for d in devices})
    if len(seen) > 1:
        raise PipelineError(
            f"{what} are on several devices ({', '.join(seen)}); pass "
            f"RuntimeOptions(device=...) to compute on one of them (the stages are moved "
            f"there), or move the model first with model.to(device)"
        )
    return torch.device(seen[0]) if seen else None


def make_current(device: torch.device) -> None:
    """Make ``device`` this process's current accelerator (NCCL and kernels default to it)."""
    if not is_accelerator(device) or device.index is None:
        return
    accel = getattr(torch, "accelerator", None)
    if accel is not None and hasattr(accel, "set_device_index"):
        accel.set_device_index(device.index)
    elif device.type == _CUDA:
        torch.cuda.set_device(device.index)


# --- mixed precision ----------------------------------------------------------------------

_AUTOCAST_DTYPES = (torch.bfloat16,)


def check_autocast(dtype: object) -> None:
    """Refuse an autocast dtype the runtime cannot train with exactly as asked."""
    if dtype is None:
        return
    if dtype == torch.float16:
        raise PipelineError(
            "autocast=torch.float16 needs loss scaling (torch.amp.GradScaler) against "
            "underflowing gradients, which the pipeline does not do; use torch.bfloat16"
        )
    if dtype not in _AUTOCAST_DTYPES:
        raise PipelineError(f"autocast must be None or torch.bfloat16, got {dtype!r}")


def autocast(device: torch.device, dtype: torch.dtype | None) -> AbstractContextManager[Any]:
    """``torch.autocast`` on ``device``'s type to ``dtype`` (a no-op context for ``None``).

    torch answers an unsupported (device type, dtype) with a warning and runs
    without autocast; here that is an error, since the user asked for it.
    """
    if dtype is None:
        return nullcontext()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            return torch.autocast(device.type, dtype=dtype)
        except (RuntimeError, UserWarning) as exc:
            raise PipelineError(
                f"autocast to {dtype} is not available on {device.type}: {exc}"
            ) from None
