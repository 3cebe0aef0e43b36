"""Measure a real model's stage costs on this device: the cost model the simulator and auto take.

For each stage, one microbatch, on the current device and thread count::

    F   forward recorded for split backward (as I/W schedules run it), loss included on the
        last stage                                            -> StageCost.F
    I   input-gradient part of a split backward               -> StageCost.I
    W   the deferred weight-gradient part                     -> StageCost.W
    R   = F: a recomputation runs the same recorded forward   -> StageCost.R
    B   = I + W: the runtime runs a full backward as I then W -> StageCost.B

Each is timed ``warmup`` times untimed and then ``repeat`` times; the median
is kept (``meta["spread"]`` has each figure's interquartile range relative to
its median, a quick check of how noisy the machine was).  Memory is counted
the way the runtime counts it (:mod:`zeropipe.runtime.memory.manager`), so predicted
and measured peaks compare: ``act`` = bytes of the distinct storages the
forward's graph saved, excluding parameters, buffers, the caller's batch and
the stage's boundary tensors; ``act_w`` = bytes the split-backward stash
holds from I to W (``WeightGradStash.nbytes``); ``boundary_bytes`` = the
stage's output.  The model's unit is ``"bytes"``; times are seconds.

Point-to-point ``latency`` (seconds) and ``bandwidth`` (bytes/s) are measured
by a ping-pong (1 byte; 16 MiB or the largest boundary tensor) between ranks
0 and 1 of the process group, only when torch.distributed is initialised with
two or more processes (every rank must then call :func:`profile`); otherwise
they stay 0 and infinite and ``meta["comm"]`` says so.

With two or more processes, ``post`` is the time a send or receive takes to
post right after a burst of compute (as in a pipeline, where it finds the
caches full of other data); the simulator charges it, so schedules with many
transfers are not taken for free.  The runtime's own cost per compute action
(``overhead``) needs the runtime, a layer above this one: it is left at 0 here
and measured by :func:`zeropipe.planning.plan.profile`, which users call as
``zeropipe.profile``.

The model is left as it was: gradients, RNG state, thread count and which
linears were prepared for split backward are restored afterwards.
"""

from __future__ import annotations

import inspect
import statistics
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn

from zeropipe.autograd.split_backward import (
    WeightGradStash,
    prepare_split,
    split_linears,
    unprepare_split,
    weight_backward_together,
)
from zeropipe.base.storage import StorageKey, distinct_bytes, storage_key
from zeropipe.core.costs import CostModel, StageCost
from zeropipe.core.errors import PipelineError

__all__ = ["Sample", "StageProbe", "global_rank", "profile_stages", "sample_parts", "synchronize"]

LossFn = Callable[..., Tensor]
Inputs = Tensor | Sequence[Tensor]  # the first stage's positional inputs
#: ``(inputs, target)``, or the inputs alone (see :func:`sample_parts`).
Sample = Inputs | tuple[Inputs, Tensor | None]


def sample_parts(
    sample: Sample, *, target: Tensor | None = None, loss_fn: LossFn | None = None
) -> tuple[tuple[Tensor, ...], Tensor | None]:
    """The first stage's inputs and the loss's target, from a sample as ``zeropipe.profile``
    and ``zeropipe.auto_plan`` take it.

    ``sample`` is ``(inputs, target)``: ``inputs`` a tensor, or a tuple of
    tensors (the first stage's positional inputs), ``target`` what
    ``loss_fn(output, target)`` scores the last stage's output against, or
    ``None`` without a loss.  A pair is read so whenever ``loss_fn`` is given or
    its second item is ``None``; otherwise (no loss, or ``target=`` given
    apart) ``sample`` is the inputs alone.  Raises a one-line
    :class:`PipelineError` when the inputs are not tensors, or ``loss_fn`` and
    a target do not come together.
    """
    inputs: object = sample
    pair = target is None and isinstance(sample, (tuple, list)) and len(sample) == 2
    if pair and (loss_fn is not None or sample[1] is None):
        inputs, second = sample[0], sample[1]
        if second is not None and not isinstance(second, Tensor):
            raise PipelineError(
                f"the sample's target (its second item) must be a tensor or None, got "
                f"{type(second).__name__}; pass sample=(inputs, target)"
            )
        target = second
    if isinstance(inputs, Tensor):
        parts: tuple[Tensor, ...] = (inputs,)
    elif isinstance(inputs, (tuple, list)) and all(isinstance(t, Tensor) for t in inputs):
        parts = tuple(inputs)
    else:
        raise PipelineError(
            f"the sample's inputs must be a tensor or a tuple of tensors (the first stage's "
            f"positional inputs), got {_kinds(inputs)}; pass sample=(inputs, target)"
        )
    if not parts:
        raise PipelineError("the sample has no inputs; pass sample=(inputs, target)")
    if target is not None and loss_fn is None:
        raise PipelineError(
            "give both target and loss_fn (the last stage's loss, loss_fn(output, target)), "
            "or neither"
        )
    if loss_fn is not None and target is None:
        raise PipelineError(
            "loss_fn needs the target it scores the last stage's output against: give both "
            "target and loss_fn, as sample=(inputs, target), or neither"
        )
    return parts, target


