r"""Backward priority: make chosen parts of a backward pass run before (or after) other ready work.

PyTorch's autograd engine keeps the nodes that are *ready* (all their
incoming gradients have arrived) in a priority queue and always runs the one
with the highest **sequence number** next.  Sequence numbers come from a
thread-local counter bumped for every node created, so by default backward is
roughly "last created, first run".  PR 114120 made the number settable
(``Node._set_sequence_nr``); :func:`prioritize` uses it so that, e.g., the
backward of an all-to-all (whose result must be communicated) is kicked off
before an unrelated dense branch that happens to have been created later::

    forward order:   x --> a2a --> A1 --> A2 --\
                     x --> dense1 --> dense2 ---+--> loss
    plain backward:  loss, dense2', dense1', A2', A1', a2a'   (dense created later: runs first)
    prioritize(A2):  loss, A2', A1', a2a', dense2', dense1'   (A-chain raised above the rest)

What is marked.  ``prioritize(t)`` marks ``t.grad_fn`` and every node reachable
from it through ``next_functions`` (its whole backward subgraph toward the
leaves), except nodes at or below ``stop_at`` tensors.  Marking the subgraph,
not only ``t.grad_fn``, matters: the engine picks one ready node at a time, so
raising just the first node of a chain would run that node first and then let
the rest of the chain compete at its old priority.  :func:`prioritize_outputs`
marks each forward's outputs of a module, stopping at the module's inputs, so
only the nodes the module created are marked.

Early marks get ``level * 2**56 + (old % 2**56)``: above every unmarked node,
higher levels above lower ones, and the old relative order kept inside a
level (so memory behaviour within the marked part does not change).  Late
marks get ``0, 1, ..., n-1`` in their old relative order: below every unmarked
node whose number is ``>= n``, which is every node except the first ``n``
created on some thread.  The original number is kept in ``node.metadata``, so
marking again (or late after early) starts from it.

Guaranteed (eager autograd engine, torch versions in :mod:`zeropipe.base._compat`):

- when the engine takes the next node from a ready queue, a marked node that
  is ready runs before every unmarked node that is ready in the same queue;
- gradients are unchanged: only the order of independent nodes changes, and
  each node's own computation is untouched.  The one visible effect: a tensor
  that receives gradient from three or more consumers adds them in run order,
  so float results can differ in the last bits (as between any two orders
  the engine may legally pick); with one or two consumers they are bitwise
  equal.

Not guaranteed:

- a marked node does not become ready sooner: it still waits for all of its
  incoming gradients, and a running node is never pre-empted.  Mark up to
  where the branch meets the rest: if ``y = mod(x)`` is marked but
  ``y.sum()`` is not, that unmarked sum waits behind the other, later
  created branch, and so does everything marked below it;
- the engine keeps one ready queue per device (CPU work on the thread that
  called backward, each accelerator on its own thread): priority orders
  nodes within one queue, not across devices;
- reentrant backward (e.g. reentrant checkpointing) runs its nested graph
  first regardless of numbers; AccumulateGrad nodes always run as soon as
  ready (their number is the maximum), so they are never marked;
- compiled autograd ignores sequence numbers: marking then warns (or, with
  ``strict=True``, raises :class:`PriorityUnsupportedError`), as it does on a
  torch without ``_set_sequence_nr``.  Compiled autograd switched on only
  *after* marking cannot be seen at marking time; call
  :func:`check_priority_support` where backward runs;
- marks must be made before backward starts: changing a number while a node
  sits in the engine's queue corrupts the queue's order (not its results);
- the profiler links forward and backward ops by sequence number; marked
  nodes lose that link.

Inspection: :func:`record_backward_order` records the order (and start/end
times) in which nodes actually ran, through node pre- and post-hooks;
:func:`predict_backward_order` replays the engine's rule (dependencies plus
the priority queue) without running anything, for CPU graphs.
"""

from __future__ import annotations

import heapq
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeAlias, cast

import torch
from torch import Tensor, nn
from torch.autograd.graph import Node
from torch.utils.hooks import RemovableHandle

from zeropipe.base import _compat
from zeropipe.core.errors import ZeropipeError

__all__ = [
    "MAX_PRIORITY_LEVEL",
    "BackwardOrder",
    "NodeEvent",
    "PriorityError",
    "PriorityMark",
    "PriorityNotAppliedWarning",
    "PriorityUnsupportedError",
    "check_priority_support",
    "original_sequence_nr",
    "predict_backward_order",
    "prioritize",
    "prioritize_outputs",
    "record_backward_order",
]

# One band per level; 2**56 numbers per band is far more nodes than a
# process creates on one thread, and 254 bands keep the top of the last band
# below UINT64_MAX, which AccumulateGrad owns.
_BAND = 2**56
MAX_PRIORITY_LEVEL = 254

