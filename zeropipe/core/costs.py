"""Cost model: how long each action takes and what it does to memory.

Times are in any unit (the simulator only adds them); memory is in any unit
too, by default "one microbatch's activations of one full rank's layers", so
a rank that holds ``v`` chunks has ``act = 1/v`` per stage.

``W_fused`` is what a W costs when its rank runs a W of the same stage right
after it: the runtime does the two as one product per weight
(:mod:`zeropipe.core.passes.fuse`), which with small microbatches costs much less than two.

Two costs belong to the runtime rather than to a stage: ``overhead``, added to every
compute action (the runtime's own bookkeeping around the stage's module), and
``post``, the time a send or receive occupies its rank when it is posted.  With
``post`` > 0 sends and receives take that time on the rank's compute lane, as
they do on the runtime's one thread (a schedule without them is simulated
lowered, see :func:`zeropipe.core.simulate.simulate`); with 0 (the default) they take none.

Data parallelism: with ``dp`` > 1 replicas, ``REDUCE_GRAD(s)`` all-reduces stage
``s``'s weight gradients (``grad_bytes``, by default its ``weights``) over a
ring: ``dp_latency + 2 (dp - 1) / dp * grad_bytes / dp_bandwidth``
(:meth:`CostModel.reduce_time`; 0 with ``dp`` = 1).  Posting it costs
``overhead`` on the compute lane; the reduction itself runs on the rank's
data-parallel link (see :mod:`zeropipe.core.simulate`).

Overlapped pairs (``Schedule.overlaps``): a forward and a backward run as one
take ``F + B - overlap * min(F, B)``.  ``overlap`` is the share of the shorter
one hidden under the longer; the default 0.0 says what one device does: it
computes one thing at a time, and running two kernels' worth of work side by
side saves only what one of them leaves idle (measure it before raising it).

Microbatches of their own sizes (``microbatch_scale``, one factor per microbatch; empty: all
1.0): microbatch ``i``'s compute times, activation copies, memory and boundary bytes are the
stages' figures times ``microbatch_scale[i]`` (``overhead``, posts and latencies are not).

Memory deltas of stage ``s`` (``act`` = kept by a full forward, ``act_w`` =
the part W still needs after I, ``ckpt`` = kept by a checkpointed forward)::

    F  +act (or +ckpt when checkpointed)    R  +(act - ckpt)
    B  -act      I  -(act - act_w)          W  -act_w
    OFFLOAD(s,i) -what (s,i) holds then     RELOAD(s,i)  +the same
    OFFLOAD(s)   -weights[s]                RELOAD(s)    +weights[s]

``workspace`` is what a backward of the stage holds only while it runs: the activations of
one block whose forward kept only its input (a block checkpointed on its own, as
``torch.utils.checkpoint`` around each block does), rebuilt for that block's backward and
freed after it.  A rank computes one thing at a time, so it reserves the largest workspace of
its stages for the whole step, beside its weights (:func:`zeropipe.core.memory.initial_memory`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from zeropipe.core.errors import ScheduleError
from zeropipe.core.ir import COMM_KINDS, COMPUTE_KINDS, Action, Kind, Schedule

__all__ = ["CostModel", "StageCost"]


@dataclass(frozen=True)
class StageCost:
    """Times and memory of one stage for one microbatch."""

    F: float = 1.0
    I: float = 1.0
    W: float = 1.0
    B: float | None = None  # None: I + W
    R: float | None = None  # None: F
    W_fused: float | None = None  # a W run together with the next W of the stage; None: W
    OFFLOAD: float = 0.0  # copy time of one microbatch's activations (copy stream)
    RELOAD: float = 0.0
    weight_copy: float = 0.0  # copy time of the stage's weights, each way
    act: float = 1.0
    act_w: float = 0.0
    ckpt: float = 0.0
    weights: float = 0.0
    boundary_bytes: float = 0.0  # size of this stage's output activation (= its input grad)
    grad_bytes: float | None = None  # weight-gradient bytes REDUCE_GRAD reduces; None: weights
    workspace: float = 0.0  # held by a backward while it runs (the module docstring)

    def __post_init__(self) -> None:
        # Checked here, not where the numbers are read, so that every way of building
        # one (a spec string, a JSON file, replace(), scaled(), merged(), profiling)
        # is covered: a negative or NaN time gives a timeline that is not a timeline.
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.name in _OPTIONAL:
                continue
            _check_number(f.name, value)

    @classmethod
    def merged(cls, group: Sequence[StageCost]) -> StageCost:
        """Consecutive stages run as one: times and memory summed, the last one's boundary."""
        if not group:
            raise ScheduleError("StageCost.merged needs at least one stage to merge")
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name == "boundary_bytes":
                values[f.name] = group[-1].boundary_bytes  # the group's output is its last's
            elif f.name == "workspace":  # one backward runs at a time: the largest one's
                values[f.name] = max(c.workspace for c in group)
            elif f.name in ("B", "R"):  # None stands for a sum of others: add what each costs
                values[f.name] = sum(c.time(Kind(f.name)) for c in group)
            elif f.name == "W_fused":  # priced for the group if for any of its stages
                given = any(c.W_fused is not None for c in group)
                values[f.name] = sum(c.fused_w for c in group) if given else None
            elif f.name == "grad_bytes":
                given = any(c.grad_bytes is not None for c in group)
                values[f.name] = sum(c.reduced_bytes for c in group) if given else None
            else:
                values[f.name] = float(sum(getattr(c, f.name) for c in group))
        return cls(**values)

    def scaled(self, factor: float) -> StageCost:
        """Every time and memory figure times ``factor`` (a stage cut into equal parts).

        The boundary size and the workspace are kept: each part still sends a whole
        activation, and still rebuilds a whole block for its backward.
        """
        _check_number("scale factor", factor)
        values: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            keep = f.name in ("boundary_bytes", "workspace") or value is None
            values[f.name] = value if keep else value * factor
        return replace(self, **values)

    @property
    def reduced_bytes(self) -> float:
        """What REDUCE_GRAD of this stage moves: ``grad_bytes``, or the parameters' ``weights``."""
        return self.weights if self.grad_bytes is None else self.grad_bytes

    @property
    def fused_w(self) -> float:
        """What a W costs run together with the next W of the stage (``W`` if not priced)."""
        return self.W if self.W_fused is None else self.W_fused

    def held_change(self, kind: Kind, *, checkpointed: bool = False) -> float:
        """How much memory one microbatch's ``kind`` on this stage takes (+) or frees (-).

        For F, R, B, I and W (the table in the module docstring); an OFFLOAD or
        RELOAD moves whatever its (stage, microbatch) holds, see :func:`memory_deltas`.
        """
        if kind is Kind.F:
            return self.ckpt if checkpointed else self.act
        if kind is Kind.R:
            return self.act - self.ckpt
        if kind is Kind.B:
            return -self.act
        if kind is Kind.I:
            return -(self.act - self.act_w)
        if kind is Kind.W:
            return -self.act_w
        raise ScheduleError(f"what {kind.value} holds depends on the schedule: see memory_deltas")

    def time(self, kind: Kind, weight_copy: bool = False) -> float:
        if kind is Kind.F:
            return self.F
        if kind is Kind.I:
            return self.I
        if kind is Kind.W:
            return self.W
        if kind is Kind.B:
            return self.I + self.W if self.B is None else self.B
        if kind is Kind.R:
            return self.F if self.R is None else self.R
        if kind in (Kind.OFFLOAD, Kind.RELOAD):
            return self.weight_copy if weight_copy else getattr(self, kind.value)
        return 0.0  # sends and receives take no time on the rank itself


