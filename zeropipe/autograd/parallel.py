r"""Parallel branches: run independent branches' forward *and* backward concurrently.

Within one ``backward()`` call the autograd engine runs all CPU nodes on the
calling thread, one after another, so independent branches (experts, towers)
never overlap even when cores are idle.  :func:`parallel_map` (and the module
form :class:`ParallelBranches`) wraps the branches in one autograd node::

    forward (pool threads)                     backward (pool threads)
    x0 -> detach -> f0 -> y0 --\               g0 -> grad(y0; x0', W0) --\
    x1 -> detach -> f1 -> y1 ---+-> [node] ->  g1 -> grad(y1; x1', W1) ---+-> dx0, dx1, dW0, dW1
                                   y0, y1                                     (one return)

Forward runs each branch on a pool thread on detached inputs with grad
enabled, so each branch records its own private graph.  The graph of every
branch is then walked once to find the leaves it reaches (parameters, and
any leaf it closed over); those leaves and the inputs that require grad
become the inputs of one custom autograd node whose outputs are the branch
outputs.  Backward of that node runs ``torch.autograd.grad`` of every branch
concurrently, w.r.t. its detached inputs and its leaves, and returns the
results to the engine.  Hence:

- gradients equal plain autograd's: each branch differentiates exactly its
  own ops; nothing is accumulated inside the branch, the engine accumulates
  into ``.grad`` once (through AccumulateGrad, so tensor hooks and
  post-accumulate-grad hooks run on the engine's thread as usual).  Leaves
  shared by several branches are summed here, in reverse branch order;
  floating-point sums of three or more parts can then differ from plain
  autograd in the last bits;
- only what the engine asks for is computed (``ctx.needs_input_grad``):
  ``torch.autograd.grad(loss, x)`` does not touch parameters;
- an exception in a branch, forward or backward, is raised as
  :class:`BranchError` naming the branch, after the other branches finished.

Branch contract: a branch may use its inputs and any leaf tensor
(parameters) freely.  A *non-leaf* tensor from outside the branch that needs
grad must be passed as an input: a branch's backward cannot reach the outer
graph.  This is checked (``check_captures``) by sequence numbers: nodes a
branch creates are numbered from its thread's counter inside a known window.
Branches must not modify their inputs in place; they are detached leaves.
Backward works once (``retain_graph=True`` on the outer backward is not
supported: the branches' graphs are freed) and is not differentiable again.

Threads.  Branches run on a :class:`~zeropipe.autograd.branch_pool.BranchPool`
(:mod:`zeropipe.autograd.branch_pool`: the calling thread works too, so
nested calls cannot deadlock); without an explicit pool,
:func:`default_branch_pool` is used.  Grad mode, inference mode, autocast
and the innermost ``saved_tensors_hooks`` are thread-local in torch; they
are captured in the caller and re-entered in each branch (autocast without
its weight-cast cache, whose shared casts would join the branches' graphs).
Intra-op thread counts are not touched (set them yourself).

Accelerators.  If the branches' tensors live on a device with streams, each
branch's forward runs on its own side stream (waiting on the caller's stream
first; the caller's stream waits on all side streams after), so kernels of
different branches overlap on the device.  Backward then runs all branches
in *one* ``torch.autograd.grad`` call on the engine's device thread: the
engine runs each backward op on the stream of its forward op, which keeps
the overlap, whereas per-branch calls from pool threads would queue on the
engine's single device thread while it waits for them.  (This path was not
run on a GPU yet.)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.function import FunctionCtx, once_differentiable

from zeropipe.autograd.branch_pool import (
    BranchError,
    BranchPool,
    ParallelMapError,
    default_branch_pool,
)
from zeropipe.autograd.priority import original_sequence_nr
from zeropipe.base import _compat

__all__ = [
    "BranchError",
    "BranchPool",
    "ParallelBranches",
    "ParallelMapError",
    "default_branch_pool",
    "parallel_map",
]

# --- thread-local state handed to branch threads ----------------------------


@dataclass(frozen=True)
class _ThreadState:
    grad: bool
    inference: bool
    autocast: tuple[tuple[str, bool, torch.dtype], ...]
    saved_hooks: tuple[Callable[..., Any], Callable[..., Any]] | None

    @classmethod
    def capture(cls, device_types: Iterable[str]) -> _ThreadState:
        autocast = tuple(
            (d, True, torch.get_autocast_dtype(d))
            for d in dict.fromkeys(["cpu", *device_types])
            if _autocast_on(d)
        )
        return cls(
            torch.is_grad_enabled(),
            torch.is_inference_mode_enabled(),
            autocast,
            _compat.top_saved_tensors_hooks(),
        )

    @contextmanager
    def entered(self) -> Iterator[None]:
        with ExitStack() as stack:
            if self.inference:
                stack.enter_context(torch.inference_mode(True))
            stack.enter_context(torch.set_grad_enabled(self.grad))
            for device_type, enabled, dtype in self.autocast:
                if enabled:
                    # Without the weight-cast cache: a cast cached by another
                    # branch (or before the call) would tie that graph to this one.
                    stack.enter_context(
                        torch.autocast(device_type, dtype=dtype, cache_enabled=False)
                    )
            if self.saved_hooks is not None:
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(*self.saved_hooks))
            yield


def _autocast_on(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device type autocast does not know (meta)
        return False


class _Streams:
    """Side streams for one call: branch i waits for the caller, the caller waits for all."""

    def __init__(self, pool: BranchPool, device: torch.device, n: int) -> None:
        self.caller = _compat.current_stream(device)
        self.side = pool.side_streams(device, n)

    @contextmanager
    def branch(self, i: int, tensors: Iterable[Tensor]) -> Iterator[None]:
        stream = self.side[i]
        stream.wait_stream(self.caller)
        for t in tensors:
            if t.device.type != "cpu":
                # Freed by the caller later, reused only after this branch used it.
                _compat.record_stream(t, stream)
        with _compat.stream_context(stream):
            yield

    def join(self, outputs: Iterable[Tensor]) -> None:
        for stream in self.side:
            self.caller.wait_stream(stream)
        for t in outputs:
            if t.device.type != "cpu":
                _compat.record_stream(t, self.caller)


# --- one call's bookkeeping -------------------------------------------------


@dataclass
class _Branch:
    """A branch after forward: detached inputs, flat outputs (with graph), leaves reached."""

    inputs: tuple[Any, ...]
    flat: list[Tensor]
    rebuild: Callable[[Sequence[Tensor]], Any]
    leaves: list[Tensor]


@dataclass
class _Run:
    branches: list[_Branch]
    names: list[str]
    pool: BranchPool
    # Function input k < len(input_slots) is branch i's positional argument j.
    input_slots: list[tuple[int, int]]
    leaves: list[Tensor]
    # For each branch, the indices into ``leaves`` it reaches.
    branch_leaves: list[list[int]] = field(default_factory=list)
    on_device: bool = False


def _as_args(x: Any) -> tuple[Any, ...]:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _flatten(out: Any, name: str) -> tuple[list[Tensor], Callable[[Sequence[Tensor]], Any]]:
    if isinstance(out, Tensor):
        return [out], lambda flat: flat[0]
    if isinstance(out, (tuple, list)) and all(isinstance(o, Tensor) for o in out):
        kind = type(out)
        return list(out), lambda flat: kind(flat) if kind in (tuple, list) else tuple(flat)
    raise ParallelMapError(
        f"branch {name} returned {type(out).__name__}; under grad a branch must return a "
        "Tensor or a tuple/list of Tensors"
    )


def _detach(x: Any) -> Any:
    if not isinstance(x, Tensor):
        return x
    d = x.detach()
    return d.requires_grad_(True) if x.requires_grad else d


def _find_leaves(flat: list[Tensor], inputs: tuple[Any, ...], lo: int, check: bool) -> list[Tensor]:
    """Leaves a branch's graph reaches (not its own inputs); checks it stays inside itself.

    Nodes the branch created are numbered ``lo <= nr < now`` by this thread's
    counter; "now" is read after the forward so that nodes torch makes lazily
    while we walk (regenerated view nodes) still count as the branch's own.
    """
    own = {id(x) for x in inputs if isinstance(x, Tensor)}
    leaves: dict[int, Tensor] = {}
    for o in flat:
        if o.requires_grad and o.grad_fn is None and id(o) not in own:
            leaves.setdefault(id(o), o)  # a branch returning a parameter as is
    seen: set[Any] = set()
    stack = [o.grad_fn for o in flat if o.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if _compat.is_accumulate_grad(node):
            var = node.variable  # type: ignore[attr-defined]
            if id(var) not in own:
                leaves.setdefault(id(var), var)
            continue
        if check:
            nr = original_sequence_nr(node)
            if nr != _compat.MAX_SEQUENCE_NR and not lo <= nr < _compat.thread_sequence_nr():
                raise ParallelMapError(
                    f"the branch's graph reaches {node.name()}, which the branch did not "
                    "create: it uses a non-leaf tensor from outside that requires grad. "
                    "Pass that tensor as an input of the branch (or, if the branch itself "
                    "made the node on another thread, use check_captures=False)"
                )
        stack.extend(n for n, _ in node.next_functions if n is not None)
    return list(leaves.values())


# --- the autograd node ------------------------------------------------------


class _ParallelFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, run: _Run, *_tensors: Tensor) -> tuple[Tensor, ...]:
        # The branches already ran; this node only connects their outputs to
        # the inputs and leaves they depend on.
        ctx.run = run  # type: ignore[attr-defined]
        ctx.set_materialize_grads(False)
        flat = [o for b in run.branches for o in b.flat]
        outs = tuple(o.detach() for o in flat)
        ctx.mark_non_differentiable(
            *(d for d, o in zip(outs, flat, strict=True) if not o.requires_grad)
        )
        return outs

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        run: _Run | None = ctx.run
        if run is None:
            raise ParallelMapError(
                "backward through a parallel_map node ran twice; its branches' graphs are "
                "freed after the first backward (retain_graph=True is not supported)"
            )
        ctx.run = None
        needs = ctx.needs_input_grad[1:]
        n_in = len(run.input_slots)
        need_input = {run.input_slots[k] for k in range(n_in) if needs[k]}
        need_leaf = [needs[n_in + k] for k in range(len(run.leaves))]

        # What each branch differentiates: outputs with a gradient, w.r.t.
        # wanted detached inputs and wanted leaves.
        jobs: list[tuple[list[Tensor], list[Tensor], list[Tensor], list[Any]]] = []
        pos = 0
        for i, b in enumerate(run.branches):
            pairs = [
                (o, g)
                for o, g in zip(b.flat, grads[pos : pos + len(b.flat)], strict=True)
                if g is not None and o.requires_grad
            ]
            pos += len(b.flat)
            keys: list[Any] = [("in", j) for j in range(len(b.inputs)) if (i, j) in need_input]
            keys += [("leaf", k) for k in run.branch_leaves[i] if need_leaf[k]]
            wrt = [b.inputs[j] if kind == "in" else run.leaves[j] for kind, j in keys]
            jobs.append(([o for o, _ in pairs], [g for _, g in pairs], wrt, keys))

        found = _device_backward(run, jobs) if run.on_device else _pool_backward(run, jobs)

        result: list[Tensor | None] = [None] * (n_in + len(run.leaves))
        slot_of = {s: k for k, s in enumerate(run.input_slots)}
        # Reverse branch order: the order plain autograd tends to reach a shared leaf in.
        for i in reversed(range(len(run.branches))):
            for (kind, j), g in zip(jobs[i][3], found[i], strict=True):
                if g is None:
                    continue
                k = slot_of[(i, j)] if kind == "in" else n_in + j
                prev = result[k]
                result[k] = g if prev is None else prev + g
        return (None, *result)


def _grad_job(
    outs: list[Tensor], grads: list[Tensor], wrt: list[Tensor]
) -> Sequence[Tensor | None]:
    if not outs or not wrt:
        return [None] * len(wrt)
    return torch.autograd.grad(outs, wrt, grads, allow_unused=True)


def _pool_backward(run: _Run, jobs: list[Any]) -> list[Sequence[Tensor | None]]:
    tasks = [lambda job=job: _grad_job(job[0], job[1], job[2]) for job in jobs]
    return run.pool.run(tasks, names=run.names, phase="backward")


def _device_backward(run: _Run, jobs: list[Any]) -> list[Sequence[Tensor | None]]:
    # One call on the engine's device thread; see "Accelerators" above.
    outs = [o for job in jobs for o in job[0]]
    grads = [g for job in jobs for g in job[1]]
    unique: dict[int, Tensor] = {}
    for job in jobs:
        for t in job[2]:
            unique.setdefault(id(t), t)
    wrt = list(unique.values())
    try:
        got = dict(zip(unique, _grad_job(outs, grads, wrt), strict=True))
    except Exception as exc:
        raise BranchError(
            f"backward of the branches ({', '.join(run.names)}) failed: "
            f"{type(exc).__name__}: {exc}",
            branch=None,
            name="all",
            phase="backward",
        ) from exc
    # A shared leaf got the engine's sum once; hand it to one branch only.
    handed: set[int] = set()
    found: list[Sequence[Tensor | None]] = []
    for job in jobs:
        row: list[Tensor | None] = []
        for t in job[2]:
            row.append(None if id(t) in handed else got[id(t)])
            handed.add(id(t))
        found.append(row)
    return found


# --- public entry points ----------------------------------------------------

Branch = Callable[..., Any]


def _name(fn: Branch) -> str:
    if isinstance(fn, nn.Module):
        return type(fn).__name__
    return str(getattr(fn, "__qualname__", type(fn).__name__))


def _device(args: list[tuple[Any, ...]], fns: list[Branch]) -> torch.device:
    for a in args:
        for x in a:
            if isinstance(x, Tensor):
                return x.device
    for f in fns:
        if isinstance(f, nn.Module):
            for p in f.parameters():
                return p.device
    return torch.device("cpu")


def parallel_map(
    fn: Branch | Sequence[Branch],
    inputs: Sequence[Any],
    *,
    pool: BranchPool | None = None,
    check_captures: bool = True,
) -> list[Any]:
    """Run branches concurrently, forward and backward; one output per input, in input order.

    ``fn`` is one callable applied to every input, or a sequence of callables
    (e.g. an ``nn.ModuleList`` of experts), one per input.  Each input is a
    tensor, or a tuple/list of positional arguments.  Under grad, a branch
    returns a tensor or a tuple/list of tensors; under ``torch.no_grad`` it may
    return anything and no autograd node is made.  See the module docstring
    for the branch contract and what is guaranteed.
    """
    if isinstance(fn, (list, tuple, nn.ModuleList)):
        fns: list[Branch] = list(fn)
        if len(fns) != len(inputs):
            raise ParallelMapError(f"{len(fns)} branches but {len(inputs)} inputs")
    elif callable(fn):
        fns = [fn] * len(inputs)
    else:
        raise ParallelMapError(f"fn must be a callable or a sequence of callables, not {fn!r}")
    if not fns:
        return []
    pool = pool if pool is not None else default_branch_pool()
    names = [_name(f) for f in fns]
    args = [_as_args(x) for x in inputs]
    device = _device(args, fns)
    streams = _Streams(pool, device, len(fns)) if _compat.streams_supported(device) else None
    state = _ThreadState.capture([device.type])
    grad = state.grad

    def forward(i: int) -> Any:
        with state.entered(), _stream_for(streams, i, args[i]):
            if not grad:
                return fns[i](*args[i])
            inputs_i = tuple(_detach(x) for x in args[i])
            lo = _compat.thread_sequence_nr()
            flat, rebuild = _flatten(fns[i](*inputs_i), names[i])
            leaves = _find_leaves(flat, inputs_i, lo, check_captures)
            return _Branch(inputs_i, flat, rebuild, leaves)

    tasks = [functools.partial(forward, i) for i in range(len(fns))]
    done = pool.run(tasks, names=names, phase="forward")
    if streams is not None:
        flat_out = [o for b in done for o in (b.flat if grad else _tensor_leaves(b))]
        streams.join(flat_out)
    if not grad:
        return done

    branches: list[_Branch] = done
    run = _Run(branches, names, pool, [], [], on_device=streams is not None)
    fn_inputs: list[Tensor] = []
    for i in range(len(fns)):
        for j, x in enumerate(args[i]):
            if isinstance(x, Tensor) and x.requires_grad:
                run.input_slots.append((i, j))
                fn_inputs.append(x)
    leaf_index: dict[int, int] = {}
    for b in branches:
        ids = []
        for leaf in b.leaves:
            if id(leaf) not in leaf_index:
                leaf_index[id(leaf)] = len(run.leaves)
                run.leaves.append(leaf)
            ids.append(leaf_index[id(leaf)])
        run.branch_leaves.append(ids)
    if not any(o.requires_grad for b in branches for o in b.flat):
        return [b.rebuild(b.flat) for b in branches]

    outs = _ParallelFunction.apply(run, *fn_inputs, *run.leaves)
    result, pos = [], 0
    for b in branches:
        result.append(b.rebuild(outs[pos : pos + len(b.flat)]))
        pos += len(b.flat)
    return result


def _stream_for(streams: _Streams | None, i: int, args: tuple[Any, ...]) -> Any:
    if streams is None:
        return nullcontext()
    return streams.branch(i, (x for x in args if isinstance(x, Tensor)))


def _tensor_leaves(out: Any) -> list[Tensor]:
    if isinstance(out, Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensor_leaves(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _tensor_leaves(o)]
    return []


class ParallelBranches(nn.Module):
    """Independent sub-modules run concurrently, forward and backward (see :func:`parallel_map`).

    ``forward(x)`` with one tensor gives it to every branch (towers);
    with a list or tuple, entry i goes to branch i (experts).  Returns the
    list of branch outputs in branch order.
    """

    def __init__(
        self,
        branches: Iterable[nn.Module],
        *,
        pool: BranchPool | None = None,
        check_captures: bool = True,
    ) -> None:
        super().__init__()
        self.branches = nn.ModuleList(branches)
        self.pool = pool
        self.check_captures = check_captures

    def forward(self, inputs: Tensor | Sequence[Any]) -> list[Any]:
        per_branch = [inputs] * len(self.branches) if isinstance(inputs, Tensor) else inputs
        return parallel_map(
            self.branches, per_branch, pool=self.pool, check_captures=self.check_captures
        )