# Where the number a node had before zeropipe touched it is remembered.
_ORIGINAL_KEY = "zeropipe.original_sequence_nr"

# A tensor or nested tuples/lists/dicts of tensors; anything else in it is ignored.
Target: TypeAlias = "Tensor | Iterable[Any] | Mapping[Any, Any]"


class PriorityError(ZeropipeError, ValueError):
    """A priority request is malformed (level out of range, a tensor that needs no gradient)."""


class PriorityUnsupportedError(ZeropipeError, RuntimeError):
    """Priority cannot take effect here (``strict=True``); the message says why."""


class PriorityNotAppliedWarning(UserWarning):
    """Priority was requested but will not change the backward order; the message says why."""


@dataclass(frozen=True)
class PriorityMark:
    """What :func:`prioritize` did.  Holds no reference to the graph, so keeping it leaks nothing."""

    applied: bool
    nodes: int
    late: bool
    level: int
    reason: str = ""


# --- graph helpers ----------------------------------------------------------


def _metadata(node: Node) -> dict[str, Any]:
    # ``metadata`` is a per-node dict attribute at runtime; the stub declares it a method.
    return cast(dict[str, Any], node.metadata)


def original_sequence_nr(node: Node) -> int:
    """The number the engine gave ``node`` at creation, before any priority mark.

    :func:`prioritize` renumbers nodes and remembers each one's original number
    in the node's metadata; code that reasons about *when* a node was created
    (e.g. :mod:`zeropipe.autograd.parallel`, checking which branch made it)
    must read this, not the current sequence number.
    """
    meta = _metadata(node)
    if _ORIGINAL_KEY in meta:
        return int(meta[_ORIGINAL_KEY])
    return _compat.get_sequence_nr(node)


def _tensors(target: Any) -> list[Tensor]:
    """Every tensor in ``target`` (a tensor, or nested tuples/lists/dicts of them)."""
    if isinstance(target, Tensor):
        return [target]
    if isinstance(target, Mapping):
        return [t for v in target.values() for t in _tensors(v)]
    if isinstance(target, (list, tuple)):
        return [t for v in target for t in _tensors(v)]
    return []


def _graph_nodes(roots: Iterable[Node], stop: Iterable[Node] = ()) -> list[Node]:
    """Nodes reachable from ``roots`` through ``next_functions``, not entering ``stop``.

    Iterative, because graphs of deep models overflow Python's recursion limit.
    """
    seen: set[Node] = set(stop)
    order: list[Node] = []
    stack = [r for r in roots if r not in seen]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        order.append(node)
        stack.extend(n for n, _ in node.next_functions if n is not None and n not in seen)
    return order


# --- support checks ---------------------------------------------------------


def _unsupported_reason(node: Node | None) -> str | None:
    if node is not None and not _compat.sequence_nr_settable(node):
        return (
            f"torch {torch.__version__} has no Node._set_sequence_nr "
            "(added in torch 2.2 by PR 114120)"
        )
    return _compat.compiled_autograd_reason()


def _not_applied(reason: str, strict: bool) -> None:
    message = f"backward priority is not applied: {reason}; the backward order stays the default"
    if strict:
        raise PriorityUnsupportedError(message)
    warnings.warn(message, PriorityNotAppliedWarning, stacklevel=3)


def check_priority_support(*, strict: bool = False) -> bool:
    """Whether priorities take effect in the backward about to run here.

    Call it where backward runs if compiled autograd may be switched on after
    marking.  Warns (or with ``strict`` raises) when they do not.
    """
    probe = torch.zeros((), requires_grad=True).clone().grad_fn
    reason = _unsupported_reason(probe)
    if reason is None:
        return True
    _not_applied(reason, strict)
    return False


# --- marking ----------------------------------------------------------------


def prioritize(
    target: Target,
    *,
    late: bool = False,
    level: int = 1,
    stop_at: Target = (),
    strict: bool = False,
) -> PriorityMark:
    """Make the backward of ``target`` run before (or with ``late``, after) other ready work.

    ``target`` is a tensor or a (nested) collection of tensors; their
    ``grad_fn`` and the backward subgraph below it are marked, except what
    lies at or below the ``grad_fn`` of ``stop_at`` tensors.  Leaf tensors
    have nothing to mark.  ``level`` (1..:data:`MAX_PRIORITY_LEVEL`) orders
    several early marks among themselves: higher first.  Mark before backward
    starts.  See the module docstring for exactly what is guaranteed.
    """
    if not 1 <= level <= MAX_PRIORITY_LEVEL:
        raise PriorityError(f"priority level {level} outside 1..{MAX_PRIORITY_LEVEL}")
    tensors = _tensors(target)
    for i, t in enumerate(tensors):
        if not t.requires_grad:
            raise PriorityError(
                f"tensor {i} of the priority target does not require grad "
                f"(shape {tuple(t.shape)}); it has no backward to prioritise"
            )
    roots = [t.grad_fn for t in tensors if t.grad_fn is not None]
    stop = [t.grad_fn for t in _tensors(stop_at) if t.grad_fn is not None]
    return _mark(_graph_nodes(roots, stop), late=late, level=level, strict=strict)


