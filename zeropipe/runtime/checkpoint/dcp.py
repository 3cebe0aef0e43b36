"""Checkpoints of a :class:`~zeropipe.Pipeline` in torch's distributed format (DCP).

    save_checkpoint(pipe, optimizer, "ckpt/step-40", extra={"step": 40})
    extra = load_checkpoint(pipe, optimizer, "ckpt/step-40")   # any ranks, any schedule

Keys are the *model's* names, not the pipeline's: a pipeline built from an
``nn.Sequential`` uses the Sequential's own ``state_dict`` keys (``3.weight``:
a slice keeps its layers' indices); stage modules cut from a model (HF
models through :func:`zeropipe.split`) take the model's names when the model
is passed as ``model=``; other stage modules are named as
``nn.Sequential(*stages)`` would name them (``<stage>.<key>``), which ties the
checkpoint to that cut.  A tensor on several stages (tied embeddings) is
stored once, under its first name; its other names are recorded as aliases.

What a checkpoint holds (one flat DCP state dict)::

    model.<name>              every parameter and persistent buffer, written by the
                              lowest rank that runs a stage holding it (in the first
                              data-parallel replica: the others hold the same; each
                              replica writes its shard of experts sharded over them)
    optim.<name>.<state>      the optimizer's per-parameter state (AdamW: step,
                              exp_avg, exp_avg_sq), keyed by parameter name, so it
                              loads into an optimizer over another subset of them
    extra                     the caller's object (written by rank 0)
    pipeline.steps            training steps the pipeline has run (what dropout is
                              seeded by), restored on load

Loading reads from the metadata what each stage needs now, whichever rank
wrote it: the checkpoint resumes on another rank count, schedule, chunking or
number of data-parallel replicas (every replica reads the same tensors).
The optimizer's hyperparameters (lr, betas, ...) are the ones of the optimizer
passed in; only its per-parameter state is restored.

Tensor parallelism: parameters that ``parallelize_module`` made DTensors (and
the optimizer's state for them) are stored as DCP stores a DTensor, each
process of the tensor-parallel group writing its own shard of the global
tensor; a tensor the group replicates (a LayerNorm's weight) is offered by
each and written once (DCP keeps one copy of identical entries).  The keys,
the shapes in the metadata and the checks on load are the global ones, so a
checkpoint saved at one tensor-parallel degree loads at another, or into plain
tensors (``tp`` 1, or :func:`consolidated_state_dict`): each process reads the
part of every tensor that its own layout holds.  The same holds for experts sharded over
"ep" (``zeropipe.parallelize(ep_mesh=)``): a checkpoint saved at ep 2 loads at ep 1
or in one process.  The processes of a
tensor-parallel group save and load together even where the pipeline is one
rank (:func:`saves_together`), and only the group's rank 0 finishes the folder
(:func:`is_lead`).

A checkpoint is never half-written.  DCP writes into ``.<name>.partial`` next
to ``path``; once every rank's files exist (``dcp.save`` returns on rank 0
after gathering every rank's writes) rank 0 writes ``manifest.json`` (the
sha256 of every file, the caller's ``meta``, the aliases) and renames the
folder into place; the other ranks wait for its word.  A save killed midway
leaves only the ``.partial`` folder, which the next save replaces.
:func:`load_checkpoint` and ``checkpoint_folder.verify_checkpoint`` compare every file with
the manifest first.

A save that fails (a full disk, a path that cannot be written) ends every
rank with the same one-line ``CheckpointError`` naming the path and the
cause, and removes the ``.partial`` folder it made.  Re-saving to an existing
``path`` moves the old folder to ``.<name>.old`` before renaming the new one
in; a save killed between those two renames leaves no folder at ``path``:
:func:`load_checkpoint` then loads the newest complete one it left (the
``.partial``, else the ``.old``) with a warning, and the next save to
``path`` renames that ``.partial`` into place first.
A ``path`` that exists and is not a checkpoint (a file, or a folder that
is neither empty nor holds a ``manifest.json``) is refused before anything
is written or moved: a re-save would move it aside and the next delete it.

The folder itself -- the manifest, the renames, verification, recovery and the
one-line reasons a save failed -- is :mod:`zeropipe.runtime.checkpoint.folder`'s.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import empty as dtensor_empty
from torch.futures import Future

from zeropipe.base.storage import local_tensor
from zeropipe.runtime.checkpoint.folder import (
    CheckpointError,
    cannot_save,
    not_a_checkpoint,
    os_error,
    partial_path,
    publish,
    recovered,
    verifies,
    why_failed,
)
from zeropipe.runtime.checkpoint.names import StateNames, is_lead, saves_together, state_names
from zeropipe.runtime.pipeline import Pipeline

__all__ = ["consolidated_state_dict", "load_checkpoint", "save_checkpoint"]

_MODEL, _OPTIM, _EXTRA = "model.", "optim.", "extra"
_STEPS = "pipeline.steps"  # training steps run: what dropout is seeded by


def _state_to_save(
    pipe: Pipeline,
    optimizer: torch.optim.Optimizer | None,
    names: StateNames,
    extra: Any,
    lead: bool,
) -> dict[str, Any]:
    state: dict[str, Any] = {
        _MODEL + n: t.detach() for n, t in names.tensors.items() if n in names.owned
    }
    if optimizer is not None:
        for p, values in optimizer.state.items():
            name = names.name_of(p)
            if name is None:
                raise CheckpointError(
                    "the optimizer holds a parameter that no stage of this process runs; "
                    "build it over pipe.parameters()"
                )
            if name in names.owned:
                for k, v in values.items():
                    state[f"{_OPTIM}{name}.{k}"] = v.detach() if isinstance(v, Tensor) else v
    if extra is not None and lead:
        state[_EXTRA] = extra
    if lead:
        state[_STEPS] = pipe.steps_done
    return state


@contextmanager
def _quiet() -> Iterator[None]:
    """DCP warns on every single-process save and load that it assumes one process: we asked."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _not_sharded(pipe: Pipeline) -> None:
    if pipe.sharded is not None:
        raise CheckpointError(
            "checkpoints of a dp_shard=True pipeline are not supported yet (each replica "
            "holds other shards); save from a replicated pipeline (dp_shard=False)"
        )


