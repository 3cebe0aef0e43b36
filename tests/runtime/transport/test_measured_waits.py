"""Measured waits: the time an action spends blocked for received data is its wait, not its work.

Two gloo processes run a pipeline whose first stage sleeps in its forward on
rank 0 only; rank 1's forwards then block for their inputs.  The executor
records that time as the event's ``wait``: the event's work starts when the
data arrived, and every bubble figure (``Timeline``, ``train_report``) counts
the wait as idle.  The drawings show it apart from the work.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from zeropipe.core.ir import Action, Kind
from zeropipe.core.passes.lower import lower
from zeropipe.core.render import render_text, to_chrome_trace
from zeropipe.core.schedules.registry import generate
from zeropipe.core.simulate import Event, Timeline, costs_from_timeline, simulate, transfer_latency

SLEEP = 0.15  # seconds rank 0's stage sleeps in each forward


class _SleepOnRankZero(nn.Module):
    """Identity, but rank 0 of a process group sleeps first (a slow stage)."""

    def forward(self, x: Tensor) -> Tensor:
        if dist.is_initialized() and dist.get_rank() == 0 and torch.is_grad_enabled():
            time.sleep(SLEEP)
        return x


def _delayed(rank: int, world: int) -> dict[str, Any]:
    from zeropipe.apps.train.report import bubble_rate
    from zeropipe.runtime.pipeline import Pipeline

    torch.manual_seed(0)
    model = nn.Sequential(
        _SleepOnRankZero(), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
    ).double()
    pipe = Pipeline(model, "1f1b", microbatches=2, loss_fn=F.mse_loss, balance=[2, 2])
    x, y = torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)
    pipe.step(x, y)  # the first step learns shapes and lines the ranks up
    dist.barrier()
    start = time.perf_counter()
    pipe.step(x, y)
    elapsed = time.perf_counter() - start
    timeline = pipe.timeline()
    events = [(str(e.action), e.start, e.end, e.wait) for e in timeline.events[rank]]
    every: list[Any] = [None] * world
    dist.all_gather_object(every, timeline.events[rank])
    whole = Timeline(pipe.schedule, every, peak_memory=[], memory_unit="bytes", measured=True)
    return {
        "latency": transfer_latency(whole),
        "events": events,
        "busy": timeline.busy(rank),
        "last_waits": {k.value: v for k, v in pipe.last_waits.items()},
        "bubble": bubble_rate(pipe, elapsed, world),
        "elapsed": elapsed,
    }


@pytest.fixture(scope="module")
def delayed() -> list[dict[str, Any]]:
    from zeropipe.runtime.launch import launch

    return launch(_delayed, 2, timeout=120.0)


def test_the_consuming_forward_waits_and_then_works_briefly(
    delayed: list[dict[str, Any]],
) -> None:
    forwards = {name: (start, end, wait) for name, start, end, wait in delayed[1]["events"]}
    for name in ("1F0", "1F1"):
        start, end, wait = forwards[name]
        # Rank 0 slept SLEEP before sending: rank 1 blocked most of that for its input.
        assert wait >= SLEEP / 2, (name, wait)
        # What is left is the forward of two 8x8 linears and a loss: far below the sleep.
        assert end - start - wait < SLEEP / 4, (name, end - start, wait)
    # Rank 0's own forwards wait for nothing: their sleep is work.
    for name, start, end, wait in delayed[0]["events"]:
        if name.startswith("0F"):
            assert wait == 0.0 and end - start >= SLEEP * 0.9, (name, wait, end - start)


def test_the_latency_is_from_the_send_to_the_waiting_consumer(
    delayed: list[dict[str, Any]],
) -> None:
    # Rank 1's forwards waited for rank 0's sleeping stage: their data was ready soon after
    # rank 0 sent it (loopback), far sooner than the sleep, and not before it was sent.
    assert 0.0 <= delayed[0]["latency"] < SLEEP / 4
    assert delayed[0]["latency"] == delayed[1]["latency"]


def _lowered_timeline(gap: float, skew: float = 0.0) -> Timeline:
    """1f1b on 2 ranks, lowered: rank 1's first forward waits for rank 0's first send and
    is ready ``gap`` after it; rank 1's clock is ``skew`` behind."""
    schedule = lower(generate("1f1b", 2, 2))
    sends: dict[str, float] = {}
    events: list[list[Event]] = [[], []]
    t = 0.0
    for k, a in enumerate(schedule.actions[0]):
        events[0].append(Event(0, k, a, t, t + 1.0))
        sends[str(a)] = t + 1.0
        t += 1.0
    t = 0.0
    for k, a in enumerate(schedule.actions[1]):
        wait = 0.0
        if str(a) == "1F0":
            wait = max(0.0, sends["0SEND_F0"] + gap - t)
        events[1].append(Event(1, k, a, t - skew, t + wait + 1.0 - skew, wait=wait))
        t += wait + 1.0
    return Timeline(schedule, events, peak_memory=[], memory_unit="bytes", measured=True)