_OPTIONAL = frozenset({"B", "R", "W_fused", "grad_bytes"})  # None stands for a sum of other figures


def _ring_all_reduce(ranks: int, nbytes: float, latency: float, bandwidth: float) -> float:
    """A ring all-reduce of ``nbytes`` over ``ranks``: ``latency + 2 (ranks - 1) / ranks x
    nbytes / bandwidth``; nothing for one rank."""
    if ranks == 1:
        return 0.0
    return latency + 2 * (ranks - 1) / ranks * nbytes / bandwidth


def _is_number(value: object) -> bool:
    # bool is an int to Python but never a cost; numbers.Real would admit Decimal etc.
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_number(name: str, value: object, *, positive: bool = False, inf: bool = False) -> None:
    """Raise ScheduleError unless ``value`` is a real number that is finite (or ``inf``
    where allowed) and >= 0 (> 0 with ``positive``); the message names it and says why."""
    if not _is_number(value):
        raise ScheduleError(
            f"{name} = {value!r} is not a number; give a finite number >= 0", rule="costs"
        )
    x = float(value)  # type: ignore[arg-type]  # _is_number checked it
    finite = math.isfinite(x) or (inf and x == math.inf)
    if not finite or x < 0 or (positive and x == 0):
        if positive:
            want = "> 0 (inf for an instant wire)" if inf else "finite and > 0"
        else:
            want = "finite and >= 0"
        raise ScheduleError(f"{name} = {value!r} must be {want}", rule="costs")


