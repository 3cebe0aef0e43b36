"""Stages and microbatches: the model cut into stages and the batch into microbatches;
a stage's module, how it is seeded, and its per-microbatch state.

A stage is built either from a hand-made module or from a slice of an
``nn.Sequential`` (seeded per layer, by the layer's index in the whole model,
so the same model cut into 2 or 4 stages draws the same dropout masks).  A
hand-made module is seeded by its stage index, so its randomness depends on
the cut, unless it names its layers' indices in the whole model with
:func:`seed_layers` (as ``zeropipe.split`` does for the stages it builds):
then each named submodule is seeded by its own index right before it runs,
exactly as a Sequential slice's layer is.  Each layer draws from a generator seeded
by ``(seed, step, microbatch, key)`` (:func:`seeded`), ``key`` its index in the whole
model: dropout masks are the same whatever order the schedule runs microbatches in,
and whatever the number of ranks.  The caller's global RNG state is saved once per
step and restored afterwards (:func:`preserved_rng`).  Between its forward and its
backward a microbatch's state holds::

    inputs   leaves fed to the module (float ones require grad)
    outputs  what the module returned (with graph); nothing once the loss is computed
    loss     on the last stage: the loss, whose backward the microbatch's weight seeds
    stash    deferred weight-gradient work between I and W (split backward)
    saved    what autograd saved for the backward, counted and movable (runtime.memory)
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from zeropipe.autograd.split_backward import WeightGradStash
from zeropipe.base import _compat
from zeropipe.base.device import autocast
from zeropipe.core.errors import PipelineError

if TYPE_CHECKING:
    from zeropipe.runtime.memory.offload import Saved

__all__ = [
    "LAYER_KEYS",
    "MicrobatchState",
    "Microbatches",
    "Outputs",
    "Stage",
    "as_tuple",
    "batch_names",
    "derive_seed",
    "given_signature",
    "given_step",
    "preserved_rng",
    "refuse_rows_weighting",
    "seed_layers",
    "seeded",
    "split_batch",
    "split_sequential",
    "split_step",
    "split_target",
    "step_microbatches",
    "step_signature",
]

# -- seeding: per (seed, step, microbatch, layer) ----------------------------------
_MASK = (1 << 63) - 1


def derive_seed(seed: int, step: int, microbatch: int, key: int) -> int:
    """A 63-bit seed from the four integers (splitmix64 mixing, stable across runs)."""
    x = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9) & _MASK
    x = (x ^ (microbatch * 0x94D049BB133111EB) ^ (key * 0xD6E8FEB86659FD93)) & _MASK
    x ^= x >> 31
    x = (x * 0xBF58476D1CE4E5B9) & _MASK
    x ^= x >> 27
    return x & _MASK


def seeded(seed: int, step: int, microbatch: int, key: int, device: torch.device) -> None:
    """Seed the CPU generator and ``device``'s for one layer's forward of one microbatch.

    The generators are seeded directly: ``torch.manual_seed`` queues a lazy
    seeding call per accelerator with a captured stack trace, which costs about
    a millisecond -- too much to pay per layer per microbatch.
    """
    value = derive_seed(seed, step, microbatch, key)
    torch.default_generator.manual_seed(value)
    if device.type != "cpu":
        module = torch.get_device_module(device.type)
        index = device.index if device.index is not None else module.current_device()
        module.default_generators[index].manual_seed(value)


@contextmanager
def preserved_rng(device: torch.device) -> Iterator[None]:
    """Restore the CPU RNG state, and ``device``'s if it is an accelerator, on exit."""
    if device.type == "cpu":
        with torch.random.fork_rng(devices=[]):
            yield
    else:
        index = device.index if device.index is not None else 0
        with torch.random.fork_rng(devices=[index], device_type=device.type):
            yield


# -- a stage -----------------------------------------------------------------------
# The attribute of a stage module that maps its submodules' names to their layer indices
# in the whole model (see seed_layers).
LAYER_KEYS = "zeropipe_layer_keys"
# Layer seeds live apart from the per-stage ones (keyed by the stage index).
_LAYER_SEED_BASE = 1_000_003


