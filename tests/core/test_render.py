"""Terminal grid, Chrome trace and PNG drawn from simulated and measured timelines."""

from __future__ import annotations

import itertools
import json
import re
import sys

import pytest

from zeropipe.core.costs import CostModel
from zeropipe.core.errors import ZeropipeError
from zeropipe.core.ir import Action, Kind, Schedule
from zeropipe.core.render import (
    KIND_COLORS,
    draw_timeline,
    render_png,
    render_pngs,
    render_text,
    to_chrome_trace,
    write_chrome_trace,
)
from zeropipe.core.schedules import generate
from zeropipe.core.simulate import Event, Timeline, simulate

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _rows(text: str, label: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(label)]


def _tokens(row: str) -> list[str]:
    """The 'F0', 'B12', 'f3' labels in one grid row, in time order."""
    return re.findall(r"[A-Za-z]\d+", row.split(maxsplit=2)[2])


def _offloading(ranks: int, microbatches: int) -> Schedule:
    """1F1B where every microbatch's activations go to host after F and come back before B."""
    base = generate("1f1b", ranks, microbatches)
    acts = []
    for rank in base.actions:
        out: list[Action] = []
        for a in rank:
            if a.kind is Kind.F:
                out += [a, Action(Kind.OFFLOAD, a.stage, a.microbatch)]
            else:
                out += [Action(Kind.RELOAD, a.stage, a.microbatch), a]
        acts.append(out)
    return base.replace_actions(acts, name="offload")


def _interleaved(ranks: int, microbatches: int) -> Schedule:
    """Two chunks per rank (stage r and r + ranks), GPipe order within each."""
    acts = []
    for r in range(ranks):
        first, second = r, r + ranks
        rank = [Action(Kind.F, first, i) for i in range(microbatches)]
        rank += [Action(Kind.F, second, i) for i in range(microbatches)]
        rank += [Action(Kind.B, second, i) for i in range(microbatches)]
        rank += [Action(Kind.B, first, i) for i in range(microbatches)]
        acts.append(rank)
    return Schedule(tuple(range(ranks)) * 2, acts, microbatches, "interleaved")


@pytest.fixture
def tiny() -> Timeline:
    return simulate(generate("1f1b", 2, 3), CostModel.parse("F=1,B=2", 2))


# -- terminal grid ---------------------------------------------------------------------
def test_text_has_one_row_per_rank_and_rank0_in_program_order(tiny: Timeline) -> None:
    text = render_text(tiny, width=60)
    assert len(_rows(text, "rank ")) == 2
    assert _tokens(_rows(text, "rank 0")[0]) == ["F0", "F1", "B0", "F2", "B1", "B2"]
    assert _tokens(_rows(text, "rank 1")[0]) == ["F0", "B0", "F1", "B1", "F2", "B2"]
    assert "copy" not in text  # no copy lane without OFFLOAD/RELOAD


def test_text_scales_time_to_width_and_marks_idle(tiny: Timeline) -> None:
    text = render_text(tiny, width=60)  # makespan 12 -> 5 columns per unit
    row1 = _rows(text, "rank 1")[0].split(maxsplit=2)[2]
    assert len(row1) == 60
    assert row1.startswith(".....F0FFF")  # rank 1 waits one F, then runs F0 for 5 columns
    # Idle: 1 unit before F0, 2 units after 1B2 while rank 0 runs 0B2; none in between.
    assert row1.count(".") == 15 and row1.endswith("." * 10)


def test_text_header_and_legend(tiny: Timeline) -> None:
    text = render_text(tiny, width=40)
    assert f"makespan {tiny.makespan:.4g}" in text
    assert f"bubble rate {100 * tiny.bubble_rate:.1f}%" in text
    assert f"steady bubble rate {100 * tiny.steady_bubble_rate:.1f}%" in text
    legend = text.splitlines()[-1]
    assert "F forward" in legend and "B backward" in legend and ". idle" in legend
    assert "W weight grad" not in legend  # only kinds that occur


def test_text_copy_lane_only_for_ranks_with_copies() -> None:
    costs = CostModel.parse("F=1,B=2", 2).replace_stage(0, OFFLOAD=0.5, RELOAD=0.5)
    text = render_text(simulate(_offloading(2, 2), costs), width=80)
    lines = text.splitlines()
    copy_rows = _rows(text, "  copy")
    assert len(copy_rows) == 2
    # Each copy row sits right under its rank's compute row.
    assert lines.index(copy_rows[0]) == lines.index(_rows(text, "rank 0")[0]) + 1
    assert re.findall(r"[OL]\d+", copy_rows[0]) == ["O0", "O1", "L0", "L1"]
    # Rank 1's copies take no time (default cost) but still show where they start.
    assert set(copy_rows[1].split()[1]) >= {"O", "L"}
    assert "O offload" in lines[-1] and "L reload" in lines[-1]