def _kinds(value: object) -> str:
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__} of ({', '.join(type(v).__name__ for v in value)})"
    return type(value).__name__


def _check_inputs(module: nn.Module, inputs: tuple[Tensor, ...]) -> None:
    """One line, not a TypeError from deep inside the forward, when the first stage's forward
    cannot take the sample's inputs."""
    try:
        signature = inspect.signature(module.forward)
    except (TypeError, ValueError):  # no signature to read: the forward will tell
        return
    try:
        signature.bind(*inputs)
    except TypeError as exc:
        n = len(inputs)
        raise PipelineError(
            f"the first stage's forward, {type(module).__name__}.forward{signature}, cannot "
            f"take the sample's {n} input tensor{'s' * (n != 1)} ({exc}); pass "
            f"sample=(inputs, target) with loss_fn= (several inputs: ((a, b), target)), "
            f"or the inputs alone"
        ) from None


def profile_stages(
    stages: Sequence[nn.Module],
    sample: Sample,
    *,
    target: Tensor | None = None,
    loss_fn: LossFn | None = None,
    warmup: int = 2,
    repeat: int = 7,
    threads: int | None = 1,
    weights: bool = False,
    process_group: Any | None = None,
    wire: bool = True,
) -> CostModel:
    """Time and measure every stage of a model; return a :class:`CostModel` in bytes and seconds.

    Args:
        stages: one module per stage, in order; an ``nn.Sequential`` is read as
            its children, i.e. one stage per layer (what balancing needs).
        sample: one microbatch, ``(inputs, target)`` as :func:`sample_parts`
            reads it (``inputs``: a tensor or a tuple of the first stage's
            inputs); or the inputs alone, with ``target=`` or without a loss.
        target, loss_fn: the last stage's loss, ``loss_fn(output, target)``;
            without them the last stage's backward starts from a gradient of ones.
        warmup, repeat: untimed and timed repetitions of each measurement.
        threads: intra-op threads while measuring (one per rank, as pipelines
            run on CPU); ``None`` leaves the setting alone.
        weights: also count each stage's parameter bytes as ``weights`` (then
            a memory limit must include them).
        process_group: the group whose ranks 0 and 1 measure the wire.
        wire: measure the wire when several processes run (every rank of the
            group must then call this); ``False`` leaves latency and bandwidth
            unmeasured.
    """
    modules = list(stages)
    if not modules:
        raise PipelineError("profile() needs at least one stage")
    if repeat < 1 or warmup < 0:
        raise PipelineError(f"repeat must be >= 1 and warmup >= 0, got {repeat}, {warmup}")
    inputs, target = sample_parts(sample, target=target, loss_fn=loss_fn)
    _check_inputs(modules[0], inputs)
    device = _device(modules, inputs)
    keep = _storages(inputs) | (_storages((target,)) if target is not None else set())
    loss = None if loss_fn is None else (loss_fn, target)
    with _restored(modules, device, threads):
        probes = _measure(modules, inputs, loss, keep, device, warmup=warmup, repeat=repeat)
        measured = [probe.cost() for probe in probes]
        stage_costs = [
            replace(cost, weights=float(distinct_bytes(probe.module.parameters())))
            if weights
            else cost
            for probe, (cost, _) in zip(probes, measured, strict=True)
        ]
    spread = [noise for _, noise in measured]
    latency, bandwidth, post, comm = (
        _wire(process_group, device, warmup, repeat, stage_costs)
        if wire
        else (0.0, float("inf"), 0.0, "not measured: wire=False")
    )
    meta = {
        "source": "zeropipe.profile",
        "device": str(device),
        "threads": threads if threads is not None else torch.get_num_threads(),
        "warmup": warmup,
        "repeat": repeat,
        "torch": torch.__version__,
        "time_unit": "s",
        "comm": comm,
        "spread": spread,
    }
    return CostModel(tuple(stage_costs), latency, bandwidth, post=post, unit="bytes", meta=meta)


