"""The list scheduler behind ``auto``: one candidate schedule from a placement and a policy.

Each rank, whenever it is free, starts the most urgent ready action under a
:class:`Policy` (warm-up forwards while memory allows, input gradients as
soon as their gradient arrives, weight gradients into gaps).  The search in
:mod:`zeropipe.core.schedules.auto` runs it for many placements and policies and
keeps the best.

It states no rule of its own about actions; it asks where the simulator asks:

    what an action waits for        Dependencies.requires        (zeropipe.core.deps)
    which transfers it sends/recvs  Dependencies.comm_of         (zeropipe.core.deps)
    how long it and each post take  CostModel.time               (zeropipe.core.costs)
    the wire between two stages     CostModel.boundary_time      (zeropipe.core.costs)
    what it holds or frees          StageCost.held_change        (zeropipe.core.costs)

so a plan's times equal :func:`zeropipe.core.simulate.simulate`'s for the same
schedule (a test checks every action's start).  One exception: with a
``post`` cost the simulator runs the lowered schedule, whose receives a rank
posts all at once ahead of its first consumer; here each post is charged to
its own compute action, an estimate -- the search simulates the candidates
it keeps.  What is the list scheduler's own is the *choice*: the policy's
priorities, the memory it reserves for deeper stages, when a W fills a gap.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from zeropipe.core.costs import CostModel
from zeropipe.core.deps import Dependencies
from zeropipe.core.errors import ScheduleError
from zeropipe.core.ir import Kind, Schedule
from zeropipe.core.schedules.list_run import Facts, ListPlan, ListRun, Policy, Step, replayed
from zeropipe.core.simulate import simulate

__all__ = [
    "ListPlan",
    "ListScheduler",
    "Policy",
    "Step",
    "compute_order",
    "list_schedule",
    "placement_of",
    "replay",
]

_TIMED = (Kind.F, Kind.B, Kind.I, Kind.W)


def placement_of(kind: str, ranks: int, chunks: int) -> tuple[int, ...]:
    """``looped``: stage s on rank s % p.  ``v``: down the ranks, back up, down, ..."""
    if kind not in ("looped", "v") or ranks < 1 or chunks < 1:
        raise ScheduleError(
            f"placement must be 'looped' or 'v' with ranks, chunks >= 1; got {kind!r}, "
            f"{ranks}, {chunks}",
            rule="unsupported",
        )
    out: list[int] = []
    for c in range(chunks):
        order = range(ranks) if kind == "looped" or c % 2 == 0 else reversed(range(ranks))
        out.extend(order)
    return tuple(out)


def compute_order(schedule: Schedule, keep_w: bool, split: bool = True) -> list[list[Step]]:
    """Per rank, a schedule's compute actions in order.

    ``keep_w``: every F, B, I and W as they are (to replay the schedule).
    Otherwise only F and the backwards, a B read as I when ``split`` (and an I
    as B when not): the W are left for the list scheduler to place.
    """
    out = []
    for acts in schedule.actions:
        steps: list[Step] = []
        for a in acts:
            if a.microbatch is None or a.kind not in _TIMED:
                continue
            if keep_w or a.kind is Kind.F:
                steps.append((a.kind, a.stage, a.microbatch))
            elif a.kind is not Kind.W:
                steps.append((Kind.I if split else Kind.B, a.stage, a.microbatch))
        out.append(steps)
    return out


def list_schedule(
    costs: CostModel,
    placement: Sequence[int],
    microbatches: int,
    policy: Policy,
    limits: Sequence[float],
    order: Sequence[Sequence[Step]] | None = None,
) -> ListPlan | None:
    """Event-driven list scheduling; ``None`` if it cannot finish within ``limits``.

    Without ``order`` a free rank picks among its ready actions by ``policy``.
    With ``order`` (per rank, F and I of another schedule, from
    :func:`compute_order`) it runs those in that order and only places the W.
    """
    return ListScheduler(costs, placement, microbatches, split=policy.split).run(
        policy, limits, order
    )


class ListScheduler:
    """:func:`list_schedule` for one cost model, placement and backward form, under many
    policies: what the dependency and cost models say is asked once, not once a run."""

    def __init__(
        self, costs: CostModel, placement: Sequence[int], microbatches: int, *, split: bool
    ) -> None:
        self.costs = costs.for_stages(len(placement))
        self.placement = tuple(placement)
        self.microbatches, self.split = microbatches, split
        deps = Dependencies.planned(placement, microbatches, split=split)
        self._facts = Facts(self.costs, deps, uniform=True)
        self.exact = self._facts.exact(microbatches)

    def run(
        self,
        policy: Policy,
        limits: Sequence[float],
        order: Sequence[Sequence[Step]] | None = None,
    ) -> ListPlan | None:
        """One plan under ``policy`` (see :func:`list_schedule`)."""
        if policy.split != self.split:
            raise ScheduleError(
                f"this list scheduler plans {'split' if self.split else 'full'} backwards; "
                f"the policy asks for {'split' if policy.split else 'full'} ones",
                rule="unsupported",
            )
        return self.run_alike([policy], limits, order)[0]

    def run_alike(
        self,
        policies: Sequence[Policy],
        limits: Sequence[float],
        order: Sequence[Sequence[Step]] | None = None,
        cutoff: float = math.inf,
    ) -> tuple[ListPlan | None, list[int]]:
        """The plan of ``policies[0]``, and the indices of those in ``policies`` with that plan.

        Policies that differ from the first only in ``gap``, ``first`` and
        ``reserve`` mostly take the same decisions: each is followed along the
        same run and dropped at the first decision it would take otherwise, so
        that the ones never dropped share its plan without a run of their own.

        ``cutoff``: give up (``None``) once some rank's end plus its work still to
        do exceeds it: the plan could not end sooner.  ``None`` is shared too,
        for the same reason (a shared run ends where the first one does).
        """
        lead = policies[0]
        if lead.split != self.split:
            raise ScheduleError(
                f"this list scheduler plans {'split' if self.split else 'full'} backwards; "
                f"the policy asks for {'split' if lead.split else 'full'} ones",
                rule="unsupported",
            )
        alike = [
            (k, p)
            for k, p in enumerate(policies)
            if k > 0
            and (p.placement, p.chunks, p.split, p.depth)
            == (lead.placement, lead.chunks, lead.split, lead.depth)
        ]
        run = ListRun(self._facts, self.microbatches, lead, limits, order, alike, cutoff)
        plan = run.run()
        return plan, [0] + [k for k, _ in run.alike]


def replay(schedule: Schedule, costs: CostModel, limits: Sequence[float]) -> ListPlan | None:
    """``schedule``'s F, B, I and W timed as they stand; ``None`` if it exceeds ``limits``.

    The list scheduler's fast path to the makespan the simulator gives a
    compute-only schedule without recompute or offload (one with overlapped
    pairs is timed by the simulator itself).
    """
    base = schedule.compute_only()
    deps = Dependencies(base)
    pairs = [(s, i) for s in range(base.num_stages) for i in range(base.microbatches)]
    uniform = len({deps.split(s, i) for s, i in pairs}) == 1
    facts = Facts(costs.for_stages(base.num_stages), deps, uniform=uniform)
    order = compute_order(base, keep_w=True)
    plan = replayed(facts, base.microbatches, limits, order)
    if plan is None or not base.overlaps:
        return plan
    # An overlapped pair starts only when the inputs of both its actions are ready, which
    # this loop does not model: time such a schedule (dualpipev's) as the simulator does.
    timeline = simulate(base, costs.for_stages(base.num_stages))
    starts = [[e.start for e in evs if e.lane == "compute"] for evs in timeline.events]
    return ListPlan(plan.steps, starts, timeline.makespan, timeline.steady_bubble_rate)