def test_text_lower_case_for_odd_chunks() -> None:
    text = render_text(simulate(_interleaved(2, 2)), width=80)
    tokens = _tokens(_rows(text, "rank 0")[0])
    assert tokens == ["F0", "F1", "f0", "f1", "b0", "b1", "B0", "B1"]
    assert "lower case" in text.splitlines()[-1]


def test_text_rejects_tiny_width(tiny: Timeline) -> None:
    with pytest.raises(ZeropipeError, match="width"):
        render_text(tiny, width=5)


# -- Chrome trace -------------------------------------------------------------------------
def test_chrome_trace_one_complete_event_per_action(tiny: Timeline) -> None:
    trace = json.loads(json.dumps(to_chrome_trace(tiny)))
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    events = [e for evs in tiny.events for e in evs]
    assert len(complete) == len(events) == 12
    by_name = {e["name"]: e for e in complete}
    for ev in events:
        got = by_name[str(ev.action)]
        assert got["ts"] == pytest.approx((ev.start - tiny.start) * 1000)
        assert got["dur"] == pytest.approx((ev.end - ev.start) * 1000)
        assert got["args"]["stage"] == ev.action.stage
        assert got["args"]["microbatch"] == ev.action.microbatch
        assert got["args"]["kind"] == ev.action.kind.value
    assert by_name["1B0"]["ts"] == 2000 and by_name["1B0"]["dur"] == 2000
    assert {e["tid"] for e in complete} == {0, 4}  # compute lanes of ranks 0 and 1
    assert "1 unit = 1000 us" in trace["otherData"]["time_scale"]


