"""zeropipe.planning.cluster: the cluster-scale search, its lower bound and its memory plans,
on synthetic cost factories (seconds and bytes) whose answers can be checked by hand."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from zeropipe.core.costs import CostModel, StageCost
from zeropipe.core.errors import ScheduleError
from zeropipe.core.ir import Schedule
from zeropipe.core.passes.build import build_schedule
from zeropipe.core.schedules import GENERATORS, generate
from zeropipe.core.simulate import simulate
from zeropipe.planning.cluster import (
    Candidate,
    Config,
    CostFactory,
    Ranking,
    fixed_costs,
    lower_bound,
    schedule_cut,
    search,
)
from zeropipe.planning.step_bound import Shape

LAYERS = 8
NAMED = ["gpipe", "1f1b", "zb-h1", "zb-h2", "interleaved-1f1b", "zbv", "dualpipev", "dualpipe"]


def factory(
    *,
    layers: int = LAYERS,
    F: float = 1.0,
    I: float = 1.0,
    W: float = 1.0,
    act: float = 10.0,
    act_w: float = 0.0,
    weights: float = 100.0,
    comm: float = 0.0,
    grad_bytes: float = 4.0,
    dp_bandwidth: float = 8.0,
    dp_latency: float = 0.01,
) -> CostFactory:
    """Per layer and per sample: times ``F``, ``I``, ``W`` (seconds); bytes ``act``
    (a checkpointed forward keeps a tenth), ``weights`` and ``grad_bytes``."""

    def costs_for(c: Config) -> CostModel:
        per = layers / c.stages
        b = c.microbatch_size
        stage = StageCost(
            F=per * F * b,
            I=per * I * b,
            W=per * W * b,
            act=per * act * b,
            act_w=per * act_w * b,
            ckpt=per * act * b / 10 if c.recompute else 0.0,
            weights=per * weights,
            grad_bytes=per * grad_bytes,
        )
        return CostModel(
            tuple(stage for _ in range(c.stages)),
            latency=comm,
            unit="bytes",
            dp=c.dp,
            dp_latency=dp_latency if c.dp > 1 else 0.0,
            dp_bandwidth=dp_bandwidth,
        )

    return costs_for


def run(**kwargs: object) -> Ranking:
    options: dict[str, object] = {
        "gpus": 8,
        "layers": LAYERS,
        "global_batch": 16,
        "costs_for": factory(),
        "memory": None,
        "schedules": NAMED,
        "microbatch_sizes": [1, 2],
        "flops_per_sample": 1.0,
        "peak_flops": 1.0,
        "seq": 1,
        "top": 6,
    }
    options.update(kwargs)
    return search(**options)  # type: ignore[arg-type]


def test_ranking_is_sorted_fitting_first_then_by_step_time() -> None:
    # 230 bytes: a 1-deep pipeline's 800 bytes of weights never fit, deep ones do.
    ranking = run(memory=230.0, top=15, schedules=["gpipe", "1f1b", "zbv"])
    cands = ranking.candidates
    assert cands and any(c.fits for c in cands) and any(not c.fits for c in cands)
    keys = [(not c.fits, c.step_time) for c in cands]
    assert keys == sorted(keys)
    assert all(c.peak_memory <= 230.0 for c in cands if c.fits)
    assert ranking.best is cands[0] and cands[0].timeline is not None


@pytest.mark.parametrize("memory", [None, 240.0, 150.0])
def test_pruning_never_changes_the_top(memory: float | None) -> None:
    costs = factory(comm=0.05, act_w=3.0)
    pruned = run(costs_for=costs, memory=memory, top=5)
    full = run(costs_for=costs, memory=memory, top=5, prune=False)
    assert pruned.candidates == full.candidates
    assert full.pruned == 0 and pruned.pruned > 0
    assert pruned.priced < full.priced


@pytest.mark.parametrize("name", NAMED)
@pytest.mark.parametrize("dp", [1, 4])
def test_the_bound_is_below_every_simulated_step(name: str, dp: int) -> None:
    chunks = 2 if name in ("interleaved-1f1b", "zbv", "dualpipev") else 1
    pp, m = 4, 8
    config = Config(pp, dp, 1, m, pp * chunks)
    costs = factory(comm=0.1, W=0.5)(config)
    sched = build_schedule(name, ranks=pp, microbatches=m, chunks=chunks, reduce_grad=dp > 1)
    costs = costs.with_copies(sched)  # dualpipe: its copies cost what their originals do
    split = any(a.kind.value in ("I", "W") for acts in sched.actions for a in acts)
    routes = Shape.probe(name, pp, chunks, m).routes(m)  # dualpipe: half down, half up
    bound = lower_bound(costs, sched.placement, m, split=split, routes=routes)
    assert 0 < bound <= simulate(sched, costs).makespan + 1e-9


def test_the_bound_is_1f1b_closed_form_on_uniform_costs() -> None:
    # (m + p - 1)(F + B) for a uniform 1F1B without wires: the bound is exact there.
    pp, m = 4, 8
    costs = factory()(Config(pp, 1, 1, m, pp))
    per = LAYERS / pp
    expected = (m + pp - 1) * per * 3
    bound = lower_bound(costs, tuple(range(pp)), m, split=False)
    assert bound == pytest.approx(expected)
    assert simulate(build_schedule("1f1b", ranks=pp, microbatches=m), costs).makespan == (
        pytest.approx(expected)
    )


def test_a_tight_limit_brings_recompute_and_a_tighter_one_unfit() -> None:
    schedules = ["1f1b"]
    free = run(memory=None, schedules=schedules, top=40)
    deep = next(c for c in free.candidates if c.pp == 8 and c.microbatch_size == 1)
    assert deep.memory_plan == "none"
    weights = 100.0  # pp 8: one layer per rank
    limit = (weights + deep.peak_memory) / 2
    tight = run(memory=limit, schedules=schedules, top=40, pp_options=[8])
    planned = next(c for c in tight.candidates if c.microbatch_size == 1)
    assert planned.fits and planned.peak_memory <= limit
    assert "recompute" in planned.memory_plan or "offload" in planned.memory_plan
    assert planned.step_time > deep.step_time  # recompute costs time
    over = run(memory=weights / 2, schedules=schedules, top=40, pp_options=[8])
    assert all(not c.fits and c.memory_plan.startswith("over") for c in over.candidates)


def test_small_pipelines_fit_memory_and_large_ones_recompute_by_share() -> None:
    # pp 2, m 4: 8 (stage, microbatch) pairs go to fit_memory; pp 8, m 16 gets a share.
    small = run(gpus=2, global_batch=4, microbatch_sizes=[1], schedules=["1f1b"], top=1,
                memory=400 + 45.0, pp_options=[2])  # fmt: skip
    assert small.candidates[0].fits
    assert small.candidates[0].memory_plan.endswith("(fit_memory)")
    large = run(gpus=8, global_batch=16, microbatch_sizes=[1], schedules=["1f1b"], top=1,
                memory=100 + 35.0, pp_options=[8])  # fmt: skip
    best = large.candidates[0]
    assert best.fits and best.memory_plan.startswith("recompute")
    assert best.peak_memory <= 135.0


def test_mfu_and_tokens_by_hand() -> None:
    # One GPU, one stage, one microbatch of 2 samples: F 2 s, B 4 s: a 6 s step.
    ranking = run(
        gpus=1, layers=1, global_batch=2, microbatch_sizes=[2], schedules=["gpipe"],
        costs_for=factory(layers=1), flops_per_sample=30.0, peak_flops=100.0, seq=50,
    )  # fmt: skip
    (c,) = ranking.candidates
    assert (c.pp, c.dp, c.microbatches, c.step_time) == (1, 1, 1, pytest.approx(6.0))
    assert c.tokens_per_second == pytest.approx(2 * 50 / 6.0)
    assert c.mfu == pytest.approx(30.0 * 2 / (6.0 * 1 * 100.0))
    assert c.bubble == pytest.approx(0.0)


def test_data_parallel_prices_the_all_reduce() -> None:
    # 2 GPUs, pp 1 x dp 2: the step ends with the all-reduce of 8 layers x 4 bytes.
    ranking = run(gpus=2, global_batch=2, microbatch_sizes=[1], schedules=["gpipe"], top=5)
    (c,) = [c for c in ranking.candidates if c.pp == 1]
    reduce = 0.01 + 2 * (2 - 1) / 2 * (LAYERS * 4.0) / 8.0
    assert c.step_time == pytest.approx(LAYERS * 3 + reduce)


def test_candidate_round_trips_through_a_dict() -> None:
    c = run(top=1).candidates[0]
    again = Candidate.from_dict(c.to_dict())
    assert again == c and again.timeline is None
    with pytest.raises(ScheduleError, match="needs"):
        Candidate.from_dict({"pp": 1})


def test_errors_name_what_is_wrong() -> None:
    with pytest.raises(ScheduleError, match="unknown schedule"):
        run(schedules=["nope"])
    with pytest.raises(ScheduleError, match="global batch"):
        run(gpus=8, global_batch=1, microbatch_sizes=[2])
    with pytest.raises(ScheduleError, match="gpus"):
        run(gpus=0)


def test_auto_is_searched_for_the_best_bounds_only() -> None:
    ranking = run(schedules=["1f1b", "auto"], auto_runs=1, auto_budget=1.0, top=20)
    assert any(c.schedule == "auto" for c in ranking.candidates)
    assert ranking.notes and "auto ran for the 1" in ranking.notes[0]


def test_fixed_costs_merge_and_cut_stages() -> None:
    base = factory()(Config(2, 1, 1, 4, 4))  # 4 stages of 2 layers
    costs_for = fixed_costs(base)
    same = costs_for(Config(2, 1, 1, 4, 4))
    merged = costs_for(Config(2, 1, 1, 4, 2))
    cut = costs_for(Config(2, 3, 1, 4, 8))
    assert same.stages == base.stages
    assert [s.F for s in merged.stages] == [4.0, 4.0]
    assert [s.F for s in cut.stages] == [1.0] * 8 and cut.dp == 3
    assert math.isclose(sum(s.weights for s in cut.stages), sum(s.weights for s in base.stages))
    # Fewer stages than measured that do not divide them: the cut with the fastest
    # slowest group (4 equal stages into 3: balance puts the group of two last).
    assert [s.F for s in costs_for(Config(3, 1, 1, 4, 3)).stages] == [2.0, 2.0, 4.0]
    with pytest.raises(ScheduleError, match="or a multiple"):
        costs_for(Config(3, 1, 1, 4, 6))
    assert replace(base, dp=1) == same


def test_schedule_cut_cuts_each_schedule_for_its_own_step() -> None:
    # An embedding-like first layer and a head-like last one, six light blocks between:
    # zbv pairs the first and last stages on rank 0, so its best cut is not balance's.
    heavy, light = StageCost(F=3.0, I=3.0, W=1.0), StageCost(F=1.0, I=1.0, W=1.0)
    layers = CostModel((heavy, *[light] * 6, heavy))
    config = Config(2, 1, 1, 8, 4)
    zbv = generate("zbv", 2, 8)
    by_balance = simulate(zbv, fixed_costs(layers)(config)).makespan
    own = schedule_cut(layers)(config, zbv)
    assert sum(own.meta["cut"]) == 8
    assert simulate(zbv, own).makespan < by_balance
    # Priced through the search, zbv's step is the one under its own cut.
    ranking = search(
        gpus=2, layers=8, global_batch=8, costs_for=fixed_costs(layers), memory=None,
        schedules=["zbv", "1f1b"], microbatch_sizes=[1], flops_per_sample=0.0,
        peak_flops=0.0, seq=0, pp_options=[2], costs_for_schedule=schedule_cut(layers),
    )  # fmt: skip
    got = {c.schedule: c.step_time for c in ranking.candidates}
    assert got["zbv"] == simulate(zbv, own).makespan
    one = generate("1f1b", 2, 8)
    assert got["1f1b"] == simulate(one, schedule_cut(layers)(Config(2, 1, 1, 8, 2), one)).makespan


@pytest.mark.parametrize("name", NAMED)
def test_a_recompute_share_fits_what_it_says_on_every_schedule(name: str) -> None:
    # pp 4, m 8: 32+ (stage, microbatch) pairs, past fit_memory's size: the per-rank share.
    costs = factory(act_w=2.0)
    free = run(gpus=4, global_batch=8, microbatch_sizes=[1], schedules=[name], pp_options=[4],
               costs_for=costs)  # fmt: skip
    natural = free.candidates[0]
    weights = 400.0 if name == "dualpipe" else 200.0  # 2 layers per rank (dualpipe: twice)
    limit = weights + (natural.peak_memory - weights) * 0.6
    ranking = run(gpus=4, global_batch=8, microbatch_sizes=[1], schedules=[name],
                  pp_options=[4], memory=limit, costs_for=costs)  # fmt: skip
    c = ranking.candidates[0]
    if c.fits:
        assert c.memory_plan.startswith("recompute") and c.peak_memory <= limit + 1e-9
    else:  # W keeps act_w whatever is recomputed: the plan says what it would need
        assert c.memory_plan.startswith("over: needs")


def test_spec_costs_price_offload_and_shard_the_optimizer_over_dp() -> None:
    from zeropipe.planning.cluster import spec_costs
    from zeropipe.planning.specs import load_hardware, load_model

    model, gpu = load_model("llama-3-8b"), load_hardware("h100-sxm")
    config = Config(4, 8, 1, 8, 4)
    plain = spec_costs(model, gpu, seq=1024)(config)
    sharded = spec_costs(model, gpu, seq=1024, shard_optimizer=True)(config)
    for p, s in zip(plain.stages, sharded.stages, strict=True):
        assert s.weights == pytest.approx(p.weights * (6 + 12 / 8) / 18)
        assert p.OFFLOAD == p.RELOAD == pytest.approx(p.act / gpu.host_bandwidth)
        assert p.OFFLOAD > 0
    assert plain.unit == "bytes" and plain.dp == 8 and plain.meta["time_unit"] == "s"


# -- tensor parallelism ---------------------------------------------------------------------
def tp_factory(comm: float = 0.3) -> CostFactory:
    """``factory()`` with each stage on ``tp`` GPUs: times, activations and weights divided
    by tp, plus ``comm`` seconds of collectives per layer and microbatch sample each way."""
    plain = factory()

    def costs_for(c: Config) -> CostModel:
        base = plain(replace(c, tp=1))
        extra = comm * LAYERS / c.stages * c.microbatch_size if c.tp > 1 else 0.0
        stages = tuple(
            replace(s.scaled(1 / c.tp), F=s.F / c.tp + extra, I=s.I / c.tp + extra)
            for s in base.stages
        )
        return replace(base, stages=stages)

    return costs_for


def test_layouts_are_every_pp_dp_tp_the_options_allow() -> None:
    from zeropipe.planning.cluster import layouts

    every = layouts(8, 8, tp_options=(1, 2, 4))
    assert all(pp * dp * tp == 8 for pp, dp, tp in every)
    assert len(every) == 4 + 3 + 2  # divisors of 8, 4 and 2
    assert layouts(8, 2, tp_options=(1,)) == [(1, 8, 1), (2, 4, 1)]  # pp <= layers
    assert layouts(8, 8, pp_options=[2], dp_options=[2], tp_options=(1, 2, 4)) == [(2, 2, 2)]
    assert layouts(8, 8, tp_options=(3,)) == []


def test_the_search_prices_tp_and_keeps_pp_x_dp_x_tp_at_the_gpus() -> None:
    # Without memory pressure tensor parallelism only adds collectives: tp 1 wins; with
    # 130 bytes (weights 800 / pp / tp) only pp x tp >= 8 fits, and tp saves the bubble.
    free = run(costs_for=tp_factory(comm=0.05), tp_options=(1, 2, 4), top=60)
    assert {c.tp for c in free.candidates} >= {1, 2} and free.best is not None
    assert free.best.tp == 1
    for c in free.candidates:
        assert c.pp * c.dp * c.tp == 8 and c.dp * c.microbatch_size * c.microbatches == 16
    tight = run(costs_for=tp_factory(comm=0.0), tp_options=(1, 2, 4, 8), memory=130.0, top=40)
    fitting = [c for c in tight.candidates if c.fits]
    assert fitting and all(c.pp * c.tp >= 8 for c in fitting)
    assert tight.best is not None and tight.best.tp > 1
    # Restricted: only what the options allow.
    only = run(costs_for=tp_factory(), tp_options=(2,), pp_options=[2], top=40)
    assert {(c.pp, c.dp, c.tp) for c in only.candidates} == {(2, 2, 2)}
    with pytest.raises(ScheduleError, match="no pp x dp x tp = 8"):
        run(costs_for=tp_factory(), tp_options=(3,))
    with pytest.raises(ScheduleError, match="tp options must be whole numbers >= 1"):
        run(costs_for=tp_factory(), tp_options=(0, 1))


def test_a_measured_cost_model_refuses_tp_and_an_old_candidate_has_tp_1() -> None:
    base = factory()(Config(2, 1, 1, 4, 2))
    with pytest.raises(ScheduleError, match="cannot price tp 2"):
        fixed_costs(base)(Config(2, 1, 1, 4, 2, tp=2))
    c = run(top=1).candidates[0]
    old = {k: v for k, v in c.to_dict().items() if k != "tp"}
    assert Candidate.from_dict(old).tp == 1 and Candidate.from_dict(c.to_dict()) == c


def test_spec_costs_give_each_config_its_tp() -> None:
    from zeropipe.planning.cluster import spec_costs
    from zeropipe.planning.specs import load_hardware, load_model

    model, gpu = load_model("llama-3-8b"), load_hardware("h100-sxm")
    costs_for = spec_costs(model, gpu, seq=1024, sequence_parallel=False, grad_bytes=2.0)
    one, four = costs_for(Config(4, 2, 1, 8, 4)), costs_for(Config(4, 2, 1, 8, 4, tp=4))
    assert four.meta["tp"] == 4 and four.meta["sequence_parallel"] is False
    assert sum(s.weights for s in four.stages) < sum(s.weights for s in one.stages) / 3.9
    assert one.stages[1].reduced_bytes == pytest.approx(one.stages[1].weights / 18 * 2)


# -- memory plans at scale -------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_recompute_rewrites_as_checkpoint_does(name: str) -> None:
    from zeropipe.core.passes.fit import checkpoint
    from zeropipe.planning.plan_memory import recompute

    for p, m, v in ((2, 4, 2), (4, 8, 2), (3, 9, 1), (4, 12, 3)):
        try:
            s = generate(name, p, m, v)
        except ScheduleError:
            continue
        for which in (None, lambda st, i: (st + i) % 3 == 0):
            fast, slow = recompute(s, which), checkpoint(s, which)
            assert fast.actions == slow.actions and set(fast.overlaps) == set(slow.overlaps)
    lowered = build_schedule("1f1b", ranks=2, microbatches=4)  # not plain: checkpoint's way
    assert recompute(lowered).actions == checkpoint(lowered).actions


@pytest.mark.parametrize("name", sorted(set(GENERATORS) - {"auto"}))
def test_the_offload_floor_is_within_two_inputs_of_the_rewrite(name: str) -> None:
    from zeropipe.core.passes.fit import checkpoint, offload
    from zeropipe.planning.plan_memory import offload_floor, peaks

    costs_for = factory(act_w=3.0)
    for p, m, v in ((2, 4, 2), (4, 8, 2), (4, 12, 1)):
        try:
            s = generate(name, p, m, v)
        except ScheduleError:
            continue
        costs = costs_for(Config(p, 1, 1, m, s.num_stages, recompute=True))
        slack = 2 * max(c.ckpt for c in costs.stages)
        floor, true = offload_floor(s, costs), peaks(offload(checkpoint(s)), costs)
        for low, high in zip(floor, true, strict=True):
            assert low <= high + 1e-9 and high <= low + slack + 1e-9


def test_an_offload_plan_is_rewritten_when_it_is_run() -> None:
    from zeropipe.core.passes.fit import checkpoint, offload
    from zeropipe.planning.plan_memory import offload_floor, plan_memory

    costs_for = factory()
    s = generate("gpipe", 4, 16)  # holds every microbatch: only offload fits it
    natural = costs_for(Config(4, 1, 1, 16, 4))
    ckpt = costs_for(Config(4, 1, 1, 16, 4, recompute=True))
    limit = max(offload_floor(s, ckpt)) + 2 * max(c.ckpt for c in ckpt.stages)
    plan = plan_memory(s, natural, ckpt, limit)
    assert plan.fits and plan.plan == "recompute + offload all" and plan.offloaded
    assert plan.schedule is s and plan.final().actions == offload(checkpoint(s)).actions
    assert max(peaks_of(plan.final(), ckpt)) <= limit


def peaks_of(schedule: Schedule, costs: CostModel) -> list[float]:
    from zeropipe.planning.plan_memory import peaks

    return peaks(schedule, costs)


def _overlapped(overlap: float = 0.5, **kwargs: float) -> CostFactory:
    """:func:`factory`'s costs with ``overlap`` of each F/B pair hidden (a MoE's all-to-all)."""
    plain = factory(**kwargs)
    return lambda config: replace(plain(config), overlap=overlap)


def test_dualpipe_is_ranked_with_its_weights_twice_and_priced_as_generated() -> None:
    ranking = run(costs_for=_overlapped(), gpus=4, pp_options=[4], schedules=["dualpipe", "zbv"])
    best = ranking.best
    assert best is not None and best.schedule == "dualpipe" and best.chunks == 1
    zbv = next(c for c in ranking.candidates if c.schedule == "zbv")
    assert best.step_time < zbv.step_time
    config = Config(4, 1, best.microbatch_size, best.microbatches, 4)
    made = build_schedule("dualpipe", ranks=4, microbatches=best.microbatches)
    priced = _overlapped()(config).with_copies(made)
    assert best.step_time == pytest.approx(simulate(made, priced).makespan)
    # 2 layers of 100 bytes per model stage, held twice on a rank: 400 bytes of weights.
    stage = priced.stages[0]
    assert stage.weights == 200.0 and priced.stages[7] == stage
    assert best.peak_memory == pytest.approx(400.0 + 5 * stage.act)  # PP + 1 in flight


def test_dualpipe_wins_the_default_search_where_its_two_directions_pay() -> None:
    ranking = run(costs_for=_overlapped(), top=3)
    assert [c.schedule for c in ranking.candidates[:2]] == ["dualpipe", "dualpipe"]
    best_other = run(costs_for=_overlapped(), top=1, schedules=NAMED[:-1]).best
    assert best_other is not None and ranking.candidates[0].step_time < best_other.step_time


@pytest.mark.parametrize(
    ("pp", "batch", "why"),
    [
        (1, 16, "pp 1, 2 microbatches: dualpipe needs an even number of ranks"),
        (8, 8, "pp 8, 8 microbatches: dualpipe needs an even number of microbatches >= 2 x "),
    ],
)
def test_dualpipe_is_refused_in_one_line_where_it_cannot_run(pp: int, batch: int, why: str) -> None:
    said = "dualpipe: 1 configuration(s) refused, none priced; e.g. " + why
    grid = {"gpus": 8, "pp_options": [pp], "global_batch": batch, "microbatch_sizes": [1]}
    with pytest.raises(ScheduleError) as err:
        run(**grid, schedules=["dualpipe"])
    assert str(err.value).startswith("nothing to price: " + said)
    ranking = run(**grid, schedules=["dualpipe", "1f1b"])
    notes = [n for n in ranking.notes if n.startswith("dualpipe: ")]
    assert len(notes) == 1 and notes[0].startswith(said) and "\n" not in notes[0]


def test_schedule_cut_prices_dualpipe_on_its_model_stages_and_their_copies() -> None:
    heavy, light = StageCost(F=3.0, I=3.0, W=1.0, weights=2.0), StageCost(F=1.0, weights=1.0)
    layers = CostModel((heavy, *[light] * 6, heavy))
    config = Config(2, 1, 1, 8, 2)
    made = generate("dualpipe", 2, 8)
    priced = schedule_cut(layers)(config, made)
    cut = fixed_costs(layers)(config).stages  # balance's cut into the 2 model stages
    assert priced.stages == cut + cut


def test_auto_in_the_cluster_search_picks_dualpipe_with_its_copies() -> None:
    ranking = run(costs_for=_overlapped(), gpus=2, pp_options=[2], schedules=["auto"])
    best = ranking.best
    assert best is not None and best.schedule == "auto" and best.timeline is not None
    assert best.timeline.schedule.copies == ((2, 0), (3, 1))
    assert best.chunks == 1 and best.peak_memory >= 2 * 400.0  # 4 layers per stage, twice


@pytest.mark.parametrize("name", ["dualpipev", "dualpipe"])
@pytest.mark.parametrize(("pp", "m"), [(2, 8), (4, 8), (4, 16)])
def test_the_bound_stays_below_the_step_when_pairs_hide_part_of_their_halves(
    name: str, pp: int, m: int
) -> None:
    # Overlapped pairs take less than their two halves: a bound that summed the halves
    # whole would lie above the step and prune a schedule that can win.
    shape = Shape.probe(name, pp, 2 if name == "dualpipev" else 1, m)
    stages = len(shape.placement) - len(shape.sample.copies)
    costs = _overlapped(0.5)(Config(pp, 1, 1, m, stages)).with_copies(shape.sample)
    step = simulate(build_schedule(name, ranks=pp, microbatches=m), costs).makespan
    assert shape.bound(costs, m) <= step
    whole = lower_bound(costs, shape.placement, m, split=shape.split, routes=shape.routes(m))
    assert whole > step  # the halves counted whole: what the bound must not do
