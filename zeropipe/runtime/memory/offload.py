"""What can leave the device: a microbatch's saved activations and a stage's weights.

:class:`SavedActivations` sits behind ``torch.autograd.graph.saved_tensors_hooks``
around one (stage, microbatch)'s forward: the graph keeps small handles, the
tensors stay reachable from here, so they can be counted and moved::

    pack    tensor -> handle (weights and the caller's batch are kept as they are;
                      views of offloadable weights are kept as (parameter, geometry))
    offload each distinct storage -> host bytes; the device copy is let go
    reload  host bytes -> device, asynchronously where there is a copy stream
    unpack  handle -> the original tensor, or the same view of the reloaded bytes

Storages, not tensors, are the unit: two saved views of one buffer move (and
count) once, and come back as views of one buffer again.  Handles are held
weakly, so whatever autograd frees during the backward is freed here too.

:class:`StageWeights` moves a stage's parameters between a host master copy
and the device by swapping each parameter's ``.data`` (the object stays, so
optimizers and gradient accumulators keep pointing at it), as
``nn.Module.to`` does; gradients follow their parameters.
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable, Iterable
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from zeropipe.base.device import Copier, Transfer
from zeropipe.base.storage import (
    StorageKey,
    as_bytes,
    distinct_bytes,
    local_tensor,
    movable,
    same_storage,
    storage_key,
    storage_nbytes,
    view_bytes,
)
from zeropipe.core.errors import PipelineError

__all__ = ["SavedActivations", "StageWeights"]


# --- saved activations --------------------------------------------------------------------


class _Block:
    """One storage's bytes while its (stage, microbatch) is offloaded or reloaded."""

    __slots__ = ("device", "host", "nbytes")

    def __init__(self, host: Transfer, nbytes: int) -> None:
        self.host: Transfer | None = host
        self.device: Transfer | None = None
        self.nbytes = nbytes


class _Packed:
    """What the graph holds instead of a saved tensor: the tensor, or where its bytes went."""

    __slots__ = ("__weakref__", "block", "geometry", "tensor")

    def __init__(self, tensor: Tensor) -> None:
        self.tensor: Tensor | None = tensor
        self.block: _Block | None = None
        self.geometry: tuple[torch.dtype, int, tuple[int, ...], tuple[int, ...]] | None = None


class _ParamView:
    """A saved view of a weight-offloaded parameter, rebuilt from its bytes of the moment."""

    __slots__ = ("dtype", "offset", "param", "size", "stride")

    def __init__(self, param: Tensor, t: Tensor) -> None:
        self.param = param
        self.dtype = t.dtype
        self.offset, self.size, self.stride = int(t.storage_offset()), tuple(t.shape), t.stride()

    def get(self) -> Tensor:
        return view_bytes(as_bytes(self.param), self.dtype, self.offset, self.size, self.stride)


class _Shard:
    """A saved DTensor whose local shard was packed (``inner``): rebuilt around it on unpack.

    Holds the DTensor's layout, not the DTensor, which would keep the shard alive.
    """

    __slots__ = ("inner", "mesh", "placements", "shape", "stride")

    def __init__(self, inner: Any, t: Tensor) -> None:
        self.inner = inner
        self.mesh = t.device_mesh  # type: ignore[attr-defined]
        self.placements = tuple(t.placements)  # type: ignore[attr-defined]
        self.shape, self.stride = t.shape, t.stride()

    def rebuild(self, local: Tensor) -> Tensor:
        from torch.distributed.tensor import DTensor

        with torch.no_grad():
            return DTensor.from_local(
                local.detach(), self.mesh, self.placements,
                run_check=False, shape=self.shape, stride=self.stride,
            )  # fmt: skip


class Saved(Protocol):
    """What a microbatch's state holds of its forward's saved tensors, until its backward.

    :class:`SavedActivations` tracks them; ``memory.manager.KnownCount`` stands in
    for a forward whose bytes an earlier one counted (no hooks, nothing to move).
    """

    where: str
    counted: bool
    signature: Hashable

    @property
    def nbytes(self) -> int: ...

    @property
    def host_nbytes(self) -> int: ...

    def hooks(self) -> AbstractContextManager[None]: ...

    def seal(self, boundary: Iterable[Tensor]) -> int: ...

    def offload(self) -> None: ...

    def reload(self) -> None: ...

    def release(self) -> None: ...