def test_chrome_trace_names_process_and_threads() -> None:
    costs = CostModel.parse("F=1,B=2", 2).replace_stage(0, OFFLOAD=0.5, RELOAD=0.5)
    trace = to_chrome_trace(simulate(_offloading(2, 2), costs))
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    assert [e["name"] for e in meta].count("process_name") == 1
    names = {e["tid"]: e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    assert names == {0: "rank 0 compute", 1: "rank 0 copy", 4: "rank 1 compute", 5: "rank 1 copy"}
    used = {e["tid"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert used == set(names)


def test_chrome_trace_of_measured_timeline_is_in_microseconds() -> None:
    schedule = generate("gpipe", 1, 2)
    t0 = 1000.0  # e.g. a perf_counter reading
    events = [
        [
            Event(0, k, a, t0 + 0.25 * k, t0 + 0.25 * k + 0.125)
            for k, a in enumerate(schedule.actions[0])
        ]
    ]
    timeline = Timeline(schedule, events, [2.0], measured=True)
    complete = [e for e in to_chrome_trace(timeline)["traceEvents"] if e["ph"] == "X"]
    assert [e["ts"] for e in complete] == pytest.approx([0, 250_000, 500_000, 750_000])
    assert all(e["dur"] == pytest.approx(125_000) for e in complete)
    assert "(s)" not in render_text(timeline) and "time in s" in render_text(timeline)


def test_write_chrome_trace(tmp_path, tiny: Timeline) -> None:
    path = write_chrome_trace(tiny, tmp_path / "t.json")
    assert json.loads(path.read_text()) == json.loads(json.dumps(to_chrome_trace(tiny)))


# -- PNG ------------------------------------------------------------------------------------
def test_render_png_writes_a_png(tmp_path, tiny: Timeline) -> None:
    path = render_png(tiny, tmp_path / "t.png", title="tiny")
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 2000


def test_render_pngs_stacks_timelines(tmp_path, tiny: Timeline) -> None:
    other = simulate(_offloading(2, 2))
    one = render_png(tiny, tmp_path / "one.png").read_bytes()
    two = render_pngs([tiny, other], tmp_path / "two.png", ["planned", "measured"]).read_bytes()
    # PNG height is big-endian at bytes 20..24: two stacked plots are taller than one.
    assert int.from_bytes(two[20:24], "big") > 1.5 * int.from_bytes(one[20:24], "big")


def test_draw_timeline_labels_title_and_legend(tiny: Timeline) -> None:
    from matplotlib.figure import Figure

    ax = Figure(figsize=(10, 2)).subplots()
    draw_timeline(ax, tiny, title="my run")
    assert ax.get_title(loc="left").startswith("my run")
    assert f"bubble rate {100 * tiny.bubble_rate:.1f}%" in ax.get_title(loc="left")
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["F forward", "B backward"]
    # Every box is wide enough at this size to carry its microbatch number.
    assert sorted(t.get_text() for t in ax.texts) == sorted("001122" * 2)
    colors = {tuple(round(c, 3) for c in p.get_facecolor()[0][:3]) for p in ax.collections}
    assert len(colors) == 2 and len(KIND_COLORS) == 8


def test_png_without_matplotlib_says_how_to_install(tmp_path, monkeypatch, tiny) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ZeropipeError, match=r"pip install 'zeropipe\[plot\]'"):
        render_png(tiny, tmp_path / "t.png")
    assert not (tmp_path / "t.png").exists()


# -- many ranks: a capped grid, drawn in time linear in ranks ----------------------------
class _CountingList(list[Event]):
    """A rank's events that count how often anything walks through them."""

    walks = 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        _CountingList.walks += 1
        return super().__iter__()


def test_grid_draws_at_most_max_ranks_rows_and_says_how_many_are_left(tiny: Timeline) -> None:
    timeline = simulate(generate("1f1b", 70, 2))
    text = render_text(timeline, width=60)
    assert len(_rows(text, "rank ")) == 64
    assert _rows(text, "rank ")[-1].startswith("rank 63 ")
    assert "... 6 more ranks not drawn; --json / --trace have them all" in text
    one_more = render_text(timeline, width=60, max_ranks=69)
    assert "... 1 more rank not drawn" in one_more
    assert "not drawn" not in render_text(timeline, width=60, max_ranks=70)
    assert "not drawn" not in render_text(tiny, width=60)
    with pytest.raises(ZeropipeError, match="max_ranks >= 1"):
        render_text(tiny, max_ranks=0)


@pytest.mark.parametrize("ranks", [200, 400])
def test_grid_walks_each_ranks_events_a_bounded_number_of_times(ranks: int) -> None:
    timeline = simulate(generate("1f1b", ranks, 2))
    timeline.events = [_CountingList(evs) for evs in timeline.events]
    _CountingList.walks = 0
    render_text(timeline, width=40)
    # The header's figures (makespan, bubble rates) walk every rank a few times and
    # each drawn row its own rank once more: linear.  Walking every rank for each
    # row (as the grid once did, to find the start time) is quadratic and fails this.
    assert _CountingList.walks <= 12 * ranks + 8 * 64


def test_a_pair_run_at_once_gets_a_thread_of_its_own_in_the_trace() -> None:
    # Perfetto draws a thread's "X" events as a stack: the backward of an overlapped pair that
    # ran beside its forward goes to the rank's "at once" thread, so no thread's events overlap.
    from zeropipe.core.render import to_chrome_trace
    from zeropipe.core.schedules import generate
    from zeropipe.core.simulate import Event, Timeline

    schedule = generate("1f1b", ranks=1, microbatches=2)
    f0, b0, f1, b1 = schedule.actions[0][:4]
    events = [
        Event(0, 0, f0, 0.0, 1.0),
        Event(0, 1, f1, 1.0, 3.0),
        Event(0, 2, b0, 1.0, 4.0, wait=0.5),
        Event(0, 3, b1, 4.0, 5.0),
    ]
    trace = to_chrome_trace(Timeline(schedule, [events], peak_memory=[0.0], measured=True))
    spans: dict[int, list[tuple[float, float]]] = {}
    names: dict[int, str] = {}
    for ev in trace["traceEvents"]:
        if ev["ph"] == "X":
            spans.setdefault(ev["tid"], []).append((ev["ts"], ev["ts"] + ev["dur"]))
        elif ev["name"] == "thread_name":
            names[ev["tid"]] = ev["args"]["name"]
    assert sorted(names.values()) == ["rank 0 at once", "rank 0 compute"]
    for tid, pieces in spans.items():
        pieces.sort()
        assert all(a[1] <= b[0] + 1e-9 for a, b in itertools.pairwise(pieces)), names[tid]
    at_once = next(t for t, n in names.items() if n.endswith("at once"))
    assert len(spans[at_once]) == 2  # B0's wait and its work