def prioritize_toward(
    target: Target, toward: Target, *, level: int = 1, strict: bool = False
) -> PriorityMark:
    """Run first only the part of ``target``'s backward that leads to ``toward``'s gradients.

    A pipeline stage uses it in a full backward: the gradient w.r.t. the stage
    input must be sent upstream, while nodes that only feed parameter
    gradients can wait.  ``toward`` tensors may be leaves (their gradient
    accumulator is the goal) or intermediate tensors (their ``grad_fn``).
    """
    if not 1 <= level <= MAX_PRIORITY_LEVEL:
        raise PriorityError(f"priority level {level} outside 1..{MAX_PRIORITY_LEVEL}")
    roots = [t.grad_fn for t in _tensors(target) if t.grad_fn is not None]
    goals = _tensors(toward)
    goal_nodes = {t.grad_fn for t in goals if t.grad_fn is not None}
    goal_leaves = {id(t) for t in goals if t.grad_fn is None}

    def is_goal(node: Node) -> bool:
        if node in goal_nodes:
            return True
        return (
            _compat.is_accumulate_grad(node) and id(getattr(node, "variable", None)) in goal_leaves
        )

    reaches: dict[Node, bool] = {}
    for node in reversed(_graph_nodes(roots)):
        # Children come after their parents in _graph_nodes' order only loosely,
        # so resolve each node by an explicit post-order walk.
        stack = [(node, False)]
        while stack:
            current, expanded = stack.pop()
            if current in reaches:
                continue
            children = [n for n, _ in current.next_functions if n is not None]
            if not expanded:
                stack.append((current, True))
                stack.extend((c, False) for c in children if c not in reaches)
                continue
            reaches[current] = is_goal(current) or any(reaches.get(c, False) for c in children)
    return _mark([n for n, hit in reaches.items() if hit], late=False, level=level, strict=strict)


def _mark(candidates: list[Node], *, late: bool, level: int, strict: bool) -> PriorityMark:
    """Give ``candidates`` (minus gradient accumulators) early or late sequence numbers."""
    nodes = [
        n
        for n in candidates
        if not _compat.is_accumulate_grad(n)
        and _compat.get_sequence_nr(n) != _compat.MAX_SEQUENCE_NR
    ]
    reason = _unsupported_reason(nodes[0] if nodes else None)
    if reason is not None:
        _not_applied(reason, strict)
        return PriorityMark(False, 0, late, level, reason)

    originals = [original_sequence_nr(n) for n in nodes]
    if late:
        # Ranks keep the marked part's own order while sitting under everything else.
        ranked = sorted(range(len(nodes)), key=lambda i: originals[i])
        new = [0] * len(nodes)
        for rank, i in enumerate(ranked):
            new[i] = rank
    else:
        new = [level * _BAND + (o % _BAND) for o in originals]
    for node, original, value in zip(nodes, originals, new, strict=True):
        _metadata(node).setdefault(_ORIGINAL_KEY, original)
        _compat.set_sequence_nr(node, value)
    return PriorityMark(True, len(nodes), late, level)