def as_tuple(value: object, what: str) -> tuple[Tensor, ...]:
    """A stage's inputs/outputs as a tuple of tensors, or a clear error."""
    items = value if isinstance(value, (tuple, list)) else (value,)
    for item in items:
        if not isinstance(item, Tensor):
            raise PipelineError(
                f"{what} must be a tensor or a tuple of tensors, got {type(item).__name__}"
            )
    return tuple(items)


@dataclass
class MicrobatchState:
    """What one stage keeps for one microbatch between its actions."""

    inputs: tuple[Tensor, ...] = ()
    outputs: tuple[Tensor, ...] = ()
    loss: Tensor | None = None  # last stage: the loss, the root of backward (seeded by its weight)
    stash: WeightGradStash | None = None
    saved: Saved | None = None  # None after a checkpointed F, or after the backward
    input_grads: tuple[Tensor, ...] | None = None
    sent_early: bool = False  # SEND_B already posted from inside B
    seen: set[str] = field(default_factory=set)


def seed_layers(module: nn.Module, keys: Mapping[str, int]) -> nn.Module:
    """Seed ``module``'s submodules by their layer indices in the whole model; returns it.

    ``keys`` maps a submodule's name (as ``module.named_modules()`` gives it) to
    its index in the whole model, e.g. ``{"0": 4, "1": 5}`` for a slice holding
    a model's layers 4 and 5.  A pipeline then seeds each named submodule by
    ``(seed, step, microbatch, index)`` right before it runs, so its dropout
    masks do not depend on how the model is cut into stages.  Randomness drawn
    outside the named submodules is still seeded by the stage index.
    """
    # On a torch.compile'd module: on the module it wraps, whose submodules the names name.
    setattr(_compat.uncompiled(module), LAYER_KEYS, dict(keys))
    _keyed_modules(module, -1)  # checked now, where the mistake is made
    return module


def _keyed_modules(module: nn.Module, index: int) -> tuple[tuple[int, nn.Module], ...]:
    """The (layer index, submodule) pairs ``module`` names under ``LAYER_KEYS``, checked.

    A ``torch.compile``'d module's names are those of the module it wraps (its own
    carry an ``_orig_mod.`` prefix); the hooks seeding them fire inside the compiled
    forward.
    """
    module = _compat.uncompiled(module)
    keys: Any = getattr(module, LAYER_KEYS, None)
    if keys is None:
        return ()
    where = f"stage {index}'s {LAYER_KEYS}" if index >= 0 else LAYER_KEYS
    if not isinstance(keys, Mapping):
        raise PipelineError(
            f"{where} must map submodule names to layer indices, got {type(keys).__name__}"
        )
    named = dict(module.named_modules())
    out, seen = [], set()
    for name, key in keys.items():
        if not isinstance(name, str) or name not in named:
            raise PipelineError(
                f"{where} names {name!r}, which is not a submodule of the "
                f"{type(module).__name__}; use names as module.named_modules() gives them"
            )
        if isinstance(key, bool) or not isinstance(key, int) or key < 0 or key in seen:
            raise PipelineError(
                f"{where} gives {name!r} the index {key!r}; layer indices are distinct ints >= 0"
            )
        seen.add(key)
        out.append((key, named[name]))
    return tuple(out)