def test_transfer_latency_pairs_a_waiting_consumer_with_its_send() -> None:
    timeline = _lowered_timeline(gap=0.25)
    assert transfer_latency(timeline) == pytest.approx(0.25)
    costs = costs_from_timeline(timeline)
    assert costs.latency == pytest.approx(0.25)
    # The planned timeline pays it: rank 1's first forward starts 0.25 after the send.
    planned = simulate(timeline.schedule, costs)
    f0 = next(e for e in planned.events[1] if str(e.action) == "1F0")
    send = next(e for e in planned.events[0] if str(e.action) == "0SEND_F0")
    assert f0.start >= send.end + 0.25 - 1e-9
    # Clocks that are not shared (ranks on two machines) give negative gaps: no latency.
    assert transfer_latency(_lowered_timeline(gap=0.25, skew=5.0)) == 0.0
    # Nobody waited: nothing measured.
    assert transfer_latency(_measured_with_a_wait()) == 0.0


def test_the_waits_add_up_to_what_the_receives_blocked(delayed: list[dict[str, Any]]) -> None:
    for out in delayed:
        total = sum(wait for *_, wait in out["events"])
        assert total == pytest.approx(sum(out["last_waits"].values()), abs=1e-6)
    assert delayed[1]["last_waits"]["RECV_F"] >= SLEEP


def test_bubbles_count_the_waits_as_idle(delayed: list[dict[str, Any]]) -> None:
    out = delayed[1]
    spans = sum(end - start for name, start, end, _ in out["events"] if _compute(name))
    waits = sum(wait for name, *_, wait in out["events"] if _compute(name))
    assert waits >= SLEEP
    assert out["busy"] == pytest.approx(spans - waits, abs=1e-9)
    # train_report's bubble over both ranks: the waits alone are idle for at least
    # waits / (2 x elapsed); counted as work (the old figure) the bubble would be lower.
    all_waits = sum(wait for o in delayed for *_, wait in o["events"])
    for o in delayed:  # each rank divides the same busy sum by its own step time
        assert o["bubble"] >= all_waits / (2 * o["elapsed"]) - 1e-9, (o["bubble"], all_waits)


def _compute(name: str) -> bool:
    return Action.parse(name).kind in (Kind.F, Kind.B, Kind.I, Kind.W, Kind.R)


def _measured_with_a_wait() -> Timeline:
    schedule = generate("1f1b", 2, 2)
    events: list[list[Event]] = []
    for rank, acts in enumerate(schedule.actions):
        t, evs = 0.0, []
        for k, a in enumerate(acts):
            wait = 0.5 if (rank, k) == (1, 0) else 0.0
            evs.append(Event(rank, k, a, t, t + wait + 1.0, wait=wait))
            t += wait + 1.0
        events.append(evs)
    return Timeline(schedule, events, peak_memory=[], memory_unit="bytes", measured=True)


def test_event_stays_compatible() -> None:
    a = Action(Kind.F, 0, 0)
    e = Event(0, 0, a, 1.0, 3.0)
    assert (e.wait, e.ready, e.work) == (0.0, 1.0, 2.0)
    waited = Event(0, 0, a, 1.0, 3.0, wait=0.5)
    assert (waited.ready, waited.work) == (1.5, 1.5)


def test_planned_costs_leave_the_wait_out() -> None:
    timeline = _measured_with_a_wait()
    costs = costs_from_timeline(timeline)
    forward = costs.stages[1].F
    assert forward == pytest.approx(1.0)  # not 1.5: the wait is not work
    assert timeline.busy(1) == pytest.approx(len(timeline.events[1]) * 1.0)


def test_trace_and_grid_show_the_wait_apart() -> None:
    timeline = _measured_with_a_wait()
    trace = to_chrome_trace(timeline)
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    waits = [e for e in complete if e["name"] == "wait"]
    assert len(waits) == 1 and waits[0]["args"]["for"] == "1F0"
    assert waits[0]["dur"] == pytest.approx(0.5e6)
    f0 = next(e for e in complete if e["name"] == "1F0")
    assert f0["ts"] == pytest.approx(0.5e6) and f0["dur"] == pytest.approx(1e6)
    json.dumps(trace)
    grid = render_text(timeline, width=40)
    row1 = next(line for line in grid.splitlines() if line.startswith("rank 1"))
    assert row1[9:].startswith("----F0F"), row1  # 0.5 of 4.5 time units in 40 columns
    assert "- waiting for data" in grid


def test_png_draws_the_wait(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from zeropipe.core.render import render_png

    path = render_png(_measured_with_a_wait(), tmp_path / "t.png")
    assert path.stat().st_size > 0
