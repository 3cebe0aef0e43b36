"""Simulator and cost model: timing rules, communication, copies, memory, metrics."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings

from tests.strategies import valid_schedules
from zeropipe.core.costs import CostModel, StageCost
from zeropipe.core.errors import ScheduleError
from zeropipe.core.ir import Action, Kind, Schedule
from zeropipe.core.memory import peak_memory
from zeropipe.core.passes.fuse import fused_weights, group_weights
from zeropipe.core.passes.lower import lower
from zeropipe.core.schedules import generate
from zeropipe.core.simulate import costs_from_timeline, simulate
from zeropipe.core.validate import validate

RECVS = (Kind.RECV_F, Kind.RECV_B)


def test_comm_delays_every_cross_rank_edge_and_same_rank_edges_are_free() -> None:
    s = Schedule.from_text(
        "microbatches: 1\nplacement: 0 1 1\nrank 0: 0F0 0B0\nrank 1: 1F0 2F0 2B0 1B0\n"
    )
    t = simulate(s, CostModel.uniform(3, comm=0.5))
    ev = {str(e.action): e for evs in t.events for e in evs}
    assert ev["1F0"].start == pytest.approx(1.5)  # 0F0 ends at 1, + wire
    assert ev["2F0"].start == pytest.approx(2.5)  # same rank: no wire
    assert ev["0B0"].start == pytest.approx(ev["1B0"].end + 0.5)
    lowered = simulate(lower(s), CostModel.uniform(3, comm=0.5))
    assert lowered.makespan == pytest.approx(t.makespan)


def test_late_receive_post_delays_the_transfer() -> None:
    # The RECV for 1F1 is posted only after 1B0; the wire starts then.
    s = Schedule.from_text(
        "microbatches: 2\nplacement: 0 1\n"
        "rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0RECV_B1 0B0 0B1\n"
        "rank 1: 1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1\n"
    )
    t = simulate(s, CostModel.uniform(2, comm=0.25))
    ev = {str(e.action): e for evs in t.events for e in evs}
    assert ev["1F1"].start == pytest.approx(ev["1B0"].end + 0.25)


def test_posts_occupy_the_rank_and_overhead_lengthens_every_compute_action() -> None:
    # gpipe, 2 ranks, 1 microbatch (F=1, B=2), lowered with each RECV one compute action
    # ahead: rank 0 runs 0RECV_B0 0F0 0SEND_F0 0B0, rank 1 1RECV_F0 1F0 1B0 1SEND_B0.
    # The critical path holds three posts.
    s = lower(generate("gpipe", 2, 1), ahead=1)
    base = simulate(s, CostModel.uniform(2, B=2)).makespan
    assert base == pytest.approx(6.0)
    posted = simulate(s, CostModel.uniform(2, B=2, post=0.25))
    assert posted.makespan == pytest.approx(base + 3 * 0.25)
    ev = {str(e.action): e for evs in posted.events for e in evs}
    assert ev["0SEND_F0"].end - ev["0SEND_F0"].start == pytest.approx(0.25)
    assert ev["0F0"].start == pytest.approx(ev["0RECV_B0"].end)  # one thread: the post first
    assert simulate(s, CostModel.uniform(2, B=2, overhead=0.1)).makespan == pytest.approx(
        base + 4 * 0.1
    )


def test_priced_posts_simulate_an_unlowered_schedule_as_the_runtime_lowers_it() -> None:
    # gpipe, 2 ranks, 1 microbatch: the default lowering puts the two sends on the
    # critical path.  Without SEND/RECV actions in the schedule they would be missed.
    s = generate("gpipe", 2, 1)
    priced = CostModel.uniform(2, B=2, post=0.25)
    t = simulate(s, priced)
    assert t.schedule.is_lowered
    assert t.makespan == pytest.approx(6.0 + 2 * 0.25)
    assert t.makespan == pytest.approx(simulate(lower(s), priced).makespan)
    # The unlowered schedule's graph, given, is replaced by the lowered one's.
    assert simulate(s, priced, graph=validate(s)).makespan == pytest.approx(t.makespan)
    # Free posts, or one rank: simulated as given.
    assert not simulate(s, CostModel.uniform(2, B=2)).schedule.is_lowered
    one = generate("1f1b", 1, 2)
    assert not simulate(one, CostModel.uniform(1, B=2, post=0.25)).schedule.is_lowered
    # Every named schedule: the same prediction, lowered here or by the caller.
    for name in ("1f1b", "interleaved-1f1b", "zbv", "zb-h1"):
        sched = generate(name, 2, 4)
        costs = CostModel.uniform(sched.num_stages, B=2, post=0.1, comm=0.05)
        assert simulate(sched, costs).makespan == pytest.approx(
            simulate(lower(sched), costs).makespan
        )


def test_receives_posted_before_the_first_consumer_leave_the_critical_path() -> None:
    # Default lowering: rank 0 posts 0RECV_B0 after 0F0, while it waits for the gradient.
    s = lower(generate("gpipe", 2, 1))
    assert [str(a) for a in s.actions[0]] == ["0F0", "0SEND_F0", "0RECV_B0", "0B0"]
    base = simulate(s, CostModel.uniform(2, B=2)).makespan
    posted = simulate(s, CostModel.uniform(2, B=2, post=0.25))
    assert posted.makespan == pytest.approx(base + 2 * 0.25)  # the two sends only
    # Every RECV of a rank sits before its first consumer of received data.
    for name in ("1f1b", "interleaved-1f1b", "zbv"):
        lowered = lower(generate(name, 2, 4))
        validate(lowered)
        for acts in lowered.actions:
            kinds = [a.kind for a in acts]
            first_recv = next(k for k, kind in enumerate(kinds) if kind in RECVS)
            last_recv = max(k for k, kind in enumerate(kinds) if kind in RECVS)
            assert all(kind in RECVS for kind in kinds[first_recv : last_recv + 1]), name
    with pytest.raises(ScheduleError, match="ahead"):
        lower(generate("1f1b", 2, 4), ahead=0)


def test_costs_read_back_from_a_timeline_replay_it() -> None:
    s = lower(generate("1f1b", 2, 4))
    truth = CostModel.uniform(2, F=1, B=2, post=0.25)
    timeline = simulate(s, truth)
    measured = costs_from_timeline(timeline)
    assert measured.post == pytest.approx(0.25)
    assert [(c.F, c.time(Kind.B)) for c in measured.stages] == [(1.0, 2.0), (1.0, 2.0)]
    assert simulate(s, measured).makespan == pytest.approx(timeline.makespan)


def test_costs_read_back_from_a_timeline_with_w_in_groups_replay_it() -> None:
    # Deferred W take W_fused and the W that runs the group takes W; the medians read back
    # must price both, or the replay of the grouped schedule comes out wrong.
    truth = CostModel.uniform(4, F=1, I=1, W=1, W_fused=0.25)
    # m=5 in pairs: every stage has lone W besides its pairs, so both figures come back.
    s = lower(group_weights(generate("zbv", 2, 5), 2))
    timeline = simulate(s, truth)
    measured = costs_from_timeline(timeline)
    assert [(c.W, c.W_fused) for c in measured.stages] == [(1.0, 0.25)] * 4
    assert simulate(s, measured).makespan == pytest.approx(timeline.makespan)
    # m=6 in threes: no lone W, so W and W_fused are each the group's time per W --
    # which adds back up to the group's time in the replay.
    s = lower(group_weights(generate("zbv", 2, 6), 3))
    timeline = simulate(s, truth)
    measured = costs_from_timeline(timeline)
    assert [(c.W, c.W_fused) for c in measured.stages] == [(0.5, 0.5)] * 4
    assert simulate(s, measured).makespan == pytest.approx(timeline.makespan)


def test_bandwidth_and_boundary_bytes() -> None:
    c = CostModel((StageCost(boundary_bytes=100.0), StageCost()), latency=0.1, bandwidth=1000.0)
    assert c.transfer_time(0) == pytest.approx(0.2)


def test_copies_overlap_compute_but_consumers_wait_for_them() -> None:
    s = Schedule.from_text(
        "microbatches: 2\nplacement: 0\nrank 0: 0F0 0OFFLOAD0 0F1 0B1 0RELOAD0 0B0\n"
    )
    costs = CostModel((StageCost(OFFLOAD=0.5, RELOAD=3.0),))
    t = simulate(s, costs)
    ev = {str(e.action): e for evs in t.events for e in evs}
    assert ev["0F1"].start == pytest.approx(1.0)  # offload runs beside it
    assert ev["0B0"].start == pytest.approx(ev["0RELOAD0"].end)
    assert t.busy(0) == pytest.approx(6.0)  # copies are not compute
    assert t.peak_memory == [1.0]  # mb 0 is on the host while mb 1 is held


def test_memory_of_recompute_offload_and_split() -> None:
    s = Schedule.from_text(
        "microbatches: 2\nplacement: 0\nrank 0: 0F0 0F1 0OFFLOAD1 0R0 0I0 0RELOAD1 0B1 0W0\n"
    )
    costs = CostModel((StageCost(act=1.0, ckpt=0.25, act_w=0.5),))
    peaks = peak_memory(s, costs)
    # 0F0 ckpt .25; 0F1 full 1 -> 1.25; offload -> .25; R -> 1; I -> .5; reload -> 1.5; B -> .5; W -> 0
    assert peaks[0] == (pytest.approx(1.5), 5)


def test_metrics_definitions() -> None:
    t = simulate(generate("1f1b", 4, 8))
    assert t.makespan == pytest.approx(33.0)
    assert t.bubble_rate == pytest.approx(1 - 4 * 24 / (4 * 33))
    # every rank's span equals the makespan in 1F1B, so steady == plain bubble
    assert t.steady_bubble_rate == pytest.approx(t.bubble_rate)
    summary = t.summary()
    assert summary["peak_memory"] == [4.0, 3.0, 2.0, 1.0]
    assert summary["schedule"] == "1f1b" and summary["ranks"] == 4 and summary["stages"] == 4


@given(valid_schedules())
@settings(max_examples=60, deadline=None)
def test_simulated_timelines_respect_every_dependency(schedule: Schedule) -> None:
    costs = CostModel.uniform(schedule.num_stages, comm=0.3)
    for s in (schedule, lower(schedule)):
        t = simulate(s, costs)
        end = {e.action: e.end for evs in t.events for e in evs}
        for evs in t.events:
            compute = [e for e in evs if e.lane == "compute"]
            for a, b in itertools.pairwise(compute):
                assert b.start >= a.end - 1e-12  # one compute at a time
        assert (
            t.makespan
            <= sum(costs.time(a) for acts in s.actions for a in acts)
            + 0.3 * 4 * s.num_stages * s.microbatches
            + 1e-9
        )
        assert all(math.isfinite(v) for v in end.values())


def test_a_w_run_together_with_the_next_costs_w_fused() -> None:
    grouped = group_weights(generate("zb-h1", 2, 6), 2)
    fused = fused_weights(grouped)
    assert fused
    plain = CostModel.uniform(2, F=1, I=1, W=1)
    cheap = CostModel.uniform(2, F=1, I=1, W=1, W_fused=0.25)
    a, b = simulate(grouped, plain), simulate(grouped, cheap)
    for evs_a, evs_b in zip(a.events, b.events, strict=True):
        for ea, eb in zip(evs_a, evs_b, strict=True):
            want = 0.25 if ea.action in fused else ea.end - ea.start
            assert eb.end - eb.start == pytest.approx(want)
    assert b.makespan < a.makespan
    # Without W_fused a grouped schedule takes what the schedule as given takes, or longer.
    assert a.makespan >= simulate(generate("zb-h1", 2, 6), plain).makespan - 1e-9


def test_cost_spec_parsing() -> None:
    c = CostModel.parse("F=1,B=2,comm=0.5", 2)
    assert c.stages[0].I == 1 and c.stages[0].W == 1 and c.latency == 0.5
    c = CostModel.parse("F=2,I=3,W=1,post=0.2,overhead=0.1", 4, chunks=2)
    assert c.stages[0].F == 1.0 and c.stages[0].act == 0.5
    assert c.post == 0.2 and c.overhead == 0.1  # per action: not divided by chunks
    assert c.stages[0].W_fused is None
    assert CostModel.parse("W=1,I=1,W_fused=0.5", 4, chunks=2).stages[0].W_fused == 0.25
    with pytest.raises(ScheduleError, match="X=1"):
        CostModel.parse("X=1", 2)
    with pytest.raises(ScheduleError, match="not a number"):
        CostModel.parse("F=fast", 2)


def test_cost_model_json_round_trip() -> None:
    c = CostModel(
        (StageCost(F=2.0, boundary_bytes=10.0, W_fused=0.3), StageCost()),
        latency=0.1,
        bandwidth=5.0,
        overhead=0.01,
        post=0.02,
    )
    assert CostModel.from_json(c.to_json()) == c
    assert CostModel.from_json(CostModel.uniform(3).to_json()) == CostModel.uniform(3)


def test_cost_model_stage_count_mismatch_is_reported() -> None:
    with pytest.raises(ScheduleError, match="2 stage"):
        simulate(generate("1f1b", 3, 3), CostModel.uniform(2))


# -- many ranks ---------------------------------------------------------------------------
def test_zbv_builds_only_the_actions_it_keeps(monkeypatch: pytest.MonkeyPatch) -> None:
    """ZB-V pads to 2p - 1 microbatches; building the padding made it quadratic in ranks."""
    import zeropipe.core.schedules.zbv as zbv_module

    built = []

    def counting_action(*args: object) -> Action:
        built.append(args)
        return Action(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(zbv_module, "Action", counting_action)
    ranks, microbatches = 300, 4
    schedule = zbv_module.zbv(ranks, microbatches)
    kept = sum(len(acts) for acts in schedule.actions)
    assert kept == ranks * 2 * microbatches * 3  # F, I, W of two chunks per microbatch
    assert len(built) == kept


def _padded_zbv(ranks: int, microbatches: int) -> list[list[Action]]:
    """ZB-V as first written: built for max(m, 2p - 1) microbatches, then trimmed."""
    from collections import Counter

    F, I, W = Kind.F, Kind.I, Kind.W
    fill = max(microbatches, 2 * ranks - 1)
    out = []
    for rank in range(ranks):
        a, b = rank, 2 * ranks - 1 - rank
        done: Counter[tuple[Kind, int]] = Counter()
        acts: list[Action] = []

        def put(kind: Kind, stage: int) -> None:
            acts.append(Action(kind, stage, done[kind, stage]))  # noqa: B023
            done[kind, stage] += 1  # noqa: B023

        for _ in range(2 * (ranks - rank) - 1):
            put(F, a)
        for _ in range(rank):
            put(F, b)
            put(F, a)
        for _ in range(ranks - rank):
            put(F, b)
            put(I, b)
            put(W, b)
        while done[F, b] < done[F, a] or done[F, a] < fill:
            if done[F, a] < fill:
                put(F, a)
            for kind, stage in ((I, a), (W, a), (F, b), (I, b), (W, b)):
                put(kind, stage)
        for _ in range(rank):
            put(I, a)
            put(I, b)
        for _ in range(ranks - rank):
            put(I, a)
            put(W, a)
        while done[W, b] < done[I, b]:
            put(W, b)
        while done[W, a] < done[I, a]:
            put(W, a)
        out.append([x for x in acts if (x.microbatch or 0) < microbatches])
    return out


@pytest.mark.parametrize("ranks", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("microbatches", [1, 2, 4, 9, 15, 16, 17, 40])
def test_zbv_is_the_padded_and_trimmed_schedule(ranks: int, microbatches: int) -> None:
    schedule = generate("zbv", ranks, microbatches)
    assert [list(acts) for acts in schedule.actions] == _padded_zbv(ranks, microbatches)


def test_finite_costs_whose_sums_overflow_are_a_schedule_error() -> None:
    schedule = generate("1f1b", 4, 8)
    with pytest.raises(ScheduleError, match="past the largest float") as info:
        simulate(schedule, CostModel.parse("F=1e308", 4))
    assert info.value.rule == "costs"
    tiny = simulate(schedule, CostModel.parse("F=5e-324,I=5e-324,W=0", 4))
    assert tiny.makespan > 0  # small is fine


def test_busy_counts_the_halves_of_a_pair_that_ran_at_once_once() -> None:
    # A measured timeline where rank 0's F and B ran at once (an overlapped pair): its busy
    # time is the union of their spans, so the bubble rate is not understated.
    from zeropipe.core.simulate import Event, Timeline

    schedule = generate("1f1b", ranks=1, microbatches=2)
    f0, b0, f1, b1 = schedule.actions[0][:4]
    events = [
        Event(0, 0, f0, 0.0, 1.0),
        Event(0, 1, f1, 1.0, 3.0),  # F of microbatch 1 from 1 to 3 ...
        Event(0, 2, b0, 2.0, 4.0, wait=0.5),  # ... and B of microbatch 0, working from 2.5 to 4
        Event(0, 3, b1, 5.0, 6.0),
    ]
    timeline = Timeline(schedule, [events], peak_memory=[0.0], measured=True)
    assert timeline.busy(0) == pytest.approx(1.0 + 3.0 + 1.0)  # [0, 4) and [5, 6)
    assert timeline.bubble_rate == pytest.approx(1 - 5.0 / 6.0)
