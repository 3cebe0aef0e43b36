"""A torch profiler trace of a step names every action it ran, as torch.distributed.pipelining
names its own: ``PP:`` and the action (``PP:1F3``, ``PP:0I5``, ``PP:2R1``, ``PP:0SEND_B3``),
counted against the schedule the step ran; and no profiler, no names (they cost time)."""

from __future__ import annotations

from collections import Counter
from itertools import pairwise

import pytest
import torch
import torch.nn.functional as F
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile

from tests.gradcheck import batch_for, mlp
from tests.runtime import dist_cases
from zeropipe import RuntimeOptions
from zeropipe.base._compat import profiler_active
from zeropipe.core.ir import Action, Kind, Schedule
from zeropipe.core.passes import fit
from zeropipe.core.passes.build import build_schedule
from zeropipe.runtime.pipeline import Pipeline
from zeropipe.runtime.step import executor


def _names(prof: profile) -> Counter[str]:
    return Counter(e.name for e in prof.events() if e.name.startswith("PP:"))


def _expected(schedule: Schedule, ranks: range) -> Counter[str]:
    return Counter(f"PP:{a}" for r in ranks for a in schedule.actions[r])


def _profiled_step(schedule: Schedule) -> tuple[Pipeline, Counter[str]]:
    model = mlp(layers=4, width=4)
    pipe = Pipeline(model, schedule, loss_fn=F.mse_loss, options=RuntimeOptions(seed=0))
    x, y = batch_for(model, batch=8)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        pipe.step(x, y)
    return pipe, _names(prof)


def test_zbv_names_every_f_i_w_of_every_stage_and_microbatch() -> None:
    pipe, names = _profiled_step(build_schedule("zbv", ranks=2, microbatches=4))
    assert names == _expected(pipe.schedule, range(2))
    # zbv splits every backward: one F, one I and one W per stage and microbatch, no B.
    for kind in (Kind.F, Kind.I, Kind.W):
        assert all(names[f"PP:{Action(kind, s, i)}"] == 1 for s in range(4) for i in range(4))
    assert not any(names[f"PP:{s}B{i}"] for s in range(4) for i in range(4))


def test_1f1b_with_recompute_names_r_and_the_transfers() -> None:
    schedule = build_schedule(fit.checkpoint(build_schedule("1f1b", ranks=2, microbatches=4)))
    pipe, names = _profiled_step(schedule)
    assert names == _expected(pipe.schedule, range(2))
    assert all(names[f"PP:{s}R{i}"] == 1 for s in range(2) for i in range(4))
    assert names["PP:0SEND_F3"] == names["PP:1RECV_F3"] == names["PP:1SEND_B0"] == 1


def test_an_overlapped_pair_is_also_one_span_around_its_two() -> None:
    pipe, names = _profiled_step(build_schedule("dualpipev", ranks=2, microbatches=4))
    acts = pipe.schedule.actions
    order = pipe.graph.order
    # A local run plays the ranks in one graph order, which could part a pair's members;
    # a pair run back to back gets torch's name for it.
    pairs = Counter(
        f"PP:({acts[r][k]};{acts[r][k + 1]})OVERLAP_F_B"
        for (r, k), after in pairwise(order)
        if k in pipe.schedule.overlapped(r) and after == (r, k + 1)
    )
    assert sum(pairs.values()) >= 4
    assert names == _expected(pipe.schedule, range(2)) + pairs


def test_each_gloo_rank_names_the_actions_it_ran() -> None:
    # In the 2-rank launch the distributed tests share (one launch per test session).
    for rank, out in enumerate(dist_cases.main_results(2)):
        got = out["profiler_names"]
        assert "crashed" not in got, got.get("crashed")
        assert got["names"] == got["actions"], f"rank {rank}"
    # zbv on 2 ranks: rank 0 runs stages 0 and 3, rank 1 stages 1 and 2.
    rank0, rank1 = (set(out["profiler_names"]["names"]) for out in dist_cases.main_results(2))
    assert {"PP:0F0", "PP:3I2", "PP:3W3", "PP:0SEND_F1"} <= rank0
    assert {"PP:1F0", "PP:2I2", "PP:2W3", "PP:1RECV_F1"} <= rank1
    assert not rank0 & {"PP:1F0", "PP:2I2"}


def test_no_profiler_no_record_function(monkeypatch: pytest.MonkeyPatch) -> None:
    # An idle record_function costs microseconds per action: none is entered unprofiled.
    entered: list[str] = []

    def counting(name: str) -> record_function:
        entered.append(name)
        return record_function(name)

    monkeypatch.setattr(executor, "record_function", counting)
    model = mlp(layers=4, width=4)
    schedule = build_schedule("zbv", ranks=2, microbatches=4)
    pipe = Pipeline(model, schedule, loss_fn=F.mse_loss)
    x, y = batch_for(model, batch=8)
    assert not profiler_active()
    assert torch.isfinite(pipe.step(x, y))
    assert entered == []
    with profile(activities=[ProfilerActivity.CPU]):
        assert profiler_active()
        pipe.step(x, y)
    assert not profiler_active()
    assert Counter(entered) == _expected(pipe.schedule, range(2))