class _Writer(dcp.FileSystemWriter):
    """DCP's file writer, whose failures reach the other ranks as the OSError behind them.

    A full disk fails inside ``torch.save`` as a RuntimeError ("unexpected pos 704
    vs 598") raised while handling the OSError; DCP pickles a rank's failure to
    hand it to every rank, which drops ``__context__``, so without this the peers
    would learn only the RuntimeError.
    """

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        try:
            return super().write_data(plan, planner)
        except Exception as exc:
            cause = os_error(exc)
            if cause is None or cause is exc:
                raise
            raise cause from None


def _agree(error: str | None, distributed: bool, group: dist.ProcessGroup | None) -> str | None:
    """Rank 0's word, on every rank: a rank that raised alone would leave its peers
    blocked in the next collective, then failing with gloo's "connection reset by peer"."""
    if not distributed:
        return error
    word = [error]
    dist.broadcast_object_list(word, group=group, group_src=0)
    return word[0]


def save_checkpoint(
    pipe: Pipeline,
    optimizer: torch.optim.Optimizer | None,
    path: str | os.PathLike[str],
    *,
    extra: Any = None,
    meta: Mapping[str, Any] | None = None,
    model: nn.Module | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> Path:
    """Save the stages this process runs, and ``optimizer``'s state for them, to ``path``.

    Every rank of a distributed pipeline calls it with the same ``path`` (a
    folder that appears complete or not at all).  ``extra`` is any picklable
    object (rank 0's is stored, e.g. step and RNG state), returned by
    :func:`load_checkpoint`; ``meta`` (JSON) goes into the manifest, readable
    without torch.  ``model``: the model the stages were cut from, whose
    names the tensors take (see the module).  Returns ``path``; a save that
    fails raises the same :class:`CheckpointError` on every rank.
    """
    _not_sharded(pipe)
    path = Path(path)
    if path.name in ("", ".."):  # "", ".", "/": no name to put the checkpoint under
        raise CheckpointError(
            f"cannot save checkpoint {str(path)!r}: it names no folder of its own; give a "
            f"folder name, e.g. 'ckpt/step-40'"
        )
    tmp = partial_path(path)
    names = state_names(pipe, model)
    distributed = saves_together(pipe, names)
    lead = is_lead(pipe, names, process_group)
    state = _state_to_save(pipe, optimizer, names, extra, lead)
    json.dumps(dict(meta or {}))  # not serialisable: fail before anything is written
    error, created = _make_partial(path, tmp) if lead else (None, False)
    # Before any rank writes: a folder rank 0 cannot make, or a path holding something
    # other than a checkpoint, fails every rank alike.
    error = _agree(error, distributed, process_group)
    if error is not None:
        raise CheckpointError(error)
    error, interrupted = _write(state, path, tmp, distributed, process_group)
    if error is None and lead:
        try:
            publish(tmp, path, meta or {}, names.aliases, optimizer)
        except OSError as exc:
            error = cannot_save(path, exc)
    if error is not None and created:
        shutil.rmtree(tmp, ignore_errors=True)  # only the folder this save made
    # The other ranks return once the checkpoint is in place, or fail alike.
    error = _agree(error, distributed, process_group)
    if interrupted is not None:
        raise interrupted
    if error is not None:
        raise CheckpointError(error)
    return path


def _make_partial(path: Path, tmp: Path) -> tuple[str | None, bool]:
    """The lead rank's empty ``.partial`` folder for a save to ``path``: (why it cannot be
    made or None, whether this save made it)."""
    error = not_a_checkpoint(path)
    if error is not None:
        return error, False
    try:
        if not path.exists() and verifies(tmp):
            os.replace(tmp, path)  # a save killed between its renames: finish it first
        shutil.rmtree(tmp, ignore_errors=True)  # what a killed save left
        tmp.mkdir(parents=True)
    except OSError as exc:
        return cannot_save(path, exc), False
    return None, True


def _write(
    state: dict[str, Any],
    path: Path,
    tmp: Path,
    distributed: bool,
    process_group: dist.ProcessGroup | None,
) -> tuple[str | None, BaseException | None]:
    """Every rank's share of ``state`` written into ``tmp`` by DCP: (why the save failed or
    None, a Ctrl-C that came while saving, re-raised once the peers are told)."""
    try:
        with _quiet():
            dcp.save(
                state,
                checkpoint_id=tmp,
                storage_writer=_Writer(tmp),
                process_group=process_group,
                # Flat already; unflattened, ``extra`` stays one pickled object.
                planner=DefaultSavePlanner(flatten_state_dict=False),
                no_dist=not distributed,
            )
    except CheckpointException as exc:  # a BaseException, which DCP hands every rank alike
        me = dist.get_rank(process_group) if distributed else 0
        own = exc.failures.get(me)
        interrupted = None
        if own is not None and not isinstance(own[0], Exception):
            interrupted = own[0]
        rank, (cause, _) = min(exc.failures.items(), key=lambda item: item[0])
        return cannot_save(path, cause, rank if distributed else None), interrupted
    return None, None


def _metadata(path: Path) -> dict[str, Any]:
    try:
        md = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as exc:  # a DCP folder that is not one: say which
        raise CheckpointError(f"cannot read the DCP metadata of {path}: {exc}") from None
    return dict(md.state_dict_metadata)


def _listed(names: list[str], limit: int = 4) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(repr(n) for n in names[:limit]) + more


def _check_model_keys(path: Path, md: dict[str, Any], names: StateNames) -> None:
    saved = {k[len(_MODEL) :] for k in md if k.startswith(_MODEL)}
    missing = sorted(set(names.tensors) - saved)
    unexpected = sorted(saved - names.every)
    fix = (
        "load it into the model it was saved from (same architecture and sizes; stage modules "
        "cut from a model need model= on both save and load)"
    )
    if missing or unexpected:
        told = [f"lacks {_listed(missing)}"] if missing else []
        if unexpected:
            told.append(f"holds {_listed(unexpected)}, which this model does not have")
        raise CheckpointError(f"checkpoint {path} {' and '.join(told)}; {fix}")
    for name, t in names.tensors.items():
        entry = md[_MODEL + name]
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(f"checkpoint {path} holds {name!r} as an object, not a tensor")
        if tuple(entry.size) != tuple(t.shape) or entry.properties.dtype != t.dtype:
            raise CheckpointError(
                f"checkpoint {path} holds {name!r} as {entry.properties.dtype} "
                f"{list(entry.size)}, the model has {t.dtype} {list(t.shape)}; {fix}"
            )


def _template(entry: Any, like: Tensor | None = None) -> Any:
    """Where DCP loads ``entry``: a tensor of its global size, laid out as the parameter
    ``like`` when it is a DTensor of that size (the optimizer's moments of a
    tensor-parallel weight), so each process reads only its own shard."""
    if not isinstance(entry, TensorStorageMetadata):
        return None  # an object: DCP puts what it unpickles in its place
    size, dtype = tuple(entry.size), entry.properties.dtype
    if isinstance(like, DTensor) and tuple(like.shape) == size:
        return dtensor_empty(
            size, dtype=dtype, device_mesh=like.device_mesh, placements=like.placements
        )
    return torch.empty(size, dtype=dtype)


def _finite(t: Tensor) -> bool:
    """No NaN or inf in what this process holds of ``t`` (a DTensor: its shard)."""
    t = local_tensor(t)
    return not t.is_floating_point() or bool(torch.isfinite(t).all())


def _first_found(found: str | None, together: bool, group: dist.ProcessGroup | None) -> str | None:
    """The lowest rank's finding, on every rank (``found`` alone when loading alone)."""
    if not together:
        return found
    every: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, found, group=group)
    return next((f for f in every if f is not None), None)