def prioritize_outputs(
    module: nn.Module,
    *,
    late: bool = False,
    level: int = 1,
    strict: bool = False,
) -> RemovableHandle:
    """Mark, on every forward of ``module``, the backward of what the module computed.

    A forward hook calls :func:`prioritize` on the module's outputs with its
    inputs as ``stop_at``, so only nodes created inside the module are marked,
    not the graph that produced its inputs.  Returns the hook's handle;
    ``handle.remove()`` stops marking (nodes already marked stay marked).
    """
    if not 1 <= level <= MAX_PRIORITY_LEVEL:
        raise PriorityError(f"priority level {level} outside 1..{MAX_PRIORITY_LEVEL}")

    def hook(_mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        outs = [t for t in _tensors(output) if t.requires_grad]
        if outs:
            prioritize(outs, late=late, level=level, stop_at=[args, kwargs], strict=strict)

    return module.register_forward_hook(hook, with_kwargs=True)


# --- inspection -------------------------------------------------------------


@dataclass
class NodeEvent:
    """One node's run: when it started and ended (``time.perf_counter`` seconds)."""

    node: Node
    name: str
    sequence_nr: int
    start: float
    end: float | None = None


class BackwardOrder:
    """The nodes a backward ran, in the order they started.

    Filled by :func:`record_backward_order`.  Events keep their nodes alive
    (nodes cannot be weakly referenced); drop the record to free the graph.
    """

    def __init__(self) -> None:
        self.events: list[NodeEvent] = []

    def __len__(self) -> int:
        return len(self.events)

    def __iter__(self) -> Iterator[NodeEvent]:
        return iter(self.events)

    def nodes(self) -> list[Node]:
        return [e.node for e in self.events]

    def names(self) -> list[str]:
        return [e.name for e in self.events]

    @property
    def start(self) -> float:
        """When the first node started: the start of backward as the engine saw it."""
        if not self.events:
            raise ZeropipeError("no backward node ran while recording")
        return self.events[0].start

    def position(self, target: Tensor | Node) -> int:
        """Index of ``target`` (a node, a tensor's ``grad_fn``, or a leaf's AccumulateGrad)."""
        for i, e in enumerate(self.events):
            if _matches(e.node, target):
                return i
        raise ZeropipeError(f"{_describe(target)} did not run while recording")

    def event(self, target: Tensor | Node) -> NodeEvent:
        return self.events[self.position(target)]

    def done_after(self, target: Tensor | Node) -> float:
        """Seconds from :attr:`start` until ``target``'s node finished."""
        e = self.event(target)
        return (e.end if e.end is not None else e.start) - self.start


def _matches(node: Node, target: Tensor | Node) -> bool:
    if not isinstance(target, Tensor):
        return node is target
    if target.grad_fn is not None:
        return node is target.grad_fn
    return _compat.is_accumulate_grad(node) and getattr(node, "variable", None) is target


def _describe(target: Tensor | Node) -> str:
    if isinstance(target, Tensor):
        return f"the node of tensor {tuple(target.shape)}"
    return f"node {target.name()}"


@contextmanager
def record_backward_order(roots: Target) -> Iterator[BackwardOrder]:
    """Record which nodes of the graph below ``roots`` run, in order, while the block runs.

    Hooks go on every node reachable from the roots' ``grad_fn`` (AccumulateGrad
    included) and are removed on exit.  Under compiled autograd the recorded
    order is compiled autograd's, and a :class:`PriorityNotAppliedWarning` says so.
    """
    reason = _compat.compiled_autograd_reason()
    if reason is not None:
        warnings.warn(
            f"recording backward order under compiled autograd ({reason}): "
            "the order is compiled autograd's and ignores priorities",
            PriorityNotAppliedWarning,
            stacklevel=3,
        )
    record = BackwardOrder()
    running: dict[Node, NodeEvent] = {}
    handles: list[RemovableHandle] = []

    def add(node: Node) -> None:
        def pre(_grads: Any) -> None:
            e = NodeEvent(node, node.name(), _compat.get_sequence_nr(node), time.perf_counter())
            running[node] = e
            record.events.append(e)

        def post(_grad_inputs: Any, _grad_outputs: Any) -> None:
            e = running.get(node)
            if e is not None:
                e.end = time.perf_counter()

        handles.append(node.register_prehook(pre))
        handles.append(node.register_hook(post))

    roots_ = [t.grad_fn for t in _tensors(roots) if t.grad_fn is not None]
    for node in _graph_nodes(roots_):
        add(node)
    try:
        yield record
    finally:
        for h in handles:
            h.remove()


def predict_backward_order(roots: Target) -> list[Node]:
    """The order the eager engine would run the graph below ``roots`` in, without running it.

    Replays the engine's rule for one ready queue (all CPU, no reentrant
    backward, every node needed): a node is ready once every edge into it has
    delivered; among ready nodes the highest sequence number runs first.
    Nodes with equal numbers (several AccumulateGrad ready together) have no
    defined order in the engine; here they come in discovery order.
    """
    root_nodes = [t.grad_fn for t in _tensors(roots) if t.grad_fn is not None]
    nodes = _graph_nodes(root_nodes)
    # Dependencies count edges, not distinct parents: a node fed twice by the
    # same parent waits for both deliveries, as in Engine::compute_dependencies.
    pending: dict[Node, int] = {n: 0 for n in nodes}
    for n in nodes:
        for child, _ in n.next_functions:
            if child is not None:
                pending[child] += 1
    tie = {n: i for i, n in enumerate(nodes)}
    ready: list[tuple[int, int, Node]] = []
    for r in dict.fromkeys(root_nodes):
        if pending[r] == 0:
            heapq.heappush(ready, (-_compat.get_sequence_nr(r), tie[r], r))
    order: list[Node] = []
    while ready:
        _, _, node = heapq.heappop(ready)
        order.append(node)
        for child, _ in node.next_functions:
            if child is None:
                continue
            pending[child] -= 1
            if pending[child] == 0:
                heapq.heappush(ready, (-_compat.get_sequence_nr(child), tie[child], child))
    return order