def _measure(
    modules: list[nn.Module],
    inputs: tuple[Tensor, ...],
    loss: tuple[LossFn, Tensor | None] | None,
    keep: set[StorageKey],
    device: torch.device,
    *,
    warmup: int,
    repeat: int,
) -> list[StageProbe]:
    """A probe per stage, ``warmup`` untimed and ``repeat`` timed repetitions run.

    The first repetition chains the stages: a stage's output, detached, is the next
    stage's input, and the last stage computes ``loss``.  The others are interleaved
    across the stages (see :class:`StageProbe`)."""
    probes: list[StageProbe] = []
    x: tuple[Tensor, ...] = inputs
    for s, module in enumerate(modules):
        last = s == len(modules) - 1
        leaves = x if s == 0 else tuple(_leaf(t) for t in x)
        probe = StageProbe(module, leaves, loss if last else None, keep, device, last)
        probe.run(timed=warmup == 0)
        probes.append(probe)
        x = probe.out
    for rep in range(max(warmup - 1, 0) + repeat - (warmup == 0)):
        for probe in probes:
            probe.run(timed=rep >= warmup - 1)
    return probes


# -- one stage ----------------------------------------------------------------------------
class StageProbe:
    """One stage's measurements; :meth:`run` does one repetition of all of them.

    Repetitions of the stages are interleaved (stage 0, 1, ..., 0, 1, ...), so
    that a burst of load on a shared machine spreads over every stage's
    samples instead of shifting one stage's median; :meth:`cost` gives the
    medians.  The module must be prepared for split backward
    (:func:`zeropipe.autograd.split_backward.prepare_split`).  Public so that a caller
    timing something else (the planning layer's runtime overhead) can
    interleave its own repetitions with a probe's.
    """

    def __init__(
        self,
        module: nn.Module,
        inputs: tuple[Tensor, ...],
        loss: tuple[LossFn, Tensor | None] | None,
        keep: set[StorageKey],
        device: torch.device,
        last: bool,
    ) -> None:
        self.module, self.inputs, self.loss, self.device, self.last = (
            module,
            inputs,
            loss,
            device,
            last,
        )
        params = {storage_key(t) for t in [*module.parameters(), *module.buffers()]}
        self.exclude = params | keep | _storages(inputs)
        self.times: dict[str, list[float]] = {k: [] for k in ("F", "I", "W", "W2")}
        self._runs = 0
        self.act = self.act_w = 0
        self.grads: list[Tensor] | None = None
        self.out: tuple[Tensor, ...] = ()
        self._saved: list[weakref.ref[Tensor]] = []  # what the forward's graph saved, weakly

    def _pack(self, t: Tensor) -> Tensor:
        self._saved.append(weakref.ref(t))
        return t

    def _forward(self, stash: WeightGradStash | None) -> tuple[tuple[Tensor, ...], list[Tensor]]:
        with stash.recording(self.module) if stash is not None else _nothing():
            value = self.module(*self.inputs)
            outs = tuple(value) if isinstance(value, (tuple, list)) else (value,)
            if self.loss is not None:
                fn, target = self.loss
                result = fn(outs[0] if len(outs) == 1 else outs, target)
                return outs, [(result[0] if isinstance(result, tuple) else result).reshape(())]
        return outs, [t for t in outs if t.requires_grad]

    def run(self, timed: bool) -> None:
        """One repetition: F -> I -> W; every other one, two F -> I and their W as one."""
        stashes = [self._forward_input(timed)]
        if self._runs % 2:  # W of two microbatches run together (W_fused)
            stashes.append(self._forward_input(timed))
        self._runs += 1
        pending = [st for st in stashes if st is not None]
        if not pending:  # a stage with nothing to differentiate has no backward to time
            return
        synchronize(self.device)
        t0 = time.perf_counter()
        weight_backward_together(pending)
        synchronize(self.device)
        if timed:
            self.times["W" if len(pending) == 1 else "W2"].append(time.perf_counter() - t0)

    def _forward_input(self, timed: bool) -> WeightGradStash | None:
        """F (recorded for split backward) then I, counting what the forward saved."""
        sync, clock = synchronize, time.perf_counter
        stash = WeightGradStash()
        # The saved bytes depend on the shapes only: counted on the first run, whose
        # hooks (a few microseconds per saved tensor) the runtime also pays only once.
        count = self._runs == 0
        self._saved.clear()
        sync(self.device)
        t0 = clock()
        with (
            torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
            if count
            else _nothing()
        ):
            outs, roots = self._forward(stash)
        sync(self.device)
        t1 = clock()
        if count:
            # The runtime holds a stage's output as a communication buffer, not as an
            # activation -- except on the last stage, whose output only the loss keeps.
            boundary = set() if self.loss is not None else _storages(outs)
            alive = [t for t in (ref() for ref in self._saved) if t is not None]
            self.act = distinct_bytes(alive, self.exclude | boundary)
            del alive
            self._saved.clear()
        if self.grads is None:
            self.grads = _output_grads(roots, self.loss is not None or self.last)
            self.out = tuple(t.detach() for t in outs)
        grads = self.grads if self.loss is None else None
        t2 = t1
        if roots:
            stash.input_backward(roots, grads)
            sync(self.device)
            t2 = clock()
            self.act_w = max(self.act_w, stash.nbytes)
        del outs
        for t in self.inputs:  # a fresh microbatch's input has no gradient yet
            t.grad = None
        if timed:
            self.times["F"].append(t1 - t0)
            if roots:
                self.times["I"].append(t2 - t1)
        return stash if roots else None

    def cost(self) -> tuple[StageCost, dict[str, float]]:
        med = {k: statistics.median(v) if v else 0.0 for k, v in self.times.items()}
        noise = {k: _iqr(v) / med[k] if med[k] > 0 else 0.0 for k, v in self.times.items() if v}
        boundary = 0 if self.last else sum(t.numel() * t.element_size() for t in self.out)
        # What the second of two W run together adds: the pair's time less one W.
        fused = max(med["W2"] - med["W"], 0.0) if self.times["W2"] and self.times["W"] else None
        cost = StageCost(
            F=med["F"],
            I=med["I"],
            W=med["W"],
            B=med["I"] + med["W"],
            R=med["F"],
            W_fused=fused,
            act=float(self.act),
            act_w=float(self.act_w),
            ckpt=0.0,
            boundary_bytes=float(boundary),
        )
        return cost, noise