class SavedActivations:
    """Every tensor one (stage, microbatch)'s forward saved for its backward.

    ``keep`` are storages never counted nor moved (weights, the caller's batch);
    ``params`` maps the storages of weight-offloaded parameters to the
    parameter, so saved views of them follow the parameter's moves.  Handles
    are held weakly: when autograd frees a saved tensor, it is gone from here too.
    """

    def __init__(
        self,
        where: str,
        copier: Copier,
        keep: frozenset[StorageKey],
        params: dict[StorageKey, Tensor],
        *,
        signature: Hashable = None,
    ) -> None:
        self.where = where
        self._copier = copier
        self._keep = keep
        self._params = params
        self._live: list[weakref.ref[_Packed]] = []
        self._boundary: set[StorageKey] = set()
        self._blocks: list[_Block] = []
        self.signature = signature  # what the caller may cache the count under

    counted = True  # its saved tensors go through the hooks (see memory.manager.KnownCount)

    def hooks(self) -> AbstractContextManager[None]:
        """The saved-tensor hooks that route this forward's saved tensors through here."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: Tensor) -> Any:
        local = local_tensor(t)
        if local is not t:
            if not hasattr(t, "device_mesh"):  # a wrapper other than a DTensor: kept
                return t
            # A DTensor (tensor parallelism): its local shard moves.
            inner = self._pack(local)
            return t if inner is local else _Shard(inner, t)
        if not movable(t):
            return t
        key = storage_key(t)
        param = self._params.get(key)
        if param is not None:
            return _ParamView(param, t)
        if key in self._keep:
            return t
        handle = _Packed(t)
        self._live.append(weakref.ref(handle))
        return handle

    def _unpack(self, handle: Any) -> Tensor:
        if isinstance(handle, Tensor):
            return handle
        if isinstance(handle, _Shard):
            return handle.rebuild(self._unpack(handle.inner))
        if isinstance(handle, _ParamView):
            return handle.get()
        if handle.tensor is not None:
            return handle.tensor
        block, geometry = handle.block, handle.geometry
        if block is None or block.device is None or geometry is None:
            raise PipelineError(
                f"{self.where}: the backward needs saved activations that are still on the "
                f"host; the schedule must RELOAD them before the backward (or R)"
            )
        return view_bytes(self._copier.ready(block.device), *geometry)

    def _handles(self) -> list[_Packed]:
        alive = [h for h in (ref() for ref in self._live) if h is not None]
        self._live = [weakref.ref(h) for h in alive]
        return alive

    def seal(self, boundary: Iterable[Tensor]) -> int:
        """End of the forward: the boundary tensors stay put; return the bytes held."""
        self._boundary = {storage_key(t) for t in boundary if movable(t)}
        return self.nbytes

    @property
    def nbytes(self) -> int:
        """Bytes of saved activations on the device now (distinct storages)."""
        resident = distinct_bytes(
            h.tensor
            for h in self._handles()
            if h.tensor is not None and storage_key(h.tensor) not in self._boundary
        )
        return resident + sum(b.nbytes for b in self._blocks if b.device is not None)

    @property
    def host_nbytes(self) -> int:
        """Bytes of this forward's activations in host memory now."""
        return sum(b.nbytes for b in self._blocks if b.host is not None)

    def offload(self) -> None:
        """Copy every movable storage to host and let go of the device copy."""
        groups: dict[StorageKey, list[_Packed]] = {}
        for h in self._handles():
            if h.tensor is not None and storage_key(h.tensor) not in self._boundary:
                groups.setdefault(storage_key(h.tensor), []).append(h)
        for members in groups.values():
            first = members[0].tensor
            assert first is not None  # filtered above
            block = _Block(self._copier.to_host(as_bytes(first)), storage_nbytes(first))
            for h in members:
                t = h.tensor
                assert t is not None
                h.geometry = (t.dtype, int(t.storage_offset()), tuple(t.shape), t.stride())
                h.block, h.tensor = block, None
            self._blocks.append(block)

    def reload(self) -> None:
        """Start copying everything offloaded back to the device."""
        for block in self._blocks:
            if block.host is not None:
                block.device = self._copier.to_device(block.host.tensor)
                block.host = None  # the copy engine keeps the source alive until it is read

    def release(self) -> None:
        """Forget everything (the backward ran; what it still needs, it holds itself)."""
        self._live.clear()
        self._blocks.clear()


# --- weights ------------------------------------------------------------------------------


