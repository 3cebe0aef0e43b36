"""Who saves what, under which name: the model's names for a pipeline's tensors, and which
processes write a checkpoint together.

A pipeline built from an ``nn.Sequential`` uses the Sequential's own keys (a slice keeps its
layers' indices); stages cut from a model passed as ``model=`` take the model's names; other
stage modules are named as ``nn.Sequential(*stages)`` would name them.  A tensor on several
stages is written once, by the lowest rank running a stage that holds it, in the first
data-parallel replica (every replica writes its shard of a tensor sharded over them, as
experts under expert parallelism); its other names are aliases (see
:mod:`zeropipe.runtime.checkpoint.dcp`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from zeropipe.runtime.checkpoint.folder import CheckpointError
from zeropipe.runtime.pipeline import Pipeline

__all__ = ["StateNames", "is_lead", "saves_together", "state_names"]


@dataclass(frozen=True)
class StateNames:
    """The model's names for a pipeline's tensors.

    ``tensors``: name -> tensor for the stages this process runs (each tensor
    once, under its first name); ``owned``: the names this process writes
    (a tensor on stages of several ranks is written by the lowest);
    ``every``: the names of every stage's tensors, on whichever rank;
    ``aliases``: a tensor's other names (``lm_head.weight`` -> the embedding's).
    Every process of a tensor-parallel group owns what its pipeline rank owns:
    each writes its shard of a DTensor (see the module).
    """

    tensors: dict[str, Tensor]
    owned: frozenset[str]
    every: frozenset[str]
    aliases: dict[str, str]

    by_id: dict[int, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "by_id", {id(t): n for n, t in self.tensors.items()})

    def name_of(self, tensor: Tensor) -> str | None:
        """The name of one of this process's tensors (None: not one of them)."""
        return self.by_id.get(id(tensor))


def state_names(pipe: Pipeline, model: nn.Module | None = None) -> StateNames:
    """The names under which :func:`save_checkpoint` stores ``pipe``'s tensors (see the module)."""
    from_model: dict[int, list[str]] = {}
    if model is not None:
        for name, t in model.state_dict(keep_vars=True).items():
            from_model.setdefault(id(t), []).append(name)
    first: dict[int, str] = {}  # id(tensor) -> its canonical name
    ranks: dict[int, int] = {}  # id(tensor) -> lowest rank running a stage that holds it
    aliases: dict[str, str] = {}
    local: dict[str, Tensor] = {}
    mine = set(pipe.stages)
    for stage in pipe.all_stages:
        keys = stage.layer_keys
        for key, t in stage.module.state_dict(keep_vars=True).items():
            if model is not None:
                names = from_model.get(id(t))
                if not names:
                    raise CheckpointError(
                        f"stage {stage.index}'s {key!r} is not a tensor of the model passed as "
                        f"model=; pass the model the stages were cut from (zeropipe.split)"
                    )
                name = names[0]
                aliases.update({other: name for other in names[1:]})
            elif keys is not None:  # a slice of an nn.Sequential: its layers' own indices
                index, _, rest = key.partition(".")
                name = f"{keys[int(index)]}.{rest}"
            else:
                name = f"{stage.index}.{key}"
            rank = pipe.schedule.placement[stage.index]
            canonical = first.setdefault(id(t), name)
            if canonical != name:
                aliases[name] = canonical
            ranks[id(t)] = min(ranks.get(id(t), rank), rank)
            if stage.index in mine:
                local[canonical] = t
    me = pipe.rank if pipe.distributed else None
    # Data-parallel replicas hold the same tensors: the first one writes them.  A DTensor
    # sharded over the replicas (experts under expert parallelism) is written by each,
    # its own shard; DCP keeps one copy of a shard several processes offer.
    owned = frozenset(
        n
        for n, t in local.items()
        if (pipe.dp_rank == 0 or _sharded(t)) and (me is None or ranks[id(t)] == me)
    )
    return StateNames(local, owned, frozenset(first.values()), aliases)


def is_lead(
    pipe: Pipeline,
    names: StateNames | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> bool:
    """Whether this process is the one that writes a checkpoint's manifest and moves it into
    place: rank 0 of the processes that save together (see :func:`saves_together`).

    Pipeline rank 0 of replica 0 is not enough: under tensor parallelism every process
    of its tensor-parallel group is that, and two of them renaming the same folder race.
    """
    if saves_together(pipe, names) and dist.is_available() and dist.is_initialized():
        return dist.get_rank(process_group) == 0
    return (not pipe.distributed or pipe.rank == 0) and pipe.dp_rank == 0


def saves_together(pipe: Pipeline, names: StateNames | None = None) -> bool:
    """Whether several processes save and load together: pipeline ranks, replicas, or the
    processes of a tensor-parallel group (a stage's DTensors span them, even at pp 1)."""
    if pipe.distributed or pipe.dp_size > 1:
        return True
    tensors = (names or state_names(pipe)).tensors.values()
    return any(_mesh_size(t) > 1 for t in tensors)


def _sharded(t: Tensor) -> bool:
    """Whether ``t`` is a DTensor each of whose processes holds a different part of it."""
    return isinstance(t, DTensor) and not all(p.is_replicate() for p in t.placements)


def _mesh_size(t: Tensor) -> int:
    """How many processes a DTensor spans (1 for a plain tensor)."""
    mesh = getattr(t, "device_mesh", None)
    return int(mesh.size()) if isinstance(t, DTensor) and mesh is not None else 1