def _output_grads(roots: list[Tensor], is_loss: bool) -> list[Tensor]:
    if is_loss:
        return [torch.ones_like(t) for t in roots]
    gen = torch.Generator(device=roots[0].device if roots else "cpu").manual_seed(0)
    return [torch.randn(t.shape, generator=gen, dtype=t.dtype, device=t.device) for t in roots]


def _iqr(values: list[float]) -> float:
    if len(values) < 4:
        return max(values) - min(values)
    q = statistics.quantiles(values, n=4)
    return q[2] - q[0]


# -- the wire ---------------------------------------------------------------------------
def _wire(
    group: Any | None, device: torch.device, warmup: int, repeat: int, costs: list[StageCost]
) -> tuple[float, float, float, str]:
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return 0.0, float("inf"), 0.0, "not measured: torch.distributed is not initialised"
    world = dist.get_world_size(group)
    if world < 2:
        return 0.0, float("inf"), 0.0, "not measured: one process"
    rank = dist.get_rank(group)
    # Large enough that the bytes, not the per-message overhead, dominate its time.
    big = int(max([c.boundary_bytes for c in costs] + [16 << 20]))
    small_t = torch.zeros(1, dtype=torch.uint8, device=device)
    big_t = torch.zeros(big, dtype=torch.uint8, device=device)
    peer0, peer1 = global_rank(group, 0), global_rank(group, 1)
    rtts: dict[int, list[float]] = {1: [], big: []}
    for tensor in (small_t, big_t):
        for rep in range(warmup + repeat):
            synchronize(device)
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(tensor, peer1, group=group)
                dist.recv(tensor, peer1, group=group)
            elif rank == 1:
                dist.recv(tensor, peer0, group=group)
                dist.send(tensor, peer0, group=group)
            synchronize(device)
            if rep >= warmup:
                rtts[tensor.numel()].append(time.perf_counter() - t0)
    post = _post_time(group, device, warmup, repeat, costs)
    result = torch.zeros(3, dtype=torch.float64, device=device)
    if rank == 0:
        latency = statistics.median(rtts[1]) / 2
        one_way = statistics.median(rtts[big]) / 2
        # When the payload's time drowns in the noise of the latency, what is left is
        # a lower bound: the whole one-way time.
        bw = big / max(one_way - latency, 0.05 * one_way)
        result = torch.tensor([latency, bw, 0.0], dtype=torch.float64, device=device)
    if rank in (0, 1):
        result[2] = post / 2  # the sum over ranks 0 and 1: the mean of a send and a receive
    dist.all_reduce(result, group=group)  # only rank 0 adds latency and bandwidth
    return (
        float(result[0]),
        float(result[1]),
        float(result[2]),
        f"ping-pong between ranks 0 and 1 of {world}: 1 byte and {big} bytes; posts "
        f"timed after compute",
    )


