"""The memory passes: where R / OFFLOAD / RELOAD go, and fitting a memory limit."""

from __future__ import annotations

import pytest
import torch.nn.functional as F

from tests.gradcheck import assert_same_gradients, batch_for, mlp, reference
from zeropipe.core.costs import CostModel
from zeropipe.core.errors import ScheduleError
from zeropipe.core.ir import Action, Kind, Schedule
from zeropipe.core.passes.fit import (
    LimitTooLow,
    checkpoint,
    fit_memory,
    offload,
    offload_weights,
    smallest_limit,
)
from zeropipe.core.passes.lower import lower
from zeropipe.core.schedules import GENERATORS, generate
from zeropipe.core.simulate import simulate
from zeropipe.core.validate import validate
from zeropipe.runtime.pipeline import Pipeline


def _grid() -> list[Schedule]:
    out = []
    for name in sorted(GENERATORS):
        for p in (1, 2, 3):
            for m in (1, 2, 4):
                try:
                    out.append(generate(name, p, m))
                except ScheduleError as err:
                    assert err.rule == "unsupported"
    return out


def test_every_generator_stays_valid_under_every_pass() -> None:
    grid = _grid()
    assert len(grid) > 30
    for s in grid:
        for rewritten in (
            checkpoint(s),
            checkpoint(s, ahead=2),
            offload(s),
            offload(checkpoint(s), prefetch=2),
            offload_weights(s),
            offload_weights(offload(checkpoint(s, ahead=1))),
            # Inserted after weight copies: R/RELOAD stay inside their stage's residency.
            offload(checkpoint(offload_weights(s), ahead=2), prefetch=2),
        ):
            validate(rewritten)
        validate(checkpoint(lower(s)))  # a lowered schedule comes back lowered
        assert checkpoint(lower(s)).is_lowered == (s.num_ranks > 1)


def test_placement_of_inserted_actions() -> None:
    s = generate("1f1b", 2, 4)
    rank0 = [str(a) for a in checkpoint(s).actions[0]]
    # R right before its backward: it needs no gradient, so it fills the wait for one.
    assert rank0[rank0.index("0B0") - 1] == "0R0"
    ahead = [str(a) for a in checkpoint(s, ahead=1).actions[0]]
    assert ahead.index("0R1") == ahead.index("0B1") - 2  # one compute action (0F2) between
    off = [str(a) for a in offload(s, [(0, 1)], prefetch=1).actions[0]]
    assert off[off.index("0F1") + 1] == "0OFFLOAD1"
    assert off.index("0RELOAD1") == off.index("0B1") - 2
    # Weight copies: reloaded one compute action ahead (prefetch), offloaded right after.
    w = " ".join(str(a) for a in offload_weights(generate("looped-bfs", 1, 2, chunks=2)).actions[0])
    assert w == "0RELOAD 0F0 1RELOAD 0F1 0OFFLOAD 1F0 1F1 1B1 0RELOAD 1B0 1OFFLOAD 0B1 0B0 0OFFLOAD"


def test_which_pairs_are_chosen() -> None:
    s = generate("gpipe", 2, 3)
    all_but_last = checkpoint(s, lambda stage, mb: mb < 2)
    rs = {
        (a.stage, a.microbatch) for acts in all_but_last.actions for a in acts if a.kind is Kind.R
    }
    assert rs == {(st, i) for st in (0, 1) for i in (0, 1)}
    assert Action(Kind.OFFLOAD, 1, 2) in offload(s, [(1, 2)]).actions[1]
    with pytest.raises(ScheduleError, match=r"no \(stage, microbatch\) \(2, 0\)"):
        checkpoint(s, [(2, 0)])


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1", "zbv"])
def test_fit_from_the_natural_peak_down_to_the_minimum(name: str) -> None:
    s = generate(name, 2, 4)
    costs = CostModel.uniform(s.num_stages, chunks=2 if name == "zbv" else 1)
    natural = max(simulate(s, costs).peak_memory)
    limit, floor = natural, None
    while True:
        try:
            fit = fit_memory(s, limit, costs)
        except ScheduleError as err:
            assert err.rule == "memory" and "smallest limit that fits is" in str(err)
            break
        validate(fit.schedule, memory_limit=limit, costs=costs)
        assert max(simulate(fit.schedule, costs).peak_memory) <= limit + 1e-9
        assert fit.makespan >= fit.base_makespan - 1e-9
        floor = limit
        limit -= 0.25
    assert floor is not None and floor < natural
    # The error's figure is right: the smallest limit that fits does fit.
    with pytest.raises(LimitTooLow) as too_low:
        fit_memory(s, floor - 0.25, costs)
    smallest = max(too_low.value.smallest)
    assert smallest == max(smallest_limit(s, costs))
    assert floor - 0.25 < smallest <= floor
    assert f"{smallest:.4g}" in str(too_low.value)
    fit_memory(s, smallest, costs)


def test_fit_explains_its_choice() -> None:
    said: list[str] = []
    fit = fit_memory(generate("gpipe", 2, 4), 2.0, log=said.append)
    assert said == [fit.explain()]
    assert "natural peak 4" in said[0] and "makespan" in said[0] and "why:" in said[0]
    assert fit.recompute or fit.offload
    untouched = fit_memory(generate("gpipe", 2, 4), 4.0)
    assert "nothing inserted" in untouched.explain() and untouched.schedule == generate(
        "gpipe", 2, 4
    )


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zbv"])
def test_fitted_schedules_fit_when_measured(name: str) -> None:
    model = mlp(dropout=0.2)
    x, y = batch_for(model, batch=8)
    base = generate(name, 2, 4)
    calibration = Pipeline(model, base, loss_fn=F.mse_loss)
    calibration.step(x, y)
    costs = calibration.measured_costs()
    natural = max(calibration.peak_saved_bytes)
    _, ref = reference(model, x, y, F.mse_loss, 4)
    smallest = max(smallest_limit(base, costs))
    steps = 4
    for k in range(steps + 1):
        limit = natural - (natural - smallest) * k / steps
        fit = fit_memory(base, limit, costs)
        pipe = Pipeline(model, fit.schedule, loss_fn=F.mse_loss)
        model.zero_grad(set_to_none=True)
        pipe.step(x, y)
        assert max(pipe.peak_saved_bytes) <= limit, (k, limit, pipe.peak_saved_bytes)
        assert_same_gradients(model.named_parameters(), ref)