class Stage:
    """One stage of the model: ``module`` plus the seeding keys of its layers."""

    def __init__(self, index: int, module: nn.Module, layer_keys: Sequence[int] | None) -> None:
        self.index = index
        # What seeds its randomness: its index, or for a copy of a stage (DualPipe's second
        # direction) the original's, so that a microbatch draws alike whichever copy runs it.
        self.seed_index = index
        self.module = module
        # One key per child layer (Sequential slice) or None: one key for the stage.
        self.layer_keys = tuple(layer_keys) if layer_keys is not None else None
        # A hand-made module's submodules seeded by their layer index (seed_layers).
        self.keyed = _keyed_modules(module, index) if layer_keys is None else ()
        self.state: dict[int, MicrobatchState] = {}
        # The dtype F and R compute in under torch.autocast (None: none); the pipeline
        # sets it from RuntimeOptions.autocast.  The backward runs outside autocast.
        self.autocast: torch.dtype | None = None
        # The module's prepared linears (zeropipe.autograd.split_backward.split_linears), found once
        # when the pipeline prepares the stage, so a recorded forward does not walk the
        # module again (None: looked up on every forward).  The pipeline may leave some
        # linears plain (Pipeline: PLAIN_BELOW_BYTES); they are not in it.
        self.linears: tuple[nn.Module, ...] | None = None
        # The first stage of a step whose batch is a dict: the names its inputs are passed
        # by, as the model's own keyword arguments (set by the pipeline each step).
        self.input_names: tuple[str, ...] | None = None

    def forward(
        self, inputs: tuple[Tensor, ...], seed: int, step: int, mb: int, device: torch.device
    ) -> tuple[Tensor, ...]:
        """The module on ``inputs`` (F and R both come here), seeded and under autocast."""
        with autocast(device, self.autocast):
            return self._forward(inputs, seed, step, mb, device)

    def _forward(
        self, inputs: tuple[Tensor, ...], seed: int, step: int, mb: int, device: torch.device
    ) -> tuple[Tensor, ...]:
        if self.layer_keys is None:
            seeded(seed, step, mb, self.seed_index, device)
            # A dict batch's first stage takes its inputs by name (input_names).
            names = self.input_names
            call = self.module if names is None else _by_name(self.module, names)
            if not self.keyed:  # a context entered per action costs microseconds: skipped
                return as_tuple(call(*inputs), f"stage {self.index}'s output")
            with self._seeding_layers(seed, step, mb, device):
                return as_tuple(call(*inputs), f"stage {self.index}'s output")
        value: tuple[Tensor, ...] = inputs
        for key, layer in zip(self.layer_keys, self.module.children(), strict=True):
            seeded(seed, step, mb, _LAYER_SEED_BASE + key, device)
            value = as_tuple(layer(*value), f"layer {key}'s output")
        return value

    @contextmanager
    def _seeding_layers(
        self, seed: int, step: int, mb: int, device: torch.device
    ) -> Iterator[None]:
        """Each keyed submodule seeded right before it runs, for this one forward only.

        The hooks are removed afterwards so that the user's own calls of the model
        (outside the pipeline) are not reseeded.
        """
        handles = [
            sub.register_forward_pre_hook(
                lambda _m, _a, k=key: seeded(seed, step, mb, _LAYER_SEED_BASE + k, device)
            )
            for key, sub in self.keyed
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def parameters(self) -> list[nn.Parameter]:
        return list(self.module.parameters())


def _by_name(module: nn.Module, names: tuple[str, ...]) -> Any:
    """``module`` called with its inputs as the keyword arguments ``names``."""
    return lambda *inputs: module(**dict(zip(names, inputs, strict=True)))


def split_layers(
    model: nn.Sequential | Sequence[nn.Module], cut: Sequence[int]
) -> list[nn.Sequential]:
    """The model's layers in consecutive ``nn.Sequential`` stages of ``cut`` layers each."""
    layers = list(model.children()) if isinstance(model, nn.Sequential) else list(model)
    if sum(cut) != len(layers) or min(cut, default=0) < 1:
        raise PipelineError(
            f"cut {list(cut)} must be positive layer counts summing to the model's {len(layers)}"
        )
    out, start = [], 0
    for count in cut:
        out.append(nn.Sequential(*layers[start : start + count]))
        start += count
    return out


def split_sequential(
    model: nn.Sequential, num_stages: int, balance: Sequence[int] | None
) -> list[Stage]:
    """Cut ``model`` into ``num_stages`` consecutive slices (``balance`` = layers per stage).

    Each stage keeps its layers' indices in the whole model, which seed their
    randomness: the same layer draws the same dropout mask whatever the cut.
    """
    count = len(model)
    if balance is None:
        if count < num_stages:
            raise PipelineError(
                f"the nn.Sequential has {count} layer(s), too few for {num_stages} stages; "
                f"use fewer stages (ranks x chunks) or a deeper model"
            )
        # As planning's even_cut (a layer above): the first stages take the remainder.
        base, extra = divmod(count, num_stages)
        balance = [base + (1 if s < extra else 0) for s in range(num_stages)]
    balance = list(balance)
    if len(balance) != num_stages:
        raise PipelineError(
            f"balance {balance} must give {num_stages} positive layer counts summing to the "
            f"model's {count} layers"
        )
    starts = [sum(balance[:s]) for s in range(num_stages)]
    return [
        Stage(s, part, list(range(starts[s], starts[s] + len(part))))
        for s, part in enumerate(split_layers(model, balance))
    ]


def detach_for_stage(tensors: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """Received or handed-over tensors as leaves of this stage's graph (no copy)."""
    return tuple(
        t.detach().requires_grad_(True)
        if torch.is_floating_point(t) or t.is_complex()
        else t.detach()
        for t in tensors
    )


# -- a step's batch cut into microbatches -------------------------------------------
def split_batch(inputs: tuple[Tensor, ...], m: int) -> tuple[list[tuple[Tensor, ...]], list[int]]:
    """``inputs`` cut into ``m`` microbatches along dim 0, and the microbatches' row counts."""
    for k, t in enumerate(inputs):
        if t.dim() == 0:
            name = "the input" if len(inputs) == 1 else f"input {k}"
            raise PipelineError(
                f"{name} is 0-dimensional (a scalar); the batch is cut into microbatches along "
                f"dim 0, so give it a batch dimension (e.g. x.reshape(1) or x.unsqueeze(0))"
            )
    batch = len(inputs[0])
    if any(len(t) != batch for t in inputs):
        raise PipelineError(f"inputs disagree on the batch size: {[len(t) for t in inputs]}")
    if batch < m:
        raise PipelineError(
            f"a batch of {batch} cannot be cut into {m} microbatches; use a larger batch"
        )
    parts = [torch.tensor_split(t, m, dim=0) for t in inputs]
    micro = [tuple(p[i] for p in parts) for i in range(m)]
    return micro, [len(mb[0]) for mb in micro]


def split_target(target: Tensor, m: int, sizes: list[int]) -> list[Tensor]:
    """``target`` cut like the inputs: one row per input row."""
    if not isinstance(target, Tensor):
        raise PipelineError(f"target must be a tensor, got {type(target).__name__}")
    if target.dim() == 0:
        raise PipelineError(
            "the target is 0-dimensional (a scalar); it is cut into microbatches along dim 0 "
            "like the inputs, so give it one row per input row (e.g. y.reshape(1))"
        )
    targets = list(torch.tensor_split(target, m, dim=0))
    if [len(t) for t in targets] != sizes:
        raise PipelineError(f"target has {len(target)} rows but inputs have {sum(sizes)}")
    return targets


def batch_names(
    inputs: Tensor | Sequence[Tensor] | Mapping[str, Tensor],
) -> tuple[tuple[str, ...] | None, Tensor | Sequence[Tensor]]:
    """A dict batch as (its names, its tensors in that order); anything else as (None, itself).

    A dict's entries are the first stage's keyword arguments (a split Hugging Face
    model's ``input_ids``, ``attention_mask``, ``position_ids``), each cut along dim 0.
    """
    if not isinstance(inputs, Mapping):
        return None, inputs
    if not inputs:
        raise PipelineError("the batch is an empty dict: give the first stage's inputs by name")
    bad = [str(k) for k, v in inputs.items() if not isinstance(k, str) or not isinstance(v, Tensor)]
    if bad:
        raise PipelineError(
            f"a dict batch maps argument names to tensors; these entries are not: {bad}"
        )
    return tuple(inputs), tuple(inputs.values())


Outputs = Tensor | tuple[Tensor, ...] | list[Tensor | tuple[Tensor, ...]]
"""What ``eval_step`` returns without a target: the last stage's output (a tensor, or a tuple
of several), or for :class:`Microbatches` a list of them, one per microbatch."""


def step_microbatches(
    inputs: Tensor | Sequence[Tensor] | Mapping[str, Tensor] | Microbatches,
    target: Tensor | None,
    m: int,
    device: torch.device | None,
    rows_weighted: bool,
) -> tuple[
    tuple[str, ...] | None,
    list[tuple[Tensor, ...]],
    list[int],
    list[Tensor] | None,
    tuple[object, ...],
]:
    """A step's microbatches: a dict batch's names, each microbatch's inputs, rows and target,
    and the step's signature (:func:`step_signature`).  A batch is cut into ``m``
    (:func:`split_step`); :class:`Microbatches` are checked as given (``rows_weighted``: the
    loss is a mean weighted by rows, refused for targets that differ beyond their rows)."""
    if not isinstance(inputs, Microbatches):
        names, batch = batch_names(inputs)
        micro, sizes, targets = split_step(batch, target, m, device)
        return names, micro, sizes, targets, step_signature(micro, target, names)
    if target is not None:
        raise PipelineError(
            "with Microbatches the targets are given inside it: "
            "pipe.step(Microbatches(inputs=[...], targets=[...])), no second argument"
        )
    names, micro, sizes, targets = given_step(inputs, m, device)
    if rows_weighted:
        refuse_rows_weighting(targets)
    return names, micro, sizes, targets, given_signature(micro, targets, names)


def split_step(
    inputs: Tensor | Sequence[Tensor], target: Tensor | None, m: int, device: torch.device | None
) -> tuple[list[tuple[Tensor, ...]], list[int], list[Tensor] | None]:
    """A step's inputs and target, on ``device`` (when given), cut into ``m`` microbatches."""
    if device is not None:  # the caller's batch, on the device the stages compute on
        inputs = tuple(t.to(device) for t in as_tuple(inputs, "inputs"))
        if isinstance(target, Tensor):
            target = target.to(device)
    micro_inputs, sizes = split_batch(as_tuple(inputs, "inputs"), m)
    targets = None if target is None else split_target(target, m, sizes)
    return micro_inputs, sizes, targets


def step_signature(
    micro_inputs: list[tuple[Tensor, ...]],
    target: Tensor | None,
    names: tuple[str, ...] | None = None,
) -> tuple[object, ...]:
    """The shapes and dtypes of a step's microbatches and target (what boundary shapes follow),
    and the names of a dict batch's inputs."""
    first, last = micro_inputs[0], micro_inputs[-1]
    meta = tuple((t.dtype, tuple(t.shape)) for t in (*first, *last))
    return (meta, None if target is None else (target.dtype, tuple(target.shape)), names)


# -- a step's microbatches, given already made --------------------------------------
MicrobatchInput = Tensor | Sequence[Tensor] | Mapping[str, Tensor]


@dataclass(frozen=True)
class Microbatches:
    """A step's microbatches, already made, each its own shape::

        batches = zeropipe.Microbatches(inputs=[x0, x1, x2], targets=[y0, y1, y2])
        loss = pipe.step(batches)

    ``inputs[i]`` is microbatch ``i`` as ``Pipeline.step`` takes a batch: a tensor, a tuple
    of tensors (the first stage's positional inputs) or a dict of tensors (its keyword
    inputs); every microbatch alike in kind, count and names, with its own rows and
    sequence length.  ``targets[i]`` is its target, one row per input row (``None``: for
    ``eval_step``'s outputs, one per microbatch).  There are as many as the pipeline's
    microbatches.  Boundary shapes are learnt per microbatch, and the loss weights each
    microbatch by what it counts, so the step's loss and gradients are those of the
    unsplit model run on the same sequences.
    """

    inputs: Sequence[MicrobatchInput]
    targets: Sequence[Tensor] | None = None

    def __post_init__(self) -> None:
        inputs = self.inputs
        if isinstance(inputs, (Tensor, Mapping)) or not isinstance(inputs, Sequence):
            raise PipelineError(
                f"Microbatches(inputs=...) takes one batch per microbatch (a list), got "
                f"{type(inputs).__name__}"
            )
        object.__setattr__(self, "inputs", tuple(inputs))
        if not self.inputs:
            raise PipelineError("Microbatches(inputs=...) holds no microbatch")
        if self.targets is not None:
            targets = self.targets
            if isinstance(targets, Tensor) or not isinstance(targets, Sequence):
                raise PipelineError(
                    f"Microbatches(targets=...) takes one target per microbatch (a list), got "
                    f"{type(targets).__name__}"
                )
            object.__setattr__(self, "targets", tuple(targets))
            if len(self.targets) != len(self.inputs):
                raise PipelineError(
                    f"Microbatches has {len(self.inputs)} inputs but {len(self.targets)} "
                    f"targets; give one target per microbatch"
                )

    def __len__(self) -> int:
        return len(self.inputs)


def given_step(
    batch: Microbatches, m: int, device: torch.device | None
) -> tuple[tuple[str, ...] | None, list[tuple[Tensor, ...]], list[int], list[Tensor] | None]:
    """Microbatches given already made, checked and on ``device`` (when given): a dict
    batch's names, each microbatch's inputs, its rows, and its target."""
    if len(batch) != m:
        raise PipelineError(
            f"Microbatches holds {len(batch)} microbatches but the pipeline runs {m} per step "
            f"(its schedule's); give {m}, or build the pipeline with microbatches={len(batch)}"
        )
    names: tuple[str, ...] | None = None
    micro: list[tuple[Tensor, ...]] = []
    sizes: list[int] = []
    for i, given in enumerate(batch.inputs):
        mb_names, tensors = batch_names(given)
        inputs = as_tuple(tensors, f"microbatch {i}'s inputs")
        if i == 0:
            names = mb_names
        elif mb_names != names or len(inputs) != len(micro[0]):
            raise PipelineError(
                f"microbatch {i}'s inputs are {_kind_of(mb_names, inputs)}, but microbatch "
                f"0's are {_kind_of(names, micro[0])}; every microbatch takes the same inputs"
            )
        sizes.append(_rows_of(inputs, i))
        micro.append(inputs if device is None else tuple(t.to(device) for t in inputs))
    targets = None
    if batch.targets is not None:
        targets = []
        for i, target in enumerate(batch.targets):
            if not isinstance(target, Tensor) or target.dim() == 0 or len(target) != sizes[i]:
                got = _describe_target(target)
                raise PipelineError(
                    f"microbatch {i}'s target must be a tensor of one row per input row "
                    f"({sizes[i]}), got {got}"
                )
            targets.append(target if device is None else target.to(device))
    return names, micro, sizes, targets


def _rows_of(inputs: tuple[Tensor, ...], i: int) -> int:
    """Microbatch ``i``'s rows: dim 0 of each input, the same for all."""
    if any(t.dim() == 0 for t in inputs):
        raise PipelineError(
            f"microbatch {i} has a 0-dimensional input (a scalar); give every input a batch "
            f"dimension (rows along dim 0)"
        )
    rows = {len(t) for t in inputs}
    if len(rows) != 1 or 0 in rows:
        raise PipelineError(
            f"microbatch {i}'s inputs must share one row count along dim 0, at least one, got "
            f"{[len(t) for t in inputs]}"
        )
    return rows.pop()


def _kind_of(names: tuple[str, ...] | None, inputs: tuple[Tensor, ...]) -> str:
    return f"a dict ({', '.join(names)})" if names is not None else f"{len(inputs)} tensor(s)"


def _describe_target(target: object) -> str:
    if not isinstance(target, Tensor):
        return type(target).__name__
    return f"{str(target.dtype).removeprefix('torch.')}{list(target.shape)}"


def given_signature(
    micro_inputs: list[tuple[Tensor, ...]],
    targets: list[Tensor] | None,
    names: tuple[str, ...] | None,
) -> tuple[object, ...]:
    """:func:`step_signature` of microbatches given already made: every microbatch's shapes
    and dtypes, inputs and target, so the boundary shapes each follows are learnt anew
    whenever any of them changes (``"microbatches"`` first marks the form)."""
    inputs = tuple(tuple((t.dtype, tuple(t.shape)) for t in mb) for mb in micro_inputs)
    target = None if targets is None else tuple((t.dtype, tuple(t.shape)) for t in targets)
    return ("microbatches", inputs, target, names)


def refuse_rows_weighting(targets: list[Tensor] | None) -> None:
    """A mean weighted by rows is exact only when every row counts as many items: refused
    for microbatches whose targets differ beyond their rows (e.g. in sequence length)."""
    if targets is None or len({tuple(t.shape[1:]) for t in targets}) < 2:
        return
    shapes = ", ".join(_describe_target(t) for t in targets[:4])
    raise PipelineError(
        f"the microbatches' targets differ beyond their rows ({shapes}, ...), so their rows "
        f"count different numbers of items, and a loss_fn returning a mean is weighted by "
        f"rows, which cannot be exact; pass zeropipe.causal_lm_loss, a torch loss module "
        f"(nn.CrossEntropyLoss()) or F.cross_entropy itself, or a function returning "
        f"(loss_sum, count) with Pipeline(loss_count=...)"
    )