def _post_time(
    group: Any | None, device: torch.device, warmup: int, repeat: int, costs: list[StageCost]
) -> float:
    """Median seconds to post a boundary-sized send (rank 0) or receive (rank 1).

    Each post follows a burst of matrix products, as in a pipeline, where it
    finds the caches full of the compute's data; that makes it several times
    dearer than a post in a tight loop.  Other ranks return 0.
    """
    dist = torch.distributed
    rank = dist.get_rank(group)
    if rank > 1:
        return 0.0
    size = int(max([c.boundary_bytes for c in costs] + [1]))
    buf = torch.zeros(size, dtype=torch.uint8, device=device)
    a = torch.randn(256, 1024, device=device)
    b = torch.randn(1024, 1024, device=device)
    peer = global_rank(group, 1 - rank)
    times = []
    for rep in range(warmup + 3 * repeat):
        for _ in range(4):
            a @ b
        synchronize(device)
        t0 = time.perf_counter()
        if rank == 0:
            work = dist.isend(buf, peer, group=group)
        else:
            work = dist.irecv(buf, peer, group=group)
        t1 = time.perf_counter()
        assert work is not None  # point-to-point ops always return a work when posted
        work.wait()
        if rep >= warmup:
            times.append(t1 - t0)
    return statistics.median(times)


def global_rank(group: Any | None, rank: int) -> int:
    if group is None:
        return rank
    return int(torch.distributed.get_global_rank(group, rank))


# -- helpers ----------------------------------------------------------------------------
def _device(modules: list[nn.Module], inputs: tuple[Tensor, ...]) -> torch.device:
    for m in modules:
        for p in m.parameters():
            return p.device
    return inputs[0].device if inputs else torch.device("cpu")


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels, so that a host timer sees their time (no-op on CPU)."""
    if device.type != "cpu" and hasattr(torch, "accelerator"):
        torch.accelerator.synchronize(device)


def _leaf(t: Tensor) -> Tensor:
    d = t.detach()
    return d.requires_grad_(True) if torch.is_floating_point(d) or d.is_complex() else d


def _storages(tensors: Sequence[Tensor | None]) -> set[StorageKey]:
    return {storage_key(t) for t in tensors if isinstance(t, Tensor)}


@contextmanager
def _nothing() -> Iterator[None]:
    yield


@contextmanager
def _restored(
    modules: list[nn.Module], device: torch.device, threads: int | None
) -> Iterator[None]:
    """Prepare for split backward and one thread; afterwards, put everything back."""
    # Linears a Pipeline already prepared stay prepared (they keep their class now).
    prepared = {id(m) for mod in modules for m in split_linears(mod, allow_plain=True)}
    plain = [
        m
        for mod in modules
        for m in mod.modules()
        if type(m) is nn.Linear and id(m) not in prepared
    ]
    params = list({id(p): p for mod in modules for p in mod.parameters()}.values())
    grads = [p.grad for p in params]
    old_threads = torch.get_num_threads()
    was_training = [m.training for m in modules]
    devices = [device] if device.type != "cpu" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type):
        try:
            for p in params:  # else backward would accumulate into the caller's .grad
                p.grad = None
            if threads is not None:
                torch.set_num_threads(threads)
            for m in modules:
                prepare_split(m)
                m.train()
            with torch.enable_grad():
                yield
        finally:
            for linear in plain:
                unprepare_split(linear)
            for p, g in zip(params, grads, strict=True):
                p.grad = g
            for m, mode in zip(modules, was_training, strict=True):
                m.train(mode)
            torch.set_num_threads(old_threads)