class StageWeights:
    """The parameters of one weight-offloaded stage: where they live now and how they move.

    The host copy of each storage is the master between steps (the optimizer
    updates it there).  RELOAD copies it to the device; OFFLOAD points the
    parameters back at it -- no device-to-host copy for weights, which do not
    change within a step -- and copies the gradients to host.
    """

    def __init__(
        self,
        parameters: Iterable[nn.Parameter],
        copier: Copier,
        *,
        index: int,
        shared: Iterable[Tensor] = (),
    ) -> None:
        """``parameters``: the stage's; ``index``: the stage's, for messages; ``shared``:
        the parameters of every other stage (a stage that shares one cannot move its own)."""
        self.index = index
        self._copier = copier
        params: dict[int, nn.Parameter] = {}
        for p in parameters:
            params.setdefault(id(p), p)
        sharded = [p for p in params.values() if local_tensor(p) is not p]
        if sharded:
            raise PipelineError(
                f"stage {self.index} holds {len(sharded)} DTensor parameter(s) (tensor "
                f"parallelism or FSDP); weight offload moves plain tensors' storages and cannot "
                f"move a DTensor's shard yet: drop the weight OFFLOAD/RELOAD actions of this "
                f"stage (offload activations instead, or shard the weights with "
                f"RuntimeOptions(dp_shard=True))"
            )
        others = {id(p) for p in shared}
        tied = [p for k, p in params.items() if k in others]
        if tied:
            raise PipelineError(
                f"stage {self.index} shares {len(tied)} parameter(s) with another stage (tied "
                f"weights); a stage whose weights are offloaded must own its parameters"
            )
        groups: dict[StorageKey, list[nn.Parameter]] = {}
        for p in params.values():
            groups.setdefault(storage_key(p), []).append(p)
        self._groups = list(groups.values())
        self.nbytes = sum(storage_nbytes(g[0]) for g in self._groups)
        self.resident = True
        self._pending: list[Transfer] = []
        self._host: list[Tensor | None] = [None] * len(self._groups)
        self._device: list[Tensor | None] = [None] * len(self._groups)

    def keys(self) -> dict[StorageKey, Tensor]:
        """Storage -> a parameter on it (for :class:`SavedActivations`)."""
        return {storage_key(p): p for group in self._groups for p in group}

    def start_offloaded(self) -> None:
        """Before the first step: the schedule reloads this stage first, so park it on the host.

        Parameters already in host memory stay where they are (on an accelerator
        they are copied once into pinned memory, so later copies can be async).
        """
        for group in self._groups:
            head = group[0]
            if head.device.type == "cpu" and not self._copier.asynchronous:
                continue
            host = self._copier.to_host(as_bytes(head)).tensor
            self._copier.synchronize()
            for p in group:
                grad, p.grad = p.grad, None
                p.data = view_bytes(host, p.dtype, int(p.storage_offset()), p.shape, p.stride())
                p.grad = None if grad is None else self._copier.to_host(grad).tensor
        self._copier.synchronize()
        self.resident = False

    def reload(self) -> None:
        if self.resident:
            return
        for k, group in enumerate(self._groups):
            host = as_bytes(group[0])
            copy = self._copier.to_device(host)
            self._pending.append(copy)
            self._host[k], self._device[k] = host, copy.tensor
            for p in group:
                grad, p.grad = p.grad, None
                p.data = view_bytes(
                    copy.tensor, p.dtype, int(p.storage_offset()), p.shape, p.stride()
                )
                if grad is not None:
                    moved = self._copier.to_device(grad)
                    self._pending.append(moved)
                    p.grad = moved.tensor
        self.resident = True

    def ready(self) -> None:
        """Before a compute action of this stage: wait for its weights' copies."""
        for copy in self._pending:
            self._copier.ready(copy)
        self._pending.clear()

    def offload(self) -> None:
        if not self.resident:
            return
        self.ready()
        for k, group in enumerate(self._groups):
            host, device = self._host[k], self._device[k]
            same = host is not None and device is not None and same_storage(group[0], device)
            # Weights do not change within a step: the host master is still right.
            target = (
                host
                if same and host is not None
                else self._copier.to_host(as_bytes(group[0])).tensor
            )
            for p in group:
                grad = None if p.grad is None else self._copier.to_host(p.grad).tensor
                p.grad = None
                p.data = view_bytes(target, p.dtype, int(p.storage_offset()), p.shape, p.stride())
                p.grad = grad
            self._host[k] = self._device[k] = None
        self.resident = False