def _dcp_load(
    state: dict[str, Any], path: Path, group: dist.ProcessGroup | None, no_dist: bool
) -> dict[str, Any]:
    """``dcp.load``, returning the state with objects too: DCP loads tensors in place but
    puts unpickled objects into the planner's own copy of the dict."""
    planner = DefaultLoadPlanner(flatten_state_dict=False)
    try:
        with _quiet():
            dcp.load(
                state, checkpoint_id=path, process_group=group, planner=planner, no_dist=no_dist
            )
    except CheckpointException as exc:  # a BaseException: `except Exception` would miss it
        rank, (cause, _) = min(exc.failures.items(), key=lambda item: item[0])
        why, _ = why_failed(cause, None if no_dist else rank)
        raise CheckpointError(f"cannot load checkpoint {path}: {why}") from None
    return {**state, **planner.state_dict}


def load_checkpoint(
    pipe: Pipeline,
    optimizer: torch.optim.Optimizer | None,
    path: str | os.PathLike[str],
    *,
    model: nn.Module | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> Any:
    """Load checkpoint ``path`` into the stages this process runs and ``optimizer``.

    The pipeline may have another rank count, schedule or chunking than the
    one that saved it.  Every file is checked against the manifest first;
    keys the model lacks or has in excess, and shapes or dtypes that differ,
    are a :class:`CheckpointError` naming the key.  Returns the ``extra``
    given to :func:`save_checkpoint` (None if none was).
    """
    _not_sharded(pipe)
    path, record = recovered(Path(path))
    if optimizer is not None and "optimizer" in record and record["optimizer"] is None:
        raise CheckpointError(
            f"checkpoint {path} holds no optimizer state (it was saved with optimizer=None); "
            f"pass optimizer=None to load the model only"
        )
    md = _metadata(path)
    names = state_names(pipe, model)
    _check_model_keys(path, md, names)
    state: dict[str, Any] = {_MODEL + n: t.detach() for n, t in names.tensors.items()}
    wanted: dict[str, list[str]] = {}
    if optimizer is not None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                name = names.name_of(p)
                if name is None:
                    raise CheckpointError(
                        "the optimizer holds a parameter that no stage of this process runs; "
                        "build it over pipe.parameters()"
                    )
                prefix = f"{_OPTIM}{name}."
                wanted[name] = [
                    k for k in md if k.startswith(prefix) and "." not in k[len(prefix) :]
                ]
                state.update({k: _template(md[k], like=p) for k in wanted[name]})
    if _EXTRA in md:
        state[_EXTRA] = None
    if _STEPS in md:
        state[_STEPS] = 0
    together = saves_together(pipe, names)
    state = _dcp_load(state, path, process_group, no_dist=not together)
    # Each process sees its own shards only: any process's finding fails every one alike.
    bad = next((n for n in names.tensors if not _finite(state[_MODEL + n])), None)
    bad = _first_found(bad, together, process_group)
    if bad is not None:
        raise CheckpointError(f"checkpoint {path} holds non-finite values in {bad!r}")
    if optimizer is not None:
        _load_optimizer(optimizer, names, state, wanted, path, record.get("optimizer"))
    if _STEPS in state:  # dropout after the resume draws as an uninterrupted run would
        pipe.steps_done = int(state[_STEPS])
    return state.get(_EXTRA)


def _load_optimizer(
    optimizer: torch.optim.Optimizer,
    names: StateNames,
    state: dict[str, Any],
    wanted: dict[str, list[str]],
    path: Path,
    saved_with: Any,
) -> None:
    """Hand the optimizer its state by position, as ``load_state_dict`` wants, from names."""
    sd = optimizer.state_dict()
    before = {**sd, "state": dict(sd["state"])}
    per_param: dict[int, dict[str, Any]] = {}
    for group, saved_group in zip(optimizer.param_groups, sd["param_groups"], strict=True):
        for p, i in zip(group["params"], saved_group["params"], strict=True):
            name = names.name_of(p)
            keys = wanted.get(name or "", [])
            if keys:
                per_param[i] = {k.rsplit(".", 1)[1]: state[k] for k in keys}
    sd["state"] = per_param
    has = sorted({k for values in per_param.values() for k in values})
    needs = sorted({k for values in before["state"].values() for k in values})
    try:
        if has and needs and has != needs:  # an optimizer that has stepped: its own keys
            raise KeyError(needs)
        optimizer.load_state_dict(sd)
    except KeyError as exc:  # AdamW's `step` missing from SGD's state, and the like
        optimizer.load_state_dict(before)  # left as it was
        needed = needs or [str(k) for k in exc.args]
        kind = type(optimizer).__name__
        by = f" (saved with {saved_with})" if isinstance(saved_with, str) else ""
        raise CheckpointError(
            f"checkpoint {path}'s optimizer state{by} does not fit this {kind}: it holds "
            f"{has}, {kind} needs {needed}; pass the same kind of optimizer it was saved "
            f"with, or optimizer=None to load the model only"
        ) from None


def consolidated_state_dict(
    path: str | os.PathLike[str],
) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The model's whole state dict from checkpoint ``path``, in one process (no process group).

    Returns ``(tensors, aliases)``: each tensor once, under its first name,
    and ``alias -> name`` for the other names of tied tensors.  Files are
    verified against the manifest first.
    """
    path, record = recovered(Path(path))
    md = _metadata(path)
    state = {k: _template(v) for k, v in md.items() if k.startswith(_MODEL)}
    if not state:
        raise CheckpointError(f"checkpoint {path} holds no model tensors")
    state = _dcp_load(state, path, None, no_dist=True)
    tensors = {k[len(_MODEL) :]: v for k, v in state.items()}
    aliases = {str(k): str(v) for k, v in dict(record.get("aliases", {})).items()}
    return tensors, aliases
