"""Storages, not tensors: the unit in which zeropipe counts and moves memory.

Two views of one buffer hold its bytes once, so every byte count in the
package (saved activations, weight-gradient stashes, parameters, the
profiler's per-stage memory) deduplicates by storage, and every move of
bytes (activation and weight offload) copies a whole storage and rebuilds
the views over it::

    tensor --storage_key--> (device, address)     which storage it lives in
           --as_bytes-----> uint8[storage nbytes]  the whole storage, no copy
    bytes  --view_bytes---> dtype view (offset, size, stride)   no copy

This is the one module that reads storage addresses and sizes; the others
call it.  Torch base layer: it imports only torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet

import torch
from torch import Tensor, nn

__all__ = [
    "StorageKey",
    "as_bytes",
    "distinct_bytes",
    "local_tensor",
    "movable",
    "same_storage",
    "storage_key",
    "storage_nbytes",
    "view_bytes",
]

StorageKey = tuple[torch.device, int]
"""Identifies a storage while it is alive: its device and its address."""


def local_tensor(t: Tensor) -> Tensor:
    """The plain tensor holding ``t``'s bytes in this process: a DTensor's local shard
    (tensor parallelism, FSDP2), the tensor inside any other wrapper subclass of one
    inner tensor (the AsyncCollectiveTensor a row-wise parallel linear returns), ``t``
    itself otherwise.

    A wrapper's own storage is invalid; its bytes live in the tensor it wraps.
    """
    while type(t) not in (Tensor, nn.Parameter):
        inner = getattr(t, "_local_tensor", None)  # a DTensor
        flatten = getattr(t, "__tensor_flatten__", None)
        if not isinstance(inner, Tensor) and flatten is not None:
            names = [n for n in flatten()[0] if isinstance(getattr(t, n, None), Tensor)]
            inner = getattr(t, names[0]) if len(names) == 1 else None
        if not isinstance(inner, Tensor) or inner is t:
            return t
        t = inner
    return t


def storage_key(t: Tensor) -> StorageKey:
    """Which storage ``t`` (a DTensor: its local shard) lives in (device and address)."""
    t = local_tensor(t)
    return (t.device, t.untyped_storage().data_ptr())


def same_storage(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` are views of one storage."""
    return storage_key(a) == storage_key(b)


def storage_nbytes(t: Tensor) -> int:
    """Bytes of the whole storage under ``t`` (not only the part ``t`` views); a DTensor:
    its local shard's."""
    return int(local_tensor(t).untyped_storage().nbytes())


def as_bytes(t: Tensor) -> Tensor:
    """The whole storage under ``t`` as a flat uint8 tensor (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def view_bytes(
    buf: Tensor, dtype: torch.dtype, offset: int, size: Sequence[int], stride: Sequence[int]
) -> Tensor:
    """A ``dtype`` view with the given geometry over ``buf``'s storage (no copy)."""
    return torch.empty(0, dtype=dtype, device=buf.device).set_(
        buf.untyped_storage(), offset, tuple(size), tuple(stride)
    )


def movable(t: Tensor) -> bool:
    """Whether ``t`` can be counted and rebuilt from its bytes (a plain dense tensor)."""
    # Only plain dense tensors can be rebuilt from their bytes; anything else
    # (sparse, subclasses, conjugate/negative views, meta) is kept as it is.
    return (
        type(t) in (Tensor, nn.Parameter)
        and t.layout is torch.strided
        and t.device.type != "meta"
        and not t.is_conj()
        and not t.is_neg()
        and storage_nbytes(t) > 0
    )


def distinct_bytes(
    tensors: Iterable[Tensor], exclude: AbstractSet[StorageKey] = frozenset()
) -> int:
    """Bytes of the distinct storages under ``tensors``, less those in ``exclude``.

    Tensors without storage of their own (sparse, meta) count nothing.
    """
    seen: dict[StorageKey, int] = {}
    for t in tensors:
        t = local_tensor(t)
        if t.layout is not torch.strided or t.device.type == "meta":
            continue
        key = storage_key(t)
        if key not in exclude:
            seen[key] = storage_nbytes(t)
    return sum(seen.values())