def _as_float(name: str, value: object) -> float:
    """``value`` as a float if it is a number (its range is __post_init__'s to check)."""
    if not _is_number(value):
        raise ScheduleError(f"{name} = {value!r} is not a number", rule="costs")
    return float(value)  # type: ignore[arg-type]  # _is_number checked it


def _as_int(name: str, value: object) -> int:
    """``value`` if it is a whole number (floats like 2.0 too); else a ScheduleError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ScheduleError(f"{name} = {value!r} is not a whole number", rule="costs")
    if math.isfinite(value) and value == int(value):
        return int(value)
    raise ScheduleError(f"{name} = {value!r} is not a whole number", rule="costs")


def _in_stage(stage: int, exc: ScheduleError) -> ScheduleError:
    """``exc`` with the stage it is about in front of its message."""
    return ScheduleError(f"stage {stage}: {exc}", rule=exc.rule)


@dataclass(frozen=True)
class CostModel:
    """Per-stage costs plus the wire: a transfer takes ``latency + bytes / bandwidth``.

    ``overhead`` is added to every compute action (and to posting a
    REDUCE_GRAD) and ``post`` is what posting a send or receive costs its rank.
    ``dp``, ``dp_latency`` and ``dp_bandwidth`` price the data-parallel gradient
    all-reduce, ``overlap`` an overlapped pair (see the module docstring).
    """

    stages: tuple[StageCost, ...]
    latency: float = 0.0
    bandwidth: float = math.inf
    overhead: float = 0.0
    post: float = 0.0
    unit: str = "microbatch"  # what memory numbers count: "microbatch" or "bytes"
    meta: dict[str, Any] = field(default_factory=dict, compare=False)
    dp: int = 1  # data-parallel replicas
    dp_latency: float = 0.0  # seconds (or cost units) per all-reduce
    dp_bandwidth: float = math.inf  # gradient bytes per second of the data-parallel link
    overlap: float = 0.0  # share of min(F, B) an overlapped pair hides
    microbatch_scale: tuple[float, ...] = ()  # per microbatch, its size (empty: all 1.0)

    def __post_init__(self) -> None:
        stages = tuple(self.stages)
        for n, stage in enumerate(stages):
            if not isinstance(stage, StageCost):
                raise ScheduleError(
                    f"stage {n}: expected a StageCost, got {type(stage).__name__}", rule="costs"
                )
        object.__setattr__(self, "stages", stages)
        for name in ("latency", "overhead", "post", "dp_latency", "overlap"):
            _check_number(name, getattr(self, name))
        _check_number("bandwidth", self.bandwidth, positive=True, inf=True)
        _check_number("dp_bandwidth", self.dp_bandwidth, positive=True, inf=True)
        for k, x in enumerate(self.microbatch_scale):
            _check_number(f"microbatch_scale[{k}]", x, positive=True)
        object.__setattr__(self, "microbatch_scale", tuple(map(float, self.microbatch_scale)))
        if not isinstance(self.dp, int) or isinstance(self.dp, bool) or self.dp < 1:
            raise ScheduleError(
                f"dp = {self.dp!r} must be a whole number >= 1 (data-parallel replicas)",
                rule="costs",
            )
        if self.overlap > 1:
            raise ScheduleError(
                f"overlap = {self.overlap!r} must be between 0 and 1 (the share of the "
                f"shorter action of a pair hidden under the longer)",
                rule="costs",
            )

    @classmethod
    def uniform(
        cls,
        num_stages: int,
        *,
        chunks: int = 1,
        F: float = 1.0,
        B: float | None = None,
        I: float | None = None,
        W: float | None = None,
        R: float | None = None,
        W_fused: float | None = None,
        comm: float = 0.0,
        act_w: float = 0.0,
        overhead: float = 0.0,
        post: float = 0.0,
    ) -> CostModel:
        """Every stage alike.  Times are per *rank's worth* of layers, divided by ``chunks``.

        Given only ``B``, I and W split it evenly; given I and W, ``B = I + W``.
        """
        if not isinstance(num_stages, int) or isinstance(num_stages, bool) or num_stages < 0:
            raise ScheduleError(f"num_stages must be an integer >= 0, got {num_stages!r}")
        if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
            raise ScheduleError(f"chunks must be an integer >= 1, got {chunks!r}")
        # Checked as given, so the message shows the user's number, not its share per chunk.
        given = {"F": F, "B": B, "I": I, "W": W, "R": R, "W_fused": W_fused}
        given |= {"comm": comm, "act_w": act_w, "overhead": overhead, "post": post}
        for name, value in given.items():
            if value is not None:
                _check_number(name, value)
        if I is None and W is None:
            I = W = (B if B is not None else 2.0) / 2
        elif I is None or W is None:
            raise ScheduleError("give both I and W (or neither, and B is split evenly)")
        stage = StageCost(
            F=F / chunks,
            I=I / chunks,
            W=W / chunks,
            B=None if B is None else B / chunks,
            R=None if R is None else R / chunks,
            W_fused=None if W_fused is None else W_fused / chunks,
            act=1.0 / chunks,
            act_w=act_w / chunks,
        )
        return cls(
            tuple(stage for _ in range(num_stages)), latency=comm, overhead=overhead, post=post
        )

    @classmethod
    def uniform_for(cls, schedule: Schedule) -> CostModel:
        """The default costs of ``schedule``: unit times and memory per rank's worth of layers.

        Each stage gets its chunk's share (:meth:`uniform` with the schedule's
        :attr:`~zeropipe.core.ir.Schedule.chunks_per_rank`).
        """
        return cls.uniform(schedule.num_stages, chunks=schedule.chunks_per_rank)

    @classmethod
    def parse(cls, spec: str, num_stages: int, chunks: int = 1) -> CostModel:
        """Read ``"F=1,B=2,I=1,W=1,comm=0"`` (any subset) into a uniform model.

        Also ``dp``, ``dp_latency``, ``dp_bandwidth``, ``overlap`` and
        ``grad_bytes`` (per rank's worth of layers, shared out over chunks).
        """
        known = {"F", "B", "I", "W", "R", "W_fused", "comm", "act_w", "overhead", "post"}
        known |= {"dp", "dp_latency", "dp_bandwidth", "overlap", "grad_bytes"}
        values: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            key, sep, val = part.partition("=")
            if not sep or key.strip() not in known:
                raise ScheduleError(
                    f"cannot read cost {part!r}: expected KEY=NUMBER with KEY one of "
                    f"{', '.join(sorted(known))}, e.g. 'F=1,I=1,W=1,comm=0'"
                )
            try:
                values[key.strip()] = float(val)
            except ValueError:
                raise ScheduleError(f"cost {key.strip()} is not a number: {val!r}") from None
        if "B" in values and "I" not in values and "W" not in values:
            pass  # uniform() splits B evenly
        elif "I" in values or "W" in values:
            values.setdefault("I", 1.0)
            values.setdefault("W", 1.0)
        try:
            model = cls._uniform_from_spec(values, num_stages, chunks)
            if "grad_bytes" in values and model.stages:
                share = replace(model.stages[0], grad_bytes=values["grad_bytes"] / chunks)
                model = replace(model, stages=tuple(share for _ in model.stages))
            return replace(
                model,
                dp=_as_int("dp", values.get("dp", 1)),
                dp_latency=values.get("dp_latency", 0.0),
                dp_bandwidth=values.get("dp_bandwidth", math.inf),
                overlap=values.get("overlap", 0.0),
            )
        except ScheduleError as exc:  # say which spec the bad number came from
            raise ScheduleError(f"cost spec {spec!r}: {exc}", rule=exc.rule) from None

    @classmethod
    def _uniform_from_spec(
        cls, values: dict[str, float], num_stages: int, chunks: int
    ) -> CostModel:
        return cls.uniform(
            num_stages,
            chunks=chunks,
            F=values.get("F", 1.0),
            B=values.get("B"),
            I=values.get("I"),
            W=values.get("W"),
            R=values.get("R"),
            W_fused=values.get("W_fused"),
            comm=values.get("comm", 0.0),
            act_w=values.get("act_w", 0.0),
            overhead=values.get("overhead", 0.0),
            post=values.get("post", 0.0),
        )

    def for_stages(self, num_stages: int, microbatches: int | None = None) -> CostModel:
        if len(self.stages) != num_stages:
            raise ScheduleError(
                f"cost model has {len(self.stages)} stage(s) but the schedule has {num_stages}"
            )
        scales = len(self.microbatch_scale)
        if scales and microbatches is not None and scales != microbatches:
            raise ScheduleError(
                f"microbatch_scale has {scales} factor(s) but the schedule has {microbatches} "
                f"microbatches; give one per microbatch",
                rule="costs",
            )
        return self

    def scale(self, microbatch: int | None) -> float:
        """Microbatch ``microbatch``'s size: what its compute, memory and bytes are multiplied
        by (1.0 without ``microbatch_scale``, and for actions of no microbatch)."""
        return (
            1.0
            if microbatch is None or not self.microbatch_scale
            else self.microbatch_scale[microbatch]
        )

    def time(self, action: Action) -> float:
        """Time ``action`` occupies its lane; for REDUCE_GRAD, the post on the compute lane."""
        size = self.scale(action.microbatch)
        if action.kind in COMPUTE_KINDS or action.kind is Kind.REDUCE_GRAD:
            return self.stages[action.stage].time(action.kind) * size + self.overhead
        if action.kind in COMM_KINDS:
            return self.post
        return self.stages[action.stage].time(action.kind, action.is_weight_copy) * size

    def copies_sum_time(self, schedule: Schedule) -> float:
        """The sum of ``schedule``'s copies' gradients across its ranks at the end of a step
        (dualpipe: every model stage runs on two ranks); 0 without copies.

        As the runtime sums parameters used on several ranks: one flat ring all-reduce of
        every copied model stage's gradients (``reduced_bytes``) over all the pipeline's
        ranks on its link, ``latency + 2 (ranks - 1) / ranks * bytes / bandwidth``.
        """
        moved = sum(self.stages[s].reduced_bytes for s in {of for _, of in schedule.copies})
        if moved == 0:
            return 0.0
        return _ring_all_reduce(schedule.num_ranks, moved, self.latency, self.bandwidth)

    def reduce_time(self, stage: int) -> float:
        """Ring all-reduce of ``stage``'s weight gradients over ``dp`` replicas (0 for one)."""
        moved = self.stages[stage].reduced_bytes
        return _ring_all_reduce(self.dp, moved, self.dp_latency, self.dp_bandwidth)

    def overlapped_time(self, first: Action, second: Action) -> float:
        """What an overlapped pair takes on the compute lane: both, less the hidden share."""
        a, b = self.time(first), self.time(second)
        return a + b - self.overlap * min(a, b)

    def transfer_time(self, stage: int, microbatch: int | None = None) -> float:
        """Wire time of one boundary tensor leaving (or its gradient entering) ``stage``."""
        moved = self.stages[stage].boundary_bytes * self.scale(microbatch)
        return self.latency + moved / self.bandwidth

    def boundary_time(self, stage: int, neighbour: int, microbatch: int | None = None) -> float:
        """Wire time between two adjacent stages, either way: the tensor is the output of
        the lower one (going backward, the gradient of that output)."""
        return self.transfer_time(min(stage, neighbour), microbatch)

    def replace_stage(self, stage: int, **changes: Any) -> CostModel:
        """This model with some figures of one stage changed (checked like any StageCost)."""
        if not 0 <= stage < len(self.stages):
            raise ScheduleError(
                f"replace_stage: no stage {stage} in a cost model of {len(self.stages)} stage(s)"
            )
        unknown = sorted(set(changes) - {f.name for f in fields(StageCost)})
        if unknown:
            raise ScheduleError(
                f"replace_stage: unknown field(s) {', '.join(unknown)}; "
                f"known: {', '.join(f.name for f in fields(StageCost))}"
            )
        stages = list(self.stages)
        try:
            stages[stage] = replace(stages[stage], **changes)
        except ScheduleError as exc:
            raise _in_stage(stage, exc) from None
        return replace(self, stages=tuple(stages))

    def with_copies(self, schedule: Schedule) -> CostModel:
        """This model of the model's stages for ``schedule``, whose ``copies`` run an
        original stage's module again (dualpipe: IR stages PP..2PP-1 copy 0..PP-1).

        A copy costs what its original costs: times, activations, boundary bytes and its
        weights (gradients and optimizer state, as ``weights`` counts them), which the
        copy's rank holds a second time.  Without copies: this model as it is.
        """
        if not schedule.copies:
            return self
        originals = schedule.num_stages - len(schedule.copies)
        if len(self.stages) != originals or any(of >= originals for _, of in schedule.copies):
            raise ScheduleError(
                f"{schedule.name} runs {originals} model stage(s) (stages 0..{originals - 1}, "
                f"the rest copies of them); the cost model has {len(self.stages)}",
                rule="costs",
            )
        stages = tuple(self.stages[schedule.copy_of(s)] for s in range(schedule.num_stages))
        return replace(self, stages=stages)

    # -- JSON ------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": "zeropipe-costs",
            "version": 1,
            "latency": self.latency,
            "bandwidth": None if math.isinf(self.bandwidth) else self.bandwidth,
            "overhead": self.overhead,
            "post": self.post,
            "dp": self.dp,
            "dp_latency": self.dp_latency,
            "dp_bandwidth": None if math.isinf(self.dp_bandwidth) else self.dp_bandwidth,
            "overlap": self.overlap,
            **({"microbatch_scale": list(self.microbatch_scale)} if self.microbatch_scale else {}),
            "unit": self.unit,
            "meta": self.meta,
            "stages": [asdict(s) for s in self.stages],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CostModel:
        """Read :meth:`to_dict`'s form; anything malformed is a ScheduleError naming it."""
        if not isinstance(data, dict) or data.get("format") != "zeropipe-costs":
            raise ScheduleError(
                "not a zeropipe cost model: field 'format' must be 'zeropipe-costs'",
                rule="syntax",
            )
        raw_stages = data.get("stages")
        if not isinstance(raw_stages, list):
            raise ScheduleError(
                "cost model JSON needs 'stages': a list with one object per stage, "
                f"got {type(raw_stages).__name__}",
                rule="syntax",
            )
        known = {f.name for f in fields(StageCost)}
        stages = []
        for n, raw in enumerate(raw_stages):
            if not isinstance(raw, dict):
                raise ScheduleError(
                    f"stage {n}: expected an object of costs, got {type(raw).__name__}",
                    rule="syntax",
                )
            unknown = sorted(str(k) for k in set(raw) - known)
            if unknown:
                raise ScheduleError(
                    f"stage {n}: unknown field(s) {', '.join(unknown)}; "
                    f"known: {', '.join(sorted(known))}",
                    rule="syntax",
                )
            try:
                stages.append(StageCost(**raw))
            except ScheduleError as exc:
                raise _in_stage(n, exc) from None
        bandwidth = data.get("bandwidth")
        dp_bandwidth = data.get("dp_bandwidth")
        meta = data.get("meta", {})
        if not isinstance(meta, dict):
            raise ScheduleError(f"cost model 'meta' must be an object, got {meta!r}", rule="syntax")
        return cls(
            stages=tuple(stages),
            latency=_as_float("latency", data.get("latency", 0.0)),
            bandwidth=math.inf if bandwidth is None else _as_float("bandwidth", bandwidth),
            overhead=_as_float("overhead", data.get("overhead", 0.0)),
            post=_as_float("post", data.get("post", 0.0)),
            dp=_as_int("dp", data.get("dp", 1)),
            dp_latency=_as_float("dp_latency", data.get("dp_latency", 0.0)),
            dp_bandwidth=math.inf
            if dp_bandwidth is None
            else _as_float("dp_bandwidth", dp_bandwidth),
            overlap=_as_float("overlap", data.get("overlap", 0.0)),
            microbatch_scale=tuple(data.get("microbatch_scale", ())),
            unit=str(data.get("unit", "microbatch")),
            meta=dict(meta),
        )

    @classmethod
    def from_json(cls, text: str) -> CostModel:
        try:
            data = json.loads(text)
        except ValueError as exc:  # JSONDecodeError, and RecursionError's cousins
            raise ScheduleError(f"cost model is not valid JSON: {exc}", rule="syntax") from None
        return cls.from_dict(data)
