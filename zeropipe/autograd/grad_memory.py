"""Gradient memory kept from one step to the next, so that W writes into pages already mapped.

``optimizer.zero_grad()`` sets every ``.grad`` to ``None`` by default, and the
next backward allocates each weight gradient afresh.  On the CUDA caching
allocator that costs nothing.  On a CPU a weight-sized allocation comes from
``mmap``: the kernel maps and zeroes every page again on first touch, which
for a 2048 x 512 float32 weight is about a thousand page faults per step.  In
a pipeline the first W of each stage pays them all, on the critical path.

:class:`GradMemory` keeps the tensor that W wrote last time and hands it back
for the parameter's next gradient -- but only when nothing else can see it:
``.grad`` is ``None``, no Python reference to the tensor survives (a user
holding ``g = p.grad`` keeps it) and no other tensor shares its storage (a
view of it keeps it).  Otherwise it allocates a new one, exactly as autograd
would.  The price is that the gradient memory stays allocated between steps,
as it would on CUDA's caching allocator; ``Pipeline(options=RuntimeOptions(keep_grad_memory=False))``
turns this off.

The "nobody else holds it" test counts references.  The counts a tensor has
when only this object holds it are measured once, on a tensor made for the
purpose, so they follow the interpreter instead of being assumed.
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor

from zeropipe.base._compat import storage_use_count
from zeropipe.base.storage import storage_nbytes

__all__ = ["GradMemory"]


class GradMemory:
    """Per-pipeline cache of weight-gradient tensors, reused when provably unreferenced."""

    def __init__(self) -> None:
        # id(param) -> (param, its last gradient tensor); holding param keeps the id unique.
        self._held: dict[int, tuple[Tensor, Tensor]] = {}
        self._alone = _counts_when_alone()

    def __len__(self) -> int:
        return len(self._held)

    @property
    def nbytes(self) -> int:
        """Bytes held for reuse (including tensors currently in use as ``.grad``)."""
        return sum(storage_nbytes(t) for _, t in self._held.values())

    def clear(self) -> None:
        """Forget every kept tensor (its memory is freed once ``.grad`` lets go too)."""
        self._held.clear()

    def take(self, param: Tensor) -> Tensor:
        """Uninitialised memory for ``param``'s new gradient (``param.grad`` must be ``None``).

        Returns the tensor kept from the last step when nothing else refers to
        it and it still matches ``param``; else a new one, which is kept for
        the next step.  The caller overwrites it and assigns it to ``param.grad``.
        """
        key = id(param)
        held = self._held.get(key)
        if held is not None:
            buf = held[1]
            # Laid out like _counts_when_alone: one reference from the tuple, one local.
            if _matches(buf, param) and _counts(buf) == self._alone:
                return buf
            del buf
        fresh = torch.empty_like(param, memory_format=torch.preserve_format)
        self._held[key] = (param, fresh)
        return fresh


def _matches(buf: Tensor, param: Tensor) -> bool:
    return (buf.shape, buf.dtype, buf.device, buf.stride()) == (
        param.shape,
        param.dtype,
        param.device,
        param.stride(),
    )


def _counts(buf: Tensor) -> tuple[int, int]:
    # Python references to the tensor object, and tensors (views) sharing its storage.  The
    # layout of this function matters: _counts_when_alone calls it the same way.
    return sys.getrefcount(buf), storage_use_count(buf)


def _counts_when_alone() -> tuple[int, int]:
    kept = {0: (torch.empty(()), torch.empty(1))}
    held = kept[0]
    buf = held[1]
    return _counts(buf)
